"""Where the time of a step goes: opt-in wall-clock timers for the parts of the live-reconfiguration protocol.

Problem: an elastic step costs more than a plain one (the step-boundary agreement, the two-phase commit through the
store, guarded waits, callbacks), and finding out which part costs what needs timers inside the runtime -- timers
that must cost nothing in a normal run.

Solution: with ``LIGHTNING_PARCAE_STEP_TIMING=1`` in a worker's environment (read by the training layer, which then
calls :func:`enable`; this module reads no environment), :func:`span` returns a context manager that adds its wall time to a per-process total under a name; otherwise it returns one shared no-op
object. :func:`summary` gives ``{name: {"n": calls, "total_s": s, "mean_ms": ms}}``;
:class:`~lightning_parcae.training.callbacks.ParcaeRunCallback` writes it as a ``step_timing`` event of every rank at
the end of training, which ``benchmarks/bench_elastic_overhead.py`` reads.

A total cannot say why a collective waited: for the slowest of 32 members to arrive, or for the operation itself.
:func:`interval` records, per call, when this process entered and left a named collective under a key every
participant computes alike (the generation and step, say), on ``time.monotonic()`` -- one clock for all processes
of a Linux host -- so that ``benchmarks/bench_scale.py`` can split a wait into the arrival of the last participant
and what the collective took after it. :func:`intervals` gives them (at most :data:`MAX_INTERVALS` per process).
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["STEP_TIMING_ENV", "ON", "MAX_INTERVALS", "enable", "span", "add", "summary", "interval", "intervals"]

STEP_TIMING_ENV = "LIGHTNING_PARCAE_STEP_TIMING"
"""Not ``PARCAE_*``: launchers drop inherited contract variables, and this debugging switch must reach the workers."""
ON = False
"""Whether the timers run in this process (see :func:`enable`)."""

MAX_INTERVALS = 4096
"""The most :func:`interval` records one process keeps (later ones are dropped, not the early ones)."""

_totals: dict[str, list[float]] = {}
_intervals: list[tuple[str, str, float, float]] = []


class _Span:
    __slots__ = ("name", "t0")

    def __init__(self, name: str) -> None:
        self.name = name
        self.t0 = 0.0

    def __enter__(self) -> "_Span":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        acc = _totals.setdefault(self.name, [0, 0.0])
        acc[0] += 1
        acc[1] += time.perf_counter() - self.t0


class _Null:
    __slots__ = ()

    def __enter__(self) -> "_Null":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL = _Null()


class _Interval:
    __slots__ = ("name", "key", "t0")

    def __init__(self, name: str, key: str) -> None:
        self.name = name
        self.key = key
        self.t0 = 0.0

    def __enter__(self) -> "_Interval":
        self.t0 = time.monotonic()
        return self

    def __exit__(self, *exc: Any) -> None:
        if len(_intervals) < MAX_INTERVALS:
            _intervals.append((self.name, self.key, self.t0, time.monotonic()))


def enable(on: bool = True) -> None:
    """Turn the timers of this process on (or off)."""
    global ON
    ON = bool(on)


def span(name: str) -> Any:
    """A context manager adding its wall time to ``name``'s total (a shared no-op unless timing is on)."""
    return _Span(name) if ON else _NULL


def add(name: str, seconds: float) -> None:
    """Add ``seconds`` measured elsewhere to ``name``'s total (callers check :data:`ON` first)."""
    acc = _totals.setdefault(name, [0, 0.0])
    acc[0] += 1
    acc[1] += seconds


def summary() -> dict[str, dict[str, float]]:
    """Calls, total seconds and mean milliseconds per timed part, in this process so far."""
    return {k: {"n": int(n), "total_s": round(t, 4), "mean_ms": round(1000 * t / n, 3) if n else 0.0}
            for k, (n, t) in sorted(_totals.items())}


def interval(name: str, key: str) -> Any:
    """A context manager recording when this process entered and left ``name`` under ``key`` (a no-op unless timing
    is on).

    Args:
        name: What is timed (e.g. ``"step agreement"``).
        key: The same string in every process taking part in the same call (e.g. ``"g3/s120"``), so that the
            calls of different processes can be matched.
    """
    return _Interval(name, key) if ON else _NULL


def intervals() -> list[list[Any]]:
    """``[name, key, entered, left]`` of each :func:`interval` so far (``time.monotonic()`` seconds, 6 decimals)."""
    return [[n, k, round(t0, 6), round(t1, 6)] for n, k, t0, t1 in _intervals]
