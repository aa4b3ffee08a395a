"""The one decision rule shared by the simulator's parcae policy and the runtime (planning.policy)."""

from __future__ import annotations

import random

import pytest

from lightning_parcae.planning.costmodel import ArtifactCostModel
from lightning_parcae.planning.forecast import make_predictor
from lightning_parcae.planning.policy import decide_with_forecast, paths_to_intervals
from lightning_parcae.planning.shape_optimizer import PAUSED, LiveputOptimizer


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
