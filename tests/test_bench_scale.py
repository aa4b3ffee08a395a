"""benchmarks/bench_scale.py turns a run's events into the scale table: figures per N and the growth column.

No processes: synthetic ``events.jsonl`` records shaped like those of ``parcae run`` (launcher ``launch``/``add``,
worker ``progress``/``step_timing``, elastic ``phase``/``migration``/``decision``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_scale  # noqa: E402


def _events(n: int, startup: float, intra: float, boundary_ms: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    def run(with_changes: bool) -> list[dict[str, Any]]:
        ev: list[dict[str, Any]] = [
            {"source": "launcher", "event": "run_start", "time": 99.0},
            {"source": "launcher", "event": "launch", "time": 100.0, "members": [f"i{k}" for k in range(n)]},
            {"source": "elastic", "event": "phase", "old": "starting", "new": "training", "generation": 0,
             "spent_s": startup / 2, "time": 100.0 + startup},
            {"source": "worker", "event": "progress", "time": 100.0 + startup, "step": 1},
        ]
        if with_changes:
            # two members of generation 1 report the intra-stage change; the slower one counts
            ev += [{"source": "elastic", "event": "migration", "generation": 1, "kind": "intra-stage",
                    "duration_s": intra * f, "transfer_s": 0.01, "joiners": [], "time": 150.0} for f in (0.5, 1.0)]
            ev += [{"source": "launcher", "event": "add", "joiners": [f"i{n}"], "time": 160.0},
                   {"source": "elastic", "event": "decision", "standbys": [f"i{n}"], "time": 163.0},
                   {"source": "elastic", "event": "migration", "generation": 2, "kind": "intra-stage",
                    "duration_s": 2.0, "transfer_s": 1.5, "joiners": [f"i{n}"], "time": 165.0}]
        else:
            ev += [{"source": "worker", "event": "step_timing", "rank": r,
                    "parts": {"step": {"n": 100, "total_s": 10.0},
                              "boundary": {"n": 100, "total_s": boundary_ms * (1 + r) / 10.0},
                              "commit": {"n": 100, "total_s": 0.1}}} for r in range(2)]
        return ev

    return run(False), run(True)


def test_summary_takes_the_slowest_member_and_separates_joins() -> None:
    fixed, changes = _events(4, startup=10.0, intra=0.2, boundary_ms=1.0)
    s = bench_scale.summarize(fixed, changes, None, 4)
    assert s["startup_s"] == 10.0
    assert s["migration:intra-stage"] == 0.2  # the slower of the two members, not the mean
    assert s["migration:join"] == 2.0 and abs(s["rest:join"] - 0.5) < 1e-9
    assert s["join_delay_s"] == 3.0
    assert s["kinds"] == {"intra-stage": 1, "join": 1}
    assert abs(s["boundary_ms"] - 1.5) < 1e-9 and abs(s["boundary_max_ms"] - 2.0) < 1e-9  # ranks at 1 and 2 ms
    # counted: the leader's write, two checks, and every member's heartbeat in one check and one multi_get (it was
    # 3 + 2 N, one check and one get per member, until the reads were batched)
    assert s["leader_ops_per_beat"] == 5.0
    assert bench_scale.leader_requests_per_beat(32) == 5


def test_growth_column_is_the_ratio_of_the_largest_n_to_the_smallest() -> None:
    results = {}
    for n, (startup, intra) in {4: (10.0, 0.2), 8: (20.0, 0.4), 16: (80.0, 0.5)}.items():
        fixed, changes = _events(n, startup=startup, intra=intra, boundary_ms=1.0)
        results[n] = bench_scale.summarize(fixed, changes, None, n)
    text = bench_scale.table(results)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()[2:]}
    assert "growth 4->16" in text.splitlines()[0] and "linear 4x" in text.splitlines()[0]
    start = rows["start-up: launch -> first step, s (median of 2 runs)"]
    assert start[2:5] == ["10.00", "20.00", "80.00"] and start[5] == "8.00"
    assert rows["migration intra-stage, s"][5] == "2.50"
    assert rows["migration inter-stage, s"][5] == "n/a"  # no such migration: no ratio invented


def test_the_planning_benchmark_times_the_leaders_real_decision() -> None:
    """benchmarks/bench_planning_scale.py runs ShapeChooser.decide itself (no stand-in): a decision at N=4 and
    N=8 takes a measurable, bounded time, and the script's table prints."""
    import bench_planning_scale

    for n in (4, 8):
        ms = bench_planning_scale.decide_ms(n, decisions=2)
        assert 0.0 < ms < 5000.0, (n, ms)
    assert bench_planning_scale.main(["--counts", "4", "--decisions", "1"]) == 0


def _timing(rank: int, intervals: list[list[Any]]) -> dict[str, Any]:
    return {"source": "worker", "event": "step_timing", "rank": rank, "parts": {}, "intervals": intervals}


def test_arrival_split_separates_waiting_for_the_last_member_from_the_collective() -> None:
    # three ranks; in each agreement rank 2 arrives last, 0.1 s after rank 0, and all leave 5 ms after it
    ev = []
    for r, late in ((0, 0.0), (1, 0.04), (2, 0.1)):
        ev.append(_timing(r, [["step agreement", f"g1/s{s}", 10.0 * s + late, 10.0 * s + 0.105] for s in (1, 2)]))
    split = bench_scale.arrival_split(ev, "step agreement")
    assert set(split) == {0, 1, 2}
    w, a, n = split[0]
    assert n == 2 and abs(w - 0.2) < 1e-9 and abs(a - 0.01) < 1e-9
    assert abs(split[2][0]) < 1e-9  # the last to arrive waits for no one
    s = bench_scale.summarize(ev, [], None, 0)
    # the median rank (rank 1) waited 60 ms per step for rank 2, then 5 ms in the all-reduce
    assert abs(s["agreement_arrival_ms"] - 60.0) < 1e-6 and abs(s["agreement_after_ms"] - 5.0) < 1e-6


def test_arrival_split_counts_only_calls_every_participant_recorded() -> None:
    # the agreement of step 2 lacks rank 1 (its records were capped): it is left out, not read as no waiting;
    # a gradient all-reduce over ranks 0 and 2 needs exactly those two
    ev = [_timing(0, [["step agreement", "g0/s1", 1.0, 1.5], ["step agreement", "g0/s2", 2.0, 2.5],
                      ["gradient all-reduce", "0,2/torch.float32/1", 1.0, 1.2]]),
          _timing(1, [["step agreement", "g0/s1", 1.4, 1.5]]),
          _timing(2, [["gradient all-reduce", "0,2/torch.float32/1", 1.1, 1.2],
                      ["gradient all-reduce", "0,2/torch.float32/2", 2.1, 2.2]])]
    agree = bench_scale.arrival_split(ev, "step agreement")
    assert agree[0][2] == 1 and abs(agree[0][0] - 0.4) < 1e-9
    grad = bench_scale.arrival_split(ev, "gradient all-reduce")
    assert set(grad) == {0, 2} and all(n == 1 for _, _, n in grad.values())
    assert grad[0][:2] == pytest.approx((0.1, 0.1)) and grad[2][:2] == pytest.approx((0.0, 0.1))


def test_join_parts_split_the_join_delay_at_the_runtime_start_and_the_standby() -> None:
    ev = [{"source": "launcher", "event": "add", "joiners": ["i9"], "time": 100.0},
          {"source": "elastic", "event": "phase", "member": "i9", "old": "starting", "new": "standby",
           "spent_s": 2.0, "time": 108.0},
          {"source": "elastic", "event": "decision", "standbys": [], "time": 107.0},
          {"source": "elastic", "event": "decision", "standbys": ["i9"], "time": 109.5}]
    assert bench_scale.join_parts(ev) == [(6.0, 2.0, 1.5)]
    assert bench_scale.join_delays(ev) == [9.5]  # the three parts add up to the delay
    # a joiner that never became a standby (preempted while booting) has no parts
    assert bench_scale.join_parts(ev[:1] + ev[2:]) == []
