"""The elastic hooks: the two-phase optimizer step (applied or discarded everywhere, then re-run), the commit
after the closure, the fit-loop set-up and the close -- with fakes of the runtime, data path, step runner and
process setup."""

from __future__ import annotations

import types
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from lightning_parcae.errors import PeerLostError
from lightning_parcae.runtime.lifecycle import Phase
from lightning_parcae.training.data_path import DataPath
from lightning_parcae.training.elastic_hooks import ElasticHooks
from lightning_parcae.training.stage_state import StageState


class Runtime:
    def __init__(self, apply: bool) -> None:
        self.apply = apply
        self.calls: list[Any] = []
        self.stall_timeout = timedelta(seconds=7)
        self.life = types.SimpleNamespace(phase=Phase.TRAINING, to=lambda phase: self.calls.append(phase))

    def decide_commit(self, step: int) -> bool:
        self.calls.append(("decide", step))
        return self.apply

    def recover(self, trainer: Any) -> None:
        self.calls.append("recover")

    def commit(self, step: int) -> None:
        self.calls.append(("commit", step))

    def close(self, finished: bool) -> None:
        self.calls.append(("close", finished))


class Steps:
    def __init__(self) -> None:
        self.discarded = 0

    def discard_pending(self) -> None:
        self.discarded += 1

    def apply_committed_step(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.step()


class Process:
    def __init__(self) -> None:
        self.timeouts: list[timedelta] = []

    def use_timeout(self, timeout: timedelta) -> None:
        self.timeouts.append(timeout)


class Plugin:
    def _after_closure(self, model: Any, optimizer: Any) -> str:
        return "closed"


def _hooks(er: Runtime) -> tuple[ElasticHooks, DataPath, Steps, Any]:
    module = nn.Linear(1, 1)
    module.trainer = types.SimpleNamespace(global_step=5)  # type: ignore[assignment]
    module.automatic_optimization = True  # type: ignore[assignment]
    host = types.SimpleNamespace(elastic_runtime=er, lightning_module=module, precision_plugin=Plugin())
    data = DataPath(StageState(), 1, True, lambda b: b)
    steps = Steps()
    return ElasticHooks(host, data, steps, Process(), "pytorch_lightning"), data, steps, host  # type: ignore[arg-type]


def test_a_step_interrupted_and_discarded_is_rewound_and_run_again() -> None:
    er = Runtime(apply=False)
    hooks, data, steps, host = _hooks(er)
    _window(data, 1)  # the step's one batch, opened at cursor 40
    host.lightning_module.weight.grad = torch.ones(1, 1)
    tries: list[int] = []

    def step() -> str:
        tries.append(1)
        if len(tries) == 1:
            data.cursor = 48  # the interrupted step had counted its batch
            raise PeerLostError("lost")
        return "stepped"

    assert hooks.optimizer_step(torch.optim.SGD(host.lightning_module.parameters(), lr=1.0), step) == "stepped"
    assert len(tries) == 2 and er.calls == [("decide", 5), "recover"]
    assert (data.cursor_epoch, data.cursor) == (0, 40) and data.rerun_step and steps.discarded == 1
    assert host.lightning_module.weight.grad is None and hooks.committing is None


def test_a_step_interrupted_after_everyone_reduced_is_applied_here_too() -> None:
    er = Runtime(apply=True)
    hooks, _, steps, host = _hooks(er)
    module = host.lightning_module
    module.weight.grad = torch.ones(1, 1)
    before = module.weight.detach().clone()

    def step() -> None:
        raise PeerLostError("lost")

    assert hooks.optimizer_step(torch.optim.SGD(module.parameters(), lr=1.0), step) is None
    assert torch.allclose(module.weight, before - 1.0) and er.calls == [("decide", 5), "recover"]
    assert steps.discarded == 0


def test_the_closure_commits_the_running_step_and_is_wrapped_once() -> None:
    er = Runtime(apply=True)
    hooks, _, _, host = _hooks(er)
    trainer = types.SimpleNamespace(accumulate_grad_batches=1, callbacks=[],
                                    fit_loop=types.SimpleNamespace(epoch_loop=types.SimpleNamespace()))
    hooks.setup(trainer, joining=True)  # type: ignore[arg-type]
    wrapped = host.precision_plugin._after_closure
    hooks.setup(trainer, joining=True)  # type: ignore[arg-type]
    assert host.precision_plugin._after_closure is wrapped
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None  # Lightning's SIGTERM broadcast is off
    assert len(trainer.callbacks) == 1  # the interval callback, once
    hooks.committing = 9
    assert wrapped(None, None) == "closed" and er.calls == [("commit", 9)]


class ReplayingSteps(Steps):
    """Records the micro-steps replayed: the batch record the data path hands each, and whether it was synced."""

    def __init__(self, data: DataPath) -> None:
        super().__init__()
        self.data = data
        self.synced = True
        self.replayed: list[tuple[Any, bool, tuple, bool]] = []

    @contextmanager
    def no_sync(self) -> Any:
        self.synced = False
        try:
            yield None
        finally:
            self.synced = True

    def training_step(self, batch: Any, *rest: Any, **kwargs: Any) -> torch.Tensor:
        record, given = self.data.replay  # what effective_batch would cut the batch from
        self.data.replay = None
        self.replayed.append((record, given, rest, self.synced))
        return torch.tensor(1.0)

    def backward(self, loss: torch.Tensor) -> torch.Tensor:
        return loss


def _window(data: DataPath, k: int) -> list[tuple[int, int, list[int]]]:
    """An accumulation window of ``k`` micro-steps (records of 4 samples each) that started at cursor 40."""
    records = [(2, 0, list(range(40 + 4 * i, 44 + 4 * i))) for i in range(k)]
    data.window, data.window_start = list(records), (0, 40)
    data.cursor_epoch, data.cursor = 0, 40 + 4 * k
    return records


def test_a_lost_peer_in_the_last_micro_step_replays_the_whole_window_on_the_new_shape() -> None:
    """Regression (issue 23): live reconfiguration refused accumulate_grad_batches > 1 because a loss inside a
    window re-ran only the window's last micro-step, on gradients half of which came from the old shape. Now the
    whole window is discarded and its micro-steps replayed in order after the recovery."""
    er = Runtime(apply=False)
    hooks, data, _, host = _hooks(er)
    steps = ReplayingSteps(data)
    hooks.steps = steps  # type: ignore[assignment]
    records = _window(data, 3)
    hooks.window_calls = [((0,), {}), ((1,), {}), ((2,), {})]
    host.lightning_module.weight.grad = torch.ones(1, 1)  # the window's accumulated gradient, now void
    tries: list[int] = []

    def step() -> str:
        tries.append(1)
        if len(tries) == 1:
            raise PeerLostError("lost in the gradient all-reduce")
        assert data.replay == (records[2], True)  # the last micro-step re-runs with Lightning's own batch
        hooks.training_step(((), 2), {}, lambda: "loss")  # Lightning's closure runs it again
        return "stepped"

    assert hooks.optimizer_step(torch.optim.SGD(host.lightning_module.parameters(), lr=1.0), step) == "stepped"
    assert er.calls == [("decide", 5), "recover"]
    # replayed after the recovery, in order, from the dataset (not Lightning's batch), without the all-reduce
    assert steps.replayed == [(records[0], False, (0,), False), (records[1], False, (1,), False)]
    assert host.lightning_module.weight.grad is None  # nothing of the discarded window's gradient is left
    assert (data.cursor_epoch, data.cursor) == (0, 40)  # rewound to the window's start (replays count again)
    assert hooks.window_calls == [] and data.window == []  # the step was applied: a new window opens


def test_a_lost_peer_in_an_earlier_micro_step_recovers_and_replays_before_it() -> None:
    """A pipeline exchange fails in micro-step 2 of 3 (outside the optimizer step): micro-step 1 is replayed on the
    recovered shape, then micro-step 2 runs again; no commit decision is needed (no one can have stepped)."""
    er = Runtime(apply=True)
    hooks, data, _, host = _hooks(er)
    steps = ReplayingSteps(data)
    hooks.steps = steps  # type: ignore[assignment]
    records = _window(data, 2)
    hooks.window_calls = [((0,), {})]
    runs: list[Any] = []

    def run() -> str:
        runs.append(data.replay)
        if len(runs) == 1:
            raise PeerLostError("lost in a pipeline send")
        return "loss"

    assert hooks.training_step(((), 1), {}, run) == "loss"
    assert er.calls == ["recover"]
    assert steps.replayed == [(records[0], False, (0,), False)]
    assert runs == [None, (records[1], True)]
    assert hooks.window_calls == [((0,), {}), ((1,), {})]  # the window goes on to its optimizer step


def test_a_lost_peer_inside_the_optimizer_step_is_left_to_it() -> None:
    hooks, _, _, _ = _hooks(Runtime(apply=False))
    hooks.committing = 5

    def run() -> None:
        raise PeerLostError("lost")

    with pytest.raises(PeerLostError):
        hooks.training_step(((), 0), {}, run)


def test_close_stops_a_finished_job_and_closes_the_runtime() -> None:
    er = Runtime(apply=True)
    hooks, _, _, _ = _hooks(er)
    hooks.close()
    assert er.calls == [Phase.STOPPED, ("close", True)]
