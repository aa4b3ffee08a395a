"""Throughput learned while training: measured step times per shape and a cost model fitted to them.

Problem: a throughput formula over per-layer times profiled on one process (``throughput doubles when D
doubles``) cannot see communication or CPU/GPU contention. On a 2-core machine it told the runtime that 4x1 was
twice as fast as 2x1; the job moved and fell from ~1,450 to ~1,000 samples/s. Parcae plans from throughput
*profiled per shape*. This module gives the runtime and the simulator one throughput model that

* prices a shape the job has run by what was **measured** (median step time of the last steps in that shape);
* prices a shape it has not run by a **fitted** cost model -- the pipeline formula with its terms re-weighted by
  least squares on the measurements (compute, CPU oversubscription, gradient all-reduce over D and bytes,
  stage-to-stage transfers, a fixed per-step overhead) -- with an **uncertainty**;
* enforces **never move to a shape measured slower** than the current one unless availability forces it
  (:meth:`MeasuredThroughput.vetoes`), and proposes a cheap **exploration** step when the model is unsure and the
  interval is long (:meth:`MeasuredThroughput.exploration`);
* bounds the **share of wall time spent exploring** (:class:`ExplorationBudget`): each try pays back on its own,
  but at N >= 8 there are dozens of unmeasured shapes and a job whose fit stays unsure could spend a large part of
  its time trying them one after another;
* saves itself as ``run_dir/profile.json`` (:meth:`MeasuredThroughput.to_json`), which
  ``parcae simulate --profile`` loads back (:func:`load_measured_profile`).

Plain Python + numpy/scipy: no torch, used by :mod:`lightning_parcae.runtime.elastic` and by the simulator.
"""

from __future__ import annotations

import json
import math
from collections import deque
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence

import numpy as np

from lightning_parcae.planning.costmodel import (
    ArtifactCostModel,
    LayerProfile,
    MigrationCostModel,
    ProfileThroughput,
    TableThroughput,
    reference_layer_params,
    reference_models,
    DefaultCostModel,
    MigrationConstants,
    Shape,
    ShapeLimits,
    ThroughputModel,
    balanced_partition,
    batch_splits,
)
from lightning_parcae.errors import ConfigurationError

__all__ = ["PipelineThroughput", "MeasuredThroughput", "exploration_value", "ExplorationBudget",
           "check_exploration_share", "DEFAULT_MAX_EXPLORATION_SHARE", "load_measured_profile", "load_cost_model",
           "PROFILE_FORMAT", "min_stages_for_memory"]

PROFILE_FORMAT = "parcae-measured-profile/1"
"""The ``format`` key of a saved measured profile (``run_dir/profile.json``)."""

FEATURES = ("overhead", "compute", "oversubscription", "allreduce", "p2p")
"""Terms of the fitted step time (ms): ``sum(coef[k] * feature[k](d, p))``. See :meth:`MeasuredThroughput.features`."""

_PRIOR = np.array([0.0, 1.0, 1.0, 1.0, 0.2])
"""Coefficients before any measurement: the formula as profiled; one core per process beyond ``cores`` shares
the CPU (step time scales with the oversubscription); all-reduce at ~1 GB/s (1 ms per MB x 2(D-1)/D);
0.2 ms per stage-to-stage message."""


def min_stages_for_memory(layer_bytes: Sequence[float], limit: Optional[float]) -> int:
    """Smallest pipeline depth whose stages each fit ``limit`` bytes (contiguous layers, greedy packing).

    Args:
        layer_bytes: Memory of each layer (parameters + gradients + optimizer state).
        limit: Per-stage memory budget, or None (no limit: 1).

    Returns:
        The smallest P, or ``len(layer_bytes) + 1`` if one layer alone exceeds the budget.
    """
    if limit is None:
        return 1
    if any(b > limit for b in layer_bytes):
        return len(layer_bytes) + 1
    stages, cur = 1, 0.0
    for b in layer_bytes:
        if cur + b > limit:
            stages, cur = stages + 1, 0.0
        cur += b
    return stages


class PipelineThroughput(ThroughputModel):
    """The runtime's pipeline formula over per-layer times (the prior the measured model re-weights).

    A step of shape (D, P) runs M micro-batches of ``B / (D M)`` samples through P stages balanced by time:
    ``(M + P - 1) * max_stage / (D M)`` (times measured on the whole global batch B). Shapes whose D does not
    split the global batch into M micro-batches, with more stages than layers, or outside ``limits`` are not
    allowed.

    Args:
        layer_ms: Forward + backward time of each layer on one global batch.
        global_batch: B.
        micro_batches: M.
        max_p: Largest pipeline depth to consider.
        min_p: Smallest pipeline depth (e.g. from a per-stage memory budget, :func:`min_stages_for_memory`).
    """

    def __init__(self, layer_ms: Sequence[float], global_batch: int, micro_batches: int,
                 max_p: Optional[int] = None, min_p: int = 1) -> None:
        if not layer_ms:
            raise ConfigurationError("layer_ms is empty: give the forward + backward time of each layer")
        if global_batch < 1 or micro_batches < 1:
            raise ConfigurationError(f"global_batch={global_batch}, micro_batches={micro_batches}: both must be >= 1")
        self.layer_ms = [max(float(t), 1e-6) for t in layer_ms]
        self.global_batch = int(global_batch)
        self.micro_batches = int(micro_batches)
        self.limits = ShapeLimits(min_p=max(1, int(min_p)), max_p=min(max_p or len(layer_ms), len(layer_ms)))
        self._stage_cache: Dict[int, float] = {}

    def stage_max_ms(self, p: int) -> float:
        """Largest stage time (global batch) when the layers are split into ``p`` stages balanced by time."""
        if p not in self._stage_cache:
            b = balanced_partition(self.layer_ms, p)
            self._stage_cache[p] = max(sum(self.layer_ms[b[k]: b[k + 1]]) for k in range(p))
        return self._stage_cache[p]

    def allowed(self, d: int, p: int) -> bool:
        """Whether (d, p) can run this job at all."""
        return (d >= 1 and self.limits.allows(d, p) and p <= len(self.layer_ms)
                and batch_splits(self.global_batch, d, self.micro_batches))

    def step_ms(self, d: int, p: int) -> float:
        """Formula step time of (d, p) in ms (``inf`` if not allowed)."""
        if not self.allowed(d, p):
            return math.inf
        m = self.micro_batches
        return (m + p - 1) * self.stage_max_ms(p) / (d * m)

    def throughput(self, d: int, p: int) -> float:
        ms = self.step_ms(d, p)
        return 0.0 if not math.isfinite(ms) else self.global_batch / (ms / 1000.0)

    def candidates(self, n: int, hint_counts: Iterable[int] = ()) -> List[Shape]:
        out = []
        for p in range(self.limits.min_p, min(n, self.limits.max_p) + 1):
            for d in range(n // p, 0, -1):
                if self.allowed(d, p):
                    out.append((d, p))
                    break
        return sorted(out)


DEFAULT_MARGIN = 0.03
"""The least gain a move between two measured shapes must show (:meth:`MeasuredThroughput.required_gain`): the
spread of one shape's median across replays of the same job on this machine was 1.2 % (issue 21, stop 51)."""

DEFAULT_MARGIN_SIGMAS = 2.0
"""Combined single-step spreads the gain of a move between two measured shapes must clear."""


def exploration_value(current: float, mean: float, sigma: float, trial_s: float, horizon_s: float,
                      move_cost_s: float, margin: float = DEFAULT_MARGIN) -> float:
    """Expected samples an exploration gains over staying (negative: it costs more than it can win).

    A try of an unmeasured shape believed to run ``N(mean, sigma)`` samples/s: the job moves to it (one
    migration), trains there for ``trial_s`` (what measuring it takes), and then keeps it if it measured faster
    than ``current * (1 + margin)``, else moves back (a second migration). The gain after the try is counted over
    the rest of ``horizon_s``::

        value = E[(X - current) 1{X > c}] * (horizon - trial - move)      # kept, where it wins
              - (current - mean) * trial                                   # the try itself
              - current * move * (1 + P(X <= c))                           # there, and back if it lost

    with ``c = current * (1 + margin)``. Plain arithmetic on the normal distribution (``math.erfc``: the leader
    prices a few hundred candidates a decision at N >= 16, and ``scipy.stats.norm`` costs ~0.2 ms a call).

    Args:
        current: Measured samples/s of the running shape.
        mean: Fitted samples/s of the candidate.
        sigma: Its standard deviation (samples/s); 0 means certain.
        trial_s: Seconds the try trains in the candidate before it counts as measured.
        horizon_s: Seconds the job expects to keep the instance count.
        move_cost_s: Seconds one in-place migration stops training.
        margin: Fraction the candidate must measure faster by to be kept (the caller's
            :meth:`MeasuredThroughput.required_gain`).
    """
    c = current * (1.0 + margin)
    if sigma <= 0:
        p_win = 1.0 if mean > c else 0.0
        gain_rate = (mean - current) * p_win
    else:
        z = (c - mean) / sigma
        p_win = 0.5 * math.erfc(z / math.sqrt(2.0))  # P(X > c)
        gain_rate = sigma * math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) + (mean - current) * p_win
    rest = max(0.0, horizon_s - trial_s - move_cost_s)
    return gain_rate * rest - (current - mean) * trial_s - current * move_cost_s * (2.0 - p_win)


DEFAULT_MAX_EXPLORATION_SHARE = 0.1
"""Default cap on the share of training wall time spent in exploration tries (see :class:`ExplorationBudget`)."""


def check_exploration_share(value: Any, name: str = "max_exploration_share") -> float:
    """``value`` as a cap on the exploring share of wall time, or a :class:`ConfigurationError` naming it.

    Args:
        value: The cap as given: a number in ``[0, 1]`` (0: never explore; 1: no cap).
        name: The option's name in the error.

    Raises:
        ConfigurationError: ``value`` is not a real number (a bool, a string, NaN) or lies outside ``[0, 1]``.
    """
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value))
    if not ok or not 0.0 <= float(value) <= 1.0:
        raise ConfigurationError(
            f"{name}={value!r}: expected the largest fraction of the training wall time spent in exploration tries, "
            f"a number in [0, 1] (default {DEFAULT_MAX_EXPLORATION_SHARE}: at most 10 %; 0: never explore; "
            "1: no cap)")
    return float(value)


class ExplorationBudget:
    """The share of a job's wall time its exploration tries may take.

    :func:`exploration_value` makes each try pay for itself *in expectation*; it does not bound how much of a run
    goes into tries. At N >= 8 there are dozens of unmeasured candidates, and while the fit stays unsure (shapes
    that do not follow the fitted family keep its error high) every next one is again worth a try: nothing stopped
    a job from spending 40 % of its time moving to shapes, measuring them and moving back. This is the bound: the
    runtime charges every try's time (:meth:`charge`: the migration to the shape, the trial until it is measured,
    the migration back if it lost) and asks before the next one (:meth:`admit`). Plain accounting over the times
    it is given (no clock): the caller says how long the job has trained and how much a try is expected to cost.

    A try is refused while ``(explored + cost) / (elapsed + cost) > max_share`` -- the share so far, counting the
    try about to start at its expected cost -- so once the cap is reached the job trains until its time makes
    room, then tries again. The first try is never refused (for ``max_share > 0``): the launch shape is the
    launcher's guess, priced before the job has trained for long, and refusing it is the regression where a job
    launched as 1x2 on 3 instances kept an idle instance for 15 s (bench_replay lh_80_90); with the first try
    exempt the share is bounded from the second one on (in the long run by ``max_share`` itself).

    Args:
        max_share: The cap, in ``[0, 1]`` (0: no try at all; 1: no cap). Checked by
            :func:`check_exploration_share`.

    Attributes:
        max_share: The cap.
        explored_s: Seconds charged to tries so far.
        tries: Tries admitted.
        refused: Tries refused by the cap (one per decision that wanted to try and was refused).

    Raises:
        ConfigurationError: ``max_share`` is not a number in ``[0, 1]``.
    """

    def __init__(self, max_share: float = DEFAULT_MAX_EXPLORATION_SHARE) -> None:
        self.max_share = check_exploration_share(max_share)
        self.explored_s = 0.0
        self.tries = 0
        self.refused = 0

    def share(self, elapsed_s: float) -> float:
        """The share of ``elapsed_s`` seconds of training spent exploring (0 before any time has passed)."""
        return self.explored_s / elapsed_s if elapsed_s > 0 else 0.0

    def allows(self, cost_s: float, elapsed_s: float) -> bool:
        """Whether a try expected to take ``cost_s`` seconds fits the cap after ``elapsed_s`` seconds of training.

        Args:
            cost_s: The try's expected time (:meth:`MeasuredThroughput.exploration_cost_s`).
            elapsed_s: Wall seconds the job has trained so far (tries included).
        """
        if self.max_share >= 1.0:
            return True
        if self.max_share <= 0.0:
            return False
        if self.tries == 0:
            return True  # the launch shape's try (see the class docstring)
        cost = max(0.0, float(cost_s))
        total = max(0.0, float(elapsed_s)) + cost
        return total > 0 and (self.explored_s + cost) / total <= self.max_share

    def admit(self, cost_s: float, elapsed_s: float) -> bool:
        """:meth:`allows`, counted: an admitted try in :attr:`tries`, a refused one in :attr:`refused`."""
        ok = self.allows(cost_s, elapsed_s)
        if ok:
            self.tries += 1
        else:
            self.refused += 1
        return ok

    def charge(self, seconds: float) -> None:
        """Add ``seconds`` (a migration or trial time of a try) to the exploring time; negative values add 0."""
        self.explored_s += max(0.0, float(seconds))

    def report(self, elapsed_s: float) -> Dict[str, Any]:
        """The accounting as an event's fields: ``max_share``, ``explored_s``, ``elapsed_s``, ``share``,
        ``tries``, ``refused``."""
        return {"max_share": self.max_share, "explored_s": round(self.explored_s, 4),
                "elapsed_s": round(max(0.0, float(elapsed_s)), 4), "share": round(self.share(elapsed_s), 4),
                "tries": self.tries, "refused": self.refused}


class MeasuredThroughput(ThroughputModel):
    """Throughput by measurement where measured, by a fitted cost model elsewhere (with its uncertainty).

    Fitted model (ms per step)::

        step(d, p) = c0                                   # per-step overhead (optimizer, agreement, Python)
                   + c1 * formula(d, p)                   # compute, balanced pipeline (PipelineThroughput)
                   + c2 * formula(d, p) * max(0, d p / cores - 1)   # CPU/GPU oversubscription (contention)
                   + c3 * 2 (d - 1) / d * stage_MB(p)      # gradient all-reduce of the largest stage
                   + c4 * 2 (M + p - 2) [p > 1]            # stage-to-stage messages on the critical path

    The coefficients are a non-negative least-squares fit of the *relative* error of every measured shape, with a
    ridge pull toward the prior (the formula as profiled) so that one or two measured shapes re-scale the model
    instead of over-fitting it. A shape with at least ``min_samples`` steps is priced by the median of its last
    ``window`` step times.

    Args:
        prior: The formula (:class:`PipelineThroughput`); its ``limits`` and ``global_batch`` are this model's.
        layer_bytes: Parameter bytes of each layer (for the all-reduce volume); None: the all-reduce term is off.
        cores: Processing units the processes share (one machine: ``os.cpu_count()``); None: no contention term.
        min_samples: Steps before a shape counts as measured.
        window: Steps kept per shape.
        ridge: Strength of the pull toward the prior coefficients.
        margin: The least fraction a move to another *measured* shape needs it measured faster by (see
            :meth:`required_gain`: the fraction grows with the spread of the two shapes' steps).
        margin_sigmas: How many combined step spreads (:meth:`spread`) the move's gain must clear.
        price_noise_as_fewer: Plan with :meth:`planning_throughput` (a measured shape whose gain over a measured
            shape with fewer processes is inside :meth:`required_gain` is priced as that shape); False: plan with
            :meth:`throughput` as measured.
    """

    def __init__(self, prior: PipelineThroughput, *, layer_bytes: Optional[Sequence[float]] = None,
                 cores: Optional[int] = None, min_samples: int = 5, window: int = 64, ridge: float = 0.1,
                 margin: float = DEFAULT_MARGIN, margin_sigmas: float = DEFAULT_MARGIN_SIGMAS,
                 price_noise_as_fewer: bool = True) -> None:
        self.prior = prior
        self.price_noise_as_fewer = bool(price_noise_as_fewer)
        self.global_batch = prior.global_batch
        self.limits = prior.limits
        self.layer_bytes = [float(b) for b in layer_bytes] if layer_bytes is not None else None
        if self.layer_bytes is not None and len(self.layer_bytes) != len(prior.layer_ms):
            raise ConfigurationError(
                f"layer_bytes has {len(self.layer_bytes)} entries but the profile has {len(prior.layer_ms)} layers")
        self.cores = int(cores) if cores else None
        self.min_samples = max(1, int(min_samples))
        self.window = max(self.min_samples, int(window))
        self.ridge = float(ridge)
        self.margin = float(margin)
        self.margin_sigmas = float(margin_sigmas)
        if not (math.isfinite(self.margin) and self.margin >= 0 and math.isfinite(self.margin_sigmas)
                and self.margin_sigmas >= 0):
            raise ConfigurationError(f"margin={margin!r}, margin_sigmas={margin_sigmas!r}: both must be finite and "
                                     f">= 0 (defaults {DEFAULT_MARGIN} and {DEFAULT_MARGIN_SIGMAS})")
        self.samples: Dict[Shape, Deque[float]] = {}
        self.constants: Optional[MigrationConstants] = None
        self.bytes_per_param = 4.0
        self.coef = _PRIOR.copy()
        self.rel_rmse = 0.0
        self._dirty = False
        # the terms of a shape depend only on the profile, which does not change: priced once per shape
        self._features: Dict[Shape, np.ndarray] = {}
        self._medians: Dict[Shape, float] = {}
        self._planning: Dict[Shape, float] = {}  # planning_throughput's prices, until the next step is recorded
        self._stage_mb_cache: Dict[int, float] = {}

    # ------------------------------------------------------------------------------------------ measurements
    def record(self, d: int, p: int, step_ms: float) -> None:
        """Add one measured step time (ms) of shape (d, p); non-finite or non-positive values are ignored."""
        if not (math.isfinite(step_ms) and step_ms > 0) or not self.prior.allowed(d, p):
            return
        self.samples.setdefault((int(d), int(p)), deque(maxlen=self.window)).append(float(step_ms))
        self._medians.pop((int(d), int(p)), None)
        self._planning.clear()
        self._dirty = True

    def measured_ms(self, d: int, p: int) -> Optional[float]:
        """Median measured step time of (d, p), or None if it has fewer than ``min_samples`` steps."""
        q = self.samples.get((d, p))
        if q is None or len(q) < self.min_samples:
            return None
        ms = self._medians.get((d, p))
        if ms is None:  # recomputed only after a new step of this shape (record)
            ms = self._medians[(d, p)] = float(np.median(q))
        return ms

    def measured(self, d: int, p: int) -> Optional[float]:
        """Measured samples/s of (d, p), or None if not measured."""
        ms = self.measured_ms(d, p)
        return None if ms is None else self.global_batch / (ms / 1000.0)

    def measured_faster(self, shape: Shape, than: Shape) -> bool:
        """Whether both shapes are measured and ``shape`` measured more samples/s than ``than``."""
        a, b = self.measured(*shape), self.measured(*than)
        return a is not None and b is not None and a > b

    def spread(self, d: int, p: int) -> Optional[float]:
        """Relative spread of single steps of a measured shape (1.4826 x MAD / median: the standard deviation of a
        normal step time, robust to the odd slow step), or None if (d, p) is not measured."""
        ms = self.measured_ms(d, p)
        if ms is None:
            return None
        q = np.asarray(self.samples[(d, p)])
        return float(1.4826 * np.median(np.abs(q - ms)) / ms)

    def required_gain(self, current: Shape, chosen: Optional[Shape] = None) -> float:
        """The fraction ``chosen`` must measure faster than ``current`` by for a move between them to count as a
        gain rather than noise: ``max(margin, margin_sigmas x hypot(spread(current), spread(chosen)))``. An
        unmeasured ``chosen`` (an exploration's candidate) is taken to spread as ``current`` does.

        The spread of single steps, not the standard error of the two medians (0.2-0.5 % at 64 steps): the
        running shape's steps move with the machine's load while a shape measured earlier keeps the load of
        its time, and the single steps' spread in the window is how far that load moved them. On the emulated
        GPT-1.5B cluster (2 cores, N = 28) 4x6 and 4x7 steps spread 1.6-3.1 %, their medians across passes
        1.2 % (one pass 7 %: its steps spread 4.5-9.2 %).

        Regression (issue 21, stop 51, pass I2, lh_80_90 at N = 28): the margin was a fixed 10 %. 4x7 measured
        43.42 samples/s against 4x6's 39.49-39.77 (1.092-1.099, steps spread 1.9-2.8 %): the veto refused the move
        seven times in 100 s, while the other policy's leader, whose 4x6 had measured a little slower, moved at
        once -- which policy won the segment was a coin flip of the running shape's measurement. Two shapes
        equal up to noise still keep the job where it is (test_margin_stops_ping_pong_between_equal_shapes).
        """
        a = self.spread(*current) or 0.0
        b = self.spread(*chosen) if chosen is not None else None
        return max(self.margin, self.margin_sigmas * math.hypot(a, a if b is None else b))

    def within_margin(self, current: Shape, chosen: Shape) -> bool:
        """Whether both shapes are measured and ``chosen`` does not measure faster than ``current`` by
        :meth:`required_gain` (slower included): a move between them would be a move for noise -- the veto's rule,
        and the one :meth:`planning_throughput` prices by."""
        a, b = self.measured(*current), self.measured(*chosen)
        return a is not None and b is not None and b < a * (1.0 + self.required_gain(current, chosen))

    def measured_shapes(self) -> List[Shape]:
        """Shapes with a measurement (at least ``min_samples`` steps)."""
        return sorted(s for s in self.samples if self.measured_ms(*s) is not None)

    # ------------------------------------------------------------------------------------------ the fit
    def _stage_mb(self, p: int) -> float:
        if self.layer_bytes is None:
            return 0.0
        if p not in self._stage_mb_cache:
            b = balanced_partition(self.prior.layer_ms, p)
            self._stage_mb_cache[p] = max(sum(self.layer_bytes[b[k]: b[k + 1]]) for k in range(p)) / 1e6
        return self._stage_mb_cache[p]

    def features(self, d: int, p: int) -> np.ndarray:
        """The fitted model's terms for (d, p) (see the class docstring), in the order of :data:`FEATURES`.

        Cached per shape (read-only array). Regression: recomputed at every call, the stage split behind the
        all-reduce term (a 60-round binary search) was ~90 % of a leader's planning at N=16 -- 2,200 calls a
        decision, 270 ms, against 60 ms at N=4 (issue 21, ``bench_scale.py``'s step-boundary agreement x49).
        """
        key = (d, p)
        x = self._features.get(key)
        if x is None:
            f = self.prior.step_ms(d, p)
            over = max(0.0, d * p / self.cores - 1.0) if self.cores else 0.0
            m = self.prior.micro_batches
            x = np.array([1.0, f, f * over, 2.0 * (d - 1) / d * self._stage_mb(p),
                          2.0 * (m + p - 2) if p > 1 else 0.0])
            x.flags.writeable = False
            self._features[key] = x
        return x

    def fit(self) -> np.ndarray:
        """Re-fit the coefficients from the measured shapes (called lazily); returns them."""
        from scipy.optimize import nnls  # noqa: PLC0415

        self._dirty = False
        shapes = self.measured_shapes() or sorted(self.samples)
        if not shapes:
            self.coef, self.rel_rmse = _PRIOR.copy(), 0.0
            return self.coef
        y = np.array([float(np.median(self.samples[s])) for s in shapes])
        x = np.stack([self.features(*s) for s in shapes])
        rel = x / y[:, None]  # rows: relative contribution of each term to the measured step time
        scale = np.where(rel.mean(axis=0) > 1e-9, rel.mean(axis=0), 1.0)
        a = np.vstack([rel, self.ridge * np.diag(scale)])
        b = np.concatenate([np.ones(len(shapes)), self.ridge * scale * _PRIOR])
        coef, _ = nnls(a, b)
        self.coef = coef
        pred = x @ coef
        self.rel_rmse = float(np.sqrt(np.mean(((pred - y) / y) ** 2)))
        return coef

    def _coef(self) -> np.ndarray:
        if self._dirty:
            self.fit()
        return self.coef

    def _priced_ms(self, d: int, p: int, coef: np.ndarray) -> float:
        """The step time of (d, p) in ms by the model's terms with coefficients ``coef`` (``inf`` if not allowed)."""
        if not self.prior.allowed(d, p):
            return math.inf
        return max(float(self.features(d, p) @ coef), 1e-6)

    def fitted_ms(self, d: int, p: int) -> float:
        """The fitted model's step time of (d, p) in ms (``inf`` if not allowed)."""
        return self._priced_ms(d, p, self._coef())

    def profiled_ms(self, d: int, p: int) -> float:
        """The step time of (d, p) as the profile prices it before any measurement (the fitted model's terms with
        the prior coefficients; ``inf`` if not allowed): the ranking :meth:`exploration` requires a try to agree
        with."""
        return self._priced_ms(d, p, _PRIOR)

    def uncertainty(self, d: int, p: int) -> float:
        """Relative uncertainty (1 sigma) of the throughput of (d, p).

        A measured shape: the spread of its steps (MAD / median). Otherwise the fit's relative error on the
        measured shapes plus an extrapolation term: 0.15 if a measured shape has the same P and process count,
        0.3 if one has the same P or the same process count, 0.5 if none does (or nothing is measured), divided
        by the square root of the number of measured shapes (each one more pins the five coefficients; with
        three measured, the fit prices held-out shapes within 15 %: tests/test_measured.py).

        Regression: without the division, 1x4 next to a measured 2x2, 1x3 and 1x2 kept a 0.35 uncertainty, and
        the job tried it (fitted 225 against a measured 277) in a 18 s horizon (bench_replay lh_80_90).
        """
        ms = self.measured_ms(d, p)
        if ms is not None:
            return float(self.spread(d, p) or 0.0) / math.sqrt(len(self.samples[(d, p)]))
        self._coef()
        meas = self.measured_shapes()
        if any(s[1] == p and s[0] * s[1] == d * p for s in meas):
            extra = 0.15
        elif any(s[1] == p or s[0] * s[1] == d * p for s in meas):
            extra = 0.3
        else:
            extra = 0.5
        return self.rel_rmse + extra / math.sqrt(max(1, len(meas)))

    # ------------------------------------------------------------------------------------------ ThroughputModel
    def step_ms(self, d: int, p: int) -> float:
        """Step time of (d, p): measured if measured, else fitted (ms; ``inf`` if not allowed)."""
        ms = self.measured_ms(d, p)
        return ms if ms is not None and self.prior.allowed(d, p) else self.fitted_ms(d, p)

    def throughput(self, d: int, p: int) -> float:
        ms = self.step_ms(d, p)
        return 0.0 if not math.isfinite(ms) else self.global_batch / (ms / 1000.0)

    def planning_throughput(self, d: int, p: int) -> float:
        """Samples/s the planner prices (d, p) at: :meth:`throughput`, except that a measured shape measured
        faster than a measured shape with fewer processes by less than :meth:`required_gain` -- a gain the
        veto would not move for -- is priced a hair below the fastest such shape.

        Two shapes equal up to noise then tie, and the tie goes to the one that needs fewer instances: a loss
        of one of them is less likely to force a move. The accounting (what a policy trains) keeps
        :meth:`throughput`; with ``price_noise_as_fewer=False`` this is :meth:`throughput`.

        Regression (issue 21, stop 52, passes M and N, hl_15_25 at 0.25 Gbps): leaving a hold of 4x6 on 32
        instances, the leader chose 4x8 (measured 4 % over 4x7, inside the 7.4 % margin of their spreads)
        over 4x7: the forecast's scenarios put 0.4 on a fall within its look-ahead, and 4x8's 4 % won the other
        0.6. The count fell to 31 and 4x8 cost a second repartition (~26 s) that 4x7 would not have;
        live-reactive, whose veto kept 4x7 on 32, trained 5 % more on the segment.

        The price of the rule: where the count stays, a real gain that small is given up (the simulator, pricing
        every shape at its median, put it at 1-3 % of hh_55_65 and ll_10_11 for both live policies in stop 53;
        this job's 4x8 / 4x7 has measured anywhere from 1.00 to 1.05).
        """
        thr = self.throughput(d, p)
        if not self.price_noise_as_fewer or thr <= 0:
            return thr
        own = self.measured(d, p)
        if own is None:
            return thr
        cached = self._planning.get((d, p))
        if cached is not None:
            return cached
        floor = 0.0
        for t in self.measured_shapes():  # all allowed: record() keeps no other shape
            if t[0] * t[1] < d * p and self.measured(*t) < own and self.within_margin(t, (d, p)):
                floor = max(floor, self.measured(*t))
        price = self._planning[(d, p)] = thr if floor <= 0 else floor * (1.0 - 1e-9)
        return price

    def candidates(self, n: int, hint_counts: Iterable[int] = ()) -> List[Shape]:
        """Every allowed shape on ``n`` instances that is not slower than a shape using fewer processes with the
        same P (a narrower D can beat a wider one once contention and all-reduce are counted)."""
        out = []
        for p in range(self.limits.min_p, min(n, self.limits.max_p) + 1):
            best = 0.0
            for d in range(1, n // p + 1):
                if self.prior.allowed(d, p):
                    thr = self.throughput(d, p)
                    if thr > best:
                        out.append((d, p))
                        best = thr
        return sorted(out)

    def best_measured(self, n: int) -> Optional[Shape]:
        """The fastest measured shape that fits ``n`` instances, or None."""
        cands = [s for s in self.measured_shapes() if s[0] * s[1] <= n and self.limits.allows(*s)]
        return max(cands, key=lambda s: self.throughput(*s)) if cands else None

    # ------------------------------------------------------------------------------------------ decisions
    def vetoes(self, current: Shape, chosen: Shape, n_next: int, *, held: bool = False) -> bool:
        """True if moving ``current -> chosen`` must not happen while ``current`` still fits the ``n_next``
        instances (availability does not force the move) and

        * ``chosen`` is measured slower than ``current`` (never move to a shape measured slower) -- or not faster
          by more than :meth:`required_gain` (at least :attr:`margin`, more where the two shapes' steps spread
          more): measurements of the running shape move with the machine's load while the others' stay as they
          were, and without a margin the job ping-pongs between two equal shapes; or
        * ``current`` is not measured yet (a few more steps measure it; moving away on the formula alone is how
          the job used to leave its best shape) and ``chosen`` is not measured either, or measured no faster than
          ``current``'s fit plus its uncertainty (``fitted x (1 + uncertainty)``); or
        * ``chosen`` is not measured and even its fitted throughput less its uncertainty
          (``fitted x (1 - uncertainty)``) does not beat the current measurement: an unmeasured shape must be
          clearly better to leave a measured one (trying a merely promising one is :meth:`exploration`'s job,
          only when the interval is long). With one or two shapes measured the fit cannot tell a fixed per-step
          cost from communication, and a guess once released half a job's processes.

        Args:
            current: The running shape.
            chosen: The shape the decision chose.
            n_next: Instances of the interval about to run.
            held: ``current`` is a *hold* the forecast chose over the throughput-best shape (to spare a migration
                while the count was expected back) and ``chosen`` is the decision's return to the throughput-best
                shape: then only ``chosen`` measured slower than ``current`` refuses the move (no margin: leaving a
                hold is no ping-pong between equal shapes, it ends a departure the decision itself took back). The
                hold was never chosen for its throughput, so an unsure fit (or an unmeasured hold) is no reason to
                stay in it once the forecast no longer supports it -- live-reactive would be in ``chosen`` already.
        """
        if chosen == current or current[0] * current[1] > n_next or not self.prior.allowed(*current):
            return False
        a, b = self.measured(*current), self.measured(*chosen)
        if held:
            return a is not None and b is not None and b < a
        if a is None:
            # kept while it fits -- unless the chosen shape is *measured* faster than even the running shape's fit at
            # its most optimistic. Regression (issue 21, stop 56, pass B, lh_80_90 at 10 Gbps): a notice forced the
            # job from 2x9 into 2x7 on 17 instances (two restarted standbys not ready yet); 18 s later, 19 present,
            # the decision chose 2x9 again -- measured 30.1 samples/s, 2x7's fit ~25 -- and the veto kept 2x7, not
            # yet measured, for another 20 s while live-reactive ran 2x9
            return b is None or b <= self.throughput(*current) * (1.0 + self.uncertainty(*current))
        if b is None:
            return self.throughput(*chosen) * (1.0 - self.uncertainty(*chosen)) <= a
        return self.within_margin(current, chosen)

    def exploration(self, n: int, current: Shape, interval_s: float, move_cost_s: float,
                    warmup_steps: int = 2, boundary_s: float = 0.0) -> Optional[Shape]:
        """An unmeasured shape whose try is expected to pay for itself, or None.

        Explore only a shape the profile itself ranks faster than the current one (:meth:`profiled_ms`), only
        when the current shape is measured and the try's expected value is positive
        (:func:`exploration_value`): the fitted
        throughput with its uncertainty as a normal belief, a try as long as measuring it takes (``warmup_steps``
        + ``min_samples`` steps at the fitted rate), a move to it afterwards only if it measures faster than the
        current shape by :meth:`required_gain` (the veto's rule), the gain counted over the rest of
        ``interval_s``. The
        shape with the largest expected value is returned. Whether the try may start is the caller's
        :class:`ExplorationBudget` (the share of wall time tries may take; a try's cost:
        :meth:`exploration_cost_s`).

        Regression: the rule was "fitted x (1 + uncertainty) beats the current measurement by the margin"; a shape
        fitted 12 % *slower* with a 0.3 uncertainty (1x2 against a measured 1x3) passed it, and the try cost
        more than its chance of winning could repay in an 18 s horizon (bench_replay, hh_55_65 and ll_10_11:
        1-2 % fewer samples than the reactive policy, which never explores). And a gate "two migrations under 5 %
        of the horizon", priced with the 0.5 s guess used before the job's first migration, kept a job launched
        as 1x2 on 3 instances there for 15 s although 1x3 was fitted 13 % faster (the veto rightly refused to move
        on an unsure fit; the try is what measures it). The expected value already charges the migrations.

        And a try was priced as its steps alone. At N = 24 (GPT-1.5B emulation, time scale 3, 20 s
        intervals) a 2x9 fitted 26 % below the measured 4x6 with a 0.5 uncertainty was priced at ~22 s of
        trial, worth trying; it lasted to the second decision, 45 s at 0.76 of 4x6 -- the whole gap to the
        reactive policy on that replay. Priced at its decisions its expected value is negative.

        And at N = 27 the fit (4x6 and 2x9 measured) priced 2x13 at 34.5 samples/s against a measured 37.3 with a
        0.35 uncertainty -- worth a try -- although the profile ranks 2x13 at 0.90 of 4x6; the try lost, and the
        exploration cap it had filled then refused the 4x7 (profiled 1.16x) the reactive policy ran.

        Args:
            n: Instances the next interval has.
            current: The running shape.
            interval_s: How long the job expects to run at ``n`` instances: the runtime passes its planning
                interval times the intervals its forecast keeps the count (a try measured in one interval pays
                back over all of them).
            move_cost_s: Typical in-place migration time of this job.
            warmup_steps: Steps of a new shape that are not measured (process groups and joiners warm up).
            boundary_s: Seconds between two decisions (the planning interval; 0: any time). A try is left only at a
                decision, so it lasts from the decision that starts it to the first one after it is measured.
        """
        cur = self.measured(*current)
        if cur is None or interval_s <= 0:
            return None
        best, best_value = None, 0.0
        profiled_current = self.profiled_ms(*current)
        for s in self.candidates(n):
            if self.measured(*s) is not None or self.profiled_ms(*s) >= profiled_current:
                continue  # measured already, or the profile itself ranks it no faster than the running shape
            mu = self.throughput(*s)
            if mu <= 0:
                continue
            trial_s = self._trial_s(s, warmup_steps, move_cost_s, boundary_s)
            value = exploration_value(cur, mu, mu * self.uncertainty(*s), trial_s, interval_s, move_cost_s,
                                      self.required_gain(current))
            if value > best_value:
                best, best_value = s, value
        return best

    def _trial_s(self, shape: Shape, warmup_steps: int, move_cost_s: float = 0.0, boundary_s: float = 0.0) -> float:
        """Seconds a try of ``shape`` trains there: until it counts as measured (at its fitted rate), and with
        decisions every ``boundary_s`` seconds on to the first decision after that (the move there included)."""
        trial = (warmup_steps + self.min_samples) * self.step_ms(*shape) / 1000.0
        if boundary_s > 0 and math.isfinite(trial):
            move = max(0.0, float(move_cost_s))
            trial = max(trial, math.ceil((move + trial) / boundary_s - 1e-9) * boundary_s - move)
        return trial

    def exploration_cost_s(self, shape: Shape, move_cost_s: float, warmup_steps: int = 2,
                           boundary_s: float = 0.0) -> float:
        """Expected wall time of a try of ``shape``, as :class:`ExplorationBudget` charges it before it starts.

        The trial (``warmup_steps + min_samples`` steps at the fitted rate, with ``boundary_s`` on to the next
        decision, as :meth:`exploration` prices it) plus two migrations: there, and back if it loses -- the try's worst case, so that an admitted try cannot
        overrun the cap by its return.

        Args:
            shape: The candidate.
            move_cost_s: Typical in-place migration time of this job.
            warmup_steps: Steps of a new shape that are not measured.
            boundary_s: Seconds between two decisions (see :meth:`exploration`).
        """
        trial = self._trial_s(shape, warmup_steps, move_cost_s, boundary_s)
        return (trial if math.isfinite(trial) else 0.0) + 2.0 * max(0.0, float(move_cost_s))

    def cost_model(self, constants: Optional[MigrationConstants] = None, *,
                   preemption_notice: bool = False) -> DefaultCostModel:
        """The migration cost model over this throughput model (the one the runtime plans with).

        Args:
            constants: Migration constants; default: the ones saved with the profile (:attr:`constants`), else
                :class:`MigrationConstants` defaults.
            preemption_notice: Departures come with a notice (:class:`DefaultCostModel`).
        """
        if self.layer_bytes is None:
            params = [1.0] * len(self.prior.layer_ms)
        else:
            params = [max(b / self.bytes_per_param, 1.0) for b in self.layer_bytes]
        return DefaultCostModel(self, params, constants or self.constants or MigrationConstants(),
                                preemption_notice=preemption_notice)

    # ------------------------------------------------------------------------------------------ persistence
    def to_json(self) -> Dict[str, Any]:
        """The profile as a JSON object (``run_dir/profile.json``; load with :func:`load_measured_profile`)."""
        coef = self._coef()
        return {
            "format": PROFILE_FORMAT,
            "layer_ms": self.prior.layer_ms,
            "global_batch": self.global_batch,
            "micro_batches": self.prior.micro_batches,
            "limits": {"min_p": self.limits.min_p, "max_p": self.limits.max_p},
            "layer_bytes": self.layer_bytes,
            "cores": self.cores,
            "min_samples": self.min_samples,
            "coefficients": dict(zip(FEATURES, (float(c) for c in coef))),
            "migration_constants": None if self.constants is None else dict(vars(self.constants)),
            "fit_relative_rmse": self.rel_rmse,
            "shapes": {f"{d},{p}": {"step_ms": list(self.samples[(d, p)]),
                                   "median_ms": float(np.median(self.samples[(d, p)])),
                                   "samples_per_s": self.global_batch / (float(np.median(self.samples[(d, p)])) / 1000.0)}
                       for d, p in sorted(self.samples)},
        }

    def save(self, path: str) -> None:
        """Write :meth:`to_json` to ``path`` (atomically: a reader never sees half a file)."""
        import os  # noqa: PLC0415

        tmp = f"{path}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, indent=1)
        os.replace(tmp, path)

    @classmethod
    def from_json(cls, raw: Dict[str, Any], source: str = "profile") -> "MeasuredThroughput":
        """Rebuild a saved profile (measurements and all); the fit is recomputed from the measurements."""
        if raw.get("format") != PROFILE_FORMAT:
            raise ConfigurationError(f"{source}: format {raw.get('format')!r} is not {PROFILE_FORMAT!r}")
        try:
            lim = raw.get("limits") or {}
            prior = PipelineThroughput(raw["layer_ms"], int(raw["global_batch"]), int(raw["micro_batches"]),
                                       max_p=lim.get("max_p"), min_p=int(lim.get("min_p", 1)))
            m = cls(prior, layer_bytes=raw.get("layer_bytes"), cores=raw.get("cores"),
                    min_samples=int(raw.get("min_samples", 5)))
            if raw.get("migration_constants"):
                m.constants = MigrationConstants(**raw["migration_constants"])
            for key, entry in (raw.get("shapes") or {}).items():
                d, p = (int(x) for x in key.split(","))
                for ms in entry["step_ms"]:
                    m.record(d, p, float(ms))
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigurationError(
                f"{source}: not a valid measured profile ({type(e).__name__}: {e}); expected keys format, layer_ms, "
                "global_batch, micro_batches, shapes{'D,P': {step_ms: [...]}} as written by the runtime") from None
        m.fit()
        return m

    def describe(self) -> str:
        """One line per measured shape, and the fitted coefficients (for logs and reports)."""
        coef = self._coef()
        lines = [f"{d}x{p}: measured {self.measured(d, p) or 0:.1f} samples/s (fit {self.global_batch / self.fitted_ms(d, p) * 1000:.1f})"
                 for d, p in self.measured_shapes()]
        lines.append("fit: " + ", ".join(f"{k}={c:.3g}" for k, c in zip(FEATURES, coef))
                     + f" (relative rmse {self.rel_rmse:.3f})")
        return "\n".join(lines)


def load_measured_profile(path: str) -> Optional[MeasuredThroughput]:
    """The measured profile at ``path``, or None if the JSON there is another kind of profile.

    Raises:
        ConfigurationError: The file cannot be read or is a broken measured profile.
    """
    try:
        with open(path) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigurationError(f"cannot read layer profile {path}: {e}") from None
    if not isinstance(raw, dict) or "format" not in raw:
        return None
    return MeasuredThroughput.from_json(raw, source=path)


def load_cost_model(kind: str, model: Optional[str] = None, profile_path: Optional[str] = None, *,
                    preemption_notice: bool = False) -> MigrationCostModel:
    """Build a cost model from CLI-style options.

    Args:
        kind: ``"artifact"`` (needs ``model``) or ``"default"``.
        model: A bundled table name (:func:`reference_models`).
        profile_path: A per-layer profile JSON (:meth:`LayerProfile.from_json`) or a run's measured profile
            (``run_dir/profile.json``, :mod:`lightning_parcae.planning.measured`), for ``default`` only.
        preemption_notice: ``default`` only: departures come with a notice and the leavers hand their state over
            (:class:`DefaultCostModel`), as the runtime prices them by default (``ParcaeStrategy(
            preemption_notice=True)``); the artifact's accounting has its own rule and refuses it.

    Returns:
        The cost model (its ``throughput`` attribute is the matching throughput model).
    """
    if (model is None) == (profile_path is None):
        raise ConfigurationError("give exactly one of a model table (--model-table NAME) or a profile (--profile FILE)")
    if kind == "artifact":
        if model is None:
            raise ConfigurationError(
                "--cost-model artifact needs --model-table NAME: the artifact's accounting only exists for its "
                f"own tables ({', '.join(reference_models())})"
            )
        if preemption_notice:
            raise ConfigurationError(
                "--cost-model artifact prices departures by the artifact's own rule; --preemption-notice applies to "
                "--cost-model default (drop it, or use --cost-model default)"
            )
        return ArtifactCostModel(model)
    if kind == "default":
        if model is not None:
            thr: ThroughputModel = TableThroughput.from_reference(model)
            layers = reference_layer_params(model)
        else:
            # a profile a run measured and fitted (run_dir/profile.json): the same model the runtime planned with
            measured = load_measured_profile(profile_path)  # type: ignore[arg-type]
            if measured is not None:
                return measured.cost_model(preemption_notice=preemption_notice)
            prof = LayerProfile.from_json(profile_path)  # type: ignore[arg-type]
            thr = ProfileThroughput(prof)
            layers = [b / 4.0 for b in prof.param_bytes]  # fp32 weights: 4 bytes per parameter
        return DefaultCostModel(thr, layers, preemption_notice=preemption_notice)
    raise ConfigurationError(f"unknown cost model {kind!r}: use 'artifact' or 'default'")
