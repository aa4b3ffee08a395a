"""Trace-driven policies: what each approach would train on a given availability trace.

Problem: before paying for spot instances a user wants to know, on a trace like theirs, how much each policy
would train and why. Every policy here walks the same intervals with the same accounting (the artifact's, see
``ARTIFACT_MODEL.md``): a transition's cost is paid out of the interval's time; what does not fit carries over
into the next interval; a new change during an unfinished one also pays a concurrent restart -- or, with this
runtime's cost model (``DefaultCostModel.waits_for_unfinished``), waits for the unfinished one to finish, as the
runtime does.

Policies:

* ``ideal`` -- the best shape for each interval's instance count, free of any cost (an upper bound).
* ``throughput`` -- reactive and restart-based (Varuna-like): the best shape after every event, paying a full
  restart, a checkpoint save + load and every stage's state each time.
* ``restart`` -- torchrun-like: one fixed shape chosen at the start; every event restarts from a checkpoint;
  while fewer instances than the shape needs are present it trains nothing.
* ``relaunch`` -- ``parcae run --restart-fallback`` as the launcher implements it: a fixed pipeline depth
  (option ``pipeline_stages``; default: the depth of the best shape for the first interval's count) and the widest
  D that fits (instances beyond D x P idle); every change of count that changes that shape (a change of idle
  instances does not: the launcher removes those first) stops the whole job and relaunches it, paying
  ``restart_ms`` (a measured restart's whole loss: downtime plus the steps redone since the last checkpoint); a
  change during an unfinished relaunch starts it over (the launcher kills the relaunching generation), it does not
  add a second one as the artifact's accounting does. Option ``startup_ms``: the first launch's cost (default:
  a restart's). Option ``launch_ms``: what a relaunch costs when nothing is training -- a change during an
  unfinished relaunch, or the end of a pause -- where no generation stops and saves (default: a restart's).
* ``parcae`` -- the liveput optimizer (:meth:`~lightning_parcae.planning.shape_optimizer.LiveputOptimizer.decide`): at the start
  of interval k it knows that interval's arrivals and preemptions (the same knowledge ``throughput`` reacts to --
  the artifact scores ``throughput`` with the count *after* interval k's events) and forecasts only the
  intervals after it, as quantile scenarios from a :mod:`~lightning_parcae.planning.forecast` predictor that has seen
  counts up to interval k. The reactive shape is always a candidate; the plan departs from it only when the
  expected gain over the scenarios clears ``risk`` standard deviations. It never sees interval k+1's events.
* ``parcae-oracle`` -- the optimizer fed the true future (the artifact's "liveput truth").
* ``live-reactive`` -- no plan, no forecast: the throughput-best allowed shape for the count each interval starts
  with (as ``throughput``), but reached by parcae's live migrations instead of restarts. ``parcae`` against it
  isolates what planning over a forecast adds; it against ``throughput`` isolates what cheaper migrations add.

Over a *measured* profile (a run's ``profile.json``: a throughput model with ``vetoes``) ``parcae`` and
``live-reactive`` also keep the runtime leader's veto (:meth:`~lightning_parcae.planning.measured.MeasuredThroughput.vetoes`):
no move, while the current shape still fits, to a shape not measured faster by the margin (``required_gain``: at
least 3 %, two combined step spreads where the steps spread more), and a hold the
decision takes back is left unless the target measured slower. Both decide at the runtime's planning prices
(:meth:`~lightning_parcae.planning.measured.MeasuredThroughput.planning_throughput`: a gain inside that margin
over a narrower measured shape counts as none) and train at the measurements. Regression (issue 21, stop 49, 0.25 Gbps replay of
lh_80_90): the runtime's reactive stayed in 4x6 on 28-31 instances (4x7 measured 6.8 % faster: under the 10 %
margin of then)
while the simulator's moved to 4x7 and back for 33 s and 30 s of repartitions, and forecast reactive 17 % low.

Option ``constants`` (``parcae``, ``parcae-oracle``, ``live-reactive``; a cost model with migration constants): one
entry per interval, the :class:`~lightning_parcae.planning.costmodel.MigrationConstants` the decision and the
interval's move are priced with from that interval on (``None``: unchanged) -- a replayed run's leader refits its
constants after each migration, so a forecast of that run can price each decision as the leader did rather than
the whole run at its last fit. The cost model gets its own constants back when the policy ends.

Option ``start_shape`` (the same three): the shape the job already runs when the trace starts -- a replayed run's
first generation, which the launcher forms before any decision (``parcae run``: D the largest power of two with
D x P within the first count) -- so the first move away from it is priced as the migration it is. Default: the
job starts paused and its first shape costs only the move from nothing. Regression (issue 21, stop 55): every
0.25 Gbps replay at N = 32 started in 4x6 and moved to 4x7 with a 24-27 s repartition that the forecast, starting
from nothing, never charged; with victims drawn from every instance the in-place forecasts were 7-16 % high.

The ``parcae`` decision is :class:`~lightning_parcae.planning.policy.ShapeDecider`, the very object (optimizer,
predictor factory, options) the runtime's ``ShapeChooser`` decides with; the cost model is the runtime's kind.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from lightning_parcae.planning.costmodel import MigrationConstants, MigrationCostModel, Shape, ThroughputModel
from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.liveput import expected_transition_cost
from lightning_parcae.planning.shape_optimizer import DEFAULT_RISK, PAUSED, fit_shape, settle
from lightning_parcae.planning.policy import LEVELS, DecisionOptions, ShapeDecider, ends_hold, hold_after

__all__ = ["PolicyResult", "POLICIES", "run_policy"]

Intervals = Sequence[Tuple[int, int, int]]


@dataclass
class PolicyResult:
    """What one policy did on a trace.

    Attributes:
        name: Policy name.
        samples: Samples trained over the whole trace.
        interval_s: Interval length.
        counts: Instances present after each interval.
        shapes: Shape used in each interval (``(0, 0)`` when nothing ran).
        cumulative: Cumulative samples after each interval.
        cost_ms: Migration cost started in each interval (0 if none).
        lost_ms: Training time lost to migrations in each interval.
        decide_s: Wall time the policy spent deciding (optimizer + predictor).
    """

    name: str
    interval_s: float
    samples: float = 0.0
    counts: List[int] = field(default_factory=list)
    shapes: List[Shape] = field(default_factory=list)
    cumulative: List[float] = field(default_factory=list)
    cost_ms: List[float] = field(default_factory=list)
    lost_ms: List[float] = field(default_factory=list)
    decide_s: float = 0.0

    @property
    def reconfigurations(self) -> int:
        """Intervals in which a migration or restart started."""
        return sum(1 for c in self.cost_ms if c > 0)

    @property
    def seconds(self) -> float:
        """Length of the trace."""
        return self.interval_s * len(self.counts)

    @property
    def mean_throughput(self) -> float:
        """Samples per second over the whole trace."""
        return self.samples / self.seconds if self.counts else 0.0

    @property
    def lost_s(self) -> float:
        """Seconds of training lost to migrations and restarts."""
        return sum(self.lost_ms) / 1000.0

    @property
    def instance_hours(self) -> float:
        """Instance-hours held (what a spot bill charges for, whether used or not)."""
        return sum(self.counts) * self.interval_s / 3600.0

    def summary(self, price: float) -> Dict[str, float]:
        """JSON-ready numbers for reports.

        Args:
            price: USD per instance-hour.
        """
        usd = self.instance_hours * price
        return {
            "samples": self.samples,
            "mean_samples_per_s": self.mean_throughput,
            "reconfigurations": self.reconfigurations,
            "lost_s": self.lost_s,
            "instance_hours": self.instance_hours,
            "usd": usd,
            "usd_per_million_samples": (usd / self.samples * 1e6) if self.samples > 0 else float("inf"),
            "decide_s": self.decide_s,
        }


class _Accountant:
    """The artifact's per-interval accounting of migration time (shared by every costed policy); a change during an
    unfinished migration costs what the cost model's ``overlapping_ms`` says."""

    def __init__(self, cm: MigrationCostModel, interval_ms: float) -> None:
        self.cm = cm
        self.interval_ms = interval_ms
        self.remain = 0.0

    def step(self, cost: float, shape: Shape) -> Tuple[float, float]:
        """Apply one interval with a transition of ``cost`` ms to ``shape``; returns (work_ms, lost_ms)."""
        if cost > 0:
            self.remain = self.cm.overlapping_ms(self.remain, cost, self.cm.concurrent_restart_ms(*shape)) \
                if self.remain > 0 else cost
        work = self.interval_ms - self.remain
        lost = min(self.interval_ms, self.remain)
        self.remain = max(0.0, -work)
        return max(0.0, work), lost


def _record(res: PolicyResult, n: int, shape: Shape, samples: float, cost: float, lost: float) -> None:
    res.samples += samples
    res.counts.append(n)
    res.shapes.append(shape)
    res.cumulative.append(res.samples)
    res.cost_ms.append(cost)
    res.lost_ms.append(lost)


def _train_after(res: PolicyResult, n: int, shape: Shape, samples_per_s: float, interval_s: float, remain: float,
                 cost: float) -> float:
    """Record one interval that trains ``shape`` for what ``remain`` ms of restart leave of it; returns what of
    the restart carries over into the next interval (the restart-based policies' accounting)."""
    _record(res, n, shape, samples_per_s * max(0.0, interval_s - remain / 1000.0), cost, min(1000.0 * interval_s, remain))
    return max(0.0, remain - 1000.0 * interval_s)


def _ideal(cm: MigrationCostModel, intervals: Intervals, interval_s: float, **_: object) -> PolicyResult:
    res = PolicyResult("ideal", interval_s)
    thr = cm.throughput
    for prev, n_in, n_out in intervals:
        n = prev + n_in - n_out
        shape = thr.best(n) or (0, 0)
        _record(res, n, shape, thr.throughput(*shape) * interval_s if shape != (0, 0) else 0.0, 0.0, 0.0)
    return res


def _throughput(cm: MigrationCostModel, intervals: Intervals, interval_s: float, **_: object) -> PolicyResult:
    res = PolicyResult("throughput", interval_s)
    thr = cm.throughput
    remain = 0.0
    for i, (prev, n_in, n_out) in enumerate(intervals):
        n = prev + n_in - n_out
        shape = thr.best(n)
        if shape is None:
            _record(res, n, (0, 0), 0.0, 0.0, 0.0)
            remain = 0.0
            continue
        cost = 0.0
        if i == 0 or n_in + n_out > 0:
            kind = "add" if (n_in > 0 or i == 0) else "remove"
            cost = cm.reactive_restart_ms(shape[0], shape[1], kind, first=(i == 0))
            remain = cost + cm.restart_ms(shape[0], shape[1], kind) if remain > 0 else cost
        remain = _train_after(res, n, shape, thr.throughput(*shape), interval_s, remain, cost)
    return res


def _restart(cm: MigrationCostModel, intervals: Intervals, interval_s: float, **_: object) -> PolicyResult:
    res = PolicyResult("restart", interval_s)
    thr = cm.throughput
    fixed: Optional[Shape] = None
    remain = 0.0
    started = False
    for i, (prev, n_in, n_out) in enumerate(intervals):
        n = prev + n_in - n_out
        if fixed is None:
            fixed = thr.best(n)
            if fixed is None:
                _record(res, n, (0, 0), 0.0, 0.0, 0.0)
                continue
        if n < fixed[0] * fixed[1]:  # the fixed world size is not available: wait
            _record(res, n, (0, 0), 0.0, 0.0, 0.0)
            remain = 0.0
            continue
        cost = 0.0
        if not started or n_in + n_out > 0:
            kind = "add" if (n_in > 0 or not started) else "remove"
            cost = cm.reactive_restart_ms(fixed[0], fixed[1], kind, first=not started)
            remain = cost + cm.restart_ms(fixed[0], fixed[1], kind) if remain > 0 else cost
            started = True
        remain = _train_after(res, n, fixed, thr.throughput(*fixed), interval_s, remain, cost)
    return res


def _fixed_depth_shape(thr: ThroughputModel, n: int, p: int) -> Optional[Shape]:
    """The widest allowed (d, p) on ``n`` instances at depth ``p`` (None if not even d = 1 fits)."""
    for d in range(n // p if p > 0 else 0, 0, -1):
        if thr.throughput(d, p) > 0:
            return (d, p)
    return None


def _relaunch(cm: MigrationCostModel, intervals: Intervals, interval_s: float, *,
              pipeline_stages: Optional[int] = None, startup_ms: Optional[float] = None,
              launch_ms: Optional[float] = None, **_: object) -> PolicyResult:
    res = PolicyResult("relaunch", interval_s)
    thr = cm.throughput
    p = int(pipeline_stages) if pipeline_stages else 0
    if pipeline_stages is not None and p < 1:
        raise ConfigurationError(f"relaunch: pipeline_stages must be >= 1, got {pipeline_stages!r}")
    if launch_ms is not None and launch_ms < 0:
        raise ConfigurationError(f"relaunch: launch_ms must be >= 0, got {launch_ms!r}")
    remain, started = 0.0, False
    running: Optional[Shape] = None  # the shape of the generation running or relaunching (None: nothing runs)
    for prev, n_in, n_out in intervals:
        n = prev + n_in - n_out
        if not p:
            best = thr.best(n)
            if best is None:
                _record(res, n, (0, 0), 0.0, 0.0, 0.0)
                continue
            p = best[1]
        shape = _fixed_depth_shape(thr, n, p)
        if shape is None:  # too few instances for one pipeline: the job waits (its state is in the checkpoint)
            _record(res, n, (0, 0), 0.0, 0.0, 0.0)
            remain, running = 0.0, None
            continue
        cost = 0.0
        # a change that leaves the shape as it is touches only idle instances beyond D x P (the launcher removes
        # those first): nothing relaunches
        if not started or (n_in + n_out > 0 and shape != running):
            if not started and startup_ms is not None:
                cost = float(startup_ms)
            elif started and (running is None or remain > 0.0) and launch_ms is not None:
                cost = float(launch_ms)  # nothing trains (a pause, or a relaunch under way): no stop, a launch
            else:
                cost = cm.restart_ms(shape[0], shape[1], "add" if n_in > 0 or not started else "remove")
            remain = cost  # a relaunch under way is abandoned and started over
            started = True
        running = shape
        remain = _train_after(res, n, shape, thr.throughput(*shape), interval_s, remain, cost)
    return res


def _liveput(
    cm: MigrationCostModel,
    intervals: Intervals,
    interval_s: float,
    *,
    look_ahead: int = 12,
    oracle: bool = False,
    reactive: bool = False,
    predictor: str = "persistence",
    max_instances: Optional[int] = None,
    risk: float = DEFAULT_RISK,
    levels: Sequence[float] = LEVELS,
    constants: Optional[Sequence[Optional[MigrationConstants]]] = None,
    tail_intervals: float = DecisionOptions.tail_intervals,
    start_shape: Optional[Shape] = None,
    min_gain: float = DecisionOptions.min_gain,
    charge_unmeasured: bool = DecisionOptions.charge_unmeasured,
    hold_risk: Optional[float] = DecisionOptions.hold_risk,
    **_: object,
) -> PolicyResult:
    res = PolicyResult("live-reactive" if reactive else "parcae-oracle" if oracle else "parcae", interval_s)
    forecast = not oracle and not reactive
    options = DecisionOptions(look_ahead=look_ahead, predictor=predictor if forecast else None,
                              max_instances=max_instances, risk=risk, levels=levels,
                              tail_intervals=tail_intervals, min_gain=min_gain,
                              charge_unmeasured=charge_unmeasured, hold_risk=hold_risk)
    decider = ShapeDecider(cm, interval_s=interval_s, options=options)
    acct = _Accountant(cm, 1000.0 * interval_s)
    # with a measured profile (a run's profile.json) the live policies keep the leader's veto, as the runtime does
    # for both: no move to a shape not measured faster by the margin while the current one still fits
    vetoes = None if oracle else getattr(cm.throughput, "vetoes", None)
    original = getattr(cm, "c", None)
    if constants is not None and not isinstance(original, MigrationConstants):
        raise ConfigurationError(f"constants per interval need a cost model with migration constants; "
                                 f"{type(cm).__name__} has none: use the default cost model (a run's profile.json)")
    start: Shape = PAUSED if start_shape is None else (int(start_shape[0]), int(start_shape[1]))
    if start != PAUSED and (min(start) < 1 or start[0] * start[1] > intervals[0][0]):
        raise ConfigurationError(f"start_shape={start_shape}: the shape the job starts in must be D x P >= 1 x 1 "
                                 f"within the count before the trace's first interval ({intervals[0][0]}); build "
                                 "the trace with start_n = the first count, or leave start_shape out to start paused")
    try:
        _walk_liveput(res, cm, intervals, decider, acct, oracle=oracle, reactive=reactive, look_ahead=look_ahead,
                      vetoes=vetoes, constants=constants, start=start)
    finally:
        if constants is not None and cm.c != original:  # type: ignore[attr-defined]
            decider.set_constants(original)  # type: ignore[arg-type]
    return res


def _walk_liveput(res: PolicyResult, cm: MigrationCostModel, intervals: Intervals, decider: ShapeDecider,
                  acct: "_Accountant", *, oracle: bool, reactive: bool, look_ahead: int,
                  vetoes: Optional[Callable[..., bool]],
                  constants: Optional[Sequence[Optional[MigrationConstants]]], start: Shape) -> None:
    """The interval loop of :func:`_liveput` (see there)."""
    opt = decider.optimizer
    shape: Shape = start
    held: Optional[Shape] = None  # the shape the last departing decision chose over the throughput-best one
    for i, (prev, n_in, n_out) in enumerate(intervals):
        if constants is not None and i < len(constants) and constants[i] is not None and \
                constants[i] != cm.c:  # type: ignore[attr-defined]
            decider.set_constants(constants[i])  # type: ignore[arg-type]
        after = prev + n_in - n_out
        t0 = time.perf_counter()
        decision = None
        # What is known at the interval's start: its arrivals have arrived and its preemption notices are in, so
        # the count it runs with is `after` -- the same knowledge the reactive `throughput` baseline uses. Only
        # the intervals after it are forecast (the oracle sees them).
        if reactive:
            target = opt.reactive_shape(after)
        elif oracle:
            plan = opt.plan(prev, shape, list(intervals[i : i + look_ahead]), remain_ms=acct.remain)
            target = plan.next_shape
        else:
            # the runtime's ShapeChooser makes this very call (planning/policy.py)
            decider.observe(after)
            decision = decider.decide(shape, (prev, n_in, n_out), remain_ms=acct.remain, held=held).decision
            target = decision.next_shape
        res.decide_s += time.perf_counter() - t0
        target = fit_shape(target, after) if target != PAUSED else PAUSED
        if target[0] * target[1] == 0 or cm.throughput.throughput(*target) <= 0:
            target = PAUSED  # nothing allowed fits: the job waits (its state is kept in the checkpoint)
        vetoed = False
        if vetoes is not None and target != PAUSED and shape[0] * shape[1] > 0:
            # the runtime's ShapeChooser.choose: a hold the decision takes back is left unless measured slower
            if vetoes(shape, target, after, held=ends_hold(decision, shape, held, target)):
                target, vetoed = shape, True
        held = hold_after(decision, shape, held, target, vetoed)
        if target == PAUSED:
            acct.remain = 0.0
            _record(res, after, target, 0.0, 0.0, 0.0)
        else:
            cost = expected_transition_cost(cm, prev, shape, *settle(prev, n_in, n_out), target).mean
            work_ms, lost = acct.step(cost, target)
            _record(res, after, target, cm.throughput.throughput(*target) * work_ms / 1000.0, cost, lost)
        shape = target


POLICIES: Dict[str, Callable[..., PolicyResult]] = {
    "ideal": _ideal,
    "throughput": _throughput,
    "restart": _restart,
    "relaunch": _relaunch,
    "parcae": lambda cm, iv, s, **kw: _liveput(cm, iv, s, oracle=False, **kw),
    "parcae-oracle": lambda cm, iv, s, **kw: _liveput(cm, iv, s, oracle=True, **kw),
    "live-reactive": lambda cm, iv, s, **kw: _liveput(cm, iv, s, reactive=True, **kw),
}
"""Policy name -> function ``(cost_model, intervals, interval_s, **options) -> PolicyResult``."""


def run_policy(name: str, cm: MigrationCostModel, intervals: Intervals, interval_s: float = 60.0, **options: object) -> PolicyResult:
    """Run one policy on a trace's intervals.

    Args:
        name: One of :data:`POLICIES`.
        cm: The cost model (with its throughput model).
        intervals: ``(prev_n, n_in, n_out)`` per interval.
        interval_s: Interval length.
        **options: ``pipeline_stages`` and ``startup_ms`` for ``relaunch``; ``look_ahead``, ``predictor``, ``max_instances`` (the cluster size, bounding forecasts; default
            none -- the policy must not learn the trace's maximum from the trace), ``risk`` (default
            :data:`~lightning_parcae.planning.shape_optimizer.DEFAULT_RISK`), ``min_gain`` (default
            :data:`~lightning_parcae.planning.shape_optimizer.DEFAULT_MIN_GAIN`), ``charge_unmeasured`` (default
            True) and ``levels`` (scenario quantiles) for the parcae policies; ``constants`` and ``start_shape``
            for the in-place ones (see the module's docstring).

    Returns:
        The policy's result.
    """
    if name not in POLICIES:
        raise ConfigurationError(f"unknown policy {name!r}: choose from {', '.join(POLICIES)}")
    if not intervals:
        raise ConfigurationError("the trace has no intervals: nothing to simulate")
    return POLICIES[name](cm, list(intervals), interval_s, **options)
