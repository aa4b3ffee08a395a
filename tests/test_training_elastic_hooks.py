"""The elastic hooks: the two-phase optimizer step (applied or discarded everywhere, then re-run), the commit
after the closure, the fit-loop set-up and the close -- with fakes of the runtime, data path, step runner and
process setup."""

from __future__ import annotations

import types
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from lightning_parcae.errors import ConfigurationError, PeerLostError
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
    host = types.SimpleNamespace(elastic_runtime=er, lightning_module=module, precision_plugin=Plugin())
    data = DataPath(StageState(), 1, True, lambda b: b)
    steps = Steps()
    return ElasticHooks(host, data, steps, Process(), "pytorch_lightning"), data, steps, host  # type: ignore[arg-type]


def test_a_step_interrupted_and_discarded_is_rewound_and_run_again() -> None:
    er = Runtime(apply=False)
    hooks, data, steps, host = _hooks(er)
    data.cursor_epoch, data.cursor = 0, 40
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


def test_accumulated_steps_are_refused_under_live_reconfiguration() -> None:
    hooks, _, _, _ = _hooks(Runtime(apply=True))
    trainer = types.SimpleNamespace(accumulate_grad_batches=2, callbacks=[])
    with pytest.raises(ConfigurationError, match="accumulate_grad_batches=1"):
        hooks.setup(trainer, joining=True)  # type: ignore[arg-type]


def test_close_stops_a_finished_job_and_closes_the_runtime() -> None:
    er = Runtime(apply=True)
    hooks, _, _, _ = _hooks(er)
    hooks.close()
    assert er.calls == [Phase.STOPPED, ("close", True)]
