"""Where the time of a step goes: opt-in wall-clock timers for the parts of the live-reconfiguration protocol.

Problem: an elastic step costs more than a plain one (the step-boundary agreement, the two-phase commit through the
store, guarded waits, callbacks), and finding out which part costs what needs timers inside the runtime -- timers
that must cost nothing in a normal run.

Solution: with ``LIGHTNING_PARCAE_STEP_TIMING=1`` in a worker's environment (read by the training layer, which then
calls :func:`enable`; this module reads no environment), :func:`span` returns a context manager that adds its wall time to a per-process total under a name; otherwise it returns one shared no-op
object. :func:`summary` gives ``{name: {"n": calls, "total_s": s, "mean_ms": ms}}``;
:class:`~lightning_parcae.training.callbacks.ParcaeRunCallback` writes it as a ``step_timing`` event of every rank at
the end of training, which ``benchmarks/bench_elastic_overhead.py`` reads.
"""

from __future__ import annotations

import time
from typing import Any

__all__ = ["STEP_TIMING_ENV", "ON", "enable", "span", "add", "summary"]

STEP_TIMING_ENV = "LIGHTNING_PARCAE_STEP_TIMING"
"""Not ``PARCAE_*``: launchers drop inherited contract variables, and this debugging switch must reach the workers."""
ON = False
"""Whether the timers run in this process (see :func:`enable`)."""

_totals: dict[str, list[float]] = {}


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
