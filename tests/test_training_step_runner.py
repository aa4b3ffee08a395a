"""The step runner at P = 1, its gradient bookkeeping, and what its last stage hands the other stages -- with a fake
strategy, fake groups, a fake transport and a fake data path (the pipelined schedule itself is covered by
tests/test_strategy.py, against single-process training)."""

from __future__ import annotations

import types
from contextlib import nullcontext
from typing import Any, Optional

import pytest
import torch
from torch import nn

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.runtime.pipeline import P2P
from lightning_parcae.training.stage_state import StageState
from lightning_parcae.training.log_replay import LogCall
from lightning_parcae.training.step_runner import StepOutcome, StepRunner


class Module(nn.Module):
    automatic_optimization = True

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 1, bias=False))
        self.trainer = types.SimpleNamespace(accumulate_grad_batches=1, current_epoch=3)
        self.steps: list[Any] = []

    def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
        self.steps.append(batch)
        return self.net(batch).sum()


class Precision:
    scaler = None

    def train_step_context(self) -> Any:
        return nullcontext()

    def pre_backward(self, loss: torch.Tensor, module: Any) -> torch.Tensor:
        return loss

    def post_backward(self, loss: torch.Tensor, module: Any) -> torch.Tensor:
        return loss


class Data:
    def __init__(self) -> None:
        self.counted: list[int] = []

    def effective_batch(self, batch: Any) -> Any:
        return batch

    def count_samples(self, epoch: int) -> None:
        self.counted.append(epoch)


def _runner(module: Module, micro: int = 1) -> tuple[StepRunner, Data]:
    groups = types.SimpleNamespace(pipeline_stages=1, data_parallel=1, world=1, is_first_stage=True,
                                   coords=types.SimpleNamespace(stage=0), prev_rank=lambda: None,
                                   next_rank=lambda: None, pipeline_group=None, data_group=None)
    state = StageState(groups=groups, stack_path="net", stage=module.net, p2p=P2P(torch.device("cpu")))  # type: ignore[arg-type]
    host = types.SimpleNamespace(lightning_module=module, precision_plugin=Precision(), root_device=torch.device("cpu"))
    data = Data()
    return StepRunner(state, micro, "1f1b", host, data), data  # type: ignore[arg-type]


def test_at_p1_the_users_step_runs_per_micro_batch_and_the_cursor_advances_once() -> None:
    module = Module()
    runner, data = _runner(module, micro=2)
    loss = runner.training_step(torch.ones(4, 2), 0)
    assert [b.shape[0] for b in module.steps] == [2, 2] and data.counted == [3]
    assert torch.isclose(loss, module.net(torch.ones(2, 2)).sum().detach())


def test_the_steps_gradients_are_kept_aside_and_put_back_in_backward() -> None:
    module = Module()
    runner, _ = _runner(module)
    loss = runner.training_step(torch.ones(1, 2), 0)
    weight = module.net[0].weight
    assert weight.grad is None and runner.pending_grads is not None  # Lightning's zero_grad comes in between
    runner.backward(loss)
    assert weight.grad is not None and torch.allclose(weight.grad, torch.ones(1, 2))
    assert runner.pending_grads is None


def test_a_discarded_step_drops_its_pending_gradients() -> None:
    module = Module()
    runner, _ = _runner(module)
    loss = runner.training_step(torch.ones(1, 2), 0)
    runner.discard_pending()
    runner.backward(loss)
    assert module.net[0].weight.grad is None


def test_no_sync_suspends_the_gradient_reduction_only_inside() -> None:
    runner, _ = _runner(Module())
    with runner.no_sync():
        assert runner.sync_grads is False
    assert runner.sync_grads is True


def test_manual_optimization_is_refused_at_p_above_1_and_with_a_grad_scaler() -> None:
    """Regression (issue 23): manual optimization was refused outright; at P = 1 it now runs (below). At P > 1 the
    schedule must own forward and backward, and a GradScaler under manual optimization is not wired: both refused,
    naming the fix."""
    module = Module()
    runner, _ = _runner(module)
    module.automatic_optimization = False
    runner.check_supported(module)  # P = 1: supported
    runner.state.groups.pipeline_stages = 2  # type: ignore[union-attr]
    with pytest.raises(ConfigurationError, match="pipeline_stages=1"):
        runner.check_supported(module)
    runner.state.groups.pipeline_stages = 1  # type: ignore[union-attr]
    runner.host.precision_plugin.scaler = object()  # type: ignore[attr-defined]
    with pytest.raises(ConfigurationError, match="manual optimization with 16-mixed"):
        runner.check_supported(module)
    module.automatic_optimization = True
    with pytest.raises(ConfigurationError, match="GradScaler"):
        runner.check_supported(module)


def test_manual_optimization_runs_the_users_step_once_and_its_backward_reduces() -> None:
    module = Module()
    module.automatic_optimization = False
    runner, data = _runner(module, micro=2)
    calls: list[str] = []
    runner.host.precision_plugin.backward = lambda loss, m, opt: (calls.append("backward"), loss.backward())
    runner.reduce_gradients = lambda: calls.append("reduce")  # type: ignore[method-assign]
    loss = runner.training_step(torch.ones(4, 2), 0)
    assert [b.shape[0] for b in module.steps] == [4] and data.counted == [3]  # no micro-batch schedule
    runner.backward(loss, None)
    assert calls == ["backward", "reduce"]
    assert torch.allclose(module.net[0].weight.grad, torch.full((1, 2), 4.0))

def test_clipping_scales_by_the_norm_over_all_parameters() -> None:
    module = Module()
    runner, _ = _runner(module)
    module.net[0].weight.grad = torch.tensor([[3.0, 4.0]])
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    runner.clip_grad_by_norm(opt, 1.0)
    assert torch.allclose(module.net[0].weight.grad.norm(), torch.tensor(1.0), atol=1e-5)


# ------------------------------------------------------------------------------- what crosses stages at P = 2
class Transport:
    """Stands in for the pipeline transport: records what is broadcast, answers with what the last stage sent."""

    device = torch.device("cpu")

    def __init__(self, incoming: Optional[torch.Tensor] = None) -> None:
        self.sent: list[tuple[torch.Tensor, int]] = []
        self.incoming = incoming

    def broadcast(self, t: Optional[torch.Tensor], src: int) -> torch.Tensor:
        if t is not None:
            self.sent.append((t, src))
            return t
        assert self.incoming is not None
        return self.incoming


class MetricModule(Module):
    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")


def _stage_runner(module: Module, last: bool, transport: Transport) -> StepRunner:
    groups = types.SimpleNamespace(pipeline_stages=2, data_parallel=1, world=2, is_last_stage=last,
                                   is_first_stage=not last, last_stage_rank=lambda: 1)
    state = StageState(groups=groups, stack_path="net", stage=module.net, p2p=transport)  # type: ignore[arg-type]
    host = types.SimpleNamespace(lightning_module=module, precision_plugin=Precision(), root_device=torch.device("cpu"))
    return StepRunner(state, 2, "1f1b", host, Data())  # type: ignore[arg-type]


def test_the_last_stage_sends_its_logs_and_loss_and_the_others_get_them() -> None:
    sender, receiver = MetricModule(), MetricModule()
    sender.acc(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 1]))
    big = torch.randn(64, 1024)  # the stack output of a language model: it must not cross
    # mse_loss returns a 0-d view of a buffer the size of its input; pickling the view would send the buffer
    loss = torch.nn.functional.mse_loss(big, torch.zeros_like(big))
    mine = StepOutcome([LogCall("loss", loss, {"sync_dist": True}), LogCall("acc", sender.acc, {})],
                       (loss.detach(), {"seen": torch.tensor(3.0)}))
    out = Transport()
    assert _stage_runner(sender, True, out).share_outcome(mine) is mine  # the last stage keeps its own outcome
    (payload, src), = out.sent
    assert src == 1 and payload.dtype == torch.uint8 and payload.numel() < big.numel() * 4 / 20
    got = _stage_runner(receiver, False, Transport(payload)).share_outcome(None)
    assert [(c.name, c.kwargs) for c in got.calls] == [("loss", {"sync_dist": True}), ("acc", {})]
    assert torch.equal(got.calls[0].value, loss.detach()) and got.calls[1].value is receiver.acc
    assert float(receiver.acc.compute()) == pytest.approx(0.5)
    received_loss, extras = got.result
    assert torch.equal(received_loss, loss.detach()) and float(extras["seen"]) == 3.0


def test_an_outcome_that_cannot_cross_fails_on_every_stage_instead_of_hanging_the_others() -> None:
    mine = StepOutcome([LogCall("loss", torch.tensor(1.0), {"reduce_fx": lambda xs: xs.mean()})], (None, None))
    out = Transport()
    with pytest.raises(ConfigurationError, match="could not be sent"):
        _stage_runner(Module(), True, out).share_outcome(mine)
    (payload, _), = out.sent  # the last stage still sent something: the error
    with pytest.raises(ConfigurationError, match="could not be sent"):
        _stage_runner(Module(), False, Transport(payload)).share_outcome(None)


def test_a_step_does_not_hold_the_previous_gradients_when_lightning_zeroes_them_anyway() -> None:
    """Regression (issue 22, bench_pipeline_peer): every stage kept the previous step's gradients aside through the
    whole step although Lightning's zero_grad drops them right after it -- one extra gradient set at the peak. They
    are dropped now when nothing accumulates and optimizer_zero_grad is Lightning's own; kept otherwise."""
    import pytorch_lightning as pl

    from lightning_parcae.training.step_runner import _zeroed_after_step

    class Plain(pl.LightningModule):
        pass

    class Keeps(pl.LightningModule):
        def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: Any) -> None:
            pass  # accumulates across steps on purpose

    trainer = types.SimpleNamespace(accumulate_grad_batches=1)
    assert _zeroed_after_step(Plain(), trainer)
    assert not _zeroed_after_step(Keeps(), trainer)
    assert not _zeroed_after_step(Plain(), types.SimpleNamespace(accumulate_grad_batches=2))
    assert not _zeroed_after_step(Module(), trainer)  # not a LightningModule: keep them (as before)


def test_on_an_emulated_cluster_the_data_parallel_all_reduce_charges_the_stages_layers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """At D = 2 the gradient all-reduce first sleeps the modelled ring all-reduce of the layers this stage holds
    (lightning_parcae.runtime.link); at D = 1 nothing is charged."""
    from lightning_parcae.runtime import link
    from lightning_parcae.training import step_runner

    calls: list[tuple[list[int], int]] = []

    class Link:
        def charge(self, layers: Any) -> float:
            return 0.0

        def allreduce_s(self, layers: Any, replicas: int) -> float:
            calls.append((list(layers), replicas))
            return 0.0

    reduced: list[int] = []
    monkeypatch.setattr(step_runner, "_all_reduce_grads", lambda params, group, scale: reduced.append(len(params)))
    before = link.set_modelled_link(Link())
    try:
        module = Module()
        runner, _ = _runner(module)
        runner.state.partition = [1]
        loss = runner.training_step(torch.ones(1, 2), 0)
        runner.backward(loss)
        runner.reduce_gradients()  # D = 1
        assert calls == [] and reduced == []
        runner.state.groups.data_parallel = 2  # type: ignore[union-attr]
        runner.reduce_gradients()
        assert calls == [([0], 2)] and reduced == [1]
    finally:
        link.set_modelled_link(before)
