"""A seeded corpus of availability traces, in families, split into a development and a held-out set.

Problem: a policy or predictor tuned on one trace (the bundled p3) tells nothing about the next user's trace. On
p3 the count never drops below 10, so the paths a new user hits first -- an outage down to 0 and the recovery
after it, a count flapping around the model's smallest shape, a long slow decline -- were never exercised. The
evaluation must cover *families* of behaviour, at more than one interval length, and keep a part of the corpus
that no choice was tuned on.

Solution: :func:`generate` draws one trace of a named family from a seed, minute by minute, and bins its timed
changes into intervals of any length with the same builder as :func:`~lightning_parcae.signals.traces.load_trace` (so a
300-s trace of a family holds the arrivals and departures of five minutes in one interval, both directions
counted). :func:`corpus` returns the bundled p3 trace, its four replay segments and every generated family at
one interval length, for the ``"dev"`` seeds or the ``"heldout"`` seeds (disjoint seed ranges).

Families (a "level" is the count the cloud tends to hold; ``cap`` is the cluster's size, 16 or 32):

* ``outage``   -- calm at a level, then outages that take the count to 0 (within 1-3 minutes), last 10-60
  minutes, and recover in bulk arrivals.
* ``flapping`` -- a count that moves by 1-3 every few minutes around a centre chosen among 6, 8 and 12 (the
  smallest pipeline depths of the bundled models), so the job keeps crossing its smallest feasible shape.
* ``decline``  -- starts full and loses an instance every 4-20 minutes (occasionally gaining one) down to a
  few, then recovers.
* ``bursty``   -- a low base with bursts of many arrivals, each preempted again in chunks within half an hour.
* ``calm``     -- a level held for hours, with rare single-instance changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.signals.traces import BUNDLED_TRACES, Trace, bundled_trace_path, from_changes, load_trace

__all__ = ["FAMILIES", "SPLITS", "CorpusTrace", "generate", "corpus"]

SPLITS: Dict[str, Tuple[int, ...]] = {"dev": (0, 1), "heldout": (1000, 1001)}
"""Seeds of each split; a held-out seed is never used while developing."""


def _outage(rng: np.random.Generator, minutes: int, cap: int) -> List[int]:
    out: List[int] = []
    level = int(rng.integers(cap // 2, cap + 1))
    n = level
    while len(out) < minutes:
        calm = int(rng.integers(30, 120))
        for _ in range(calm):
            if rng.random() < 0.05:
                n = int(np.clip(n + rng.choice([-2, -1, 1, 2]), 1, cap))
            out.append(n)
        # the outage: the count falls to 0 within 1-3 minutes
        steps = int(rng.integers(1, 4))
        for k in range(steps):
            n = int(round(n * (steps - k - 1) / steps))
            out.append(n)
        out.extend([0] * int(rng.integers(10, 61)))
        level = int(rng.integers(cap // 2, cap + 1))
        n = 0
        while n < level:  # recovery in bulk arrivals
            n = min(level, n + int(rng.integers(3, 13)))
            out.append(n)
            if rng.random() < 0.5:
                out.append(n)
    return out[:minutes]


def _flapping(rng: np.random.Generator, minutes: int, cap: int) -> List[int]:
    centre = int(rng.choice([6, 8, 12]))
    n = centre
    out: List[int] = []
    while len(out) < minutes:
        out.extend([n] * int(rng.integers(1, 8)))
        n = int(np.clip(n + rng.choice([-3, -2, -1, 1, 2, 3]) + (1 if n < centre - 3 else -1 if n > centre + 3 else 0), 0, cap))
    return out[:minutes]


def _decline(rng: np.random.Generator, minutes: int, cap: int) -> List[int]:
    n = cap
    floor = int(rng.integers(2, 7))
    out: List[int] = []
    while len(out) < minutes:
        out.extend([n] * int(rng.integers(4, 21)))
        if n <= floor:
            n = min(cap, n + int(rng.integers(cap // 2, cap + 1)))  # the recovery after the decline
            floor = int(rng.integers(2, 7))
        elif rng.random() < 0.15:
            n = min(cap, n + 1)
        else:
            n -= int(rng.integers(1, 3))
        n = max(n, 0)
    return out[:minutes]


def _bursty(rng: np.random.Generator, minutes: int, cap: int) -> List[int]:
    base = int(rng.integers(4, 11))
    n = base
    out: List[int] = []
    while len(out) < minutes:
        out.extend([n] * int(rng.integers(10, 60)))
        n = min(cap, base + int(rng.integers(cap // 3, cap - base + 1)))  # a burst of arrivals
        while n > base and len(out) < minutes:
            out.extend([n] * int(rng.integers(1, 10)))
            n = max(base, n - int(rng.integers(1, 7)))  # preempted again in chunks
    return out[:minutes]


def _calm(rng: np.random.Generator, minutes: int, cap: int) -> List[int]:
    n = int(rng.integers(cap // 2, cap + 1))
    out: List[int] = []
    for _ in range(minutes):
        if rng.random() < 0.01:
            n = int(np.clip(n + rng.choice([-1, 1]), 1, cap))
        out.append(n)
    return out


FAMILIES: Dict[str, Callable[[np.random.Generator, int, int], List[int]]] = {
    "outage": _outage,
    "flapping": _flapping,
    "decline": _decline,
    "bursty": _bursty,
    "calm": _calm,
}
"""Generated family name -> ``(rng, minutes, cap) -> count per minute``."""


def generate(family: str, seed: int, *, interval_s: float = 60.0, hours: float = 6.0, cap: int = 32) -> Trace:
    """One seeded trace of a generated family.

    Args:
        family: A key of :data:`FAMILIES`.
        seed: Seed of the draw (the same seed gives the same trace at every interval length).
        interval_s: Interval length of the returned trace (the family is drawn per minute, then binned).
        hours: Length of the trace.
        cap: Largest instance count (the cluster's size).

    Returns:
        The trace; its ``source`` is ``"<family>/seed<seed>/cap<cap>"``.

    Raises:
        ConfigurationError: Unknown family, or a non-positive length, interval or cap.
    """
    if family not in FAMILIES:
        raise ConfigurationError(f"unknown trace family {family!r}; known: {', '.join(FAMILIES)}")
    if hours <= 0 or cap < 1 or interval_s <= 0:
        raise ConfigurationError(f"hours={hours}, cap={cap}, interval_s={interval_s}: all must be positive")
    minutes = int(round(hours * 60))
    rng = np.random.default_rng([seed, list(FAMILIES).index(family)])
    counts = FAMILIES[family](rng, minutes, cap)
    changes, prev = [], 0
    for m, c in enumerate(counts):
        if c != prev:
            changes.append((60.0 * m, max(c - prev, 0), max(prev - c, 0)))
        prev = c
    return from_changes(changes, 60.0 * minutes, float(interval_s), f"{family}/seed{seed}/cap{cap}")


@dataclass(frozen=True)
class CorpusTrace:
    """One trace of the corpus.

    Attributes:
        family: ``"p3"``, ``"p3-segments"`` or a generated family name.
        name: Unique name within the corpus.
        trace: The intervals.
    """

    family: str
    name: str
    trace: Trace


def corpus(
    split: str = "dev", *, interval_s: float = 60.0, hours: Optional[float] = None, seeds: Sequence[int] = ()
) -> List[CorpusTrace]:
    """The evaluation corpus at one interval length.

    Args:
        split: ``"dev"`` or ``"heldout"`` (which seeds of :data:`SPLITS`); the bundled p3 trace and its segments
            belong to ``"dev"`` (the project was developed on them) and are not repeated in ``"heldout"``.
        interval_s: Interval length (the bundled traces are re-binned to it).
        hours: Length of each generated trace; ``None``: 6 h at 60-s intervals (360 intervals), 18 h at longer
            ones (216 intervals of 300 s).
        seeds: Override of the split's seeds.

    Returns:
        The traces, bundled ones first, then each generated family at caps 32 and 16 for each seed.
    """
    if split not in SPLITS:
        raise ConfigurationError(f"unknown split {split!r}; known: {', '.join(SPLITS)}")
    if hours is None:
        hours = 6.0 if interval_s <= 60.0 else 18.0
    out: List[CorpusTrace] = []
    if split == "dev":
        for name in BUNDLED_TRACES:
            tr = load_trace(bundled_trace_path(name), interval_s=interval_s)
            out.append(CorpusTrace("p3" if name == "p3" else "p3-segments", name, tr))
    for family in FAMILIES:
        for i, seed in enumerate(seeds or SPLITS[split]):
            cap = 32 if i % 2 == 0 else 16
            tr = generate(family, seed, interval_s=interval_s, hours=hours, cap=cap)
            out.append(CorpusTrace(family, tr.source, tr))
    return out
