"""Tests of ``parcae run`` (lightning_parcae.run) and its worker callback.

Problem they guard: the launcher is where a user first meets the system. Bad options must fail fast with a message
that says what to fix and must leave nothing running; a worker that crashes must take the run down with its log
tail shown; a static cluster must train to the end; and a replayed trace must go through the restart fallback
(notice -> checkpoint -> relaunch at the new size -> resume) and produce a report.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.run import Launcher, RunFailed, _config, build_parser, main, scale_counts

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = str(ROOT / "examples" / "train_run.py")


def _err(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    rc = main(argv)
    assert rc == 2
    return capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ validation (fast)
def test_parser_builds_if_imported() -> None:
    assert build_parser().prog == "parcae run"


def test_main_rejects_if_no_command(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "no worker command" in _err(capsys, ["--instances", "2", "--run-dir", str(tmp_path)])


def test_main_rejects_if_more_instances_than_host(capsys: pytest.CaptureFixture[str]) -> None:
    err = _err(capsys, ["--instances", "100000", "--", "python", "x.py"])
    assert "more instances than the machine can host" in err


def test_main_rejects_if_instances_not_positive(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--instances must be >= 1" in _err(capsys, ["--instances", "0", "--", "python", "x.py"])


def test_main_rejects_if_trace_unknown(capsys: pytest.CaptureFixture[str]) -> None:
    err = _err(capsys, ["--instances", "2", "--trace", "no_such_trace", "--", "python", "x.py"])
    assert "unknown trace 'no_such_trace'" in err and "hh_55_65" in err


def test_main_rejects_if_trace_format_bad(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("this is not, a trace, at all\n")
    err = _err(capsys, ["--instances", "2", "--trace", str(bad), "--", "python", "x.py"])
    assert str(bad) in err


def test_main_rejects_if_pipeline_stages_bad(capsys: pytest.CaptureFixture[str]) -> None:
    assert "--pipeline-stages" in _err(capsys, ["--instances", "2", "--pipeline-stages", "x", "--", "python", "x.py"])


def test_config_rejects_if_time_scale_not_positive() -> None:
    with pytest.raises(ConfigurationError, match="--time-scale"):
        _config(["--instances", "1", "--time-scale", "0", "--", "python", "x.py"])


def test_scale_counts_maps_peak_to_cap_if_trace_larger() -> None:
    assert scale_counts([32, 16, 1, 0], 32, 4) == [4, 2, 1, 0]


def test_config_schedule_follows_bundled_trace_if_named() -> None:
    cfg = _config(["--instances", "3", "--trace", "hh_55_65", "--", "python", "x.py"])
    assert max(cfg.schedule) == 3 and len(cfg.schedule) == 60
    assert 60 * cfg.wall_interval_s == pytest.approx(180.0)  # a 1-hour segment replays in ~3 minutes


@pytest.mark.timeout(30)
def test_main_fails_if_store_unreachable(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    rc = main(["--instances", "1", "--store", f"tcp://127.0.0.1:{port}", "--store-timeout", "1",
               "--run-dir", str(tmp_path), "--", "python", "x.py"])
    assert rc == 1
    assert "could not reach the coordination store" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()  # no worker was started


@pytest.mark.timeout(60)
def test_callback_exits_if_token_wrong(tmp_path: Path) -> None:
    from lightning_parcae.runtime.store import host_store, new_token

    store = host_store("tcp://127.0.0.1:0", token=new_token())
    env = {**os.environ, "PARCAE_RUN_DIR": str(tmp_path), "PARCAE_STORE": f"tcp://127.0.0.1:{store.port}",
           "PARCAE_JOB_TOKEN": "not-the-token", "RANK": "0"}
    code = "from lightning_parcae.callbacks import ParcaeRunCallback; ParcaeRunCallback(); print('started')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=50)
    assert proc.returncode == 3
    assert "wrong job token" in proc.stderr and "started" not in proc.stdout
    del store


# ------------------------------------------------------------------------------------------------ processes
@pytest.mark.timeout(60)
def test_launcher_stops_everyone_if_script_crashes_on_start(tmp_path: Path) -> None:
    script = ("import os, sys, time\n"
              "if os.environ['RANK'] == '0':\n"
              "    sys.exit('boom: crashing on start')\n"
              "time.sleep(120)\n")
    cfg = _config(["--instances", "2", "--run-dir", str(tmp_path), "--no-plot", "--",
                   sys.executable, "-c", script])
    launcher = Launcher(cfg)
    with pytest.raises(RunFailed, match="boom: crashing on start") as info:
        launcher.run()
    assert "exited with" in str(info.value)
    assert len(launcher.workers) == 2
    for w in launcher.workers:  # the sleeping rank 1 was killed, nothing is left running
        assert w.proc.poll() is not None
        with pytest.raises(ProcessLookupError):
            os.killpg(w.proc.pid, 0)


@pytest.mark.timeout(120)
def test_main_trains_to_the_end_if_static_two_instances(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["--instances", "2", "--run-dir", str(tmp_path), "--progress-every", "5", "--",
               sys.executable, EXAMPLE, "--max-steps", "30", "--ckpt-every", "10"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["final_step"] == 30 and report["num_restarts"] == 0 and report["trace"] is None
    assert report["samples"] == 30 * 64
    assert (tmp_path / "ckpt" / "last.ckpt").exists() and (tmp_path / "report.png").exists()
    starts = [e for e in report["events"] if e.get("event") == "start"]
    assert starts and (starts[0]["D"], starts[0]["P"], starts[0]["N"]) == (2, 1, 2)


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_main_restarts_and_resumes_if_trace_removes_and_adds(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"  # counts format: 2 instances, one removed at 60 s, one added back at 120 s
    trace.write_text("0,2\n60000,1\n120000,2\n180000,2\n")
    run_dir = tmp_path / "run"
    rc = main(["--instances", "2", "--trace", str(trace), "--time-scale", "7.5", "--grace", "30",
               "--run-dir", str(run_dir), "--progress-every", "5", "--",
               sys.executable, EXAMPLE, "--max-steps", "400", "--step-delay", "0.02", "--ckpt-every", "50"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((run_dir / "report.json").read_text())
    assert (run_dir / "report.png").exists()
    assert report["trace"]["instances_per_interval"] == [2, 1, 2, 2]
    assert report["num_restarts"] >= 1 and all(r["lost_s"] > 0 for r in report["restarts"])
    assert report["final_step"] == 400
    kinds = [e["event"] for e in report["events"]]
    assert "notice" in kinds and "restart_done" in kinds and kinds.count("launch") >= 2
    ends = [e for e in report["events"] if e.get("event") == "end"]
    assert ends and ends[-1]["step"] == 400
