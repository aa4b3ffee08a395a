"""Tests of lightning_parcae.planning.shape_optimizer: the receding-horizon liveput DP."""

from __future__ import annotations

import itertools
import random
from typing import Sequence

import pytest

from lightning_parcae.planning.costmodel import (ArtifactCostModel, DefaultCostModel, MigrationConstants, MigrationCostModel,
                                                 ShapeLimits, TableThroughput, reference_layer_params)
from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.liveput import expected_transition_cost
from lightning_parcae.planning.shape_optimizer import DEFAULT_MIN_GAIN, PAUSED, LiveputOptimizer, fit_shape


class ToyCost(MigrationCostModel):
    """Hand-priced costs: keeping the depth costs ``inter_ms`` when a stage must be refilled (else 0), changing
    the depth costs ``repartition_ms``; starting from nothing is free."""

    def __init__(self, table, inter_ms=0.0, repartition_ms=0.0, concurrent_ms=0.0, limits=ShapeLimits()) -> None:
        self.throughput = TableThroughput(table, global_batch=64, limits=limits)
        self.inter_ms, self.repartition_ms, self.concurrent_ms = inter_ms, repartition_ms, concurrent_ms

    def stage_term(self, d, p, d2, stage, victims):
        return (1.0 if d2 > d - victims else 0.0), 0.0

    def combine(self, n, d, p, n_in, n_out, d2, m, a):
        return self.inter_ms if m > 0 else 0.0

    def repartition_transfer_ms(self, p, p2, survivors):
        return 0.0

    def repartition_rest_ms(self, n, d, p, n_in, n_out, d2, p2, fallback):
        return 0.0 if p == 0 else self.repartition_ms

    def concurrent_restart_ms(self, d2, p2):
        return self.concurrent_ms

    def restart_ms(self, d, p, kind):
        return 0.0

    def checkpoint_ms(self):
        return 0.0

    def full_state_transfer_ms(self, p):
        return 0.0


@pytest.fixture(scope="module")
def gpt() -> ArtifactCostModel:
    return ArtifactCostModel("gpt-1.5b")


def _chain(n: int, counts: Sequence[int]) -> list:
    out, prev = [], n
    for c in counts:
        out.append((prev, max(c - prev, 0), max(prev - c, 0)))
        prev = c
    return out


# ---------------------------------------------------------------------------------------------------- basics


def test_plan_picks_throughput_best_if_look_ahead_one_and_zero_costs() -> None:
    table = TableThroughput.from_reference("gpt-1.5b").table
    cm = ToyCost(table, limits=ShapeLimits(6, 32))
    opt = LiveputOptimizer(cm, look_ahead=1)
    for n in range(6, 33):
        plan = opt.plan(n, (0, 0), [(n, 0, 0)])
        best = cm.throughput.best(n)
        best_thr = cm.throughput.throughput(*best)
        assert cm.throughput.throughput(*plan.next_shape) == best_thr, n
        ties = [s for s in cm.throughput.candidates(n) if cm.throughput.throughput(*s) == best_thr]
        if len(ties) == 1:
            assert plan.next_shape == best, n
        else:  # e.g. N=17: (1,17) and (2,8) both 29.484/s; the optimizer prefers the shallower pipeline
            assert plan.next_shape == min(ties, key=lambda s: (s[1], s)), n
        assert plan.sequence == (plan.next_shape,)
        assert plan.expected_samples == pytest.approx(best_thr * 60.0)
        assert plan.first_cost_ms == 0.0 and plan.counts == (n,)


def test_plan_never_returns_shape_that_does_not_fit_if_random_futures(gpt) -> None:
    rng = random.Random(5)
    opt = LiveputOptimizer(gpt, look_ahead=4)
    shape, n = (0, 0), 12
    for _ in range(25):
        counts = [min(20, max(8, n + rng.randint(-3, 3)))]
        for _ in range(3):
            counts.append(min(20, max(8, counts[-1] + rng.randint(-2, 2))))
        plan = opt.plan(n, shape, _chain(n, counts))
        assert plan.counts == tuple(counts)
        assert len(plan.sequence) == 4 and plan.sequence[0] == plan.next_shape
        for (d, p), c in zip(plan.sequence, counts):
            assert d * p <= c and 6 <= p <= 32 and gpt.throughput.throughput(d, p) > 0
        shape, n = plan.next_shape, counts[0]


def test_plan_respects_min_p_and_max_p_if_overridden(gpt) -> None:
    for lo, hi in [(8, 8), (10, 16), (6, 7), (13, 32)]:
        opt = LiveputOptimizer(gpt, look_ahead=3, min_p=lo, max_p=hi)
        plan = opt.plan(0, (0, 0), [(0, 24, 0), (24, 0, 2), (22, 3, 0)])
        assert all(lo <= p <= hi for _, p in plan.sequence), (lo, hi, plan.sequence)
    zero = ToyCost(TableThroughput.from_reference("gpt-1.5b").table)
    assert LiveputOptimizer(zero, look_ahead=1).plan(0, (0, 0), [(0, 32, 0)]).next_shape == (4, 8)
    assert LiveputOptimizer(zero, look_ahead=1, min_p=9).plan(0, (0, 0), [(0, 32, 0)]).next_shape == (3, 10)
    assert LiveputOptimizer(zero, look_ahead=1, max_p=7).plan(0, (0, 0), [(0, 32, 0)]).next_shape == (4, 7)


def test_plan_avoids_throughput_best_if_known_removal_next_interval() -> None:
    # On 8 instances (2,4) is best (100/s) but after one removal only (1,4) at 50/s keeps the depth; (1,7) trains 90/s
    # and survives the removal with one spare 1/8 of the time (an inter-stage refill of 1 s otherwise), while moving
    # from (2,4) to (1,7) later costs a 50-s repartition.
    table = {(2, 4): 100.0, (1, 7): 90.0, (1, 4): 50.0}
    cm = ToyCost(table, inter_ms=1000.0, repartition_ms=50_000.0)
    future = [(8, 0, 0), (8, 0, 1)] + [(7, 0, 0)] * 4
    assert cm.throughput.best(8) == (2, 4)
    plan = LiveputOptimizer(cm, look_ahead=6).plan(8, (0, 0), future)
    assert plan.next_shape == (1, 7) != cm.throughput.best(8)
    assert plan.sequence == ((1, 7),) * 6
    # hand-derived: 5400 + 90 * (60 - 7/8 s) + 4 * 5400
    assert plan.expected_samples == pytest.approx(5400 + 90 * (60 - 0.875) + 4 * 5400, rel=1e-12)
    # without the look-ahead, or without the removal, the throughput-optimal shape wins
    assert LiveputOptimizer(cm, look_ahead=1).plan(8, (0, 0), future).next_shape == (2, 4)
    assert LiveputOptimizer(cm, look_ahead=6).plan(8, (0, 0), [(8, 0, 0)] * 6).next_shape == (2, 4)


def test_plan_uses_only_look_ahead_intervals_if_future_longer() -> None:
    table = {(2, 4): 100.0, (1, 7): 90.0, (1, 4): 50.0}
    cm = ToyCost(table, inter_ms=1000.0, repartition_ms=50_000.0)
    future = [(8, 0, 0), (8, 0, 1)] + [(7, 0, 0)] * 4
    plan = LiveputOptimizer(cm, look_ahead=2).plan(8, (0, 0), future)
    assert len(plan.sequence) == 2 and plan.counts == (8, 7)


# ---------------------------------------------------------------------------------------------------- carry-over


def test_plan_pays_remaining_migration_if_remain_ms_below_interval() -> None:
    cm = ToyCost({(2, 4): 100.0, (1, 7): 90.0}, repartition_ms=50_000.0, concurrent_ms=500.0)
    plan = LiveputOptimizer(cm, look_ahead=1).plan(8, (2, 4), [(8, 0, 0)], remain_ms=20_000.0)
    assert plan.next_shape == (2, 4)
    assert plan.first_cost_ms == 20_000.0
    assert plan.expected_samples == pytest.approx(100.0 * 40.0)


def test_plan_adds_concurrent_restart_if_changing_during_unfinished_migration() -> None:
    # staying pays the 50 s still unfinished; switching replaces it with 5 s + 0.5 s concurrent restart
    cm = ToyCost({(2, 4): 100.0, (1, 7): 90.0}, repartition_ms=5_000.0, concurrent_ms=500.0)
    plan = LiveputOptimizer(cm, look_ahead=1).plan(8, (2, 4), [(8, 0, 0)], remain_ms=50_000.0)
    assert plan.next_shape == (1, 7)
    assert plan.first_cost_ms == pytest.approx(5_500.0)
    assert plan.expected_samples == pytest.approx(90.0 * 54.5)


def test_plan_waits_for_the_unfinished_migration_if_the_cost_model_says_the_runtime_does() -> None:
    """This runtime finishes a migration before it decides again (DefaultCostModel.waits_for_unfinished): a
    change during an unfinished one costs the rest of it plus the change, with no concurrent restart."""
    cm = ToyCost({(2, 4): 100.0, (1, 7): 90.0}, repartition_ms=5_000.0, concurrent_ms=500.0)
    cm.waits_for_unfinished = True
    plan = LiveputOptimizer(cm, look_ahead=1).plan(8, (2, 4), [(8, 0, 0)], remain_ms=20_000.0, first=(1, 7))
    assert plan.first_cost_ms == pytest.approx(25_000.0)
    assert plan.expected_samples == pytest.approx(90.0 * 35.0)
    # staying just finishes the unfinished one, as before
    assert LiveputOptimizer(cm, look_ahead=1).plan(8, (2, 4), [(8, 0, 0)], remain_ms=20_000.0).next_shape == (2, 4)


@pytest.mark.parametrize("waits", [False, True])
def test_a_move_that_outlasts_its_interval_cannot_be_left_for_a_cheap_hop_if_the_runtime_waits(waits: bool) -> None:
    """Regression (issue 21, 0.25 Gbps replays: repartitions of 16-27 s against 20 s intervals). Under the
    artifact's rule a change during an unfinished migration drops its rest: the plan that starts an 18 s move to
    2x5 "switched" one interval later to 1x10 -- one cheap step from 2x5 -- for its rest plus a group rebuild, so
    a move longer than an interval was valued as if most of it could be skipped. The runtime finishes every
    migration before deciding again; with ``waits_for_unfinished`` the plan for 2x5 is what finishing it yields."""

    class Hops(ToyCost):
        def repartition_rest_ms(self, n, d, p, n_in, n_out, d2, p2, fallback):
            if p == 0:
                return 0.0
            return 500.0 if (d, p, d2, p2) == (2, 5, 1, 10) else 18_000.0

    cm = Hops({(2, 4): 1000.0, (2, 5): 1400.0, (1, 10): 1350.0}, concurrent_ms=200.0)
    cm.waits_for_unfinished = waits
    opt = LiveputOptimizer(cm, interval_s=6.0, look_ahead=12)
    plan = opt.plan(10, (2, 4), [(10, 0, 0)] * 12, first=(2, 5))
    if waits:
        assert plan.sequence == ((2, 5),) * 12
        assert plan.expected_samples == pytest.approx(1400.0 * (72.0 - 18.0))
    else:  # the artifact's accounting: the 18 s move is left after 6 s for 0.7 s more
        assert plan.sequence[1] == (1, 10)
        assert plan.expected_samples == pytest.approx(1350.0 * (72.0 - 6.0 - 0.7))


def test_plan_carries_unfinished_cost_into_next_interval_if_remain_exceeds_interval() -> None:
    cm = ToyCost({(2, 4): 100.0})
    plan = LiveputOptimizer(cm, look_ahead=2).plan(8, (2, 4), [(8, 0, 0), (8, 0, 0)], remain_ms=70_000.0)
    assert plan.sequence == ((2, 4), (2, 4))
    assert plan.first_cost_ms == 70_000.0
    assert plan.expected_samples == pytest.approx(100.0 * 50.0)  # nothing in the first interval, 50 s in the next
    one = LiveputOptimizer(cm, look_ahead=1).plan(8, (2, 4), [(8, 0, 0)], remain_ms=70_000.0)
    assert one.expected_samples == 0.0


def _brute_best(cm, opt, n, shape, future, remain=0.0):
    """Best expected samples over every shape sequence, with the artifact's per-interval accounting."""
    counts, prev, events = [], n, []
    for _, n_in, n_out in future:
        events.append((n_in, n_out))
        prev = prev + n_in - n_out
        counts.append(prev)
    cands = [opt.targets(c, ())[0] for c in counts]
    best, best_seq, carried = -1.0, None, False
    for seq in itertools.product(*cands):
        s, rem, cur, cur_n = 0.0, remain, shape, n
        for (n_in, n_out), tgt, c in zip(events, seq, counts):
            cost = expected_transition_cost(cm, cur_n, cur, n_in, n_out, tgt).mean
            if cost > 0:
                rem = cost + cm.concurrent_restart_ms(*tgt) if rem > 0 else cost
            work = 60_000.0 - rem
            if work >= 0:
                s += cm.throughput.throughput(*tgt) * work / 1000.0
            else:
                carried = True
            rem = max(0.0, -work)
            cur, cur_n = tgt, c
        if s > best:
            best, best_seq = s, seq
    return best, best_seq, carried


@pytest.mark.parametrize(
    "n, shape, counts",
    [
        (12, (2, 6), [12, 10, 11]),
        (0, (0, 0), [12, 12, 9]),
        (13, (1, 13), [13, 14, 12]),
        (10, (1, 10), [12, 12, 12]),
    ],
)
def test_plan_matches_exhaustive_search_if_small_gpt_horizon(gpt, n, shape, counts) -> None:
    opt = LiveputOptimizer(gpt, look_ahead=3)
    future = _chain(n, counts)
    plan = opt.plan(n, shape, future)
    best, seq, carried = _brute_best(gpt, opt, n, shape, future)
    assert not carried or best >= plan.expected_samples - 1e-6
    if not carried:  # every migration fits its interval: the (shape, unfinished) DP is exact
        assert plan.expected_samples == pytest.approx(best, rel=1e-12)
    # the plan's own sequence achieves what it claims
    s, cur, cur_n = 0.0, shape, n
    for (_, n_in, n_out), tgt, c in zip(future, plan.sequence, counts):
        cost = expected_transition_cost(gpt, cur_n, cur, n_in, n_out, tgt).mean
        s += gpt.throughput.throughput(*tgt) * max(0.0, 60_000.0 - cost) / 1000.0
        cur, cur_n = tgt, c
    assert s == pytest.approx(plan.expected_samples, rel=1e-12)


# ---------------------------------------------------------------------------------------------------- errors


def test_plan_pauses_if_no_shape_fits_a_future_interval(gpt) -> None:
    # 4 instances in interval 1: no gpt-1.5b shape (P >= 6) fits, so the plan waits there and restarts after
    opt = LiveputOptimizer(gpt, look_ahead=3)
    plan = opt.plan(8, (1, 8), [(8, 0, 0), (8, 0, 4), (4, 4, 0)])
    assert plan.sequence[1] == PAUSED
    assert plan.next_shape == (1, 8)  # keep running until the drop (any change would cost a restart)
    # resuming is a fresh start: the best shape on 8 counting its start cost ((1,7): cheaper groups than (1,8))
    def resumed(t):
        return gpt.throughput.throughput(*t) * (60_000.0 - expected_transition_cost(gpt, 4, PAUSED, 4, 0, t).mean) / 1000.0
    best_resume = max(gpt.throughput.candidates(8), key=resumed)
    assert plan.sequence[2] == best_resume == (1, 7)
    expected = gpt.throughput.throughput(1, 8) * 60.0 + resumed(best_resume)
    assert plan.expected_samples == pytest.approx(expected, rel=1e-12)


def test_plan_returns_paused_if_nothing_fits_next_interval(gpt) -> None:
    plan = LiveputOptimizer(gpt, look_ahead=2).plan(0, PAUSED, [(0, 5, 0), (5, 0, 0)])
    assert plan.next_shape == PAUSED and plan.sequence == (PAUSED, PAUSED)
    assert plan.expected_samples == 0.0 and plan.first_cost_ms == 0.0
    # limits that exclude every depth pause too
    plan = LiveputOptimizer(gpt, look_ahead=1, min_p=33).plan(0, PAUSED, [(0, 32, 0)])
    assert plan.next_shape == PAUSED


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(interval_s=0), "interval_s=0"),
        (dict(look_ahead=0), "look_ahead=0"),
        (dict(min_p=9, max_p=8), "min_p=9 > max_p=8"),
    ],
)
def test_optimizer_raises_configuration_error_if_bad_settings(gpt, kwargs, match) -> None:
    with pytest.raises(ConfigurationError, match=match):
        LiveputOptimizer(gpt, **kwargs)


@pytest.mark.parametrize(
    "args, kwargs, match",
    [
        ((12, (1, 12), []), {}, "future is empty"),
        ((-1, (0, 0), [(0, 12, 0)]), {}, "n=-1"),
        ((12, (1, 12), [(12, 0, 0)]), dict(remain_ms=-5.0), "remain_ms=-5.0"),
        ((10, (2, 6), [(10, 0, 0)]), {}, r"shape \(2, 6\) needs 12 instances but only 10"),
    ],
)
def test_plan_raises_configuration_error_if_bad_inputs(gpt, args, kwargs, match) -> None:
    with pytest.raises(ConfigurationError, match=match):
        LiveputOptimizer(gpt, look_ahead=2).plan(*args, **kwargs)


# ---------------------------------------------------------------------------------------------------- fit_shape


@pytest.mark.parametrize(
    "shape, n, expected",
    [((4, 8), 32, (4, 8)), ((4, 8), 20, (2, 8)), ((4, 8), 8, (1, 8)), ((4, 8), 7, (1, 7)), ((2, 9), 30, (2, 9))],
)
def test_fit_shape_keeps_depth_or_falls_back_to_one_pipeline_if_too_big(shape, n, expected) -> None:
    assert fit_shape(shape, n) == expected


# ------------------------------------------------------------------------------------------------ decisions


from lightning_parcae.planning.shape_optimizer import settle  # noqa: E402


@pytest.mark.parametrize(
    "n, n_in, n_out, expected",
    [(0, 5, 1, (4, 0)), (2, 3, 4, (1, 2)), (10, 0, 3, (0, 3)), (3, 0, 3, (0, 3)), (0, 0, 0, (0, 0))],
)
def test_settle_nets_out_departures_of_instances_that_arrived_within_the_interval(n, n_in, n_out, expected) -> None:
    assert settle(n, n_in, n_out) == expected
    a, b = settle(n, n_in, n_out)
    assert n + a - b == n + n_in - n_out and b <= n


def test_decide_returns_reactive_shape_if_every_scenario_agrees(gpt) -> None:
    opt = LiveputOptimizer(gpt, look_ahead=4)
    dec = opt.decide(24, (3, 8), (24, 0, 0), [[(24, 0, 0)] * 3], [1.0])
    assert dec.next_shape == dec.reactive == opt.reactive_shape(24) == gpt.throughput.best(24)
    assert not dec.departs and dec.expected_gain == 0.0


@pytest.mark.parametrize("seed", range(6))
def test_decide_fits_the_known_count_and_keeps_reactive_if_risk_is_huge(gpt, seed) -> None:
    """Whatever the scenarios, the decision fits the instances present once the interval's known events are in;
    with an infinite risk aversion it is always the reactive choice."""
    rng = random.Random(seed)
    opt = LiveputOptimizer(gpt, look_ahead=5)
    for _ in range(6):
        n = rng.randint(6, 32)
        shape = rng.choice([s for s in gpt.throughput.candidates(n)] or [PAUSED])
        n_in, n_out = rng.randint(0, 4), rng.randint(0, min(4, n))
        after = n + n_in - n_out
        scenarios = [_chain(after, [max(0, after + rng.randint(-6, 6)) for _ in range(4)]) for _ in range(3)]
        dec = opt.decide(n, shape, (n, n_in, n_out), scenarios, [0.2, 0.5, 0.3])
        assert dec.next_shape[0] * dec.next_shape[1] <= after
        assert dec.reactive in dec.candidates
        safe = opt.decide(n, shape, (n, n_in, n_out), scenarios, [0.2, 0.5, 0.3], risk=float("inf"))
        if safe.departs:  # only possible when the departure wins in *every* scenario (std 0, gain > 0)
            assert safe.gain_std == 0.0 and safe.expected_gain > 0
        else:
            assert safe.next_shape == opt.reactive_shape(after)


def test_decide_departs_from_reacting_if_a_known_drop_follows_in_every_scenario() -> None:
    """Seeing the same preemption coming in every scenario, the decision avoids the throughput-best shape that
    would pay for a refill (the same setting as the plan test above, but through decide)."""
    table = {(4, 2): 100.0, (3, 2): 90.0, (2, 2): 70.0}
    cm = ToyCost(table, inter_ms=59_000.0, repartition_ms=0.0)
    opt = LiveputOptimizer(cm, look_ahead=3)
    dec = opt.decide(8, (3, 2), (8, 0, 0), [_chain(8, [6, 6])] * 2, [0.5, 0.5])
    assert dec.reactive == (4, 2)
    assert dec.departs and dec.expected_gain > 0


def test_decide_raises_if_weights_do_not_match_scenarios(gpt) -> None:
    opt = LiveputOptimizer(gpt, look_ahead=3)
    with pytest.raises(ConfigurationError, match="weights"):
        opt.decide(16, (2, 8), (16, 0, 0), [[(16, 0, 0)]], [0.5, 0.5])


def test_prepare_changes_no_plan_if_called_before_the_first_decision() -> None:
    """``prepare`` only moves work earlier: plans with and without it are identical."""
    futures = [_chain(32, [32, 30, 30, 31, 31, 28]), _chain(20, [20, 19, 22, 22, 18, 18]), _chain(12, [14, 10, 10, 16, 16, 16])]
    a = LiveputOptimizer(ArtifactCostModel("gpt-1.5b"), look_ahead=6)
    b = LiveputOptimizer(ArtifactCostModel("gpt-1.5b"), look_ahead=6)
    assert b.prepare(32, max_out=2) > 0
    for fut in futures:
        n = fut[0][0]
        shape = ArtifactCostModel("gpt-1.5b").throughput.best(n)
        pa, pb = a.plan(n, shape, fut), b.plan(n, shape, fut)
        assert pa.sequence == pb.sequence and pa.expected_samples == pytest.approx(pb.expected_samples, rel=1e-12)


# ---------------------------------------------------------------------------------------------------- prices


def test_prices_changed_makes_the_optimizer_read_new_throughputs() -> None:
    """A measured model's prices move as steps are measured; the optimizer caches candidate throughputs per count,
    so it keeps the old prices until told (the runtime says so before every decision)."""
    cm = ToyCost({(1, 1): 10.0, (2, 1): 15.0, (1, 2): 12.0})
    opt = LiveputOptimizer(cm, look_ahead=1)
    assert opt.reactive_shape(2) == (2, 1)
    cm.throughput.table[(1, 2)] = 30.0  # (1, 2) was measured much faster than its profile said
    assert opt.reactive_shape(2) == (2, 1)  # the cached price
    opt.prices_changed()
    assert opt.reactive_shape(2) == (1, 2)
    assert opt.plan(2, (2, 1), [(2, 0, 0)]).next_shape == (1, 2)


def test_set_constants_reprices_cached_transitions_so_a_costly_move_is_no_longer_taken() -> None:
    """The runtime refits its migration constants while it plans (issue 21): transition costs the optimizer has
    cached must follow. Here the best shape of 24 instances -> that of 28 pays at 10 Gbps; with state moving at 0.25 Gbps the same
    optimizer, asked again, keeps 4x6 over a short look-ahead (a cached price would have moved it)."""
    thr = TableThroughput.from_reference("gpt-1.5b")
    cm = DefaultCostModel(thr, reference_layer_params("gpt-1.5b"), preemption_notice=True)
    opt = LiveputOptimizer(cm, interval_s=60.0, look_ahead=2)
    cur = thr.best(24)
    assert cur is not None and cur != thr.best(28)
    fast = opt.plan(28, cur, [(28, 0, 0)] * 2)
    assert fast.next_shape != cur
    before = opt.transition_costs(28, cur, 0, 0, [fast.next_shape])[0]
    opt.set_constants(MigrationConstants(bandwidth_bytes_per_s=1.25e9 / 400))
    assert opt.transition_costs(28, cur, 0, 0, [fast.next_shape])[0] > 10 * before
    assert opt.plan(28, cur, [(28, 0, 0)] * 2).next_shape == cur


def test_set_constants_refuses_a_cost_model_without_migration_constants() -> None:
    opt = LiveputOptimizer(ArtifactCostModel("gpt-1.5b"), interval_s=60.0, look_ahead=2)
    with pytest.raises(ConfigurationError, match="ArtifactCostModel has no migration constants"):
        opt.set_constants(MigrationConstants())


def test_a_known_first_move_replaces_the_expectation_over_victims_and_only_there() -> None:
    """The runtime's leader knows who leaves when it decides, so it passes the price of each first move
    (``first_costs``); the optimizer uses it for the interval about to run only -- later intervals, whose victims
    nobody knows, keep the expectation -- and a target the caller does not know (``None``) keeps it too.
    Here 1x4 on 4 instances with one leaving: 1x3 is the only shape left."""
    table = {(1, 3): 30.0, (1, 4): 40.0, (2, 2): 45.0, (1, 2): 20.0, (2, 1): 18.0, (1, 1): 10.0, (3, 1): 25.0}
    cm = ToyCost(table, inter_ms=0.0, repartition_ms=20_000.0)
    opt = LiveputOptimizer(cm, interval_s=60.0, look_ahead=3)
    future = [(4, 0, 1), (3, 0, 0), (3, 0, 0)]
    base = opt.plan(4, (1, 4), future)
    assert base.first_cost_ms == pytest.approx(20_000.0)
    unknown = opt.plan(4, (1, 4), future, first_costs=lambda target: None)
    assert unknown == base
    known = opt.plan(4, (1, 4), future, first_costs=lambda target: 5_000.0 if target == base.next_shape else None)
    assert known.next_shape == base.next_shape and known.first_cost_ms == pytest.approx(5_000.0)
    gained = table[base.next_shape] * 15.0  # 15 s more training in the first interval, nothing else
    assert known.expected_samples == pytest.approx(base.expected_samples + gained)
    # decide() scores every candidate with the same known first move
    d = opt.decide(4, (1, 4), (4, 0, 1), [[(3, 0, 0), (3, 0, 0)]], first_costs=lambda t: 5_000.0)
    assert d.next_shape in table


def test_a_tail_credits_the_shape_a_plan_ends_in_so_a_move_that_pays_back_after_the_horizon_is_taken() -> None:
    """Regression (issue 21, stop 50, pass H): at 28 instances with a flat forecast, 4x6 -> 4x7 (39.6 -> 43.4
    samples/s, 24 s to move) was worth less than staying *within the 240 s horizon* (9,428 vs 9,434 samples), so
    the plan held 4x6 for the rest of the run. Here: 40 -> 44 samples/s for a 24 s move, 12 intervals of 20 s.
    Without a tail the truncated horizon keeps the slower shape; with one (the terminal value) the move is taken,
    and ``expected_samples`` still counts the horizon only."""
    cm = ToyCost({(2, 2): 40.0, (3, 2): 44.0}, inter_ms=24_000.0)
    flat = [(4, 2, 0)] + [(6, 0, 0)] * 11
    bare = LiveputOptimizer(cm, interval_s=20.0, look_ahead=12).plan(4, (2, 2), flat)
    assert bare.next_shape == (2, 2) and bare.expected_samples == pytest.approx(40.0 * 240)
    assert bare.score == bare.expected_samples and bare.value is None
    tail = LiveputOptimizer(cm, interval_s=20.0, look_ahead=12, tail_intervals=12).plan(4, (2, 2), flat)
    assert tail.next_shape == (3, 2) and tail.expected_samples == pytest.approx(44.0 * (240 - 24))
    assert tail.value == pytest.approx(44.0 * (240 - 24) + 44.0 * 240)
    with pytest.raises(ConfigurationError, match="tail_intervals=-1"):
        LiveputOptimizer(cm, tail_intervals=-1)


def test_a_decision_that_reacts_names_the_bet_it_did_not_take_and_how_close_it_came() -> None:
    """A run's events must say how close a rejected bet came to the risk rule (stop 51: at risk 1 the lh_80_90
    passes reported ``0 +- 0`` for every decision, so nobody could tell whether 0.5 would have bet). Half the
    scenarios see the preemption, half do not: the hold gains in expectation with a spread; a risk above its odds
    reacts and reports it, a risk below takes it and reports no alternative."""
    table = {(4, 2): 100.0, (3, 2): 90.0, (2, 2): 70.0}
    cm = ToyCost(table, inter_ms=59_000.0, repartition_ms=0.0)
    opt = LiveputOptimizer(cm, look_ahead=3)
    scenarios = [_chain(8, [6, 6]), _chain(8, [6, 6]), _chain(8, [8, 8])]
    bold = opt.decide(8, (3, 2), (8, 0, 0), scenarios, risk=0.0)
    assert bold.departs and bold.alternative is None and bold.gain_std > 0
    odds = bold.expected_gain / bold.gain_std
    shy = opt.decide(8, (3, 2), (8, 0, 0), scenarios, risk=odds + 0.01)
    assert not shy.departs and shy.expected_gain == 0.0
    assert shy.alternative == bold.next_shape
    assert (shy.alternative_gain, shy.alternative_std) == pytest.approx((bold.expected_gain, bold.gain_std))
    agreed = opt.decide(8, (4, 2), (8, 0, 0), [_chain(8, [8, 8])])
    assert agreed.alternative is None and agreed.candidates == ((4, 2),)


# ---------------------------------------------------------------------------------------- unmeasured shapes
class FittedTable(TableThroughput):
    """A table whose shapes outside ``measured`` are *fitted*, each with relative uncertainty ``u`` (the part of
    :class:`~lightning_parcae.planning.measured.MeasuredThroughput` that :meth:`LiveputOptimizer.decide` reads)."""

    def __init__(self, table, measured, u, min_samples=5) -> None:
        super().__init__(table, global_batch=64)
        self._measured, self.u, self.min_samples = set(measured), u, min_samples

    def measured(self, d, p):
        return self.table.get((d, p)) if (d, p) in self._measured else None

    def uncertainty(self, d, p):
        return 0.0 if (d, p) in self._measured else self.u


def _hold(measured, u, **kwargs):
    """On 8 instances, two may leave (two scenarios in three): 4x2 would then need a refill of 20 s, which 3x2
    skips (the fitted gain of holding 3x2: 357 +- 146 samples)."""
    cm = ToyCost({(4, 2): 100.0, (3, 2): 90.0, (2, 2): 70.0}, inter_ms=20_000.0)
    cm.throughput = FittedTable(cm.throughput.table, measured, u)
    opt = LiveputOptimizer(cm, look_ahead=3, min_gain=0.0, **kwargs)  # the risk rule alone (min_gain: below)
    return opt, opt.decide(8, (3, 2), (8, 0, 0), [_chain(8, [6, 6]), _chain(8, [6, 6]), _chain(8, [8, 8])])


@pytest.mark.parametrize("u", [0.0, 0.02, 0.05, 0.1, 0.2, 0.4, 0.8])
def test_a_departure_to_an_unmeasured_shape_must_clear_its_fits_uncertainty_too(u) -> None:
    """Regression (issue 21, stop 53, pass S): on a notice at 28 instances, the leader left 4x7 for an
    unmeasured 1x26 -- a 0.3 s move against 16 s into 4x6 -- on a fitted gain of 389 +- 254 samples that
    counted 1x26 at its fit; it measured 10 % under it, and the pass lost 3 % to live-reactive. The spread over
    the scenarios was all the decision weighed; the fit's own error (0.2-0.3 there) was not.

    Here the hold (3x2, kept where reacting would take 4x2) is unmeasured with uncertainty ``u``: the decision
    adds ``u`` times what the hold's plan rests on it to the spread, departs exactly when the gain clears both,
    and never charges the same hold once it is measured (nor with the charge switched off)."""
    _, measured = _hold({(4, 2), (3, 2), (2, 2)}, u)
    _, off = _hold({(4, 2), (2, 2)}, u, charge_unmeasured=False)
    opt, on = _hold({(4, 2), (2, 2)}, u)
    assert measured.departs and measured.fit_std == 0.0
    assert off.departs and off.fit_std == 0.0
    assert (measured.expected_gain, measured.gain_std) == pytest.approx((off.expected_gain, off.gain_std))
    fit = on.fit_std
    spread = off.gain_std
    if u == 0.0:
        assert on.departs and on.fit_std == 0.0
        return
    # one sigma of the fit on the samples the hold's plan rests on 3x2 beyond reacting's: linear in u, and no more
    # than 3x2's five measuring steps at 90 samples/s plus the 20 s refill back into 4x2 (ToyCost) at u
    _, tenth = _hold({(4, 2), (2, 2)}, 0.1)
    per_u = tenth.fit_std / 0.1
    assert fit == pytest.approx(u * per_u)
    assert 0.0 < fit <= u * 90.0 * (5 * 64 / 90.0 + 20.0) + 1e-9
    assert on.departs == (u <= 0.1)  # here a fit within 10 % still pays for the hold, one within 20 % does not
    assert on.departs == (off.expected_gain > (spread ** 2 + fit ** 2) ** 0.5)
    if on.departs:
        assert on.gain_std == pytest.approx((spread ** 2 + fit ** 2) ** 0.5)
    else:
        assert on.alternative == (3, 2) and on.alternative_std == pytest.approx((spread ** 2 + fit ** 2) ** 0.5)


def test_reacting_on_an_unmeasured_shape_gives_a_departure_no_credit() -> None:
    """The charge is one-sided: where the *reactive* shape is the unmeasured one, its fit's error does not make
    a departure to a measured shape look safer -- the decision is the one without the charge."""
    _, plain = _hold({(3, 2), (2, 2)}, 0.4, charge_unmeasured=False)
    _, on = _hold({(3, 2), (2, 2)}, 0.4)
    assert on.next_shape == plain.next_shape
    assert (on.expected_gain, on.gain_std, on.fit_std) == pytest.approx((plain.expected_gain, plain.gain_std, 0.0))


@pytest.mark.parametrize("interval_s", [1.0, 5.0, 20.0, 60.0])
def test_a_wrong_fit_is_exposed_only_until_measured_and_moved_out_of(interval_s) -> None:
    """``unmeasured_risk`` counts a stay in an unmeasured shape for at most its measuring steps plus the move back
    to the reactive shape; a shorter stay counts whole, a measured shape or a plan of measured shapes not at all."""
    cm = ToyCost({(4, 2): 100.0, (3, 2): 90.0, (2, 2): 70.0}, inter_ms=10_000.0, repartition_ms=4_000.0)
    cm.throughput = FittedTable(cm.throughput.table, {(4, 2)}, 0.3)
    opt = LiveputOptimizer(cm, interval_s=interval_s, look_ahead=4)
    plan = opt.plan(8, (3, 2), [(8, 0, 0)] * 4, first=(3, 2))
    assert plan.sequence[0] == (3, 2)
    stay_s = sum(interval_s for s in plan.sequence if s == (3, 2))  # the plan may leave it; it stays a prefix
    assert plan.sequence[: int(round(stay_s / interval_s))] == ((3, 2),) * int(round(stay_s / interval_s))
    cap_s = 5 * 64 / 90.0 + 10.0  # five steps, then the refill back to 4x2 (ToyCost: same depth, 10 s)
    expected = 0.3 * 90.0 * min(stay_s, cap_s)
    assert (2, 2) not in plan.sequence  # the only unmeasured shape the plan runs is 3x2
    assert opt.unmeasured_risk(plan) == pytest.approx(expected, rel=1e-6)
    measured_plan = opt.plan(8, (4, 2), [(8, 0, 0)] * 4)
    assert set(measured_plan.sequence) == {(4, 2)} and opt.unmeasured_risk(measured_plan) == 0.0
    assert LiveputOptimizer(cm, interval_s=interval_s, charge_unmeasured=False).unmeasured_risk(plan) == 0.0


@pytest.mark.parametrize("move_s", [18.05, 18.1, 18.2, 18.5, 19.0, 20.0, 24.0])
def test_a_gain_the_estimates_cannot_tell_from_none_is_no_departure_even_when_every_scenario_agrees(move_s) -> None:
    """Regression (issue 21, stop 54, ll_10_11 with role-blind victims): every forecast path said 32 instances,
    so the gain's spread was 0 and the risk rule passed any gain; parcae held 4x6 against the reactive 4x7 for an
    expected 16 samples out of ~9,000 and trained 140 s in the slower shape while live-reactive moved.

    Here 3x2 runs at 90 samples/s and the reactive 4x2 at 100 after a move of ``move_s``; over three 60 s
    intervals holding 3x2 gains ``90 x 180 - 100 x (180 - move_s)``. The hold is taken only if that is at least
    ``min_gain`` (1 %) of the reactive plan's value -- and, with ``min_gain=0``, whenever it is positive."""
    cm = ToyCost({(4, 2): 100.0, (3, 2): 90.0, (2, 2): 70.0}, inter_ms=1000.0 * move_s)
    gain = 90.0 * 180 - 100.0 * (180 - move_s)
    reactive_value = 100.0 * (180 - move_s)
    for min_gain, needed in ((DEFAULT_MIN_GAIN, DEFAULT_MIN_GAIN * reactive_value), (0.0, 0.0)):
        opt = LiveputOptimizer(cm, look_ahead=3, min_gain=min_gain)
        dec = opt.decide(8, (3, 2), (8, 0, 0), [_chain(8, [8, 8])] * 3)
        assert dec.reactive == (4, 2)
        assert dec.departs == (gain > needed), (min_gain, gain, needed)
        if dec.departs:
            assert dec.expected_gain == pytest.approx(gain) and dec.gain_std == pytest.approx(0.0, abs=1e-6)
        else:
            assert dec.alternative == (3, 2) and dec.alternative_gain == pytest.approx(gain)


def test_min_gain_outside_zero_to_one_is_a_configuration_error() -> None:
    cm = ToyCost({(4, 2): 100.0})
    for bad in (-0.1, 1.0, float("nan")):
        with pytest.raises(ConfigurationError, match="min_gain="):
            LiveputOptimizer(cm, min_gain=bad)


@pytest.mark.parametrize("min_gain", [0.0, DEFAULT_MIN_GAIN, 0.015, 0.03])
@pytest.mark.parametrize("risk", [0.0, 1.0, 1.5, 2.0, 2.3, 3.0])
def test_the_least_gain_is_a_floor_beside_the_risk_rule_not_a_second_penalty(risk: float, min_gain: float) -> None:
    """Regression (issue 21, stop 55, hl_15_25 with role-blind victims): stop 54 subtracted the least gain from
    what cleared the risk rule, so the two added up. On 28 instances parcae's hold of 4x6 (238 +- 193 samples,
    1.23 sigma, against a least gain of ~90) was refused, though it cleared each rule on its own -- the hold that
    won pass V (1.036) without the least gain; the pass tied (0.994). The least gain is meant for gains the
    estimates cannot tell from none, where the spread says nothing; it is now a floor of its own: a departure
    must clear ``risk`` sigma *and* gain ``min_gain`` of the reactive plan's value.

    Here holding 3x2 on 8 instances that may drop to 6 gains 357 +- 111 samples over a reactive plan of ~14,700."""
    opt, base = _hold(measured=[(4, 2), (3, 2), (2, 2)], u=0.0)
    scenarios = [_chain(8, [6, 6]), _chain(8, [6, 6]), _chain(8, [8, 8])]
    mean, std = base.expected_gain if base.departs else base.alternative_gain, \
        base.gain_std if base.departs else base.alternative_std
    futures = [[(8, 0, 0)] + sc[:2] for sc in scenarios]
    value = sum(opt.plan(8, (3, 2), f, first=(4, 2)).score for f in futures) / len(futures)
    assert mean > 0 and std > 0 and value > 0
    dec = LiveputOptimizer(opt.cm, look_ahead=3, min_gain=min_gain).decide(8, (3, 2), (8, 0, 0), scenarios,
                                                                          risk=risk)
    assert dec.departs == (mean - risk * std > 0 and mean > min_gain * value), (mean, std, value)
    if (risk, min_gain) == (2.0, DEFAULT_MIN_GAIN):  # each rule alone passes; their sum would not
        assert 0 < mean - risk * std < min_gain * value < mean and dec.departs


@pytest.mark.parametrize("hold_risk", [None, 0.0, 0.5, 1.0, 4.0])
@pytest.mark.parametrize("risk", [0.0, 1.0, 3.0, 3.5, 5.0])
def test_a_bet_already_taken_is_kept_on_hold_risk_and_entered_on_risk(risk: float, hold_risk) -> None:
    """Regression (issue 21, stop 55, pass Y on hl_15_25 at 0.25 Gbps with role-blind victims): on 28 instances
    parcae held 4x6 against the reactive 4x7 at 232 +- 195 samples (1.19 sigma); 14 s later, the count still 28,
    it scored the same hold at 185 +- 212 (0.87 sigma), took it back under the 1-sigma risk rule and paid the 24 s
    repartition into 4x7 one interval after live-reactive had: the interval the bet lost *and* the move it was
    meant to avoid. The risk rule guards entering a bet; staying in one (``held``: the shape a departing decision
    chose, still running) must clear ``hold_risk`` sigma instead (``None``: ``risk``, the old rule).

    Here holding 3x2 on 8 instances that may drop to 6 gains 357 +- 111 samples (3.2 sigma): with the job in
    3x2 as a held bet the margin is ``hold_risk``; not held, or held elsewhere, it is ``risk``."""
    opt, base = _hold(measured=[(4, 2), (3, 2), (2, 2)], u=0.0)
    mean, std = (base.expected_gain, base.gain_std) if base.departs else (base.alternative_gain, base.alternative_std)
    assert mean > 0 and std > 0
    scenarios = [_chain(8, [6, 6]), _chain(8, [6, 6]), _chain(8, [8, 8])]
    kept_margin = risk if hold_risk is None else hold_risk
    for held, margin in (((3, 2), kept_margin), (None, risk), ((2, 2), risk), ((4, 2), risk)):
        dec = opt.decide(8, (3, 2), (8, 0, 0), scenarios, risk=risk, held=held, hold_risk=hold_risk)
        assert dec.departs == (mean - margin * std > 0), (held, margin, mean, std)
        assert dec.next_shape == ((3, 2) if dec.departs else (4, 2))
    # a held shape the job no longer runs is no bet kept: entering it again is a new bet
    moved = opt.decide(8, (2, 2), (8, 0, 0), scenarios, risk=risk, held=(3, 2), hold_risk=hold_risk)
    entered = opt.decide(8, (2, 2), (8, 0, 0), scenarios, risk=risk)
    assert (moved.next_shape, moved.expected_gain) == (entered.next_shape, entered.expected_gain)


@pytest.mark.parametrize("name, bad", [("risk", -1.0), ("risk", float("nan")), ("hold_risk", -1.0),
                                       ("hold_risk", float("nan"))])
def test_a_risk_below_zero_or_not_a_number_is_a_configuration_error_naming_it(name: str, bad: float) -> None:
    """``decide`` names which margin was wrong (``risk`` or ``hold_risk``) and what it takes. An infinite margin
    stays allowed there (depart only on a gain every scenario agrees on), each for its own case: with ``risk``
    infinite a held bet (357 +- 111 samples) is still kept on ``hold_risk`` = 0; with ``hold_risk`` infinite it
    is left for the reactive 4x2."""
    opt, _ = _hold(measured=[(4, 2), (3, 2), (2, 2)], u=0.0)
    with pytest.raises(ConfigurationError, match=rf"^{name}={bad!r}: a risk aversion must be a number >= 0"):
        opt.decide(8, (3, 2), (8, 0, 0), [_chain(8, [6, 6])], held=(3, 2), **{name: bad})
    margins = {"risk": 1.0, "hold_risk": 0.0, name: float("inf")}
    kept = opt.decide(8, (3, 2), (8, 0, 0), [_chain(8, [6, 6]), _chain(8, [6, 6]), _chain(8, [8, 8])], held=(3, 2),
                      **margins)
    assert kept.next_shape == ((3, 2) if name == "risk" else (4, 2))
