"""What ``parcae run`` shows and writes (``lightning_parcae.launch.console``), fed events by hand.

Problem it guards: the console reads the event log into the workers' reports and prints change and progress lines
and the report -- and only that. It once advanced the restart (it marked a generation's first step and completed
the pending restart); now it must leave the run's state exactly as it found it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

from lightning_parcae.launch.console import Console
from lightning_parcae.launch.processes import ELASTIC, RESTART_FALLBACK
from launch_fakes import parts, text_out, worker


def _console(tmp_path: Path, **cfg):
    p = parts(tmp_path, **cfg)
    out = text_out()
    return Console(p["cfg"], p["state"], p["reports"], p["pool"], out), p, out


def test_read_new_returns_complete_lines_once(tmp_path: Path) -> None:
    con, _, _ = _console(tmp_path)
    assert con.read_new() == []  # no log yet
    log = tmp_path / "events.jsonl"
    log.write_text('{"a": 1}\nnot json\n{"b": 2}\n{"c": ')
    assert con.read_new() == [{"a": 1}, {"b": 2}]
    with open(log, "a") as f:
        f.write('3}\n')
    assert con.read_new() == [{"c": 3}] and con.read_new() == []


def test_record_keeps_the_latest_progress_rate_and_the_reported_batch(tmp_path: Path) -> None:
    con, p, _ = _console(tmp_path)
    rep = p["reports"]
    con.record({"source": "worker", "event": "progress", "generation": 0, "step": 5, "samples_per_s": 40.0,
                "global_batch": 64, "micro_batches": 2})
    con.record({"source": "worker", "event": "checkpoint", "generation": 0, "step": 6, "samples_per_s": 1.0})
    assert rep.latest["step"] == 6 and rep.latest["samples_per_s"] == 40.0  # only progress carries a rate
    assert rep.batch == (64, 2) and len(rep.events) == 2


def test_the_console_does_not_change_the_run_state(tmp_path: Path) -> None:
    """Regression: ``Console.read_events`` marked the generation's first step, completed the pending restart and
    set ``finished``; the launcher does all of that now."""
    con, p, _ = _console(tmp_path, mode=ELASTIC)
    st = p["state"]
    st.launched(generation=0, resume_step=0, instances=2, now=0.0, launch=0)
    st.pending_restart = {"t_request": 0.0, "last_step": 0, "samples_per_s": 0.0}
    before = copy.deepcopy(st)
    for ev in [{"source": "worker", "event": "progress", "generation": 0, "step": 3, "time": 1.0},
               {"source": "worker", "event": "checkpoint", "generation": 0, "step": 3, "time": 1.1},
               {"source": "elastic", "event": "fallback", "member": "i0", "reason": "lost", "time": 1.2},
               {"source": "worker", "event": "end", "generation": 0, "step": 4, "time": 1.3}]:
        con.record(ev)
    assert st == before and p["events"].events == []


def test_phases_and_migrations_become_shapes_and_one_change_line(tmp_path: Path) -> None:
    con, p, out = _console(tmp_path)
    rep = p["reports"]
    con.record({"source": "elastic", "event": "phase", "member": "i0", "old": "starting", "new": "training",
                "generation": 0, "D": 2, "P": 1, "time": 1.0})
    assert rep.phases == {"i0": "training"} and rep.egen == 0 and rep.shapes[-1]["why"] == "launch"
    for member in ("i0", "i1"):
        con.record({"source": "elastic", "event": "migration", "member": member, "generation": 1, "kind": "intra-stage",
                    "reason": "plan", "D": 1, "P": 2, "N": 2, "duration_s": 0.5, "time": 2.0})
    assert rep.egen == 1 and rep.migrations[1]["members"] == ["i0", "i1"]
    lines = [ln for ln in out.getvalue().splitlines() if "migration -> gen 1" in ln]
    assert len(lines) == 1 and "intra-stage to 1x2" in lines[0]


def test_a_recovery_costs_the_time_since_the_launchers_kill(tmp_path: Path) -> None:
    con, p, _ = _console(tmp_path)
    p["state"].kill_times.append(3.0)
    con.record({"source": "elastic", "event": "migration", "member": "i0", "generation": 2, "kind": "intra-stage",
                "reason": "recovery from a loss", "D": 1, "P": 1, "N": 1, "duration_s": 0.5, "time": 5.0})
    report = con.report()
    assert report["migrations"][0]["lost_s"] == 2.0 and report["time_lost_by_kind_s"]["recovery"] == 2.0


def test_progress_says_what_the_run_is_doing(tmp_path: Path) -> None:
    con, p, out = _console(tmp_path, mode=ELASTIC)
    st, pool = p["state"], p["pool"]
    con.progress(force=True, instances=0)
    assert out.getvalue().rstrip().endswith("(paused: no instances)")
    st.launched(generation=0, resume_step=0, instances=2, now=0.0, launch=0)
    pool.workers = [worker("i0"), worker("i1", joiner=True)]
    con.progress(force=True, instances=2)
    last = out.getvalue().splitlines()[-1]
    assert "N=2" in last and "standby=1" in last and last.endswith("(starting)")
    st.begin_fallback({"reason": "x", "killed": [], "graceful": True, "t_request": 0.0})
    con.progress(force=True, instances=2)
    assert out.getvalue().splitlines()[-1].endswith("(fallback: relaunching)")
    n = len(out.getvalue().splitlines())
    con.progress(instances=2)  # within --progress-every: nothing
    assert len(out.getvalue().splitlines()) == n


def test_restart_progress_and_report_count_restarts(tmp_path: Path) -> None:
    con, p, out = _console(tmp_path, mode=RESTART_FALLBACK, trace="t", schedule=[2, 1])
    st = p["state"]
    st.generation, st.n, st.shape = 1, 2, (2, 1)
    st.restarts.append({"lost_s": 4.5, "t_request": 0.0, "downtime_s": 4.0})
    con.progress(force=True)
    assert "N=2 DxP=2x1 gen=1" in out.getvalue() and "time_lost=4.5s" in out.getvalue()
    report = json.loads((tmp_path / "report.json").read_text()) if con.report() else None
    assert report["num_restarts"] == 1 and report["launches"] == 2 and report["time_lost_s"] == 4.5
    assert report["trace"]["instances_per_interval"] == [2, 1]
