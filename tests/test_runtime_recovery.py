"""Recovery's choice of the survivors' generation when a loss overtakes a planned one."""

from __future__ import annotations

import types
from typing import Any

import torch.distributed as dist

from lightning_parcae.planning.migration_plan import Layout
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.generation import GenerationRecords, GenerationState
from lightning_parcae.runtime.lifecycle import Lifecycle
from lightning_parcae.runtime.liveness import Liveness, dead_key
from lightning_parcae.runtime.part import PartContext
from lightning_parcae.runtime.recovery import Recovery

OLD = ("i0", "i1", "i2", "i3", "i4", "i5")


class _Shapes:
    """The shape choice as recovery sees it: 1x3 for the survivors, two layers a stage."""

    def __init__(self) -> None:
        self.shape: Any = (1, 3)

    def choose(self, n_now: int, n_next: int, observe: bool, *, available: Any = None, senders: Any = None) -> Any:
        # the survivors' move is priced by the plan recovery makes: drawn from, and sent by, the survivors only
        assert available is not None and list(available) == list(senders) and len(available) == n_next
        return self.shape

    def partition_for(self, p: int) -> list[int]:
        return [2] * p

    def fewest_instances(self, above: int) -> Any:
        return 3 if self.shape is None else None


def _recovery(store: dist.Store, events: list[tuple[str, dict[str, Any]]]) -> Recovery:
    """A Recovery over typed fakes: generation 0 of six members at 2x3, the shape choice fixed."""
    state = GenerationState(member="i0")
    state.enter({"generation": 0, "layout": Layout(OLD, (2, 2, 2)).to_json(), "layer_bytes": [1] * 6})
    host = types.SimpleNamespace(stack_path="net", layer_names=[str(i) for i in range(6)], layer_times=[1.0] * 6,
                                 optimizer_state_factor=2.0, full_stack=None)
    ctx = PartContext(member="i0", store=store, coord=Coordinator(store), live=Liveness(lambda: store, "i0"),
                      life=Lifecycle("i0"), event=lambda name, **f: events.append((name, f)))
    return Recovery(ctx, state, GenerationRecords(host, state), _Shapes(), host,  # type: ignore[arg-type]
                    dead_after_s=3.0, run_dir=None)


def _planned(coord: Coordinator, members: list[str]) -> dict[str, Any]:
    """The leader's interval decision for generation 1 (no ``dead`` field: it was not made by survivors)."""
    return coord.propose({"generation": 1, "kind": "repartition", "step": 4, "transition": members,
                          "reason": "interval"})


def test_survivors_skip_a_planned_generation_that_names_a_dead_member() -> None:
    """Regression (chaos seed 44): i1 was SIGKILLed at the step where the leader had just proposed the interval's
    generation 1 with all six members in it. The five survivors adopted that record, waited 15 s for i1's
    process-group key and fell back to the checkpoint although every stage had a live replica. The planned record
    is now abandoned (one verdict in the store) and the survivors' generation takes number 2."""
    store = dist.HashStore()
    events: list[tuple[str, dict[str, Any]]] = []
    rec_a, rec_b = _recovery(store, events), _recovery(store, events)
    _planned(rec_a.ctx.coord, list(OLD))
    alive, dead = ["i0", "i2", "i3", "i4", "i5"], ["i1"]
    first = rec_a._survivors_generation(1, 4, alive, dead, "peer lost")
    assert first["generation"] == 1 and "dead" not in first  # the planned record is what generation 1 holds
    assert rec_a.abandoned(first, dead)
    ours = rec_a._survivors_generation(2, 4, alive, dead, "peer lost")
    assert ours["generation"] == 2 and ours["transition"] == alive and ours["dead"] == dead
    # a second survivor reaches the same verdict and the same generation 2
    assert rec_b.abandoned(rec_b._survivors_generation(1, 4, alive, dead, "peer lost"), dead)
    assert rec_b._survivors_generation(2, 4, alive, dead, "peer lost") == ours


def test_survivors_skip_a_planned_generation_whose_joiner_was_declared_dead_while_it_formed() -> None:
    """Regression (the README's main job, slow suite): generation 1 admitted the standby ``j``, which was gone
    before the transition world formed. Every old member is alive and announces itself, so the old rule (abandon
    when a *dead old member* is in the record) kept the record and the survivors would wait for ``j`` again. The
    heartbeat thread that declared ``j`` dead left its key; the planned record is abandoned and the survivors'
    generation 2 holds the old members only. Without that key (``j`` alive) the record is kept."""
    store = dist.HashStore()
    rec = _recovery(store, [])
    planned = _planned(rec.ctx.coord, [*OLD, "j"])
    assert rec.lost_joiners(planned) == []
    store.set(dead_key(1, "j"), "j missed heartbeats for 3.0 s (declared dead by i2)")
    assert rec.lost_joiners(planned) == ["j"]
    assert rec.abandoned(planned, [] + rec.lost_joiners(planned))
    ours = rec._survivors_generation(2, 4, list(OLD), [], "peer lost")
    assert ours["generation"] == 2 and ours["transition"] == list(OLD) and "j" not in ours["layout"]["members"]


def test_survivors_obey_the_first_verdict_if_their_views_of_the_dead_differ() -> None:
    """One survivor waited out a silent member (i3, SIGSTOPped) that another then saw announce itself: the first
    verdict in the store holds for both, so they never enter different generations."""
    store = dist.HashStore()
    events: list[tuple[str, dict[str, Any]]] = []
    keeper, waiter = _recovery(store, events), _recovery(store, events)
    planned = _planned(keeper.ctx.coord, list(OLD))
    assert not keeper.abandoned(planned, dead=[])  # saw everyone in the planned record alive: "keep"
    assert not waiter.abandoned(planned, dead=["i3"])  # would abandon, but the verdict is taken


def test_survivors_adopt_a_record_made_by_survivors_or_a_fallback_as_it_is() -> None:
    """Only a planned record can be abandoned: a survivors' record (it names the dead) and a fallback bind all."""
    store = dist.HashStore()
    rec = _recovery(store, [])
    survivors = {"generation": 1, "kind": "intra-stage", "transition": ["i0", "i2"], "dead": ["i1"]}
    fallback = {"generation": 1, "kind": "fallback", "reason": "stage lost"}
    assert not rec.abandoned(survivors, dead=["i1", "i2"])
    assert not rec.abandoned(fallback, dead=["i1"])
    assert not store.check([Coordinator.verdict_key(1)])  # no verdict was needed


def test_a_second_round_skips_the_survivors_generation_a_survivor_died_in_and_counts_it_dead() -> None:
    """Regression (chaos seed 386, 5 instances): generation 0 lost i1 while the leader's planned generation 1
    named it; the survivors abandoned 1 and proposed their own generation 2 with i3 in it -- and i3 was SIGKILLed
    while 2 formed. In the next round from the same base, i3's announcement from the first round was still in the
    store, so it counted alive, the survivors re-adopted generation 2 (a survivors' record binds everyone) and
    waited for i3 again: 128 rounds in 400 s and no step trained, until the run was killed. Generation 2 is now
    skipped (i3 was declared dead while it formed) and the survivors' generation 3 leaves i3 out."""
    store = dist.HashStore()
    events: list[tuple[str, dict[str, Any]]] = []
    rec = _recovery(store, events)
    rec.dead_after_s = 0.05  # i1 never announces: waited out quickly
    coord = rec.ctx.coord
    planned = _planned(coord, list(OLD))
    assert rec.abandoned(planned, ["i1"])  # the first round's verdict on the planned generation 1
    first_round = [m for m in OLD if m != "i1"]
    for m in first_round:
        coord.announce_survivor(0, m, {"step": 4})
    second = coord.propose({"generation": 2, "kind": "intra-stage", "step": 4, "transition": first_round,
                            "dead": ["i1"], "reason": "recovery: peer lost"})
    assert not rec.abandoned(second, ["i1"])  # while it forms it binds everyone (and no "keep" is recorded)
    store.set(dead_key(2, "i3"), "i3 missed heartbeats for 3.0 s (declared dead by i0)")  # i3 dies; 2 never forms
    from lightning_parcae.runtime.lifecycle import Phase

    rec.ctx.life.to(Phase.TRAINING)
    out = rec.survivors_record(rec.begin(), 4)
    assert out["generation"] == 3 and "i3" not in out["transition"] and "i1" not in out["transition"]
    assert out["dead"] == ["i1", "i3"]
    assert [f["generation"] for name, f in events if name == "abandoned"] == [1, 2]
    assert rec.declared_dead_since(0, OLD) == {"i3"}
    # a second survivor of the same round reaches the same generation 3
    other = _recovery(store, [])
    assert other.abandoned(coord.generation(2), ["i1"])  # the verdict is in the store, whatever its view
    assert other._survivors_generation(3, 4, ["i0", "i2"], ["i1", "i3"], "peer lost") == out


def test_recovery_that_keeps_failing_from_the_same_generation_stops_for_the_checkpoint() -> None:
    """Defence behind seed 386: a survivors' generation that fails to form for a reason nobody declared (no death)
    is re-adopted round after round. More rounds from one base than it has members (+2) is such a loop: the
    survivors stop for a restart from the checkpoint, loudly, instead of retrying forever."""
    from lightning_parcae.runtime.lifecycle import Phase

    store = dist.HashStore()
    rec = _recovery(store, [])
    for m in OLD:
        rec.ctx.coord.announce_survivor(0, m, {"step": 4})
    seen = []
    rec.ctx.life.to(Phase.TRAINING)
    for _ in range(len(OLD) + 3):
        seen.append(rec.survivors_record(rec.begin(), 4))
        rec.ctx.life.to(Phase.MIGRATING)  # the switch to it, which fails: the next round begins
    assert all(r["generation"] == 1 and r["kind"] != "fallback" for r in seen[:-1])  # the same record each round
    last = seen[-1]
    assert last["generation"] == 2 and last["kind"] == "fallback"
    assert "recovery from generation 0 formed no generation in 8 rounds" in last["reason"]


def test_survivors_propose_a_fallback_at_the_target_generation_if_no_shape_fits() -> None:
    store = dist.HashStore()
    rec = _recovery(store, [])
    rec.shapes.shape = None  # type: ignore[attr-defined]
    out = rec._survivors_generation(2, 4, ["i0"], ["i1", "i2", "i3", "i4", "i5"], "peer lost")
    assert out["generation"] == 2 and out["kind"] == "fallback" and "no shape fits 1" in out["reason"]
    assert out["min_instances"] == 3 and "the model needs at least 3" in out["reason"]  # the launcher waits for 3


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def test_a_stop_with_every_member_alive_saves_a_checkpoint_before_leaving(monkeypatch: Any, tmp_path: Any) -> None:
    """All members under notice, no shape fits: the host saves ``run_dir/ckpt/last.ckpt`` and the stop exits 75."""
    from lightning_parcae.contract import FALLBACK_EXIT
    from lightning_parcae.runtime import recovery
    from lightning_parcae.runtime.lifecycle import Phase

    monkeypatch.setattr(recovery, "exit_now", lambda code: (_ for _ in ()).throw(_Exit(code)))
    events: list[tuple[str, dict[str, Any]]] = []
    rec = _recovery(dist.HashStore(), events)
    saved: list[str] = []
    rec.host = types.SimpleNamespace(save_before_leaving=lambda trainer, path: saved.append(path))  # type: ignore[assignment]
    rec.run_dir = str(tmp_path)
    rec.ctx.life.to(Phase.MIGRATING)
    try:
        rec.fallback(types.SimpleNamespace(global_step=8), {"reason": "no shape fits 0", "checkpoint": True})
    except _Exit as exc:
        assert exc.code == FALLBACK_EXIT
    assert saved == [str(tmp_path / "ckpt" / "last.ckpt")]
    assert events[-1][0] == "fallback" and events[-1][1]["checkpoint"] == saved[0]
    assert rec.ctx.life.phase == Phase.FALLBACK


def test_a_member_the_survivors_left_out_fences_itself(monkeypatch: Any) -> None:
    """i0 woke up after being declared dead: the survivors' generation 1 (already proposed) does not name it."""
    from lightning_parcae.contract import FENCED_EXIT
    from lightning_parcae.runtime import recovery
    from lightning_parcae.runtime.lifecycle import Phase

    monkeypatch.setattr(recovery, "exit_now", lambda code: (_ for _ in ()).throw(_Exit(code)))
    store = dist.HashStore()
    events: list[tuple[str, dict[str, Any]]] = []
    rec = _recovery(store, events)
    rec.dead_after_s = 0.05
    rec.ctx.coord.propose({"generation": 1, "kind": "intra-stage", "transition": ["i1", "i2"], "dead": ["i0"]})
    rec.ctx.life.to(Phase.TRAINING)
    loss = rec.begin()
    assert rec.ctx.life.phase == Phase.RECOVERING and rec.ctx.live.aborted.is_set()
    try:
        rec.survivors_record(loss, 4)
        raise AssertionError("not fenced")
    except _Exit as exc:
        assert exc.code == FENCED_EXIT
    assert [e[0] for e in events][-2:] == ["recovering", "fenced"]
    assert rec.ctx.coord.survivor(0, "i0") is not None  # it announced itself before it knew
