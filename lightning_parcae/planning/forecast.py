"""Forecasting how many spot instances will be available over the next intervals.

Problem: the liveput optimizer plans the next ``L`` intervals (L = 8, 10, 12 minutes in the paper), so it needs the
instance count of each of them *before* they happen, from the last ``W`` observed counts only. A point guess is not
enough to plan safely: the planner also wants to know how far off the guess may be. Spot availability is a step
function -- long flat stretches, then bursts of arrivals or preemptions -- so classic time-series models often lose
to "nothing will change", and a forecaster must be honest about that.

Solution: an online :class:`Predictor` observes each interval's true count and forecasts the next ``horizon``
counts as a :class:`Forecast` (mean and a central band). Three predictors share one band mechanism:

* :class:`PersistencePredictor` -- the last count, for every step.
* :class:`ArimaPredictor` -- an ARIMA fitted by ``statsmodels`` on a short window, falling back to persistence
  whenever the window carries too little signal or the fit fails or warns.
* :class:`ArtifactPredictor` -- the Parcae artifact's heuristic ARIMA(1,1,0)-with-drift (smoothing, flattening,
  clamping, damping), as described in the reference ``ARTIFACT_MODEL.md``.

The band is *empirical*: every predictor remembers its own past forecast errors per step ahead (online, only from
intervals already observed) and puts the band at their 10 % / 90 % quantiles, so it covers about 80 % of outcomes
once a few dozen errors are known; before that it widens with recent volatility and ``sqrt(step)``.

:func:`evaluate`, :func:`coverage` and :func:`mae_table` walk a trace online (forecast at every ``t`` from history up
to ``t``) and score the forecasts; ``docs/traces_and_predictor.md`` has the measured table for the p3 trace.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, Optional, Sequence

import numpy as np

from lightning_parcae.errors import ConfigurationError, build_by_name

__all__ = [
    "Forecast",
    "Predictor",
    "PersistencePredictor",
    "ArimaPredictor",
    "ArtifactPredictor",
    "HazardPredictor",
    "EnsemblePredictor",
    "PREDICTORS",
    "make_predictor",
    "Backtest",
    "backtest",
    "evaluate",
    "coverage",
    "mae_table",
    "format_mae_table",
]


def _check_int(name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigurationError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class Forecast:
    """Expected instance counts for the next ``L`` intervals, with a central band.

    Attributes:
        mean: ``(L,)`` expected count after each future interval.
        lower: ``(L,)`` lower edge of the central band (about 80 % of outcomes lie within the band).
        upper: ``(L,)`` upper edge of the band.
    """

    mean: np.ndarray
    lower: np.ndarray
    upper: np.ndarray

    def __post_init__(self) -> None:
        arrays = []
        for name in ("mean", "lower", "upper"):
            a = np.array(getattr(self, name), dtype=float)
            if a.ndim != 1 or not np.all(np.isfinite(a)):
                raise ConfigurationError(f"Forecast.{name} must be a 1-D array of finite numbers, got {a!r}")
            a.flags.writeable = False
            object.__setattr__(self, name, a)
            arrays.append(a)
        mean, lower, upper = arrays
        if not (mean.shape == lower.shape == upper.shape):
            raise ConfigurationError(
                f"Forecast arrays differ in shape: mean {mean.shape}, lower {lower.shape}, upper {upper.shape}"
            )
        if np.any(lower > mean + 1e-9) or np.any(upper < mean - 1e-9):
            raise ConfigurationError("Forecast band must contain the mean (lower <= mean <= upper)")

    def __len__(self) -> int:
        return int(self.mean.shape[0])

    def rounded(self) -> np.ndarray:
        """Integer counts: the mean rounded to the nearest integer, kept inside ``[floor(lower), ceil(upper)]``.

        Returns:
            ``(L,)`` non-negative int array.
        """
        r = np.clip(np.rint(self.mean), np.floor(self.lower), np.ceil(self.upper))
        return np.maximum(r, 0).astype(np.int64)

    def intervals(self, current_n: int) -> list[tuple[int, int, int]]:
        """The rounded forecast as trace intervals.

        Args:
            current_n: Instances present now (before the first forecast interval).

        Returns:
            ``[(prev_n, n_in, n_out), ...]`` with the net change of each step as ``n_in`` or ``n_out``.
        """
        prev = _check_int("current_n", current_n, 0)
        out = []
        for n in self.rounded().tolist():
            d = n - prev
            out.append((prev, max(d, 0), max(-d, 0)))
            prev = n
        return out


class Predictor(abc.ABC):
    """Online forecaster of instance counts.

    Call :meth:`observe` with each interval's true count, then :meth:`forecast` for the next ``horizon`` intervals.
    Subclasses compute the mean in :meth:`forecast` and pass it to :meth:`_finish`, which clips it to
    ``[min_instances, max_instances]``, attaches the empirical band and remembers it to score later.

    Args:
        window: How many past counts (W) the model looks at.
        min_instances: Lowest count a forecast may take.
        max_instances: Highest count a forecast may take (``None``: no upper bound).
        seed: Seed for randomized predictors (the built-in ones are deterministic and ignore it).

    Raises:
        ConfigurationError: ``window < 1``, negative bounds or ``min_instances > max_instances``.
    """

    name: ClassVar[str] = "base"
    #: Central probability of the band.
    band_level: ClassVar[float] = 0.8
    #: Past errors per step kept for the band (240 one-minute intervals = 4 h).
    band_memory: ClassVar[int] = 240
    #: Errors needed at a step before the empirical band replaces the volatility band.
    band_min_errors: ClassVar[int] = 30

    def __init__(
        self, *, window: int = 12, min_instances: int = 0, max_instances: Optional[int] = 32, seed: int = 0
    ) -> None:
        self.window = _check_int("window", window, 1)
        self.min_instances = _check_int("min_instances", min_instances, 0)
        self.max_instances: Optional[int] = None if max_instances is None else _check_int("max_instances", max_instances, 0)
        if self.max_instances is not None and self.min_instances > self.max_instances:
            raise ConfigurationError(
                f"min_instances ({min_instances}) must not exceed max_instances ({max_instances})"
            )
        self.seed = int(seed)
        self.reset()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(window={self.window}, min_instances={self.min_instances}, "
            f"max_instances={self.max_instances})"
        )

    def reset(self) -> None:
        """Forget all observations and past errors."""
        self._history: deque[int] = deque(maxlen=self.window)
        self._t = 0
        self._pending: dict[int, np.ndarray] = {}
        self._errors: list[deque[float]] = []

    @property
    def history(self) -> np.ndarray:
        """The last ``window`` observed counts, oldest first."""
        return np.array(self._history, dtype=float)

    def observe(self, n: int) -> None:
        """Record the true count after the latest interval (and score earlier forecasts against it).

        Args:
            n: Instances present after the interval.

        Raises:
            ConfigurationError: ``n`` is not a non-negative integer.
        """
        n = _check_int("observed count", n, 0)
        self._history.append(n)
        self._t += 1
        for origin in list(self._pending):
            mean = self._pending[origin]
            step = self._t - origin
            if 1 <= step <= len(mean):
                while len(self._errors) < step:
                    self._errors.append(deque(maxlen=self.band_memory))
                self._errors[step - 1].append(n - float(mean[step - 1]))
            if step >= len(mean):
                del self._pending[origin]

    def scored_errors(self, last: Optional[int] = None) -> list[float]:
        """Errors (observed - forecast mean) of this predictor's scored forecasts, all steps ahead pooled.

        Args:
            last: Keep only the latest ``last`` errors of each step ahead (``None``: all that are remembered).

        Returns:
            The errors of step 1 (oldest first), then those of step 2, and so on.
        """
        return [e for errs in self._errors for e in (list(errs) if last is None else list(errs)[-last:])]

    @abc.abstractmethod
    def forecast(self, horizon: int) -> Forecast:
        """Forecast the counts of the next ``horizon`` intervals from the observations so far.

        Args:
            horizon: Number of future intervals (L >= 1).

        Returns:
            The forecast; ``mean``, ``lower`` and ``upper`` lie in ``[min_instances, max_instances]``.

        Raises:
            ConfigurationError: ``horizon < 1`` or nothing observed yet.
        """

    def scenarios(
        self, horizon: int, levels: Sequence[float] = (0.1, 0.3, 0.5, 0.7, 0.9)
    ) -> tuple[np.ndarray, np.ndarray]:
        """Integer count paths at quantiles of the forecast's error distribution, for planning against it.

        Path ``k`` is the forecast mean plus, at every step, the ``levels[k]`` quantile of this predictor's own
        past errors at that step (online, as for the band); before :attr:`band_min_errors` errors are known, a
        normal quantile of the recent volatility times ``sqrt(step)``. Each level carries an equal share of the
        probability; paths that round to the same counts are merged and their weights added.

        Args:
            horizon: Steps ahead.
            levels: Quantile levels in (0, 1), one path each.

        Returns:
            ``(paths, weights)``: ``(K, horizon)`` int counts in ``[min_instances, max_instances]`` and ``(K,)``
            weights summing to 1.
        """
        from scipy.stats import norm

        lv = np.asarray(levels, dtype=float)
        if lv.ndim != 1 or len(lv) == 0 or np.any((lv <= 0) | (lv >= 1)):
            raise ConfigurationError(f"levels must be quantile levels in (0, 1), got {list(levels)!r}")
        fc = self.forecast(horizon)
        hist = self.history
        diffs = np.diff(hist)
        sigma = float(np.sqrt(np.mean(diffs**2))) if len(diffs) else 0.0
        dev = np.empty((len(lv), len(fc)))
        for i in range(len(fc)):
            errs = self._errors[i] if i < len(self._errors) else ()
            if len(errs) >= self.band_min_errors:
                dev[:, i] = np.quantile(np.fromiter(errs, dtype=float), lv)
            else:
                dev[:, i] = norm.ppf(lv) * sigma * np.sqrt(i + 1.0)
        paths = self._clip(np.rint(fc.mean[None, :] + dev)).astype(np.int64)
        merged: dict[tuple[int, ...], float] = {}
        for row in paths:
            key = tuple(row.tolist())
            merged[key] = merged.get(key, 0.0) + 1.0 / len(lv)
        return np.array(list(merged), dtype=np.int64).reshape(len(merged), len(fc)), np.array(list(merged.values()))

    # -- helpers for subclasses --------------------------------------------------------------------------------

    def _start(self, horizon: int) -> tuple[int, np.ndarray]:
        horizon = _check_int("horizon", horizon, 1)
        if not self._history:
            raise ConfigurationError(f"{type(self).__name__}.forecast: observe() at least one count first")
        return horizon, self.history

    def _clip(self, x: np.ndarray) -> np.ndarray:
        return np.clip(x, self.min_instances, self.max_instances)

    def _finish(self, mean: np.ndarray) -> Forecast:
        """Clip ``mean``, attach the band and remember the forecast for scoring."""
        mean = self._clip(np.asarray(mean, dtype=float))
        horizon = len(mean)
        kept = self._pending.get(self._t)
        if kept is None or len(kept) <= horizon:
            self._pending[self._t] = mean.copy()
        lo_q = (1.0 - self.band_level) / 2.0
        lower = np.empty(horizon)
        upper = np.empty(horizon)
        hist = self.history
        diffs = np.diff(hist)
        sigma = float(np.sqrt(np.mean(diffs**2))) if len(diffs) else 0.0
        z = 1.2815515655446004  # standard-normal 90 % quantile, for the 80 % fallback band
        for i in range(horizon):
            errs = self._errors[i] if i < len(self._errors) else ()
            if len(errs) >= self.band_min_errors:
                e = np.fromiter(errs, dtype=float)
                lower[i] = mean[i] + min(0.0, float(np.quantile(e, lo_q, method="lower")))
                upper[i] = mean[i] + max(0.0, float(np.quantile(e, 1.0 - lo_q, method="higher")))
            else:
                half = z * sigma * np.sqrt(i + 1.0)
                lower[i] = mean[i] - half
                upper[i] = mean[i] + half
        return Forecast(mean, self._clip(lower), self._clip(upper))


class PersistencePredictor(Predictor):
    """Every future count equals the last observed one ("nothing will change")."""

    name: ClassVar[str] = "persistence"

    def forecast(self, horizon: int) -> Forecast:
        horizon, hist = self._start(horizon)
        return self._finish(np.full(horizon, hist[-1]))


# Forecasts of the ARIMA predictors depend only on the window's shape, not its level (d = 1), so fits are cached
# by (predictor kind, model spec, window minus its last value). Bounded to keep memory flat in long runs.
_FIT_CACHE: dict[tuple, Optional[np.ndarray]] = {}
_FIT_CACHE_MAX = 20_000
_CACHE_HORIZON = 32


_BLAS_THREADS: Optional[list[tuple[Callable[[], int], Callable[[int], None]]]] = None


def _blas_thread_controls() -> list[tuple[Callable[[], int], Callable[[int], None]]]:
    """(get, set) thread-count functions of every OpenBLAS loaded in this process (Linux; else none)."""
    global _BLAS_THREADS
    if _BLAS_THREADS is None:
        controls = []
        try:
            with open("/proc/self/maps") as maps:
                paths = sorted({ln.split()[-1] for ln in maps if "openblas" in ln.lower() and ".so" in ln})
            for path in paths:
                lib = ctypes.CDLL(path)
                for suffix in ("64_", ""):
                    get = getattr(lib, f"scipy_openblas_get_num_threads{suffix}", None) or getattr(
                        lib, f"openblas_get_num_threads{suffix}", None
                    )
                    put = getattr(lib, f"scipy_openblas_set_num_threads{suffix}", None) or getattr(
                        lib, f"openblas_set_num_threads{suffix}", None
                    )
                    if get is not None and put is not None:
                        controls.append((get, put))
                        break
        except (OSError, AttributeError):
            controls = []
        _BLAS_THREADS = controls
    return _BLAS_THREADS


@contextlib.contextmanager
def _single_threaded_blas() -> Iterator[None]:
    """Run tiny ARIMA fits on one BLAS thread: on a busy 2-core host, OpenBLAS threads make them ~7x slower."""
    controls = _blas_thread_controls()
    saved = []
    for get, put in controls:
        saved.append(int(get()))
        put(1)
    try:
        yield
    finally:
        for (_, put), n in zip(controls, saved):
            put(n)


def _fit_arima(series: np.ndarray, order: tuple[int, int, int], trend: str, horizon: int) -> Optional[np.ndarray]:
    """Fit ``ARIMA(order)`` with ``trend`` and forecast; ``None`` if the fit raises, warns or is not finite."""
    steps = max(horizon, _CACHE_HORIZON)
    key = (order, trend, tuple(np.round(series - series[-1], 9).tolist()))
    if key in _FIT_CACHE:
        cached = _FIT_CACHE[key]
        if cached is None or len(cached) >= horizon:
            return None if cached is None else cached[:horizon] + series[-1]
    from statsmodels.tsa.arima.model import ARIMA  # imported lazily: slow, and only needed here

    result: Optional[np.ndarray]
    with warnings.catch_warnings(record=True) as caught, _single_threaded_blas():
        warnings.simplefilter("always")
        try:
            fitted = ARIMA(series - series[-1], order=order, trend=trend).fit()
            result = np.asarray(fitted.forecast(steps), dtype=float)
        except Exception:  # noqa: BLE001 -- any failure of the fit means "fall back"
            result = None
    if caught or result is None or not np.all(np.isfinite(result)):
        result = None
    if len(_FIT_CACHE) >= _FIT_CACHE_MAX:
        _FIT_CACHE.clear()
    _FIT_CACHE[key] = result
    return None if result is None else result[:horizon] + series[-1]


class ArimaPredictor(Predictor):
    """ARIMA(1,1,0) fitted by ``statsmodels`` on the last ``window`` counts, made robust for step-shaped traces.

    Falls back to persistence when fewer than :attr:`min_fit` counts are known, when the window holds fewer than
    :attr:`min_changes` changes (nothing to fit), or when ``statsmodels`` raises or warns (non-convergence,
    non-stationary start, too few observations). Because spot counts mostly stay put, the loss that matters (MAE)
    is minimized by the conditional *median*, which is usually "no change": the ARIMA deviation from the last count
    is multiplied by :attr:`shrink` and then soft-thresholded by :attr:`deadband` instances, so only a clear
    momentum moves the forecast. The default window is 30 (30 minutes at 60-s intervals): 12 points are too few to
    estimate the AR coefficient (on p3, W=12 gives MAE 1.83/2.37 at L=8/12 against 1.80/2.35 with W=30). Fits
    are cached by window shape, so runs are deterministic and fast.
    """

    name: ClassVar[str] = "arima"
    order: ClassVar[tuple[int, int, int]] = (1, 1, 0)
    trend: ClassVar[str] = "n"
    min_fit: ClassVar[int] = 6
    min_changes: ClassVar[int] = 2
    shrink: ClassVar[float] = 1.0
    deadband: ClassVar[float] = 1.0

    def __init__(
        self, *, window: int = 30, min_instances: int = 0, max_instances: Optional[int] = 32, seed: int = 0
    ) -> None:
        super().__init__(window=window, min_instances=min_instances, max_instances=max_instances, seed=seed)

    def forecast(self, horizon: int) -> Forecast:
        horizon, hist = self._start(horizon)
        last = hist[-1]
        mean = np.full(horizon, last)
        if len(hist) >= self.min_fit and np.count_nonzero(np.diff(hist)) >= self.min_changes:
            fitted = _fit_arima(hist, self.order, self.trend, horizon)
            if fitted is not None:
                dev = self.shrink * (fitted - last)
                mean = last + np.sign(dev) * np.maximum(np.abs(dev) - self.deadband, 0.0)
        return self._finish(mean)


class ArtifactPredictor(Predictor):
    """The Parcae artifact's predictor, as far as ``ARTIFACT_MODEL.md`` describes it.

    Steps on the window of W counts (the artifact uses W = L):

    1. Smooth short excursions: a single count that differs from two equal neighbours takes their value.
    2. Flatten before the last turning point: counts before the start of the latest monotone run are set to the
       count where that run starts, so the model only sees the current leg.
    3. Fit ARIMA(1,1,0) with drift (``trend="t"``) and forecast L counts; if the flattened window is constant,
       too short (< 3) or the fit fails, the forecast is the last count.
    4. Clamp steps 2..L to +-3 around the first forecast, and everything to ``[min_instances, max_instances]``
       (the artifact uses [8, 32], hence ``min_instances=8`` by default here).
    5. Damp monotone trends: if the raw window is monotone and rose or fell by >= 10 (>= 5), the forecast's
       deviation from the last count is multiplied by 0.5 (0.75).

    The reference states these steps, not their exact definitions; the definitions above are this module's.
    """

    name: ClassVar[str] = "artifact"

    def __init__(
        self, *, window: int = 12, min_instances: int = 8, max_instances: Optional[int] = 32, seed: int = 0
    ) -> None:
        super().__init__(window=window, min_instances=min_instances, max_instances=max_instances, seed=seed)

    @staticmethod
    def _smooth(x: np.ndarray) -> np.ndarray:
        y = x.copy()
        for i in range(1, len(y) - 1):
            if y[i - 1] == x[i + 1] and y[i] != y[i - 1]:
                y[i] = y[i - 1]
        return y

    @staticmethod
    def _flatten(x: np.ndarray) -> np.ndarray:
        d = np.sign(np.diff(x))
        moves = np.flatnonzero(d)
        if len(moves) < 2:
            return x
        start = moves[-1]
        for j in moves[::-1]:
            if d[j] != d[moves[-1]]:
                break
            start = j
        y = x.copy()
        y[:start] = x[start]
        return y

    def forecast(self, horizon: int) -> Forecast:
        horizon, hist = self._start(horizon)
        last = hist[-1]
        series = self._flatten(self._smooth(hist))
        mean = np.full(horizon, last)
        if len(series) >= 3 and np.any(np.diff(series) != 0):
            fitted = _fit_arima(series, (1, 1, 0), "t", horizon)
            if fitted is not None:
                mean = fitted
        mean = mean.copy()
        mean[1:] = np.clip(mean[1:], mean[0] - 3, mean[0] + 3)
        mean = self._clip(mean)
        diffs = np.diff(hist)
        if len(diffs) and (np.all(diffs >= 0) or np.all(diffs <= 0)):
            moved = abs(hist[-1] - hist[0])
            factor = 0.5 if moved >= 10 else 0.75 if moved >= 5 else 1.0
            mean = last + factor * (mean - last)
        return self._finish(mean)


class HazardPredictor(Predictor):
    """A hazard model of arrivals and preemptions: expected drift from per-interval event rates and sizes.

    Over the last ``window`` intervals (default 60) it estimates the chance that an interval has a net arrival
    (``h_in``) or a net preemption (``h_out``) and their mean sizes (``s_in``, ``s_out``), and forecasts
    ``last + k * (h_in * s_in - h_out * s_out)`` k steps ahead, floored at 0 (a count cannot go negative, which
    the plain drift ignores near an outage). It captures steady declines and recoveries; on flat traces its
    drift is ~0 and it equals persistence.
    """

    name: ClassVar[str] = "hazard"

    def __init__(
        self, *, window: int = 60, min_instances: int = 0, max_instances: Optional[int] = 32, seed: int = 0
    ) -> None:
        super().__init__(window=window, min_instances=min_instances, max_instances=max_instances, seed=seed)

    def forecast(self, horizon: int) -> Forecast:
        horizon, hist = self._start(horizon)
        diffs = np.diff(hist)
        drift = 0.0
        if len(diffs) >= 5:
            up, down = diffs[diffs > 0], -diffs[diffs < 0]
            h_in, h_out = len(up) / len(diffs), len(down) / len(diffs)
            drift = h_in * (float(up.mean()) if len(up) else 0.0) - h_out * (float(down.mean()) if len(down) else 0.0)
        steps = np.arange(1, horizon + 1, dtype=float)
        return self._finish(np.maximum(hist[-1] + drift * steps, 0.0))


class EnsemblePredictor(Predictor):
    """Online selection among member predictors, fitted on the trace as it unfolds.

    Every member observes every count; each forecast is the forecast of the member whose own scored forecasts
    had the lowest mean absolute error over the last :attr:`recent` intervals (all steps ahead pooled). A
    member must beat persistence by :attr:`margin` (relative) to be chosen, so the ensemble falls back to
    "nothing will change" until something has clearly earned its place on *this* trace. The band is the
    ensemble's own empirical band (its errors are those of whichever member it used).
    """

    name: ClassVar[str] = "ensemble"
    members: ClassVar[tuple[str, ...]] = ("persistence", "arima", "hazard")
    recent: ClassVar[int] = 60
    margin: ClassVar[float] = 0.05

    def __init__(
        self, *, window: int = 30, min_instances: int = 0, max_instances: Optional[int] = 32, seed: int = 0
    ) -> None:
        self._members = [
            PREDICTORS[m](min_instances=min_instances, max_instances=max_instances, seed=seed) for m in self.members
        ]
        super().__init__(window=window, min_instances=min_instances, max_instances=max_instances, seed=seed)
        self.chosen: list[str] = []

    def reset(self) -> None:
        super().reset()
        for m in getattr(self, "_members", []):
            m.reset()
        self.chosen = []

    def observe(self, n: int) -> None:
        super().observe(n)
        for m in self._members:
            m.observe(n)

    def _recent_mae(self, m: Predictor) -> float:
        errs = m.scored_errors(self.recent)
        return float(np.mean(np.abs(errs))) if len(errs) >= 10 else float("inf")

    def forecast(self, horizon: int) -> Forecast:
        horizon, _ = self._start(horizon)
        fcs = [m.forecast(horizon) for m in self._members]  # every member forecasts, so every member is scored
        scores = [self._recent_mae(m) for m in self._members]
        best = 0
        for i in range(1, len(self._members)):
            if scores[i] < scores[best] * (1.0 - self.margin):
                best = i
        self.chosen.append(self._members[best].name)
        return self._finish(fcs[best].mean)


PREDICTORS: dict[str, type[Predictor]] = {
    "persistence": PersistencePredictor,
    "arima": ArimaPredictor,
    "artifact": ArtifactPredictor,
    "hazard": HazardPredictor,
    "ensemble": EnsemblePredictor,
}


def make_predictor(name: str, **kw: Optional[int]) -> Predictor:
    """Build a predictor by name.

    Args:
        name: A key of :data:`PREDICTORS`.
        **kw: Keyword arguments of :class:`Predictor` (``window``, ``min_instances``, ``max_instances``, ``seed``).

    Returns:
        A fresh predictor.

    Raises:
        ConfigurationError: Unknown name (the message lists the known ones) or bad arguments.
    """
    return build_by_name(PREDICTORS, name, kw, unknown=f"unknown predictor {name!r}; known: {', '.join(PREDICTORS)}",
                         bad=f"predictor {name!r}")


@dataclass(frozen=True)
class Backtest:
    """Per-step scores of an online walk over a trace (index ``i`` is ``i + 1`` intervals ahead).

    Attributes:
        mae: Mean absolute error of ``Forecast.mean``.
        coverage: Fraction of outcomes inside ``[lower, upper]``.
        n: Number of scored forecasts at each step.
    """

    mae: np.ndarray
    coverage: np.ndarray
    n: np.ndarray


def backtest(trace_counts: Sequence[int], predictor: Predictor, horizon: int) -> Backtest:
    """Walk a trace online and score every forecast.

    The predictor is reset, then for each ``t`` it observes ``counts[t]`` and forecasts ``t+1 .. t+horizon`` from
    history up to ``t``; steps past the end of the trace are not scored.

    Args:
        trace_counts: Count after each interval (e.g. ``Trace.counts()``).
        predictor: The predictor to score (it is reset first and left holding the whole trace).
        horizon: Steps ahead (L).

    Returns:
        Per-step MAE, band coverage and number of scored pairs (``nan`` where a step has none).
    """
    horizon = _check_int("horizon", horizon, 1)
    counts = [int(c) for c in trace_counts]
    n_total = len(counts)
    abs_err = np.zeros(horizon)
    covered = np.zeros(horizon)
    scored = np.zeros(horizon, dtype=np.int64)
    predictor.reset()
    actual_all = np.asarray(counts, dtype=float)
    for t in range(n_total):
        predictor.observe(counts[t])
        steps = min(horizon, n_total - 1 - t)
        if steps <= 0:
            break
        fc = predictor.forecast(horizon)
        actual = actual_all[t + 1 : t + 1 + steps]
        abs_err[:steps] += np.abs(actual - fc.mean[:steps])
        covered[:steps] += (actual >= fc.lower[:steps] - 1e-9) & (actual <= fc.upper[:steps] + 1e-9)
        scored[:steps] += 1
    with np.errstate(invalid="ignore", divide="ignore"):
        return Backtest(abs_err / scored, covered / scored, scored)


def evaluate(trace_counts: Sequence[int], predictor: Predictor, horizon: int) -> np.ndarray:
    """Mean absolute error per step ahead of an online walk (see :func:`backtest`).

    Args:
        trace_counts: Count after each interval.
        predictor: The predictor (reset first).
        horizon: Steps ahead (L).

    Returns:
        ``(horizon,)`` float array; element ``i`` is the MAE ``i + 1`` intervals ahead.
    """
    return backtest(trace_counts, predictor, horizon).mae


def coverage(trace_counts: Sequence[int], predictor: Predictor, horizon: int) -> np.ndarray:
    """Fraction of outcomes inside the forecast band, per step ahead (see :func:`backtest`).

    Args:
        trace_counts: Count after each interval.
        predictor: The predictor (reset first).
        horizon: Steps ahead (L).

    Returns:
        ``(horizon,)`` float array of coverages in ``[0, 1]``.
    """
    return backtest(trace_counts, predictor, horizon).coverage


def mae_table(
    counts: Sequence[int],
    horizons: Sequence[int],
    names: Optional[Sequence[str]] = None,
    window: Optional[int] = None,
    **bounds: Optional[int],
) -> dict[str, dict[int, np.ndarray]]:
    """Per-step MAE of several predictors at several horizons, for printing.

    Args:
        counts: Count after each interval.
        horizons: The horizons L to evaluate.
        names: Predictor names (default: all of :data:`PREDICTORS`).
        window: History length W for every predictor; ``None`` uses W = L for ``"artifact"`` (as the artifact
            does) and each predictor's default (12) otherwise.
        **bounds: ``min_instances`` / ``max_instances`` passed to every predictor (default: each predictor's own).

    Returns:
        ``table[name][L]`` is the ``(L,)`` per-step MAE; its mean is the artifact's single number.
    """
    table: dict[str, dict[int, np.ndarray]] = {}
    for name in names if names is not None else list(PREDICTORS):
        table[name] = {}
        for horizon in horizons:
            kw: dict = dict(bounds)
            if window is not None:
                kw["window"] = window
            elif name == "artifact":
                kw["window"] = int(horizon)
            table[name][int(horizon)] = evaluate(counts, make_predictor(name, **kw), int(horizon))
    return table


def format_mae_table(table: dict[str, dict[int, np.ndarray]]) -> str:
    """Render :func:`mae_table` output: one row per predictor, the mean MAE over steps 1..L per column.

    Args:
        table: ``table[name][L]`` per-step MAE arrays.

    Returns:
        A plain-text table.
    """
    horizons = sorted({h for row in table.values() for h in row})
    width = max([len("predictor"), *(len(n) for n in table)])
    lines = [f"{'predictor':<{width}}  " + "  ".join(f"{'L=' + str(h):>6}" for h in horizons)]
    for name, row in table.items():
        cells = [f"{float(np.nanmean(row[h])):6.3f}" if h in row else f"{'-':>6}" for h in horizons]
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)
