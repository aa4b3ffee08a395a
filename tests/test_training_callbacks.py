"""The launcher's worker callbacks: periodic checkpoints, the agreed stop on a notice, progress events, and the
elastic interval callback's step boundary and metrics -- with fake trainers and runtimes, no processes."""

from __future__ import annotations

import json
import signal
import types
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_parcae.contract import RUN_DIR_ENV
from lightning_parcae.training.callbacks import callback_class


class Strategy:
    def __init__(self, stop: bool = False) -> None:
        self.stop = stop
        self.data_parallel, self.pipeline_stages, self.global_batch, self.micro_batches = 2, 1, 8, 1
        self.elastic_runtime = None

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
        return decision or self.stop


def _trainer(strategy: Any, step: int) -> Any:
    saved: list[str] = []
    trainer = types.SimpleNamespace(strategy=strategy, global_step=step, is_global_zero=True, world_size=2,
                                    should_stop=False, saved=saved, global_rank=0, sanity_checking=False)
    trainer.save_checkpoint = lambda path, weights_only=None: saved.append(path)
    return trainer


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv(RUN_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(signal, "signal", lambda *args: None)  # keep the test runner's own SIGTERM handler
    return tmp_path


def test_the_run_callback_is_a_no_op_outside_the_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)
    cb = callback_class("run")(every_n_steps=1)
    trainer = _trainer(Strategy(), step=1)
    cb.on_train_batch_end(trainer, None, torch.tensor(1.0), torch.ones(4), 0)
    assert not cb.active and trainer.saved == []


def test_periodic_checkpoints_every_n_steps_after_the_resumed_step(run_dir: Path) -> None:
    cb = callback_class("run")(every_n_steps=2, check_token=False)
    for step in (1, 2, 3, 4):
        cb.on_train_batch_end(_trainer(Strategy(), step), None, torch.tensor(1.0), torch.ones(4), 0)
    kinds = [e["event"] for e in _events(run_dir)]
    assert kinds.count("checkpoint") == 2
    assert all(e["D"] == 2 and e["global_batch"] == 8 for e in _events(run_dir))


@pytest.mark.parametrize("step_s", [0.5, 6.0, 30.0])
def test_progress_reports_the_rate_also_when_a_step_takes_longer_than_the_rate_window(
        run_dir: Path, monkeypatch: pytest.MonkeyPatch, step_s: float) -> None:
    """Regression: the rate was taken over the batches of the last 5 s only, so a job whose steps took longer (the
    GPT-1.5B emulation at time scale 3: 4.8 s at 2 x 7; a large model on real hardware: tens of seconds) kept one
    entry in that window and never wrote a progress event -- no rate on the console, and a static measurement of
    0 samples/s."""
    from lightning_parcae.training import callbacks  # noqa: PLC0415

    clock = [1000.0]
    monkeypatch.setattr(callbacks.time, "time", lambda: clock[0])
    cb = callback_class("run")(every_n_steps=0, progress_every_s=0.0, check_token=False)
    for step in range(1, 6):
        clock[0] += step_s
        cb.on_train_batch_end(_trainer(Strategy(), step), None, torch.tensor(1.0), torch.ones(4), 0)
    rates = [e["samples_per_s"] for e in _events(run_dir) if e["event"] == "progress"]
    assert len(rates) == 4  # every step after the first
    assert rates == pytest.approx([8 / step_s] * 4)  # global batch 8 per step


@pytest.mark.parametrize("batch_s", [0.5, 3.0])
def test_progress_under_gradient_accumulation_counts_whole_steps(run_dir: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 batch_s: float) -> None:
    """Four batches per optimizer step: the rate is steps over the time between the batches that completed them --
    also when a step (4 x 3 s) is longer than the rate window, where the batch before the step's last one would
    give four times the rate."""
    from lightning_parcae.training import callbacks  # noqa: PLC0415

    clock = [1000.0]
    monkeypatch.setattr(callbacks.time, "time", lambda: clock[0])
    cb = callback_class("run")(every_n_steps=0, progress_every_s=0.0, check_token=False)
    for batch in range(1, 21):
        clock[0] += batch_s
        cb.on_train_batch_end(_trainer(Strategy(), batch // 4), None, torch.tensor(1.0), torch.ones(4), 0)
    rates = [e["samples_per_s"] for e in _events(run_dir) if e["event"] == "progress"]
    assert rates and rates[-1] == pytest.approx(8 / (4 * batch_s))
    assert all(r > 0 for r in rates)


def test_a_notice_on_any_rank_stops_every_rank_after_a_checkpoint(run_dir: Path) -> None:
    cb = callback_class("run")(every_n_steps=0, check_token=False)
    trainer = _trainer(Strategy(stop=True), step=5)  # another rank was notified
    cb.on_train_batch_end(trainer, None, torch.tensor(1.0), torch.ones(4), 0)
    assert trainer.should_stop and cb.stopped_for_restart and len(trainer.saved) == 1
    assert [e["event"] for e in _events(run_dir)] == ["checkpoint", "stop"]


def test_a_notice_before_the_first_step_stops_every_rank_without_a_step_or_a_checkpoint(run_dir: Path) -> None:
    """Regression (issue 21): a relaunch noticed during its set-up (the next change of the trace came first) ran a
    step and saved a checkpoint before stopping; now it stops at the start, and the checkpoint it resumed from
    stays the resume point."""
    cb = callback_class("run")(every_n_steps=0, check_token=False)
    trainer = _trainer(Strategy(stop=True), step=24)  # another rank was notified while starting
    cb.on_train_start(trainer, None)
    assert trainer.should_stop and cb.stopped_for_restart and trainer.saved == []
    cb.on_train_batch_end(trainer, None, torch.tensor(1.0), torch.ones(4), 0)  # Lightning would not run it
    cb.on_train_end(trainer, None)
    assert trainer.saved == []
    assert [(e["event"], e["step"]) for e in _events(run_dir)] == [("stop", 24)]


def test_a_generation_without_a_notice_starts_training(run_dir: Path) -> None:
    cb = callback_class("run")(every_n_steps=0, check_token=False)
    trainer = _trainer(Strategy(), step=24)
    cb.on_train_start(trainer, None)
    assert not trainer.should_stop and [e["event"] for e in _events(run_dir)] == ["start"]


def test_the_elastic_callback_runs_the_step_boundary_and_logs_the_shape() -> None:
    calls: list[str] = []
    layout = types.SimpleNamespace(members=["a", "b"], data_parallel=2, pipeline_stages=1)
    er = types.SimpleNamespace(boundary=lambda trainer: calls.append("boundary"), layout=layout, generation=3,
                               stats={"predicted_N": [4]}, migrations=[])
    strategy = Strategy()
    strategy.elastic_runtime = er  # type: ignore[assignment]
    trainer = _trainer(strategy, step=10)
    trainer.log_every_n_steps = 5
    logged: dict[str, float] = {}
    module = types.SimpleNamespace(log=lambda k, v, **kw: logged.__setitem__(k, v))
    callback_class("elastic")().on_train_batch_end(trainer, module, None, None, 0)
    assert calls == ["boundary"]
    assert logged["parcae/N"] == 2.0 and logged["parcae/generation"] == 3.0 and logged["parcae/predicted_N"] == 4.0
