"""Tests of lightning_parcae.planning.migration_plan: slot choice, transfers, kinds, errors and JSON.

Optimality is checked against ``_brute_force``, a deliberately naive re-derivation that tries every injective
assignment of available members to the new layout's slots and scores it from the raw member/partition lists (it
does not use :class:`Layout`).
"""

from __future__ import annotations

import itertools
import json
import random
import sys
from typing import Sequence

import pytest

from lightning_parcae.planning.costmodel import MigrationKind
from lightning_parcae.errors import ConfigurationError, ParcaeError
from lightning_parcae.planning.migration_plan import Layout, MigrationPlan, StageLostError, Transfer, plan_migration

# ---------------------------------------------------------------------------------------------------- reference


def _layers(partition: Sequence[int], stage: int) -> set[int]:
    start = sum(partition[:stage])
    return set(range(start, start + partition[stage]))


def _held(members: Sequence[str], partition: Sequence[int], member: str) -> set[int]:
    if member not in members:
        return set()
    return _layers(partition, list(members).index(member) % len(partition))


def _score(
    old: Layout,
    available: Sequence[str],
    senders: Sequence[str],
    chosen: Sequence[str],
    partition: Sequence[int],
    layer_bytes: Sequence[int],
) -> tuple[int, ...]:
    """The planner's documented lexicographic criteria for ``chosen`` (rank order), computed naively."""
    members, old_part = list(old.members), list(old.partition)
    p, p_old = len(partition), len(old_part)
    sendable = set().union(*[_held(members, old_part, m) for m in senders]) if senders else set()
    unsendable = nbytes = nlayers = joiners = stage_moves = replica_moves = index_sum = order = 0
    for rank, m in enumerate(chosen):
        lacks = _layers(partition, rank % p) - _held(members, old_part, m)
        unsendable += len(lacks - sendable)
        nbytes += sum(layer_bytes[x] for x in lacks)
        nlayers += len(lacks)
        if m in members:
            stage_moves += members.index(m) % p_old != rank % p
            replica_moves += members.index(m) // p_old != rank // p
        else:
            joiners += 1
        index_sum += list(available).index(m)
        order += list(available).index(m) * (len(chosen) - 1 - rank)
    return (unsendable, nbytes, nlayers, joiners, stage_moves, replica_moves, index_sum, order)


def _brute_force(
    old: Layout,
    available: Sequence[str],
    shape: tuple[int, int],
    partition: Sequence[int],
    layer_bytes: Sequence[int],
    senders: Sequence[str] | None = None,
) -> tuple[int, ...]:
    """The lexicographically smallest score over every assignment of available members to the new slots."""
    if senders is None:
        senders = [m for m in old.members if m in available]
    d, p = shape
    return min(
        _score(old, available, senders, chosen, partition, layer_bytes)
        for chosen in itertools.permutations(available, d * p)
    )


def _check_plan(plan: MigrationPlan, available: Sequence[str], senders: Sequence[str], layer_bytes: Sequence[int]):
    """Invariants every plan must satisfy: exact coverage of missing layers from live holders, consistent lists."""
    old, new = plan.old, plan.new
    assert set(new.members) <= set(available)
    assert plan.standby == tuple(m for m in available if m not in new.members)
    assert plan.leaving == tuple(m for m in old.members if m not in new.members)
    needed = {
        (m, x)
        for r, m in enumerate(new.members)
        for x in _layers(new.partition, r % new.pipeline_stages) - _held(old.members, old.partition, m)
    }
    assert sorted((t.dst, t.layer) for t in plan.transfers) == sorted(needed)
    for t in plan.transfers:
        assert t.src != t.dst
        assert t.src in senders
        assert t.layer in _held(old.members, old.partition, t.src)
        assert t.nbytes == layer_bytes[t.layer]


def _plan_score(plan: MigrationPlan, available, senders, layer_bytes) -> tuple[int, ...]:
    return _score(plan.old, available, senders, plan.new.members, plan.new.partition, layer_bytes)


# 2 replicas x 2 stages, 4 layers: a0 a1 | b0 b1
OLD22 = Layout(members=("a0", "a1", "b0", "b1"), partition=(2, 2))
# 3 replicas x 2 stages, 6 layers (stage 0 = layers 0-3, stage 1 = layers 4-5)
OLD32 = Layout(members=("a0", "a1", "b0", "b1", "c0", "c1"), partition=(4, 2))
BYTES4 = [10, 20, 30, 40]
BYTES6 = [10, 10, 10, 10, 7, 9]


# ---------------------------------------------------------------------------------------------------- layout


def test_layout_reports_shape_stages_and_holders_if_valid():
    assert (OLD32.data_parallel, OLD32.pipeline_stages, OLD32.num_layers) == (3, 2, 6)
    assert OLD32.stage_of("b1") == 1 and OLD32.replica_of("b1") == 1
    assert OLD32.stage_of("zz") is None and OLD32.replica_of("zz") is None
    assert OLD32.layers_of("c0") == range(0, 4) and OLD32.layers_of("c1") == range(4, 6)
    assert OLD32.layers_of("zz") == range(0)
    assert OLD32.stage_layers(1) == range(4, 6)
    assert OLD32.holders(5) == ("a1", "b1", "c1")
    assert OLD32.holders(0) == ("a0", "b0", "c0")


def test_layout_names_each_members_rank_and_each_layers_stage():
    """``rank_of`` and ``stage_of_layer`` are what a planner reads of another layout (no private lookups)."""
    assert [OLD32.rank_of(m) for m in OLD32.members] == list(range(6))
    assert OLD32.rank_of("zz") is None
    assert [OLD32.stage_of_layer(layer) for layer in range(6)] == [0, 0, 0, 0, 1, 1]
    with pytest.raises(ConfigurationError, match="layer 6 does not exist"):
        OLD32.stage_of_layer(6)


@pytest.mark.parametrize(
    ("members", "partition", "needle"),
    [
        (("a", "b", "c"), (1, 1), "multiple of P=2"),
        (("a", "a"), (1, 1), "'a'"),
        (("a", "b"), (2, 0), "positive"),
        (("a", "b"), (), "empty"),
        ((), (1,), "multiple of P=1"),
        (("a", ""), (1, 1), "non-empty strings"),
    ],
)
def test_layout_raises_configuration_error_if_invalid(members, partition, needle):
    with pytest.raises(ConfigurationError, match=needle):
        Layout(members=members, partition=partition)


def test_layout_round_trips_through_json_if_valid():
    d = json.loads(json.dumps(OLD32.to_json()))
    assert d == {"members": ["a0", "a1", "b0", "b1", "c0", "c1"], "partition": [4, 2]}
    assert Layout.from_json(d) == OLD32
    with pytest.raises(ConfigurationError, match="partition"):
        Layout.from_json({"members": ["a"]})


# ---------------------------------------------------------------------------------------------------- plans


def test_plan_migration_returns_none_and_no_transfers_if_nothing_changes():
    plan = plan_migration(OLD22, ["a0", "a1", "b0", "b1"], (2, 2), (2, 2), BYTES4)
    assert plan.kind is MigrationKind.NONE
    assert plan.new == OLD22
    assert plan.transfers == () and plan.bytes_moved == 0
    assert plan.standby == () and plan.leaving == ()


def test_plan_migration_keeps_survivors_in_place_if_bytes_tie_even_at_zero_bytes():
    # Every layer is free to move, a joiner is listed first: survivors keeping stage and replica still win.
    plan = plan_migration(OLD22, ["j", "b1", "a1", "b0", "a0"], (2, 2), (2, 2), [0, 0, 0, 0])
    assert plan.kind is MigrationKind.NONE
    assert plan.new == OLD22
    assert plan.standby == ("j",)


def test_plan_migration_drops_a_replica_without_moving_bytes_if_one_replica_is_lost():
    available = ["a1", "b0", "b1"]
    plan = plan_migration(OLD22, available, (1, 2), (2, 2), BYTES4)
    assert plan.kind is MigrationKind.INTRA_STAGE
    assert plan.bytes_moved == 0 and plan.transfers == ()
    assert (plan.new.data_parallel, plan.new.pipeline_stages) == (1, 2)
    assert [OLD22.stage_of(m) for m in plan.new.members] == [0, 1]
    assert len(plan.standby) == 1 and set(plan.new.members) | set(plan.standby) == set(available)
    assert "a0" in plan.leaving and set(plan.leaving) == {"a0", *plan.standby}
    _check_plan(plan, available, ["a1", "b0", "b1"], BYTES4)


def test_plan_migration_moves_a_survivor_to_another_stage_if_that_stage_is_short():
    # a0 and b0 are gone; stage 0 keeps only c0, so one stage-1 survivor must take stage 0 of replica 0 or 1.
    available = ["a1", "b1", "c0", "c1"]
    plan = plan_migration(OLD32, available, (2, 2), (4, 2), BYTES6)
    assert plan.kind is MigrationKind.INTER_STAGE
    movers = [m for m in plan.new.members if OLD32.stage_of(m) != plan.new.stage_of(m)]
    assert len(movers) == 1
    assert OLD32.stage_of(movers[0]) == 1 and plan.new.stage_of(movers[0]) == 0
    assert plan.bytes_moved == sum(BYTES6[:4])
    assert [(t.layer, t.src, t.dst) for t in plan.transfers] == [(x, "c0", movers[0]) for x in range(4)]
    assert plan.receives(movers[0]) == plan.transfers == plan.sends("c0")
    _check_plan(plan, available, available, BYTES6)


def test_plan_migration_fills_a_slot_with_a_joiner_balanced_across_holders_if_a_member_is_replaced():
    available = ["a0", "a1", "b0", "b1", "c1", "j"]
    plan = plan_migration(OLD32, available, (3, 2), (4, 2), BYTES6)
    assert plan.kind is MigrationKind.INTRA_STAGE
    assert plan.new.members == ("a0", "a1", "b0", "b1", "j", "c1")
    received = plan.receives("j")
    assert sorted(t.layer for t in received) == [0, 1, 2, 3]
    assert received == plan.transfers
    assert {t.src for t in received} == {"a0", "b0"}
    assert sum(t.nbytes for t in plan.sends("a0")) == sum(t.nbytes for t in plan.sends("b0")) == 20
    assert plan.leaving == ("c0",) and plan.standby == ()
    _check_plan(plan, available, ["a0", "a1", "b0", "b1", "c1"], BYTES6)
    # the joiner receives all 40 bytes, each holder sends 20: what the move's time grows with is the 40
    assert plan.peak_bytes == 40 == plan.bytes_moved


def test_a_plans_peak_bytes_is_the_most_one_process_sends_or_receives_not_the_total():
    """Transfers run in parallel between processes: two receivers of 30 bytes each from two senders take as long
    as one (peak 30, total 60); one sender serving both takes twice as long (peak 60)."""
    old, new = Layout(("a", "b"), (2,)), Layout(("c", "d"), (2,))
    parallel = MigrationPlan(old, new, (Transfer(0, "a", "c", 30), Transfer(0, "b", "d", 30)), MigrationKind.INTRA_STAGE)
    serial = MigrationPlan(old, new, (Transfer(0, "a", "c", 30), Transfer(0, "a", "d", 30)), MigrationKind.INTRA_STAGE)
    assert (parallel.peak_bytes, parallel.bytes_moved) == (30, 60)
    assert (serial.peak_bytes, serial.bytes_moved) == (60, 60)
    assert MigrationPlan(old, old, (), MigrationKind.NONE).peak_bytes == 0


def test_plan_migration_moves_only_missing_layers_if_repartitioned_from_2x2_to_1x4():
    old = Layout(members=("a0", "a1", "b0", "b1"), partition=(4, 4))
    layer_bytes = [5, 1, 2, 7, 3, 4, 6, 8]
    available = ["a0", "a1", "b0", "b1", "j"]
    for partition in [(3, 2, 2, 1), (2, 2, 2, 2), (1, 4, 2, 1), (1, 1, 1, 5)]:
        plan = plan_migration(old, available, (1, 4), partition, layer_bytes)
        assert plan.kind is MigrationKind.REPARTITION
        assert plan.bytes_moved == _brute_force(old, available, (1, 4), partition, layer_bytes)[1]
        _check_plan(plan, available, old.members, layer_bytes)
    plan = plan_migration(old, available, (1, 4), (3, 2, 2, 1), layer_bytes)
    # Stage-0 holders take new stages 0 and 1 (only layer 4 missing), stage-1 holders take stages 2 and 3.
    assert plan.bytes_moved == 3
    assert [(t.layer, t.dst) for t in plan.transfers] == [(4, plan.new.members[1])]
    assert plan.transfers[0].src in ("a1", "b1")
    assert plan.standby == ("j",)


def test_plan_migration_raises_stage_lost_error_naming_the_stage_if_every_replica_of_it_is_gone():
    with pytest.raises(StageLostError, match=r"old stage 0\b.*last checkpoint") as info:
        plan_migration(OLD22, ["a1", "b1"], (1, 2), (2, 2), BYTES4)
    assert isinstance(info.value, ParcaeError) and isinstance(info.value, RuntimeError)
    assert info.value.stages == (0,) and info.value.layers == (0, 1)
    assert "layers 0-1" in str(info.value)


def test_plan_migration_uses_a_noticed_member_as_source_if_it_is_among_senders():
    # a0 is under notice (can send, not available), b0 vanished: a0 is the only holder of stage 0.
    senders = ["a0", "a1", "b1"]
    plan = plan_migration(OLD22, ["a1", "b1"], (1, 2), (2, 2), BYTES4, senders=senders)
    assert plan.kind is MigrationKind.INTER_STAGE
    assert {t.src for t in plan.transfers} == {"a0"}
    assert plan.bytes_moved == BYTES4[0] + BYTES4[1]
    assert set(plan.leaving) == {"a0", "b0"} and plan.standby == ()
    _check_plan(plan, ["a1", "b1"], senders, BYTES4)


def test_plan_migration_avoids_needing_an_unsendable_layer_if_another_assignment_can():
    # h holds layer 0 (0 bytes) but cannot send. Cheapest in bytes: k takes layers 0-1 (lacks only layer 0,
    # 0 bytes) and q keeps layer 2 -- but layer 0 would have to come from h. So h keeps it and gets layer 1 from k.
    old = Layout(members=("h", "k", "q"), partition=(1, 1, 1))
    layer_bytes = [0, 50, 50]
    cheap = plan_migration(old, ["h", "k", "q"], (1, 2), (2, 1), layer_bytes)
    assert cheap.new.members == ("k", "q") and cheap.bytes_moved == 0
    assert [(t.layer, t.src, t.dst) for t in cheap.transfers] == [(0, "h", "k")]
    safe = plan_migration(old, ["h", "k", "q"], (1, 2), (2, 1), layer_bytes, senders=["k", "q"])
    assert safe.new.members == ("h", "q") and safe.bytes_moved == 50
    assert [(t.layer, t.src, t.dst) for t in safe.transfers] == [(1, "k", "h")]
    assert safe.standby == ("k",)


def test_plan_migration_spreads_sends_over_holders_by_bytes_if_several_hold_a_layer():
    # Three pure data-parallel holders of all 6 layers; two joiners need everything: 12 transfers, 112 bytes.
    old = Layout(members=("a", "b", "c"), partition=(6,))
    plan = plan_migration(old, ["a", "b", "c", "j", "k"], (5, 1), (6,), BYTES6)
    assert plan.kind is MigrationKind.INTRA_STAGE
    assert plan.bytes_moved == 2 * sum(BYTES6)
    loads = [sum(t.nbytes for t in plan.sends(m)) for m in ("a", "b", "c")]
    assert sum(loads) == plan.bytes_moved
    assert max(loads) - min(loads) <= max(BYTES6)
    assert all(plan.sends(m) for m in ("a", "b", "c"))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"available": ["a0", "a1", "b0"]}, "needs 4 members but only 3 are available"),
        ({"partition": (4,)}, "has 1 stages"),
        ({"partition": (1, 2)}, "covers 3 layers"),
        ({"layer_bytes": [1, 2, 3]}, "3 entries"),
        ({"layer_bytes": [1, 2, 3, -4]}, "int >= 0"),
        ({"available": ["a0", "a1", "b0", "b0"]}, "'b0'"),
        ({"senders": ["a0", "zz"]}, "zz"),
        ({"shape": (0, 2)}, ">= 1"),
    ],
)
def test_plan_migration_raises_configuration_error_if_inputs_disagree(kwargs, needle):
    args = {"available": ["a0", "a1", "b0", "b1"], "shape": (2, 2), "partition": (2, 2), "layer_bytes": BYTES4}
    args.update(kwargs)
    senders = args.pop("senders", None)
    with pytest.raises(ConfigurationError, match=needle):
        plan_migration(OLD22, **args, senders=senders)


def test_plan_migration_round_trips_through_json_if_planned():
    plan = plan_migration(OLD32, ["a0", "a1", "b0", "b1", "c1", "j", "k"], (3, 2), (3, 3), BYTES6)
    d = json.loads(json.dumps(plan.to_json()))
    assert d["kind"] == "repartition"
    assert isinstance(d["transfers"][0], dict)
    back = MigrationPlan.from_json(d)
    assert back == plan
    assert back.bytes_moved == plan.bytes_moved
    with pytest.raises(ConfigurationError, match="unknown migration kind"):
        MigrationPlan.from_json({**d, "kind": "teleport"})


def test_plan_migration_returns_identical_plans_if_called_twice_with_the_same_inputs():
    args = (OLD32, ["k", "a1", "b1", "c0", "j", "c1"], (2, 3), (2, 2, 2), BYTES6)
    first, second = plan_migration(*args), plan_migration(*args)
    assert first == second
    assert json.dumps(first.to_json()) == json.dumps(second.to_json())


def test_plan_migration_never_imports_torch_if_imported_alone():
    import subprocess

    code = "import sys, lightning_parcae.planning.migration_plan; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# ---------------------------------------------------------------------------------------------------- property


def _random_partition(rng: random.Random, layers: int, p: int) -> tuple[int, ...]:
    cuts = sorted(rng.sample(range(1, layers), p - 1))
    return tuple(b - a for a, b in zip([0, *cuts], [*cuts, layers]))


@pytest.mark.parametrize("seed", range(40))
def test_plan_migration_matches_brute_force_optimum_if_small(seed):
    rng = random.Random(seed)
    old_shape = rng.choice([(1, 4), (2, 2), (4, 1), (1, 5), (5, 1), (2, 3), (3, 2), (1, 6), (6, 1)])
    layers = rng.randint(6, 8)
    old = Layout(
        members=tuple(f"m{i}" for i in range(old_shape[0] * old_shape[1])),
        partition=_random_partition(rng, layers, old_shape[1]),
    )
    layer_bytes = [rng.choice([0, 1, 2, 3, 5, 8, 100]) for _ in range(layers)]
    survivors = [m for m in old.members if rng.random() < 0.7]
    joiners = [f"j{i}" for i in range(rng.randint(0, max(0, 6 - len(survivors))))]
    available = survivors + joiners
    rng.shuffle(available)
    if not available:
        available = ["j0"]
    noticed = [m for m in old.members if m not in survivors and rng.random() < 0.3]
    senders = [m for m in old.members if m in survivors or m in noticed]
    shapes = [(d, p) for d in range(1, 7) for p in range(1, 7) if d * p <= len(available) and p <= layers]
    shape = rng.choice(shapes)
    if shape[1] == old_shape[1] and rng.random() < 0.5:
        partition = old.partition
    else:
        partition = _random_partition(rng, layers, shape[1])
    best = _brute_force(old, available, shape, partition, layer_bytes, senders)
    if best[0] > 0:
        with pytest.raises(StageLostError):
            plan_migration(old, available, shape, partition, layer_bytes, senders=senders)
        return
    plan = plan_migration(old, available, shape, partition, layer_bytes, senders=senders)
    assert plan.bytes_moved == best[1]
    assert _plan_score(plan, available, senders, layer_bytes) == best
    _check_plan(plan, available, senders, layer_bytes)
    assert plan == plan_migration(old, available, shape, partition, layer_bytes, senders=senders)


def test_transfer_is_a_plain_frozen_record():
    t = Transfer(layer=1, src="a", dst="b", nbytes=3)
    assert (t.layer, t.src, t.dst, t.nbytes) == (1, "a", "b", 3)
    with pytest.raises(AttributeError):
        t.layer = 2  # type: ignore[misc]


def _sent_received(plan: MigrationPlan) -> tuple[dict[str, int], dict[str, int]]:
    sent: dict[str, int] = {}
    received: dict[str, int] = {}
    for t in plan.transfers:
        sent[t.src] = sent.get(t.src, 0) + t.nbytes
        received[t.dst] = received.get(t.dst, 0) + t.nbytes
    return sent, received


def test_no_sender_sends_more_than_the_most_any_member_receives_when_holders_can_share_it() -> None:
    """Regression (issue 21, stop 50): the sources were picked receiver by receiver, each transfer from the
    least-loaded holder so far, and 4x6 -> 4x7 of the emulated GPT-1.5B (26 layers of 110-152 kB of state) had one
    holder send two layers (305 kB) while no member received more than 255 kB -- a migration's time is the most one
    process sends or receives, and that move took 16-24 s on the 0.25 Gbps link. Four replicas hold every layer:
    the sends can be spread so that receiving is the bottleneck, in both directions."""
    nbytes = [110592] + [152448] * 24 + [102144]
    p6, p7 = [5, 4, 4, 4, 4, 5], [4, 4, 4, 4, 4, 4, 2]  # balanced by bytes
    for (p, part), (p2, part2), extra in (((6, p6), (7, p7), 4), ((7, p7), (6, p6), 0)):
        old = Layout(tuple(f"o{i}" for i in range(4 * p)), tuple(part))
        avail = list(old.members) + [f"j{i}" for i in range(extra)]
        plan = plan_migration(old, avail, (4, p2), part2, nbytes)
        sent, received = _sent_received(plan)
        assert plan.kind.value == "repartition"
        assert max(sent.values()) <= max(received.values()) == plan.peak_bytes


@pytest.mark.parametrize("seed", range(12))
def test_the_busiest_sender_has_no_transfer_another_holder_could_take_and_stay_below_it(seed: int) -> None:
    """Over drawn moves (shapes, partitions, layer sizes, members leaving with a notice -- they still send): the
    sources are balanced to a local optimum -- no transfer of the busiest sender could go to another eligible
    sender whose load would stay below the busiest -- and every transfer still comes from a holder of its layer."""
    rng = random.Random(seed)
    layers = rng.randint(6, 16)
    nbytes = [rng.choice([100, 150, 200, 400]) for _ in range(layers)]

    def part(p: int) -> list[int]:
        cuts = sorted(rng.sample(range(1, layers), p - 1))
        return [b - a for a, b in zip([0] + cuts, cuts + [layers])]

    d, p = rng.randint(1, 4), rng.randint(1, min(4, layers))
    old = Layout(tuple(f"o{i}" for i in range(d * p)), tuple(part(p)))
    leaving = set(rng.sample(old.members, rng.randint(0, max(0, d * p - 2))))
    avail = [m for m in old.members if m not in leaving] + [f"j{i}" for i in range(rng.randint(0, 4))]
    d2 = rng.randint(1, 4)
    p2 = rng.randint(1, max(1, min(layers, len(avail) // d2)))
    if d2 * p2 > len(avail):
        d2, p2 = 1, min(layers, len(avail))
    plan = plan_migration(old, avail, (d2, p2), part(p2), nbytes, senders=list(old.members))
    sent, _ = _sent_received(plan)
    for t in plan.transfers:
        assert t.layer in _held(old.members, old.partition, t.src)
    if not sent:
        return
    top = max(sent.values())
    busiest = [m for m, b in sent.items() if b == top]
    for t in plan.transfers:
        if t.src in busiest and len(busiest) == 1:
            others = [m for m in old.members if m != t.src and t.layer in _held(old.members, old.partition, m)]
            assert all(sent.get(m, 0) + t.nbytes >= top for m in others)


def test_slots_that_spare_the_busiest_receiver_are_kept_when_the_plans_peak_is_lower() -> None:
    """Regression (issue 21, stop 50): the slots were filled to move the fewest bytes in total, and 3x9 -> 4x7 of
    the emulated GPT-1.5B gave one member 610 kB to receive where an assignment existed in which nobody receives
    more than 457 kB; transfers run in parallel, so the busiest receiver bounds the migration's time (a few more
    bytes in total, spread over more receivers, finish sooner). The planner now also solves with that bound and
    keeps the plan with the lower peak (where more bytes in all would load the senders more, the brute-force test
    above still finds the fewest-bytes plan)."""
    nbytes = [110592] + [152448] * 24 + [102144]
    old = Layout(tuple(f"o{i}" for i in range(27)), (3, 2, 3, 3, 3, 3, 3, 3, 3))  # balanced by bytes
    avail = list(old.members) + ["j0"]
    plan = plan_migration(old, avail, (4, 7), [4, 4, 4, 4, 4, 4, 2], nbytes)
    received: dict[str, int] = {}
    for t in plan.transfers:
        received[t.dst] = received.get(t.dst, 0) + t.nbytes
    assert max(received.values()) <= 457344
