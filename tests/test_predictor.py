"""Tests of lightning_parcae.planning.forecast: forecasts, bounds, online updates, bands and walk-forward scores."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from lightning_parcae.planning import forecast as P
from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.forecast import (
    PREDICTORS,
    ArimaPredictor,
    ArtifactPredictor,
    Forecast,
    PersistencePredictor,
    backtest,
    coverage,
    evaluate,
    format_mae_table,
    make_predictor,
    mae_table,
)
from lightning_parcae.planning.forecast import _fit_arima  # the fit itself: tells a converged fit from a fallback
from lightning_parcae.signals.traces import bundled_trace_path, load_trace


@pytest.fixture(scope="module")
def p3_counts() -> np.ndarray:
    return load_trace(bundled_trace_path("p3")).counts()


@pytest.fixture(scope="module")
def segment_counts() -> np.ndarray:
    return load_trace(bundled_trace_path("lh_80_90")).counts()


def _feed(pred: P.Predictor, counts: list[int]) -> P.Predictor:
    for c in counts:
        pred.observe(c)
    return pred


# ---------------------------------------------------------------------------------------------------- Forecast


def test_forecast_rounds_within_band_if_mean_fractional() -> None:
    fc = Forecast(np.array([20.4, 20.6, 7.5]), np.array([19.0, 20.6, 7.0]), np.array([21.0, 22.0, 7.5]))
    assert fc.rounded().tolist() == [20, 21, 8]
    assert fc.rounded().dtype.kind == "i"


def test_forecast_intervals_give_net_changes_if_counts_move() -> None:
    fc = Forecast(np.array([22.0, 22.0, 19.0]), np.array([20.0, 20.0, 17.0]), np.array([23.0, 23.0, 20.0]))
    assert fc.intervals(20) == [(20, 2, 0), (22, 0, 0), (22, 0, 3)]


def test_forecast_raises_if_band_excludes_mean() -> None:
    with pytest.raises(ConfigurationError, match="contain the mean"):
        Forecast(np.array([5.0]), np.array([6.0]), np.array([7.0]))
    with pytest.raises(ConfigurationError, match="shape"):
        Forecast(np.array([5.0, 5.0]), np.array([4.0]), np.array([7.0]))


# ---------------------------------------------------------------------------------------------------- persistence


def test_persistence_repeats_last_count_if_history_moves() -> None:
    pred = _feed(PersistencePredictor(), [10, 14, 13])
    fc = pred.forecast(5)
    assert fc.mean.tolist() == [13.0] * 5
    assert np.all(fc.lower <= fc.mean) and np.all(fc.upper >= fc.mean)
    pred.observe(20)
    assert pred.forecast(2).mean.tolist() == [20.0, 20.0]


def test_persistence_mae_equals_lagged_differences_if_evaluated(p3_counts: np.ndarray) -> None:
    mae = evaluate(p3_counts, PersistencePredictor(), 12)
    c = p3_counts.astype(float)
    expected = [np.mean(np.abs(c[h:] - c[:-h])) for h in range(1, 13)]
    np.testing.assert_allclose(mae, expected)


# ---------------------------------------------------------------------------------------------------- bounds / API


@pytest.mark.parametrize("name", sorted(PREDICTORS))
def test_forecast_stays_in_bounds_if_history_trends_past_them(name: str) -> None:
    pred = make_predictor(name, window=12, min_instances=10, max_instances=20)
    _feed(pred, [20, 19, 17, 15, 14, 13, 12, 11, 10, 10, 9, 8])
    fc = pred.forecast(12)
    for arr in (fc.mean, fc.lower, fc.upper):
        assert arr.shape == (12,)
        assert np.all(arr >= 10) and np.all(arr <= 20)
    assert np.all(fc.rounded() >= 10)


@pytest.mark.parametrize("name", sorted(PREDICTORS))
def test_forecast_raises_if_nothing_observed_or_bad_horizon(name: str) -> None:
    pred = make_predictor(name)
    with pytest.raises(ConfigurationError, match="observe"):
        pred.forecast(3)
    pred.observe(5)
    with pytest.raises(ConfigurationError, match="horizon"):
        pred.forecast(0)


def test_make_predictor_lists_names_if_unknown() -> None:
    assert set(PREDICTORS) == {"persistence", "arima", "artifact", "hazard", "ensemble"}
    assert isinstance(make_predictor("arima", window=20), ArimaPredictor)
    with pytest.raises(ConfigurationError, match="persistence, arima, artifact, hazard, ensemble"):
        make_predictor("prophet")
    with pytest.raises(ConfigurationError, match="window"):
        make_predictor("persistence", window=0)
    with pytest.raises(ConfigurationError, match="exceed"):
        make_predictor("persistence", min_instances=9, max_instances=8)
    with pytest.raises(ConfigurationError, match="observed count"):
        make_predictor("persistence").observe(-1)


def test_observe_updates_forecast_online_if_new_counts_arrive() -> None:
    pred = _feed(ArimaPredictor(window=12), [20] * 12)
    assert pred.forecast(3).mean.tolist() == [20.0] * 3
    _feed(pred, [21, 22, 23, 24, 25, 26])
    moved = pred.forecast(3).mean
    assert moved[0] >= 26.0
    assert pred.history.tolist()[-3:] == [24.0, 25.0, 26.0] and len(pred.history) == 12
    pred.reset()
    with pytest.raises(ConfigurationError):
        pred.forecast(1)


def test_arima_falls_back_to_persistence_if_history_short_or_flat() -> None:
    short = _feed(ArimaPredictor(), [10, 30, 10])
    assert short.forecast(4).mean.tolist() == [10.0] * 4
    flat = _feed(ArimaPredictor(), [17] * 40)
    assert flat.forecast(4).mean.tolist() == [17.0] * 4


def test_artifact_clamps_steps_to_three_around_first_if_history_climbs() -> None:
    climb = [10, 11, 13, 14, 16, 17, 19, 20]  # smoothing and flattening leave it as it is: the fit sees it whole
    pred = _feed(ArtifactPredictor(window=8, min_instances=0, max_instances=100), climb)
    fc = pred.forecast(8)
    assert np.all(np.abs(fc.mean[1:] - fc.mean[0]) <= 3 + 1e-9)
    if _fit_arima(np.array(climb, dtype=float), (1, 1, 0), "t", 8) is None:
        # Environment drift, found 2026-12-02 in a fresh venv (numpy 2.4.6; scipy 1.16.3 and 1.17.1; statsmodels
        # 0.14.6 and 0.15.0 all alike): the ML fit of this almost exactly linear climb raises a ConvergenceWarning,
        # and the contract for a fit that warns is persistence (the last count), not a made-up drift.
        np.testing.assert_allclose(fc.mean, 20.0)
    else:
        assert fc.mean[0] > 20  # the drift continues, damped


def test_artifact_flattens_before_turning_point_if_history_reverses() -> None:
    x = np.array([10.0, 14.0, 18.0, 18.0, 16.0, 15.0])
    assert ArtifactPredictor._flatten(x).tolist() == [18.0, 18.0, 18.0, 18.0, 16.0, 15.0]
    assert ArtifactPredictor._smooth(np.array([5.0, 5.0, 9.0, 5.0, 6.0])).tolist() == [5.0, 5.0, 5.0, 5.0, 6.0]


# ---------------------------------------------------------------------------------------------------- determinism


@pytest.mark.parametrize("name", sorted(PREDICTORS))
def test_evaluate_repeats_exactly_if_run_twice_from_cold_cache(name: str, segment_counts: np.ndarray) -> None:
    counts = segment_counts[:36]
    P._FIT_CACHE.clear()
    first = backtest(counts, make_predictor(name, window=10), 6)
    P._FIT_CACHE.clear()
    second = backtest(counts, make_predictor(name, window=10), 6)
    np.testing.assert_array_equal(first.mae, second.mae)
    np.testing.assert_array_equal(first.coverage, second.coverage)
    assert first.n.tolist() == [35 - h for h in range(6)]


# ---------------------------------------------------------------------------------------------------- bands


def test_band_covers_about_eighty_percent_if_walked_over_p3(p3_counts: np.ndarray) -> None:
    cov = coverage(p3_counts, PersistencePredictor(), 10)
    assert cov.shape == (10,)
    assert 0.75 <= float(cov.mean()) <= 0.92


def test_band_widens_with_step_if_errors_grow(p3_counts: np.ndarray) -> None:
    pred = PersistencePredictor(window=12)
    _feed(pred, [20, 21, 20, 22])
    early = pred.forecast(12)  # too few scored errors: volatility band, widening with sqrt(step)
    assert early.upper[-1] - early.lower[-1] > early.upper[0] - early.lower[0] > 0
    backtest(p3_counts[:300], pred, 12)  # leaves the predictor holding 300 intervals of scored errors
    late = pred.forecast(12)  # empirical band from those errors
    assert late.upper[-1] - late.lower[-1] > late.upper[0] - late.lower[0]


# ---------------------------------------------------------------------------------------------------- p3 scores


def test_artifact_mae_is_in_reference_ballpark_if_p3_l12(p3_counts: np.ndarray) -> None:
    mae = evaluate(p3_counts, ArtifactPredictor(window=12), 12)
    # Reference: about 3.0 instances at L=12 (artifact's own accounting); ours must be the same order.
    assert 2.2 <= float(mae.mean()) <= 3.6
    assert float(mae.mean()) > float(evaluate(p3_counts, PersistencePredictor(), 12).mean())


def test_mae_table_has_one_array_per_name_and_horizon_if_asked(segment_counts: np.ndarray) -> None:
    table = mae_table(segment_counts[:30], [4, 6], names=["persistence", "artifact"])
    assert set(table) == {"persistence", "artifact"}
    assert [len(table["artifact"][h]) for h in (4, 6)] == [4, 6]
    text = format_mae_table(table)
    assert "L=4" in text and "artifact" in text and len(text.splitlines()) == 3


# ---------------------------------------------------------------------------------------------------- hygiene


def test_predictor_module_does_not_import_torch_if_imported_alone() -> None:
    code = (
        "import sys, lightning_parcae.planning.forecast as p, lightning_parcae.signals.traces;"
        "p.evaluate([3, 4, 4, 5, 5, 6, 6, 6, 7, 7], p.make_predictor('arima', window=8), 2);"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------ unbounded, scenarios, ensemble


@pytest.mark.parametrize("name", ["persistence", "arima", "hazard", "ensemble"])
def test_forecast_is_not_clipped_if_no_maximum_given(name: str) -> None:
    """Regression: forecasts were clipped to 32, so a constant 40-instance trace scored MAE 8 instead of 0."""
    assert float(np.nanmean(evaluate([40] * 30, make_predictor(name, max_instances=None), 4))) == 0.0
    assert float(np.nanmean(evaluate([40] * 30, make_predictor(name, max_instances=32), 4))) == 8.0


@pytest.mark.parametrize("seed", range(4))
def test_scenarios_are_ordered_quantile_paths_with_weights_summing_to_one_if_walked(seed: int) -> None:
    """Quantile paths never cross (a higher level is never below a lower one), stay in bounds and merge equal
    paths, on random step traces, before and after the empirical band takes over."""
    rng = np.random.default_rng(seed)
    counts = np.clip(20 + np.cumsum(rng.choice([-2, -1, 0, 0, 0, 0, 1, 2], size=120)), 0, 40)
    pred = make_predictor("persistence", max_instances=40)
    for t, c in enumerate(counts):
        pred.observe(int(c))
        if t % 17 == 0 or t > 100:
            paths, w = pred.scenarios(6, (0.1, 0.3, 0.5, 0.7, 0.9))
            assert w.sum() == pytest.approx(1.0) and np.all(w > 0)
            assert paths.shape[1] == 6 and np.all(paths >= 0) and np.all(paths <= 40)
            assert len({tuple(p) for p in paths.tolist()}) == len(paths)
            order = np.argsort(paths[:, -1], kind="stable")
            assert np.all(np.diff(paths[order], axis=0) >= 0)


def test_scenarios_raise_if_levels_outside_zero_one() -> None:
    pred = make_predictor("persistence")
    pred.observe(5)
    with pytest.raises(ConfigurationError, match="levels"):
        pred.scenarios(3, (0.0, 0.5))


def test_hazard_forecasts_decline_and_stops_at_zero_if_history_falls_steadily() -> None:
    pred = make_predictor("hazard", max_instances=None)
    _feed(pred, list(range(30, 10, -1)))
    fc = pred.forecast(30)
    assert fc.mean[0] < 11 and np.all(np.diff(fc.mean) <= 0) and fc.mean[-1] == 0.0


def test_ensemble_uses_persistence_until_a_member_clearly_beats_it_if_trace_declines() -> None:
    """On a flat history the ensemble answers persistence; on a long steady decline the hazard member's drift
    wins its recent-error race and the ensemble follows it."""
    pred = make_predictor("ensemble", max_instances=None)
    for c in [20] * 30:
        pred.observe(c)
        pred.forecast(4)
    assert set(pred.chosen) == {"persistence"}
    for c in range(200, 50, -1):
        pred.observe(c)
        pred.forecast(4)
    assert pred.chosen[-1] != "persistence"


def test_scored_errors_are_each_steps_latest_errors_pooled_if_forecasts_were_scored() -> None:
    """Persistence at 10 forecasts 10, 10; the counts after are 12 then 15: the step-1 errors are 2 (10 -> 12)
    and 3 (12 -> 15), the step-2 error of the first forecast is 5 (10 -> 15). ``last`` keeps the latest of each
    step (what the ensemble ranks its members by)."""
    pred = make_predictor("persistence", max_instances=None)
    assert pred.scored_errors() == []
    pred.observe(10)
    pred.forecast(2)
    pred.observe(12)
    pred.forecast(2)
    pred.observe(15)
    assert pred.scored_errors() == [2.0, 3.0, 5.0]
    assert pred.scored_errors(last=1) == [3.0, 5.0]
    pred.reset()
    assert pred.scored_errors() == []
