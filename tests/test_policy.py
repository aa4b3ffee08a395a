"""The one decision rule shared by the simulator's parcae policy and the runtime (planning.policy)."""

from __future__ import annotations

import random

import pytest

from lightning_parcae.planning.costmodel import ArtifactCostModel
from lightning_parcae.planning.forecast import make_predictor
from lightning_parcae.planning.policy import (
    LEVELS,
    DecisionOptions,
    ShapeDecider,
    decide_with_forecast,
    make_decision_predictor,
    paths_to_intervals,
)
from lightning_parcae.planning.shape_optimizer import DEFAULT_MIN_GAIN, PAUSED, LiveputOptimizer


@pytest.fixture(scope="module")
def gpt() -> ArtifactCostModel:
    return ArtifactCostModel("gpt-1.5b")


def test_paths_to_intervals_chains_counts_from_the_start() -> None:
    assert paths_to_intervals(10, [12, 9, 9]) == [(10, 2, 0), (12, 0, 3), (9, 0, 0)]


@pytest.mark.parametrize("seed", range(4))
def test_decision_fits_the_known_interval_and_matches_a_manual_decide(gpt: ArtifactCostModel, seed: int) -> None:
    """Over random histories: the decision fits the count after the known interval, and it is exactly
    LiveputOptimizer.decide over the predictor's quantile scenarios (what the runtime used to skip: it planned
    with a point forecast and ``plan``, while the simulator scored ``decide``)."""
    rng = random.Random(seed)
    opt = LiveputOptimizer(gpt, look_ahead=6)
    pred = make_predictor("persistence", max_instances=32)
    n, shape = 16, PAUSED
    for _ in range(8):
        n_in, n_out = rng.randint(0, 3), rng.randint(0, min(3, n))
        after = n + n_in - n_out
        pred.observe(after)
        dec, scenarios, weights = decide_with_forecast(opt, pred, shape, (n, n_in, n_out))
        assert dec.next_shape == PAUSED or dec.next_shape[0] * dec.next_shape[1] <= after
        assert abs(sum(weights) - 1.0) < 1e-9 and all(len(sc) == 5 for sc in scenarios)
        manual = opt.decide(n, shape, (n, n_in, n_out), scenarios, weights)
        assert manual == dec
        shape, n = dec.next_shape, after


def test_decision_without_a_predictor_plans_the_known_interval_only(gpt: ArtifactCostModel) -> None:
    opt = LiveputOptimizer(gpt, look_ahead=4)
    dec, scenarios, _ = decide_with_forecast(opt, None, PAUSED, (12, 0, 0))
    assert scenarios == [[]]
    assert dec == opt.decide(12, PAUSED, (12, 0, 0), [[]], [1.0])
    assert dec.next_shape[0] * dec.next_shape[1] <= 12


@pytest.mark.parametrize("look_ahead, window", [(1, 8), (4, 8), (12, 12), (20, 20)])
@pytest.mark.parametrize("name", ["persistence", "artifact", "hazard"])
def test_the_decision_predictor_looks_back_the_look_ahead_from_zero_to_the_cluster_size(
        look_ahead: int, window: int, name: str) -> None:
    """One factory for both callers: window max(L, 8), bounds [0, max_instances] -- whatever the class defaults
    (``artifact`` alone would clip forecasts at 8 instances, ``hazard`` look back 60)."""
    pred = make_decision_predictor(DecisionOptions(look_ahead=look_ahead, predictor=name, max_instances=24))
    assert pred is not None and pred.name == name
    assert (pred.window, pred.min_instances, pred.max_instances) == (window, 0, 24)
    assert make_decision_predictor(DecisionOptions(predictor=None)) is None


@pytest.mark.parametrize("min_gain, charge_unmeasured", [(DEFAULT_MIN_GAIN, True), (0.0, False), (0.05, True)])
def test_the_decider_is_decide_with_forecast_over_its_own_optimizer_and_predictor(
        gpt: ArtifactCostModel, min_gain: float, charge_unmeasured: bool) -> None:
    """Walking a history through the decider gives, interval by interval, decide_with_forecast over an optimizer
    and a predictor built as the decider documents them -- with the options' least gain and fit charge."""
    rng = random.Random(3)
    options = DecisionOptions(look_ahead=6, predictor="persistence", max_instances=32, risk=0.25, levels=LEVELS[1:4],
                              min_gain=min_gain, charge_unmeasured=charge_unmeasured)
    decider = ShapeDecider(gpt, interval_s=120.0, options=options)
    assert (decider.optimizer.min_gain, decider.optimizer.charge_unmeasured) == (min_gain, charge_unmeasured)
    opt = LiveputOptimizer(gpt, interval_s=120.0, look_ahead=6, min_gain=min_gain,
                           charge_unmeasured=charge_unmeasured)
    pred = make_predictor("persistence", window=8, min_instances=0, max_instances=32)
    n, shape = 16, PAUSED
    for _ in range(6):
        n_in, n_out = rng.randint(0, 3), rng.randint(0, min(3, n))
        after = n + n_in - n_out
        decider.observe(after)
        pred.observe(after)
        got = decider.decide(shape, (n, n_in, n_out))
        want = decide_with_forecast(opt, pred, shape, (n, n_in, n_out), risk=0.25, levels=LEVELS[1:4])
        assert (got.decision, got.scenarios, list(got.weights)) == (want.decision, want.scenarios, list(want.weights))
        assert got.median == got.scenarios[len(got.scenarios) // 2]
        shape, n = got.decision.next_shape, after
    assert decider.observed == 6


def test_a_decider_given_the_history_decides_as_one_that_observed_it(gpt: ArtifactCostModel) -> None:
    """A new leader replays the job's history: its decision is the old leader's."""
    history = [16, 18, 18, 15, 16, 20]
    walked = ShapeDecider(gpt, interval_s=60.0, options=DecisionOptions(look_ahead=5))
    for c in history:
        walked.observe(c)
    replayed = ShapeDecider(gpt, interval_s=60.0, options=DecisionOptions(look_ahead=5), history=history)
    assert replayed.observed == walked.observed == len(history)
    a, b = replayed.decide((2, 8), (16, 4, 0)), walked.decide((2, 8), (16, 4, 0))
    assert (a.decision, a.scenarios, list(a.weights)) == (b.decision, b.scenarios, list(b.weights))


def test_a_decider_without_a_predictor_plans_the_known_interval_only(gpt: ArtifactCostModel) -> None:
    decider = ShapeDecider(gpt, interval_s=60.0, options=DecisionOptions(look_ahead=4, predictor=None))
    decider.observe(12)  # nothing to remember it in
    assert decider.observed == 0 and decider.predictor is None
    got = decider.decide(PAUSED, (12, 0, 0))
    assert got.scenarios == [[]] and got.median == []
    assert got.decision == decider.optimizer.decide(12, PAUSED, (12, 0, 0), [[]], [1.0])


def test_a_decision_between_planning_intervals_forecasts_from_the_count_it_knows(gpt: ArtifactCostModel) -> None:
    """Regression (issue 21, stop 49, 0.25 Gbps replay of lh_80_90): the runtime observes counts at planning
    intervals only; at a notice between them (32 -> 27) the persistence forecast after the known interval was 32,
    so every drop was expected to reverse and the job parked in cheap, slow shapes. The forecast now starts from
    the known count, and the predictor's own history is left one count per planning interval."""
    decider = ShapeDecider(gpt, interval_s=60.0, options=DecisionOptions(look_ahead=5), history=[32] * 6)
    got = decider.decide((4, 8), (32, 0, 5))
    assert got.median and all(prev + n_in - n_out == 27 for prev, n_in, n_out in got.median)
    assert decider.observed == 6 and int(decider.predictor.history[-1]) == 32  # type: ignore[union-attr]
    walked = ShapeDecider(gpt, interval_s=60.0, options=DecisionOptions(look_ahead=5), history=[32] * 6 + [27])
    want = walked.decide((4, 8), (32, 0, 5))
    assert (got.decision, got.scenarios, list(got.weights)) == (want.decision, want.scenarios, list(want.weights))
