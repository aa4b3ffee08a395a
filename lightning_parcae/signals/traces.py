"""Spot-instance availability traces, read from several file formats into fixed-length intervals.

Problem: the planner decides once per interval (60 s in the paper) and needs, for every interval, how many
instances were there before it and how many arrived and left during it -- ``(prev_N, n_in, n_out)``. Traces come
in different shapes: a per-node event log (the artifact's ``p3trace.csv``), a running count per event
(``p3.csv``), the JSON-lines replay segments of the AWS experiment, and SkyPilot-style JSON with one count per fixed
gap. Each must give the *same* interval sequence for the same history, at any interval length, and a malformed file
must be reported with its name, the line and what was expected -- not with a numpy or json traceback.

Solution: every reader turns its file into a list of timed count changes (``+k`` / ``-k`` at time ``t``) and a
covered duration; one builder bins the changes into intervals ``floor(t / interval_s)`` and walks them from ``N = 0``.

Formats (see ``docs/traces_and_predictor.md`` for examples):

* ``events``   -- CSV ``t_ms,add|remove,node``; every row is one node arriving or leaving.
* ``counts``   -- CSV ``t_ms,count``; the instance count right after each event.
* ``segment``  -- JSON lines ``[t_ms, op, {"nodes": [...], "duration": ms, ...}]`` with ``op`` in
  ``add``/``remove``/``no-op``/``migration``; the first ``add`` lists the nodes present at the start.
* ``skypilot`` -- JSON ``{"metadata": {"gap_seconds": g}, "data": [count, ...]}``; ``data[i]`` is the count
  during ``[i*g, (i+1)*g)``.

A trace starts with zero instances, so the first interval of ``p3trace.csv`` is ``(0, 18, 0)``.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence, Union

import numpy as np

from lightning_parcae.errors import ConfigurationError, TraceFormatError

__all__ = [
    "usable_counts",
    "Interval",
    "Trace",
    "TRACE_FORMATS",
    "from_counts",
    "from_changes",
    "scale_counts",
    "scaled",
    "load_trace",
    "bundled_trace_path",
    "BUNDLED_TRACES",
]

TRACE_FORMATS = ("events", "counts", "segment", "skypilot")

_DATA_DIR = pathlib.Path(__file__).resolve().parent.parent / "data"
#: Bundled trace names accepted by :func:`bundled_trace_path`.
BUNDLED_TRACES = ("p3", "hh_55_65", "hl_15_25", "lh_80_90", "ll_10_11")

# Tolerance when binning times: 0.3 s intervals must put 0.6 s into bin 2 despite binary floating point.
_EPS = 1e-9


@dataclass(frozen=True)
class Interval:
    """One fixed-length interval of a trace.

    Attributes:
        index: 0-based position in the trace.
        start_s: Start time in seconds from the trace start.
        duration_s: Length of the interval in seconds.
        prev_n: Instances present before the interval's events.
        n_in: Instances added during the interval.
        n_out: Instances removed during the interval.
    """

    index: int
    start_s: float
    duration_s: float
    prev_n: int
    n_in: int
    n_out: int

    def __post_init__(self) -> None:
        for name in ("index", "prev_n", "n_in", "n_out"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
                raise ConfigurationError(f"Interval.{name} must be a non-negative integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        if self.n_out > self.prev_n + self.n_in:
            raise ConfigurationError(
                f"Interval {self.index}: removes {self.n_out} of only {self.prev_n} + {self.n_in} instances"
            )

    @property
    def n(self) -> int:
        """Instances present after the interval: ``prev_n + n_in - n_out``."""
        return self.prev_n + self.n_in - self.n_out


@dataclass(frozen=True)
class Trace:
    """A sequence of equal-length intervals, each continuing the count of the one before it.

    Attributes:
        intervals: The intervals, ``intervals[k].index == k``.
        interval_s: Interval length in seconds.
        source: File path or a description of where the trace came from.
        native_interval_s: The grid the file was recorded on: SkyPilot's ``gap_seconds``, or for timestamped
            formats the coarsest whole number of minutes all its times fall on (e.g. 300.0 for a trace recorded
            every 5 minutes); ``None`` when there is no clear grid. A trace binned at another ``interval_s``
            was resampled.
    """

    intervals: tuple[Interval, ...]
    interval_s: float
    source: str
    native_interval_s: Optional[float] = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "intervals", tuple(self.intervals))
        object.__setattr__(self, "interval_s", _check_interval(self.interval_s))
        for k, iv in enumerate(self.intervals):
            if iv.index != k:
                raise ConfigurationError(f"{self.source}: interval at position {k} has index {iv.index}")
            if k and iv.prev_n != self.intervals[k - 1].n:
                raise ConfigurationError(
                    f"{self.source}: interval {k} starts with {iv.prev_n} instances but interval {k - 1} "
                    f"ended with {self.intervals[k - 1].n}"
                )

    def __len__(self) -> int:
        return len(self.intervals)

    def __iter__(self) -> Iterator[Interval]:
        return iter(self.intervals)

    def __getitem__(self, k: int) -> Interval:
        if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
            raise TypeError(f"Trace indices must be integers (use Trace.slice for time ranges), got {k!r}")
        return self.intervals[int(k)]

    def counts(self) -> np.ndarray:
        """Instance count after each interval.

        Returns:
            Integer array of length ``len(self)``.
        """
        return np.fromiter((iv.n for iv in self.intervals), dtype=np.int64, count=len(self.intervals))

    @property
    def max_n(self) -> int:
        """Largest instance count seen, before or after any interval (0 for an empty trace)."""
        return max((max(iv.prev_n, iv.n) for iv in self.intervals), default=0)

    def slice(self, start_s: float, end_s: Optional[float] = None) -> "Trace":
        """Intervals whose start lies in ``[start_s, end_s)``, as a new trace.

        The result is re-indexed from 0 and its times are shifted so the first selected interval starts at 0 s;
        that interval keeps its ``prev_n`` (the count carried in from before the slice).

        Args:
            start_s: First start time to keep, in seconds.
            end_s: Start times at or after this are dropped; ``None`` keeps everything to the end.

        Returns:
            The selected intervals (possibly none).

        Raises:
            ConfigurationError: ``end_s`` lies before ``start_s``.
        """
        if end_s is not None and end_s < start_s:
            raise ConfigurationError(f"Trace.slice: end_s={end_s} lies before start_s={start_s}")
        chosen = [
            iv
            for iv in self.intervals
            if iv.start_s >= start_s - _EPS and (end_s is None or iv.start_s < end_s - _EPS)
        ]
        offset = chosen[0].start_s if chosen else 0.0
        out = tuple(
            Interval(k, iv.start_s - offset, iv.duration_s, iv.prev_n, iv.n_in, iv.n_out)
            for k, iv in enumerate(chosen)
        )
        end = "" if end_s is None else f"{end_s:g}"
        return Trace(out, self.interval_s, f"{self.source}[{start_s:g}s:{end}]", self.native_interval_s)

    def as_tuples(self) -> list[tuple[int, int, int]]:
        """The intervals as ``[(prev_n, n_in, n_out), ...]`` (the artifact's ``interval`` field)."""
        return [(iv.prev_n, iv.n_in, iv.n_out) for iv in self.intervals]


def _check_interval(interval_s: float) -> float:
    if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float, np.integer, np.floating)):
        raise ConfigurationError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
    value = float(interval_s)
    if not math.isfinite(value) or value <= 0:
        raise ConfigurationError(f"interval_s must be a positive number of seconds, got {interval_s!r}")
    return value


def from_changes(
    changes: Sequence[tuple[float, int, int]],
    end_s: float,
    interval_s: float,
    source: str,
) -> Trace:
    """Bin timed changes ``(t_s, added, removed)`` into intervals covering ``[0, end_s]`` (the trace starts at 0).

    The number of intervals is enough to hold the last change and to cover ``end_s``: an event at ``t`` goes to
    interval ``floor(t / interval_s)``; a covered duration ``end_s`` needs ``ceil(end_s / interval_s)`` intervals.
    Every loader of timed events builds its trace here (and :mod:`~lightning_parcae.signals.corpus` too).

    Args:
        changes: ``(t_s, added, removed)`` per change, ``t_s`` seconds from the start.
        end_s: Duration the trace must cover.
        interval_s: Interval length.
        source: Description stored in :attr:`Trace.source`.

    Returns:
        The trace; an interval holds both directions of the changes binned into it.
    """
    last_t = max((t for t, _, _ in changes), default=0.0)
    n_int = max(int(math.floor(last_t / interval_s + _EPS)) + 1, int(math.ceil(end_s / interval_s - _EPS)), 1)
    n_in = np.zeros(n_int, dtype=np.int64)
    n_out = np.zeros(n_int, dtype=np.int64)
    for t, added, removed in changes:
        k = int(math.floor(t / interval_s + _EPS))
        n_in[k] += added
        n_out[k] += removed
    intervals = []
    prev = 0
    for k in range(n_int):
        iv = Interval(k, k * interval_s, interval_s, prev, int(n_in[k]), int(n_out[k]))
        intervals.append(iv)
        prev = iv.n
    return Trace(tuple(intervals), interval_s, source)


def from_counts(
    counts: Sequence[int], interval_s: float = 60.0, start_n: int = 0, source: str = "counts"
) -> Trace:
    """Build a trace from the instance count after each interval.

    Args:
        counts: ``counts[k]`` is the number of instances after interval ``k``.
        interval_s: Interval length in seconds.
        start_n: Instances before the first interval.
        source: Description stored in :attr:`Trace.source`.

    Returns:
        A trace with ``trace.counts() == counts``; each interval holds only the net change (``n_in`` or ``n_out``).

    Raises:
        ConfigurationError: A count (or ``start_n``) is not a non-negative integer, or ``interval_s <= 0``.
    """
    interval_s = _check_interval(interval_s)
    values = [start_n, *list(counts)]
    for i, c in enumerate(values):
        if isinstance(c, bool) or not isinstance(c, (int, np.integer)) or c < 0:
            where = "start_n" if i == 0 else f"counts[{i - 1}]"
            raise ConfigurationError(f"{where} must be a non-negative integer, got {c!r}")
    intervals = []
    for k in range(1, len(values)):
        d = int(values[k]) - int(values[k - 1])
        intervals.append(Interval(k - 1, (k - 1) * interval_s, interval_s, int(values[k - 1]), max(d, 0), max(-d, 0)))
    return Trace(tuple(intervals), interval_s, source)


def scale_counts(counts: Sequence[int], peak: int, cap: int) -> list[int]:
    """Map trace counts to instance counts: proportional, so that ``peak`` becomes ``cap``; 0 stays 0.

    Args:
        counts: Instances in each trace interval.
        peak: The trace's largest count.
        cap: Instances the largest count maps to.

    Returns:
        One count per interval, each in ``[0, cap]``; a non-zero count maps to at least 1.
    """
    if peak <= 0:
        return [0 for _ in counts]
    return [0 if c <= 0 else max(1, min(cap, int(round(c * cap / peak)))) for c in counts]


def scaled(trace: Trace, cap: int) -> Trace:
    """``trace`` with its counts scaled so that its peak becomes ``cap`` (as ``parcae run --max-instances`` replays it).

    Each interval keeps only the net change of the scaled counts (an interval that gained and lost instances
    becomes one net change).

    Raises:
        ConfigurationError: ``cap < 1``.
    """
    if cap < 1:
        raise ConfigurationError(f"cap={cap}: scale to at least 1 instance")
    counts = scale_counts([int(c) for c in trace.counts()], trace.max_n, cap)
    start = scale_counts([trace[0].prev_n], trace.max_n, cap)[0] if len(trace) else 0
    return from_counts(counts, interval_s=trace.interval_s, start_n=start, source=f"{trace.source} (peak scaled to {cap})")


def usable_counts(counts: Sequence[int], join_delay_intervals: int) -> list[int]:
    """The instances a job can *use* in each interval when a new instance needs time before it is useful.

    A departure is immediate; an arrival becomes usable ``join_delay_intervals`` intervals later (process start,
    imports, the heartbeat the leader sees at a step boundary, admission -- about 4.4 s for ``parcae run``'s joiners,
    three 1.5 s intervals of a 40x replay). An instance that arrives and leaves within the delay is never used. Computed as
    the minimum count over the last ``join_delay_intervals + 1`` intervals; the first interval's instances start
    together, so the job's own start-up is not delayed here.

    Args:
        counts: Instances present after each interval.
        join_delay_intervals: Whole intervals an arrival waits (0: usable at once, as the artifact assumes).

    Returns:
        One usable count per interval, each ``<=`` the present count.

    Raises:
        ConfigurationError: ``join_delay_intervals < 0``.
    """
    k = int(join_delay_intervals)
    if k < 0:
        raise ConfigurationError(f"join_delay_intervals={join_delay_intervals}: give 0 or more intervals")
    c = [int(x) for x in counts]
    return [min(c[max(0, i - k): i + 1]) for i in range(len(c))]


def bundled_trace_path(name: str = "p3") -> pathlib.Path:
    """Path of a trace shipped with the package.

    Args:
        name: ``"p3"`` (the artifact's ``p3trace.csv``, 683 minutes) or one of the 1-hour replay segments
            ``"hh_55_65"``, ``"hl_15_25"``, ``"lh_80_90"``, ``"ll_10_11"``.

    Returns:
        The file path inside the installed package.

    Raises:
        ConfigurationError: Unknown name (the message lists the known ones).
    """
    if name == "p3":
        return _DATA_DIR / "p3trace.csv"
    if name in BUNDLED_TRACES:
        return _DATA_DIR / "segments" / f"trace_{name}.txt"
    raise ConfigurationError(f"unknown bundled trace {name!r}; known: {', '.join(BUNDLED_TRACES)}")


# ----------------------------------------------------------------------------------------------------------------
# Readers


def _fail(path: str, line: Optional[int], what: str) -> TraceFormatError:
    where = f"{path}, line {line}" if line is not None else path
    return TraceFormatError(f"{where}: {what}")


def _data_lines(text: str) -> list[tuple[int, str]]:
    """Non-blank, non-comment lines with their 1-based line numbers."""
    out = []
    for i, raw in enumerate(text.splitlines(), start=1):
        s = raw.strip()
        if s and not s.startswith("#"):
            out.append((i, s))
    return out


def _number(path: str, line: int, field: str, what: str) -> float:
    try:
        value = float(field)
    except ValueError:
        raise _fail(path, line, f"expected {what}, got {field!r}") from None
    if not math.isfinite(value):
        raise _fail(path, line, f"expected {what}, got {field!r}")
    return value


def _time_s(path: str, line: int, field: Union[str, float, int], last_s: float) -> float:
    if isinstance(field, str):
        t_ms = _number(path, line, field, "a timestamp in ms (a non-negative number)")
    elif isinstance(field, (int, float)) and not isinstance(field, bool) and math.isfinite(field):
        t_ms = float(field)
    else:
        raise _fail(path, line, f"expected a timestamp in ms (a non-negative number), got {field!r}")
    if t_ms < 0:
        raise _fail(path, line, f"expected a non-negative timestamp in ms, got {field!r}")
    t_s = t_ms / 1000.0
    if t_s < last_s:
        raise _fail(path, line, f"timestamps must not decrease: {field!r} ms comes after {last_s * 1000:g} ms")
    return t_s


def _count(path: str, line: int, field: Union[str, float, int], where: str = "count") -> int:
    if isinstance(field, str):
        value = _number(path, line, field, f"a non-negative integer {where}")
    elif isinstance(field, (int, float)) and not isinstance(field, bool) and math.isfinite(field):
        value = float(field)
    else:
        raise _fail(path, line, f"expected a non-negative integer {where}, got {field!r}")
    if value < 0 or value != int(value):
        raise _fail(path, line, f"expected a non-negative integer {where}, got {field!r}")
    return int(value)


def _strip_header(path: str, lines: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Drop a CSV header: a first line whose first field is not a number."""
    if lines:
        first = lines[0][1].split(",")[0].strip()
        try:
            float(first)
        except ValueError:
            return lines[1:]
    return lines


def _timed_rows(path: str, text: str, what: str, layout: str) -> Iterator[tuple[int, float, list[str]]]:
    """The data rows of a CSV trace as (line, time in s, fields), checked: at least one row, ``layout``'s number
    of fields each, times not going backwards (``what`` names the rows in the error for an empty file)."""
    lines = _strip_header(path, _data_lines(text))
    if not lines:
        raise _fail(path, None, f"no {what} (expected rows {layout!r})")
    n = len(layout.split(","))
    last = 0.0
    for line, s in lines:
        fields = [f.strip() for f in s.split(",")]
        if len(fields) != n:
            raise _fail(path, line, f"expected {n} fields {layout!r}, got {len(fields)}: {s!r}")
        last = _time_s(path, line, fields[0], last)
        yield line, last, fields


def _read_events(path: str, text: str) -> tuple[list[tuple[float, int, int]], float]:
    present: set[str] = set()
    changes = []
    last = 0.0
    for line, t, fields in _timed_rows(path, text, "events", "t_ms,add|remove,node"):
        last = t
        op, node = fields[1], fields[2]
        if not node:
            raise _fail(path, line, "expected a node name in the third field, got an empty one")
        if op == "add":
            if node in present:
                raise _fail(path, line, f"node {node!r} is added again while still present")
            present.add(node)
            changes.append((t, 1, 0))
        elif op == "remove":
            if node not in present:
                raise _fail(
                    path, line, f"node {node!r} is removed but is not present (never added, or removed already)"
                )
            present.remove(node)
            changes.append((t, 0, 1))
        else:
            raise _fail(path, line, f"expected event 'add' or 'remove', got {op!r}")
    return changes, last


def _read_counts(path: str, text: str) -> tuple[list[tuple[float, int, int]], float]:
    changes = []
    prev = 0
    last = 0.0
    for line, t, fields in _timed_rows(path, text, "rows", "t_ms,count"):
        last = t
        n = _count(path, line, fields[1], "instance count")
        d = n - prev
        changes.append((t, max(d, 0), max(-d, 0)))
        prev = n
    return changes, last


_SEGMENT_OPS = ("add", "remove", "no-op", "migration")


def _read_segment(path: str, text: str) -> tuple[list[tuple[float, int, int]], float]:
    lines = _data_lines(text)
    if not lines:
        raise _fail(path, None, "no lines (expected JSON lines '[t_ms, op, {\"nodes\": [...]}]')")
    present: set[str] = set()
    changes = []
    last = 0.0
    end = 0.0
    for line, s in lines:
        try:
            rec = json.loads(s)
        except json.JSONDecodeError as e:
            raise _fail(path, line, f"expected a JSON array [t_ms, op, {{...}}]: {e.msg} at column {e.colno}") from None
        if not isinstance(rec, list) or len(rec) != 3 or not isinstance(rec[2], dict):
            raise _fail(path, line, f"expected a JSON array [t_ms, op, {{\"nodes\": [...]}}], got {s[:80]!r}")
        t_field, op, info = rec
        t = _time_s(path, line, t_field, last)
        last = t
        if op not in _SEGMENT_OPS:
            raise _fail(path, line, f"expected op in {', '.join(_SEGMENT_OPS)}, got {op!r}")
        duration = info.get("duration")
        if duration is not None:
            if isinstance(duration, bool) or not isinstance(duration, (int, float)) or not duration >= 0:
                raise _fail(path, line, f"expected 'duration' to be a non-negative number of ms, got {duration!r}")
            end = max(end, t + duration / 1000.0)
        if op in ("no-op", "migration"):
            continue
        nodes = info.get("nodes")
        if not isinstance(nodes, list):
            raise _fail(path, line, f"expected a list under 'nodes' for op {op!r}, got {nodes!r}")
        names = [str(x) for x in nodes]
        if op == "add":
            for name in names:
                if name in present:
                    raise _fail(path, line, f"node {name!r} is added again while still present")
                present.add(name)
            changes.append((t, len(names), 0))
        else:
            for name in names:
                if name not in present:
                    raise _fail(path, line, f"node {name!r} is removed but is not present")
                present.remove(name)
            changes.append((t, 0, len(names)))
    return changes, end


def _read_skypilot(path: str, text: str) -> tuple[list[tuple[float, int, int]], float]:
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise _fail(path, e.lineno, f"expected a JSON object {{\"metadata\": ..., \"data\": [...]}}: {e.msg}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("data"), list) or not isinstance(doc.get("metadata"), dict):
        raise _fail(path, 1, "expected a JSON object with 'metadata' (an object) and 'data' (a list of counts)")
    gap = doc["metadata"].get("gap_seconds")
    if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not math.isfinite(gap) or gap <= 0:
        raise _fail(path, None, f"expected metadata.gap_seconds to be a positive number, got {gap!r}")
    data = doc["data"]
    if not data:
        raise _fail(path, None, "expected at least one count in 'data', got an empty list")
    changes = []
    prev = 0
    for i, value in enumerate(data):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < 0 or value != int(value):
            raise _fail(path, None, f"data[{i}]: expected a non-negative integer count, got {value!r}")
        d = int(value) - prev
        changes.append((i * float(gap), max(d, 0), max(-d, 0)))
        prev = int(value)
    return changes, len(data) * float(gap)


_READERS = {
    "events": _read_events,
    "counts": _read_counts,
    "segment": _read_segment,
    "skypilot": _read_skypilot,
}


def _detect(path: str, text: str) -> str:
    lines = _data_lines(text)
    if not lines:
        raise _fail(path, None, "the file is empty (expected a trace in one of: " + ", ".join(TRACE_FORMATS) + ")")
    first_line, first = lines[0]
    if first.startswith("{"):
        return "skypilot"
    if first.startswith("["):
        return "segment"
    csv_lines = _strip_header(path, lines)
    if csv_lines:
        line, s = csv_lines[0]
        fields = [f.strip() for f in s.split(",")]
        if len(fields) == 3:
            return "events"
        if len(fields) == 2:
            return "counts"
        first_line, first = line, s
    raise _fail(
        path,
        first_line,
        f"cannot tell the trace format from {first[:60]!r}; expected 't_ms,add|remove,node' (events), "
        "'t_ms,count' (counts), a JSON line '[t_ms, op, {...}]' (segment) or a JSON object with "
        "'metadata' and 'data' (skypilot); pass fmt= to force one",
    )


def load_trace(path: Union[str, os.PathLike], *, interval_s: float = 60.0, fmt: Optional[str] = None) -> Trace:
    """Read a trace file into fixed-length intervals.

    Args:
        path: The trace file.
        interval_s: Interval length in seconds (any positive value; 120 merges pairs of 60-s intervals).
        fmt: One of :data:`TRACE_FORMATS`; ``None`` detects it from the content.

    Returns:
        The trace, starting from zero instances; ``source`` is the path.

    Raises:
        ConfigurationError: ``interval_s <= 0`` or an unknown ``fmt``.
        TraceFormatError: The file is missing, unreadable, empty, of no known format, or malformed (the message
            names the file, the line and what was expected).
    """
    interval_s = _check_interval(interval_s)
    if fmt is not None and fmt not in TRACE_FORMATS:
        raise ConfigurationError(f"unknown trace format {fmt!r}; known: {', '.join(TRACE_FORMATS)}")
    name = os.fspath(path)
    try:
        text = pathlib.Path(name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise TraceFormatError(f"{name}: cannot read the trace file ({e})") from e
    if fmt is None:
        fmt = _detect(name, text)
    elif not _data_lines(text):
        raise _fail(name, None, f"the file is empty (expected a {fmt} trace)")
    changes, end_s = _READERS[fmt](name, text)
    trace = from_changes(changes, end_s, interval_s, name)
    if fmt == "skypilot":
        native: Optional[float] = float(json.loads(text)["metadata"]["gap_seconds"])
    else:
        native = _native_interval(changes, end_s)
    return Trace(trace.intervals, trace.interval_s, name, native)


def _native_interval(changes: Sequence[tuple[float, int, int]], end_s: float) -> Optional[float]:
    """The grid a timestamped trace was recorded on, if it has a clear one.

    That is the coarsest whole number of minutes that every change time and the end are multiples of, given at
    least three distinct such times (fewer prove nothing); ``None`` otherwise -- an event log with times at
    arbitrary seconds has no grid of its own.
    """
    times = {int(round(t * 1000.0)) for t in [*(t for t, _, _ in changes), end_s]}
    if len(times) < 3:
        return None
    grid = 0
    for t in times:
        grid = math.gcd(grid, t)
    return grid / 1000.0 if grid and grid % 60_000 == 0 else None
