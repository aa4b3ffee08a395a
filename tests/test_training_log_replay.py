"""Merging ``self.log`` over micro-batches (one call per name, merged as ``reduce_fx`` says), and the calls crossing
to another pipeline stage (plain values; a torchmetrics Metric as its state, loaded into the receiver's copy)."""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch
from torch import nn

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.training.log_replay import LogCall, LogRecorder, local_calls, portable_calls, replay_calls


class Module:
    def __init__(self) -> None:
        self.logged: list[tuple[str, Any, dict[str, Any]]] = []

    def log(self, name: str, value: Any, **kwargs: Any) -> None:
        self.logged.append((name, value, kwargs))


def _record(module: Module, calls: list[tuple[str, Any, dict[str, Any]]]) -> None:
    recorder = LogRecorder(module)
    with recorder.active():
        for name, value, kwargs in calls:
            module.log(name, value, **kwargs)
    assert module.logged == []  # nothing reached Lightning during the micro-steps
    recorder.replay()


@pytest.mark.parametrize("fx,expected", [("mean", 2.0), ("sum", 6.0), ("max", 3.0), ("min", 1.0)])
def test_one_merged_call_per_name_by_reduce_fx(fx: str, expected: float) -> None:
    module = Module()
    _record(module, [("loss", torch.tensor(v), {"reduce_fx": fx}) for v in (1.0, 2.0, 3.0)])
    assert len(module.logged) == 1
    name, value, _ = module.logged[0]
    assert name == "loss" and float(value) == expected


def test_batch_sizes_are_summed_and_non_numbers_keep_the_last_value() -> None:
    module = Module()
    _record(module, [("acc", 0.5, {"batch_size": 2}), ("acc", 1.0, {"batch_size": 2}), ("tag", "a", {}),
                     ("tag", "b", {})])
    logged = {name: (value, kwargs) for name, value, kwargs in module.logged}
    assert float(logged["acc"][0]) == 0.75 and logged["acc"][1]["batch_size"] == 4
    assert logged["tag"][0] == "b"


def test_positional_log_options_are_refused() -> None:
    recorder = LogRecorder(Module())
    with pytest.raises(ConfigurationError, match="by keyword"):
        recorder("loss", 1.0, True)


def test_in_order_keeps_every_call_as_made() -> None:
    recorder = LogRecorder(Module())
    recorder("a", 1.0)
    recorder("b", 2.0, prog_bar=True)
    recorder("a", 3.0)
    assert [(c.name, c.value, c.kwargs) for c in recorder.in_order()] == [
        ("a", 1.0, {}), ("b", 2.0, {"prog_bar": True}), ("a", 3.0, {})]


class MetricModule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        import torchmetrics

        self.acc = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")


def test_a_logged_metric_crosses_as_its_state_and_loads_into_the_receivers_copy() -> None:
    sender, receiver = MetricModule(), MetricModule()
    sender.acc(torch.tensor([0, 1, 2, 2]), torch.tensor([0, 1, 1, 1]))
    step_value = sender.acc(torch.tensor([0, 1]), torch.tensor([0, 1]))  # what Lightning logs on step
    calls = [LogCall("acc", sender.acc, {"on_epoch": True}), LogCall("loss", torch.tensor(2.5), {})]
    sent = pickle.loads(pickle.dumps(portable_calls(sender, calls)))
    assert not any(isinstance(c.value, nn.Module) for c in sent)  # no module object crosses, only its state
    got = local_calls(receiver, sent, torch.device("cpu"))
    assert got[0].value is receiver.acc and got[0].kwargs == {"on_epoch": True}
    assert float(got[1].value) == 2.5
    assert float(receiver.acc.compute()) == pytest.approx(float(sender.acc.compute())) == pytest.approx(4 / 6)
    assert receiver.acc.update_count == 2
    replayed = Module()
    replay_calls(replayed, got)  # what the receiving stage hands Lightning: its own metric, with the step value
    assert replayed.logged[0][1] is receiver.acc
    assert float(receiver.acc.__getstate__()["_forward_cache"]) == pytest.approx(float(step_value))


def test_a_logged_metric_that_is_not_a_submodule_is_refused_by_name() -> None:
    import torchmetrics

    stray = torchmetrics.classification.MulticlassAccuracy(num_classes=3)
    with pytest.raises(ConfigurationError, match="must be a submodule"):
        portable_calls(MetricModule(), [LogCall("acc", stray, {})])
