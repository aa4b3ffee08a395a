"""Tests of lightning_parcae.signals.traces: every format, resampling, slicing and the errors for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from lightning_parcae.errors import ConfigurationError, TraceFormatError
from lightning_parcae.signals.traces import (
    TRACE_FORMATS,
    Interval,
    Trace,
    bundled_trace_path,
    from_changes,
    from_counts,
    load_trace,
)

REFERENCE = Path("/work/shared/reference/traces")
SEGMENT_START = {"hh_55_65": 330, "hl_15_25": 90, "lh_80_90": 480, "ll_10_11": 600}
# From the reference README: start N, mean N, add events / nodes, remove events / nodes (first line excluded).
SEGMENT_TABLE = {
    "hh_55_65": (32, 27.5, 7, 16, 9, 19),
    "hl_15_25": (27, 29.6, 4, 7, 6, 11),
    "lh_80_90": (18, 16.8, 12, 17, 8, 18),
    "ll_10_11": (18, 14.6, 0, 0, 3, 4),
}


@pytest.fixture(scope="module")
def p3() -> Trace:
    return load_trace(bundled_trace_path("p3"))


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------------------------------- events


def test_load_trace_matches_artifact_summary_if_p3_events_at_60s(p3: Trace) -> None:
    active = [iv for iv in p3 if iv.n_in or iv.n_out]
    assert len(p3) == 683
    assert len(active) == 163
    assert sum(1 for iv in active if iv.n_in and not iv.n_out) == 84
    assert sum(1 for iv in active if iv.n_out and not iv.n_in) == 79
    assert p3.max_n == 32
    assert p3.counts()[-1] == 10
    assert p3.as_tuples()[0] == (0, 18, 0)
    assert p3.interval_s == 60.0 and p3[5].start_s == 300.0 and p3[5].duration_s == 60.0


@pytest.mark.skipif(not REFERENCE.exists(), reason="/work/shared reference data absent")
def test_load_trace_equals_liveput_res_intervals_if_p3_events(p3: Trace) -> None:
    ref = json.loads((REFERENCE / "liveput_res" / "gpt-1.5b_p3_gbs128_mbs1.json").read_text())
    assert p3.as_tuples() == [tuple(e["interval"]) for e in ref]


def test_load_trace_bins_by_floor_and_pads_if_events_are_sparse(tmp_path: Path) -> None:
    path = _write(tmp_path, "e.csv", "0,add,a\n0,add,b\n59999,add,c\n180000,remove,a\n185000,add,a\n")
    trace = load_trace(path)
    assert trace.as_tuples() == [(0, 3, 0), (3, 0, 0), (3, 0, 0), (3, 1, 1)]
    assert trace.counts().tolist() == [3, 3, 3, 3]
    assert trace.source == str(path)


def test_load_trace_skips_header_if_events_csv_has_one(tmp_path: Path) -> None:
    path = _write(tmp_path, "e.csv", "timestamp_ms,event,node\n0,add,a\n60000,remove,a\n")
    assert load_trace(path).as_tuples() == [(0, 1, 0), (1, 0, 1)]


# ---------------------------------------------------------------------------------------------------- counts


@pytest.mark.skipif(not REFERENCE.exists(), reason="/work/shared reference data absent")
def test_load_trace_equals_events_reading_if_p3_counts_csv(p3: Trace) -> None:
    counts = load_trace(REFERENCE / "p3.csv")
    assert counts.as_tuples() == p3.as_tuples()


def test_load_trace_sums_ups_and_downs_if_counts_move_both_ways_in_one_interval(tmp_path: Path) -> None:
    path = _write(tmp_path, "c.csv", "0,4\n10000,6\n20000,3\n130000,5\n")
    assert load_trace(path).as_tuples() == [(0, 6, 3), (3, 0, 0), (3, 2, 0)]


# ---------------------------------------------------------------------------------------------------- segment


@pytest.mark.parametrize("name", sorted(SEGMENT_TABLE))
def test_load_trace_matches_readme_table_if_segment(name: str, p3: Trace) -> None:
    trace = load_trace(bundled_trace_path(name))
    start_n, mean_n, add_ev, add_nodes, rm_ev, rm_nodes = SEGMENT_TABLE[name]
    rest = list(trace)[1:]
    assert len(trace) == 60
    assert trace.as_tuples()[0] == (0, start_n, 0)
    assert round(float(trace.counts().mean()), 1) == mean_n
    assert (sum(1 for iv in rest if iv.n_in), sum(iv.n_in for iv in rest)) == (add_ev, add_nodes)
    assert (sum(1 for iv in trace if iv.n_out), sum(iv.n_out for iv in trace)) == (rm_ev, rm_nodes)
    k = SEGMENT_START[name]
    assert trace.counts().tolist() == p3.counts()[k : k + 60].tolist()


def test_load_trace_ignores_no_ops_and_migrations_if_segment_has_them(tmp_path: Path) -> None:
    lines = [
        [0, "add", {"nodes": ["n0", "n1", "n2"], "duration": 60000}],
        [60000, "migration", {"nodes": [], "duration": 60000}],
        [120000, "remove", {"nodes": ["n1"], "duration": 60000}],
        [180000, "no-op", {"nodes": [], "duration": 60000}],
    ]
    path = _write(tmp_path, "s.txt", "\n".join(json.dumps(x) for x in lines) + "\n")
    assert load_trace(path).as_tuples() == [(0, 3, 0), (3, 0, 0), (3, 0, 1), (2, 0, 0)]


# ---------------------------------------------------------------------------------------------------- skypilot


def test_load_trace_starts_from_zero_if_skypilot(tmp_path: Path) -> None:
    path = _write(tmp_path, "s.json", json.dumps({"metadata": {"gap_seconds": 60}, "data": [4, 4, 2, 5]}))
    assert load_trace(path).as_tuples() == [(0, 4, 0), (4, 0, 0), (4, 0, 2), (2, 3, 0)]


def test_load_trace_samples_and_holds_if_skypilot_gap_differs_from_interval(tmp_path: Path) -> None:
    doc = {"metadata": {"gap_seconds": 30}, "data": [4, 6, 3, 3, 5]}
    path = _write(tmp_path, "s.json", json.dumps(doc, indent=2))
    # 60-s intervals: [0,60) holds samples 4,6 ; [60,120) 3,3 ; [120,180) 5 (its gap ends at 150 s).
    assert load_trace(path).as_tuples() == [(0, 6, 0), (6, 0, 3), (3, 2, 0)]
    # 20-s intervals: each 30-s sample holds over 1.5 intervals; 150 s of data need ceil(150/20) = 8 intervals.
    fine = load_trace(path, interval_s=20)
    assert fine.counts().tolist() == [4, 6, 6, 3, 3, 3, 5, 5]


# ---------------------------------------------------------------------------------------------------- resampling


@pytest.mark.parametrize("interval_s", [120.0, 180.0, 90.0, 7.5])
def test_load_trace_keeps_end_counts_if_resampled(interval_s: float, p3: Trace) -> None:
    coarse = load_trace(bundled_trace_path("p3"), interval_s=interval_s)
    fine = p3.counts()
    # p3 events sit at whole minutes, so at the end e of a coarse interval the count is the one after 60-s
    # interval ceil(e / 60) - 1 (the last one starting before e), or the final count past the trace end.
    last = [min(int(np.ceil((k + 1) * interval_s / 60)) - 1, len(fine) - 1) for k in range(len(coarse))]
    assert len(coarse) == int(np.floor(682 * 60 / interval_s)) + 1
    assert coarse.counts().tolist() == fine[last].tolist()
    assert sum(iv.n_in for iv in coarse) == sum(iv.n_in for iv in p3)
    assert sum(iv.n_out for iv in coarse) == sum(iv.n_out for iv in p3)


def test_load_trace_merges_pairs_if_interval_is_120s_for_every_format(tmp_path: Path) -> None:
    counts = [3, 3, 5, 2, 2, 4]
    events, count_rows, segment = [], [], []
    prev, node, alive = 0, 0, []
    for k, c in enumerate(counts):
        t = k * 60000
        added, removed = [], []
        while len(alive) < c:
            alive.append(f"n{node}")
            added.append(f"n{node}")
            node += 1
        while len(alive) > c:
            removed.append(alive.pop())
        events += [f"{t},add,{x}" for x in added] + [f"{t},remove,{x}" for x in removed]
        if c != prev:
            count_rows.append(f"{t},{c}")
        op = "add" if added else "remove" if removed else "no-op"
        segment.append(json.dumps([t, op, {"nodes": added or removed, "duration": 60000}]))
        prev = c
    files = {
        "events": _write(tmp_path, "e.csv", "\n".join(events)),
        "counts": _write(tmp_path, "c.csv", "\n".join(count_rows)),
        "segment": _write(tmp_path, "s.txt", "\n".join(segment)),
        "skypilot": _write(tmp_path, "k.json", json.dumps({"metadata": {"gap_seconds": 60}, "data": counts})),
    }
    for fmt, path in files.items():
        assert load_trace(path).counts().tolist() == counts, fmt
        assert load_trace(path, fmt=fmt, interval_s=120).as_tuples() == [(0, 3, 0), (3, 2, 3), (2, 2, 0)], fmt


# ---------------------------------------------------------------------------------------------------- slicing


def test_slice_reindexes_and_keeps_prev_n_if_cut_mid_trace(p3: Trace) -> None:
    part = p3.slice(330 * 60.0, 390 * 60.0)
    assert len(part) == 60
    assert part[0].index == 0 and part[0].start_s == 0.0 and part[59].start_s == 59 * 60.0
    assert part[0].prev_n == p3[330].prev_n
    assert part.as_tuples() == p3.as_tuples()[330:390]
    assert len(p3.slice(682 * 60.0)) == 1
    assert len(p3.slice(10 * 60.0 + 1, 12 * 60.0)) == 1  # only interval 11 starts in [601 s, 720 s)


def test_slice_raises_if_end_before_start(p3: Trace) -> None:
    with pytest.raises(ConfigurationError, match="before"):
        p3.slice(100.0, 50.0)


# ---------------------------------------------------------------------------------------------------- small API


def test_from_counts_round_trips_if_counts_given() -> None:
    trace = from_counts([3, 5, 5, 1], interval_s=30.0, start_n=2)
    assert trace.as_tuples() == [(2, 1, 0), (3, 2, 0), (5, 0, 0), (5, 0, 4)]
    assert trace.counts().dtype.kind == "i" and trace.counts().tolist() == [3, 5, 5, 1]
    assert trace.max_n == 5 and trace[-1].n == 1 and trace[1].start_s == 30.0
    assert [iv.index for iv in trace] == [0, 1, 2, 3]


def test_from_counts_raises_if_count_negative() -> None:
    with pytest.raises(ConfigurationError, match=r"counts\[1\]"):
        from_counts([3, -1])


def test_trace_raises_if_intervals_do_not_chain() -> None:
    with pytest.raises(ConfigurationError, match="ended with"):
        Trace((Interval(0, 0.0, 60.0, 0, 2, 0), Interval(1, 60.0, 60.0, 3, 0, 0)), 60.0, "x")


def test_getitem_raises_if_index_not_int(p3: Trace) -> None:
    with pytest.raises(TypeError):
        p3[1.0]  # type: ignore[index]


def test_bundled_trace_path_lists_names_if_unknown() -> None:
    assert bundled_trace_path().name == "p3trace.csv"
    assert bundled_trace_path("ll_10_11").name == "trace_ll_10_11.txt"
    with pytest.raises(ConfigurationError, match="hh_55_65"):
        bundled_trace_path("p4")


# ---------------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("text", "line", "expect"),
    [
        ("0,add,a\n60000,add\n", 2, "3 fields"),
        ("0,add,a\nabc,add,b\n", 2, "timestamp"),
        ("0,add,a\n60000,join,b\n", 2, "'add' or 'remove'"),
        ("0,add,a\n60000,remove,b\n", 2, "not present"),
        ("0,add,a\n0,add,a\n", 2, "added again"),
        ("60000,add,a\n0,add,b\n", 2, "must not decrease"),
        ("-5,add,a\n", 1, "non-negative"),
    ],
)
def test_load_trace_names_file_and_line_if_events_malformed(tmp_path: Path, text: str, line: int, expect: str) -> None:
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceFormatError, match=expect) as info:
        load_trace(path)
    assert f"{path}, line {line}:" in str(info.value)


@pytest.mark.parametrize(
    ("text", "line", "expect"),
    [
        ("0,3\n60000,-1\n", 2, "non-negative integer"),
        ("0,3\n60000,2.5\n", 2, "integer"),
        ("0,3\n0,1,2\n", 2, "2 fields"),
    ],
)
def test_load_trace_names_line_if_counts_malformed(tmp_path: Path, text: str, line: int, expect: str) -> None:
    path = _write(tmp_path, "bad.csv", text)
    with pytest.raises(TraceFormatError, match=expect) as info:
        load_trace(path)
    assert f"line {line}:" in str(info.value)


@pytest.mark.parametrize(
    ("lines", "line", "expect"),
    [
        (['[0, "add", {"nodes": ["a"]}]', '[60000, "kill", {"nodes": ["a"]}]'], 2, "expected op in"),
        (['[0, "add", {"nodes": ["a"]}]', '[60000, "remove", {"nodes": ["b"]}]'], 2, "not present"),
        (['[0, "add", {"nodes": ["a"]}]', '[60000, "add", {"nodes": ["b"]'], 2, "JSON array"),
        (['[0, "add", {"nodes": ["a"]}]', '[60000, "add"]'], 2, "JSON array"),
        (['[0, "add", {"nodes": "a"}]'], 1, "list under 'nodes'"),
    ],
)
def test_load_trace_names_line_if_segment_malformed(tmp_path: Path, lines: list[str], line: int, expect: str) -> None:
    path = _write(tmp_path, "bad.txt", "\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError, match=expect) as info:
        load_trace(path)
    assert f"{path}, line {line}:" in str(info.value)


@pytest.mark.parametrize(
    ("doc", "expect"),
    [
        ('{"metadata": {"gap_seconds": 60}, "data": [3, -1]}', r"data\[1\]"),
        ('{"metadata": {"gap_seconds": 0}, "data": [3]}', "gap_seconds"),
        ('{"metadata": {"gap_seconds": 60}, "data": []}', "at least one"),
        ('{"metadata": {"gap_seconds": 60}}', "'data'"),
        ('{"metadata": {"gap_seconds": 60},\n "data": [3,, 4]}', "line 2"),
    ],
)
def test_load_trace_says_what_is_wrong_if_skypilot_malformed(tmp_path: Path, doc: str, expect: str) -> None:
    path = _write(tmp_path, "bad.json", doc)
    with pytest.raises(TraceFormatError, match=expect) as info:
        load_trace(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize("text", ["", "\n  \n", "# only a comment\n"])
def test_load_trace_says_empty_if_file_has_no_data(tmp_path: Path, text: str) -> None:
    path = _write(tmp_path, "empty.csv", text)
    with pytest.raises(TraceFormatError, match="empty"):
        load_trace(path)
    with pytest.raises(TraceFormatError, match="empty"):
        load_trace(path, fmt="events")


def test_load_trace_lists_formats_if_content_undetectable(tmp_path: Path) -> None:
    path = _write(tmp_path, "odd.txt", "1 2 3 4\n")
    with pytest.raises(TraceFormatError, match=r"line 1: cannot tell the trace format.*skypilot"):
        load_trace(path)


def test_load_trace_raises_trace_error_if_file_missing(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read"):
        load_trace(tmp_path / "nope.csv")


def test_load_trace_lists_formats_if_fmt_unknown(tmp_path: Path) -> None:
    path = _write(tmp_path, "e.csv", "0,add,a\n")
    with pytest.raises(ConfigurationError, match="skypilot"):
        load_trace(path, fmt="parquet")
    assert set(TRACE_FORMATS) == {"events", "counts", "segment", "skypilot"}


@pytest.mark.parametrize("interval_s", [0, -60.0, float("nan"), float("inf"), "60"])
def test_load_trace_rejects_interval_if_not_positive_number(tmp_path: Path, interval_s: object) -> None:
    path = _write(tmp_path, "e.csv", "0,add,a\n")
    with pytest.raises(ConfigurationError, match="interval_s"):
        load_trace(path, interval_s=interval_s)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="interval_s"):
        from_counts([1], interval_s=interval_s)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------- hygiene


def test_traces_module_does_not_import_torch_if_imported_alone() -> None:
    code = "import sys, lightning_parcae.signals.traces; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_load_trace_records_native_interval_if_times_fall_on_a_grid(tmp_path: Path, p3: Trace) -> None:
    assert p3.native_interval_s == 60.0
    (tmp_path / "t.csv").write_text("0,4\n300000,6\n900000,2\n1200000,2\n")
    t = load_trace(tmp_path / "t.csv")
    assert t.native_interval_s == 300.0 and t.interval_s == 60.0
    assert t.slice(300.0).native_interval_s == 300.0
    (tmp_path / "odd.csv").write_text("0,4\n1234,6\n75000,5\n")
    assert load_trace(tmp_path / "odd.csv").native_interval_s is None  # event times on no minute grid
    (tmp_path / "two.csv").write_text("0,4\n600000,6\n")
    assert load_trace(tmp_path / "two.csv").native_interval_s is None  # two times prove no grid


@pytest.mark.parametrize("k", [0, 1, 3])
def test_usable_counts_delay_arrivals_not_departures(k: int) -> None:
    """A joiner needs ~4.4 s (process start, admission) before it trains: the simulator let it train from its
    interval's start and forecast the in-place runs up to 9 % high on segments with arrivals."""
    from lightning_parcae.signals.traces import usable_counts

    counts = [3, 3, 4, 4, 4, 4, 2, 2, 3, 2, 2, 2]
    out = usable_counts(counts, k)
    assert all(u <= c for u, c in zip(out, counts)) and len(out) == len(counts)
    # departures at once
    assert out[6] == 2
    # the arrival at interval 2 counts from interval 2 + k
    assert out[2 + k] == 4 and all(out[i] == 3 for i in range(2, 2 + k))
    # an arrival that leaves within the delay is never used
    assert out[8] == (3 if k == 0 else 2)
    assert usable_counts(counts, 0) == counts


def test_usable_counts_raise_if_delay_is_negative() -> None:
    from lightning_parcae.signals.traces import usable_counts

    with pytest.raises(ConfigurationError, match="join_delay_intervals=-1"):
        usable_counts([1, 2], -1)


def test_from_changes_bins_both_directions_of_each_interval_and_covers_the_duration() -> None:
    """Changes at 0 s (+3), 30 s (+1), 59 s (-2) and 61 s (-1) in 60-s intervals over 150 s: three intervals,
    the first holding an arrival and a departure (net +2), the last none."""
    trace = from_changes([(0.0, 3, 0), (30.0, 1, 0), (59.0, 0, 2), (61.0, 0, 1)], 150.0, 60.0, "events")
    assert trace.as_tuples() == [(0, 4, 2), (2, 0, 1), (1, 0, 0)]
    assert trace.counts().tolist() == [2, 1, 1] and trace.source == "events"
    assert len(from_changes([], 0.0, 60.0, "empty")) == 1  # at least one interval
