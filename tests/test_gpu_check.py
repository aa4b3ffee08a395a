"""The prepared GPU check (benchmarks/gpu_check.py) runs its models end to end -- here on CPU.

Problem: the check is only run when a GPU machine is lent (minutes of device time, sometimes none for many
sessions); a broken model option found there wastes the lease. This runs each model of ``--model`` at a tiny size
with ``--accelerator cpu``: ParcaeStrategy at P = 1 and its mid-training resume must end with Lightning's own
parameters exactly (same kernels, same order, one process).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow  # ~20-40 s per model on 2 cores: four Lightning runs in their own processes
@pytest.mark.timeout(600)
@pytest.mark.parametrize("model", ["peer-lm", "hf-gpt2", "hf-llama"])
def test_each_model_of_the_prepared_check_trains_like_lightning_and_resumes(model: str, tmp_path: Path) -> None:
    if model.startswith("hf-"):
        pytest.importorskip("transformers", reason="transformers (a test extra) is not installed")
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--accelerator", "cpu",
                           "--model", model, "--vocab", "512", "--dim", "32", "--blocks", "2", "--seq", "16",
                           "--batch", "8", "--steps", "4", "--warmup", "2", "--out", str(out)],
                          capture_output=True, text=True, timeout=550, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["model"] == model and got["vocab"] == 512
    assert got["parcae_vs_lightning_max_rel_param_diff"] == 0.0
    assert got["resume_vs_lightning_max_rel_param_diff"] == 0.0
    assert got["parcae"]["strategy"] == "ParcaeStrategy" and got["lightning"]["strategy"] != "ParcaeStrategy"
