"""The GPT example (examples/gpt): the paper's memory regime, deterministic data, and a short pipelined run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

from gpt import GPT, StdlibText, stdlib_bytes  # noqa: E402

from lightning_parcae.planning.measured import min_stages_for_memory  # noqa: E402
from lightning_parcae.runtime.partition import balance_stages, layer_memory_bytes  # noqa: E402

CONFIG = yaml.safe_load((ROOT / "examples" / "gpt" / "config.yaml").read_text())
SPOT = yaml.safe_load((ROOT / "examples" / "gpt" / "spot.yaml").read_text())


@pytest.mark.parametrize("config", [CONFIG, SPOT], ids=["config.yaml", "spot.yaml"])
def test_whole_model_exceeds_the_instance_budget_but_two_stages_fit(config):
    """The configured budget forces P >= 2 (the GPT-1.5B-on-16-GB regime), and a 2-stage split exists."""
    model = GPT(**config["model"])
    budget = config["trainer"]["strategy"]["init_args"]["max_stage_memory_bytes"]
    memory = [layer_memory_bytes(layer) for layer in model.layers]
    assert isinstance(model.layers, __import__("torch").nn.Sequential) and len(model.layers) >= 10  # embed, 8, head
    assert sum(memory) > budget
    assert min_stages_for_memory(memory, budget) == 2
    sizes = balance_stages([1.0] * len(memory), 2, memory, budget)
    assert len(sizes) == 2 and sum(sizes) == len(memory)


@pytest.mark.parametrize("max_bytes", [10_000, 123_457])
def test_stdlib_text_is_deterministic_and_byte_level(max_bytes: int):
    a, b = stdlib_bytes(max_bytes), stdlib_bytes(max_bytes)
    assert a == b and len(a) == max_bytes
    dm = StdlibText(seq_len=32, batch_size=4, max_bytes=max_bytes)
    dm.setup()
    x = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 33) and int(x.max()) < 256


def test_bad_width_is_a_clear_error():
    with pytest.raises(ValueError, match="multiple of n_heads"):
        GPT(d_model=30, n_heads=4)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_trains_pipelined_with_validation(tmp_path: Path):
    """Two processes, P = 2 (forced by the budget), 30 steps: the loss falls and validation reports perplexity."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), "--config",
         str(ROOT / "examples" / "gpt" / "config.yaml"), "--trainer.devices", "2", "--trainer.max_steps", "30",
         "--trainer.val_check_interval", "30", "--trainer.strategy.init_args.pipeline_stages", "2"],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=230)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "finished at step 30: D=1 P=2" in out.stdout
    val = float(out.stdout.rsplit("val_loss=", 1)[1].split()[0])
    assert val < 5.0  # from ln(256) = 5.55 at initialisation


def test_emulated_accelerator_time_is_per_sample_and_weighted_by_layer():
    """spot.yaml's emulated device: every block models ``device_ms_per_sample`` per sample (the embedding a quarter,
    the head half of it); 0 is off, negative is a clear error."""
    import torch  # noqa: PLC0415

    model = GPT(**SPOT["model"])
    ms = SPOT["model"]["device_ms_per_sample"]
    assert ms > 0 and [layer.device_ms for layer in model.layers] == [0.25 * ms] + [ms] * 8 + [0.5 * ms]
    assert all(layer.device_ms == 0 for layer in GPT(**CONFIG["model"]).layers)
    with pytest.raises(ValueError, match="device_ms_per_sample"):
        GPT(device_ms_per_sample=-1.0)
    block = model.layers[1]
    x = torch.randn(10, 8, SPOT["model"]["d_model"])
    import time  # noqa: PLC0415

    t0 = time.perf_counter()
    with torch.no_grad():
        block(x)
    assert time.perf_counter() - t0 >= 10 * ms / 1000.0


def test_every_kind_schedule_is_shaped_as_its_header_says():
    """examples/gpt/every_kind.csv says what it is: lh_80_90 scaled to 4 instances for its first 20 intervals, then
    2 x10, 4 x6, 3 x8, 2 x8, 3 x8 -- one drop of two (the only change that can leave a stage short)."""
    import itertools

    from lightning_parcae.signals.traces import bundled_trace_path, load_trace, scaled

    demo = [int(c) for c in load_trace(ROOT / "examples" / "gpt" / "every_kind.csv").counts()][:60]
    seg = [int(c) for c in scaled(load_trace(bundled_trace_path("lh_80_90")), 4).counts()]
    assert demo[:20] == seg[:20]
    runs = [(k, len(list(g))) for k, g in itertools.groupby(demo)]
    assert runs == [(3, 11), (4, 9), (2, 10), (4, 6), (3, 8), (2, 8), (3, 8)], runs
    assert [(a, b) for a, b in zip(demo, demo[1:]) if b < a - 1] == [(4, 2)]


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_main_job_shows_a_pipeline_and_every_migration_kind(tmp_path: Path):
    """The README's main command (the trace, the victims, the emulated devices): P >= 2 throughout, at least one
    repartition, one inter-stage and one intra-stage migration, no restart, the loss falling."""
    import json

    run_dir = tmp_path / "out"
    out = subprocess.run(
        [sys.executable, "-m", "lightning_parcae.launch.run", "--instances", "4", "--trace",
         str(ROOT / "examples" / "gpt" / "every_kind.csv"), "--victims", "stage", "--time-scale", "30",
         "--emulated-devices", "--pipeline-stages", "2", "--run-dir", str(run_dir), "--progress-every", "10",
         "--no-plot", "--", sys.executable, str(ROOT / "examples" / "gpt" / "train.py"), "--config",
         str(ROOT / "examples" / "gpt" / "spot.yaml")],
        capture_output=True, text=True, cwd=tmp_path, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    kinds = {m["kind"] for m in report["migrations"]}
    assert {"repartition", "inter-stage", "intra-stage"} <= kinds, (kinds, out.stdout[-3000:])
    assert report["num_restarts"] == 0
    assert all(s["P"] >= 2 for s in report["shapes"] if s.get("P")), report["shapes"]
    losses = [e["loss"] for e in report["events"] if e.get("event") == "progress" and e.get("loss") is not None]
    assert losses and losses[-1] < losses[0] - 1.0
