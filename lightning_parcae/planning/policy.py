"""The Parcae decision of one interval: the one rule, and the one predictor, that the simulator and the runtime run.

Problem: the simulator's ``parcae`` policy must score exactly what the runtime does, or ``parcae simulate`` says
nothing about a real job. Both know the interval about to run (its arrivals have arrived, its preemption notices
are in) and forecast only the intervals after it. If each caller built its own predictor and optimizer they would
drift apart (they did: the runtime's predictor had another window and, for ``artifact``, another lower bound).

This module holds the decision once, for both callers:

* :class:`DecisionOptions` -- how the decision is made (look-ahead, predictor, forecast bound, risk, least gain,
  fit charge, levels);
* :func:`make_decision_predictor` -- the one predictor factory;
* :class:`ShapeDecider` -- the decision state of one job (its optimizer and predictor): it observes the count of
  each interval and decides the next shape (:meth:`~lightning_parcae.planning.shape_optimizer.LiveputOptimizer.decide`
  over the predictor's quantile scenarios, :func:`decide_with_forecast`).

Who owns what: a :class:`ShapeDecider` owns its optimizer and predictor; its caller (the simulator's ``parcae``
policy, the runtime's ``ShapeChooser``) feeds it counts with :meth:`~ShapeDecider.observe`, tells it when prices
changed with :meth:`~ShapeDecider.prices_changed`, and reads both only to plan or report (never to change them).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable, List, NamedTuple, Optional, Sequence, Tuple

from lightning_parcae.planning.costmodel import MigrationConstants, MigrationCostModel, Shape
from lightning_parcae.planning.forecast import Predictor, make_predictor
from lightning_parcae.planning.shape_optimizer import (
    DEFAULT_HOLD_RISK,
    DEFAULT_MIN_GAIN,
    DEFAULT_RISK,
    Decision,
    FirstCosts,
    LiveputOptimizer,
    check_risk,
)

__all__ = [
    "DEFAULT_RISK",
    "LEVELS",
    "DecisionOptions",
    "ForecastDecision",
    "ShapeDecider",
    "decide_with_forecast",
    "ends_hold",
    "hold_after",
    "make_decision_predictor",
    "paths_to_intervals",
    "check_risk",
]

LEVELS: Tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
"""Quantile levels of the forecast's own errors; one scenario path each (equal paths merged)."""


Interval = Tuple[int, int, int]
"""``(prev_n, n_in, n_out)`` of one interval."""


@dataclass(frozen=True)
class DecisionOptions:
    """How the shape decision is made: the same options in the simulator and in the runtime.

    Attributes:
        look_ahead: Intervals planned over: the known one and ``look_ahead - 1`` forecast ones.
        predictor: Predictor name (:data:`~lightning_parcae.planning.forecast.PREDICTORS`), or ``None`` to plan
            with the known interval only (the oracle and reactive simulator policies).
        max_instances: Highest count a forecast may take (the cluster size; ``None``: unbounded).
        risk: Standard deviations of gain a departure from the reactive shape must clear.
        levels: Quantile levels of the forecast scenarios.
        tail_intervals: Intervals after the horizon credited to the shape a plan ends in (the optimizer's
            terminal value, :class:`~lightning_parcae.planning.shape_optimizer.LiveputOptimizer`).
        min_gain: The least fraction of the reactive plan's expected value a departure must gain besides the risk
            rule (:data:`~lightning_parcae.planning.shape_optimizer.DEFAULT_MIN_GAIN`; 0: none).
        charge_unmeasured: Add the fit's error on shapes not yet measured to a departure's spread
            (:meth:`~lightning_parcae.planning.shape_optimizer.LiveputOptimizer.unmeasured_risk`; False: the
            scenarios' spread only).
        hold_risk: Standard deviations of gain that *staying* in a bet already taken must clear
            (:meth:`~lightning_parcae.planning.shape_optimizer.LiveputOptimizer.decide`'s ``held``;
            :data:`~lightning_parcae.planning.shape_optimizer.DEFAULT_HOLD_RISK`; ``None``: the same ``risk`` as
            entering it).
    """

    look_ahead: int = 12
    predictor: Optional[str] = "persistence"
    max_instances: Optional[int] = None
    risk: float = DEFAULT_RISK
    levels: Sequence[float] = LEVELS
    tail_intervals: float = 0.0
    min_gain: float = DEFAULT_MIN_GAIN
    charge_unmeasured: bool = True
    hold_risk: Optional[float] = DEFAULT_HOLD_RISK


class ForecastDecision(NamedTuple):
    """A decision with the futures it was scored against (unpacks as ``decision, scenarios, weights``).

    Attributes:
        decision: The optimizer's decision for the interval about to run.
        scenarios: Forecast futures after that interval, as ``(prev_n, n_in, n_out)`` lists (``[[]]``: none).
        weights: Probability of each scenario.
    """

    decision: Decision
    scenarios: List[List[Interval]]
    weights: Sequence[float]

    @property
    def median(self) -> List[Interval]:
        """The middle scenario (the median path for the default levels); empty if there is none."""
        return self.scenarios[len(self.scenarios) // 2] if self.scenarios else []


def make_decision_predictor(options: DecisionOptions) -> Optional[Predictor]:
    """The predictor of the shape decision -- the one factory the simulator and the runtime use.

    Its window is the look-ahead (at least 8 counts), its lower bound 0 and its upper bound ``max_instances``.

    Args:
        options: The decision's options.

    Returns:
        A fresh predictor, or ``None`` when ``options.predictor`` is ``None``.

    Raises:
        ConfigurationError: Unknown predictor name or bad bounds.
    """
    if options.predictor is None:
        return None
    return make_predictor(options.predictor, window=max(options.look_ahead, 8), min_instances=0,
                          max_instances=options.max_instances)


def ends_hold(decision: Optional[Decision], current: Shape, held: Optional[Shape], chosen: Shape) -> bool:
    """Whether moving ``current -> chosen`` ends a *hold*: ``current`` is the shape a departing decision chose over
    the throughput-best one (``held``) and this decision, no longer departing, chose ``chosen``. The veto then
    refuses the move only if ``chosen`` is measured slower
    (:meth:`~lightning_parcae.planning.measured.MeasuredThroughput.vetoes` with ``held=True``). The runtime's
    ``ShapeChooser`` and the simulator's live policies both ask this."""
    return decision is not None and not decision.departs and current == held and chosen == decision.next_shape


def hold_after(decision: Optional[Decision], current: Shape, held: Optional[Shape], final: Shape,
               vetoed: bool) -> Optional[Shape]:
    """The hold after a decision whose shape, after the runtime's rules, is ``final``: ``final`` when the decision
    departed to it (and no veto kept ``current``), none once the job moves elsewhere, else ``held`` unchanged."""
    if decision is not None and decision.departs and final == decision.next_shape and not vetoed:
        return final
    return None if final != current else held


def paths_to_intervals(start: int, path: Sequence[int]) -> List[Interval]:
    """Instance counts ``path`` after ``start`` as ``(prev_n, n_in, n_out)`` intervals."""
    out, prev = [], int(start)
    for c in path:
        c = int(c)
        out.append((prev, max(c - prev, 0), max(prev - c, 0)))
        prev = c
    return out


def decide_with_forecast(
    opt: LiveputOptimizer,
    pred: Optional[Predictor],
    shape: Shape,
    now: Interval,
    *,
    remain_ms: float = 0.0,
    risk: float = DEFAULT_RISK,
    levels: Sequence[float] = LEVELS,
    first_costs: Optional[FirstCosts] = None,
    held: Optional[Shape] = None,
    hold_risk: Optional[float] = None,
) -> ForecastDecision:
    """Decide the shape of the interval ``now = (prev_n, n_in, n_out)`` about to run.

    The predictor must already have observed the count after ``now`` (``prev_n + n_in - n_out``); the intervals
    after it are its quantile scenarios over the optimizer's look-ahead.

    Args:
        opt: The liveput optimizer (its ``look_ahead`` sets the horizon).
        pred: The predictor, or ``None`` to plan with the known interval only.
        shape: The current shape (``(0, 0)`` before the job runs).
        now: The interval about to run, as known at its start.
        remain_ms: Milliseconds still needed by an unfinished migration.
        risk: Standard deviations of gain a departure from the reactive shape must clear.
        levels: Quantile levels of the scenarios.
        first_costs: The known cost of the move about to be made, per target (the runtime's leader knows who
            leaves and who joins); ``None``: the expectation over victim patterns prices it.
        held: The bet the job runs (see :meth:`LiveputOptimizer.decide`), or ``None``.
        hold_risk: Standard deviations of gain staying in ``held`` must clear (``None``: ``risk``).

    Returns:
        ``(decision, scenarios, weights)``: the decision and the futures it was scored against.
    """
    prev, n_in, n_out = now
    after = prev + n_in - n_out
    scenarios: List[List[Interval]] = [[]]
    weights: Sequence[float] = [1.0]
    if pred is not None and opt.look_ahead > 1:
        paths, weights = pred.scenarios(opt.look_ahead - 1, levels)
        scenarios = [paths_to_intervals(after, p) for p in paths]
    decision = opt.decide(prev, shape, now, scenarios, weights, remain_ms=remain_ms, risk=risk, first_costs=first_costs,
                          held=held, hold_risk=hold_risk)
    return ForecastDecision(decision, scenarios, weights)


class ShapeDecider:
    """The shape decision of one job: its liveput optimizer and its predictor, built once from the options.

    The simulator's ``parcae`` policy and the runtime's ``ShapeChooser`` each keep one and call it the same way:
    :meth:`observe` the count the interval about to run will have, then :meth:`decide` its shape.

    Args:
        cost_model: Migration costs (its ``throughput`` prices the shapes).
        interval_s: Length of one planning interval.
        options: How the decision is made.
        history: Counts already seen (a new leader replays the job's history), oldest first.

    Attributes:
        optimizer: The liveput optimizer (owned here; callers may ``plan`` with it, not change it).
        predictor: The predictor (owned here; ``None`` without a forecast), fed only through :meth:`observe`.
        options: The options it was built with.
    """

    def __init__(self, cost_model: MigrationCostModel, *, interval_s: float,
                 options: DecisionOptions = DecisionOptions(), history: Iterable[int] = ()) -> None:
        self.options = options
        self.optimizer = LiveputOptimizer(cost_model, interval_s=interval_s, look_ahead=options.look_ahead,
                                          tail_intervals=options.tail_intervals, min_gain=options.min_gain,
                                          charge_unmeasured=options.charge_unmeasured)
        self.predictor: Optional[Predictor] = make_decision_predictor(options)
        for n in history:
            self.observe(n)

    @property
    def observed(self) -> int:
        """Counts the predictor holds (0 before the first :meth:`observe`, or without a predictor)."""
        return 0 if self.predictor is None else len(self.predictor.history)

    def observe(self, n: int) -> None:
        """Record the count of the interval about to run (before :meth:`decide` is asked about it)."""
        if self.predictor is not None:
            self.predictor.observe(n)

    def prices_changed(self) -> None:
        """The throughput model's prices changed (steps were measured): the optimizer re-reads them."""
        self.optimizer.prices_changed()

    def set_constants(self, constants: MigrationConstants) -> None:
        """Price migrations with new constants (refitted from measured migrations): see
        :meth:`LiveputOptimizer.set_constants`."""
        self.optimizer.set_constants(constants)

    def decide(self, shape: Shape, now: Interval, *, remain_ms: float = 0.0,
               first_costs: Optional[FirstCosts] = None, held: Optional[Shape] = None) -> ForecastDecision:
        """The shape of the interval ``now = (prev_n, n_in, n_out)`` about to run (see :func:`decide_with_forecast`).

        A decision between two planning intervals (a notice, a loss, an arrival: the runtime observes counts only
        at planning intervals) forecasts from the count it knows the interval will have -- a copy of the predictor
        observes it, the predictor itself does not (its history stays one count per planning interval). Regression
        (issue 21, stop 49, 0.25 Gbps replay of lh_80_90): at each notice of a falling count (32 -> 27 -> 21 -> 19
        -> 16) the persistence forecast after the known interval was the count *before* the notice, so the
        optimizer expected every drop to reverse and parked the job in shapes cheap to enter and leave (1x26 at
        24 samples/s where 4x6 ran 38), each fitting the count so tightly that the next drop forced another move.

        Args:
            shape: The current shape (``(0, 0)`` before the job runs).
            now: The interval about to run, as known at its start.
            remain_ms: Milliseconds still needed by an unfinished migration.
            first_costs: The known cost of the move about to be made, per target (see :func:`decide_with_forecast`).
            held: The bet the job runs: the shape an earlier departing decision chose (:func:`hold_after`), kept
                on ``options.hold_risk``.

        Returns:
            The decision with the scenarios it was scored against.
        """
        pred = self.predictor
        after = now[0] + now[1] - now[2]
        if pred is not None and (not len(pred.history) or int(pred.history[-1]) != after):
            pred = copy.deepcopy(pred)
            pred.observe(after)
        return decide_with_forecast(self.optimizer, pred, shape, now, remain_ms=remain_ms,
                                    risk=self.options.risk, levels=self.options.levels, first_costs=first_costs,
                                    held=held, hold_risk=self.options.hold_risk)
