"""The Parcae decision of one interval, from a predictor: the one rule the simulator and the runtime both run.

Problem: the simulator's ``parcae`` policy must score exactly what the runtime does, or ``parcae simulate`` says
nothing about a real job. Both know the interval about to run (its arrivals have arrived, its preemption notices
are in) and forecast only the intervals after it. This module turns a predictor's quantile scenarios into the
:meth:`~lightning_parcae.planning.shape_optimizer.LiveputOptimizer.decide` call -- once, for both callers.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

from lightning_parcae.planning.costmodel import Shape
from lightning_parcae.planning.forecast import Predictor
from lightning_parcae.planning.shape_optimizer import Decision, LiveputOptimizer

__all__ = ["LEVELS", "decide_with_forecast", "paths_to_intervals"]

LEVELS: Tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
"""Quantile levels of the forecast's own errors; one scenario path each (equal paths merged)."""


def paths_to_intervals(start: int, path: Sequence[int]) -> List[Tuple[int, int, int]]:
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
    now: Tuple[int, int, int],
    *,
    remain_ms: float = 0.0,
    risk: float = 0.5,
    levels: Sequence[float] = LEVELS,
) -> Tuple[Decision, List[List[Tuple[int, int, int]]], Sequence[float]]:
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

    Returns:
        ``(decision, scenarios, weights)``: the decision and the futures it was scored against.
    """
    prev, n_in, n_out = now
    after = prev + n_in - n_out
    scenarios: List[List[Tuple[int, int, int]]] = [[]]
    weights: Sequence[float] = [1.0]
    if pred is not None and opt.look_ahead > 1:
        paths, weights = pred.scenarios(opt.look_ahead - 1, levels)
        scenarios = [paths_to_intervals(after, p) for p in paths]
    decision = opt.decide(prev, shape, now, scenarios, weights, remain_ms=remain_ms, risk=risk)
    return decision, scenarios, weights
