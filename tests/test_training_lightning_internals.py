"""Lightning's private internals the strategy relies on still exist with the shape used (run this first after a
Lightning upgrade), and each adapter does what its docstring says -- on fakes where a real object is not needed."""

from __future__ import annotations

import importlib
import types
from typing import Any

import pytest
import torch

from lightning_parcae.training import lightning_internals as li

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")


@pytest.mark.parametrize("ns", NAMESPACES)
def test_the_wrapped_lightning_internals_exist(ns: str) -> None:
    pl = importlib.import_module(ns)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    assert callable(li.prepare_dataloader(trainer))
    assert callable(li.checkpoint_connector(trainer).resume_start)
    assert li.fit_data_source(trainer) is not None
    assert callable(trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor)
    assert callable(trainer.strategy.precision_plugin._after_closure)
    subprocess_launcher, multiprocessing_launcher = li.launcher_classes(
        importlib.import_module(f"{ns}.strategies.launchers"))
    assert subprocess_launcher.__name__ == "_SubprocessScriptLauncher"
    assert multiprocessing_launcher.__name__ == "_MultiProcessingLauncher"
    module = pl.LightningModule()
    assert li.module_trainer(module) is None and li.module_trainer(None) is None
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    wrapped = importlib.import_module(f"{ns}.core.optimizer").LightningOptimizer(optimizer)
    assert li.inner_optimizer(wrapped) is optimizer and li.inner_optimizer(optimizer) is optimizer


def test_the_dataloader_preparation_is_replaced_and_restored() -> None:
    class Connector:
        def _prepare_dataloader(self, *args: Any) -> str:
            return "own"

    trainer = types.SimpleNamespace(_data_connector=Connector())
    li.replace_prepare_dataloader(trainer, lambda *args: "ours")
    assert trainer._data_connector._prepare_dataloader() == "ours"
    li.restore_prepare_dataloader(trainer)
    assert trainer._data_connector._prepare_dataloader() == "own"


def test_after_closure_is_wrapped_once_and_unwrapped() -> None:
    class Plugin:
        def _after_closure(self, model: Any, optimizer: Any) -> str:
            return "own"

    plugin = Plugin()
    seen: list[str] = []

    def wrap(original: Any) -> Any:
        def after(model: Any, optimizer: Any) -> Any:
            seen.append("wrapped")
            return original(model, optimizer)
        return after

    li.wrap_after_closure(plugin, wrap)
    li.wrap_after_closure(plugin, wrap)
    assert plugin._after_closure(None, None) == "own" and seen == ["wrapped"]
    li.unwrap_after_closure(plugin)
    assert plugin._after_closure(None, None) == "own" and seen == ["wrapped"]


def test_the_sigterm_broadcast_is_silenced() -> None:
    trainer = types.SimpleNamespace(fit_loop=types.SimpleNamespace(epoch_loop=types.SimpleNamespace()))
    li.silence_sigterm_broadcast(trainer)
    assert trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor() is None


def test_a_litdata_stream_built_in_a_world_of_n_is_made_to_yield_the_whole_stream(tmp_path: Any) -> None:
    """LitData's StreamingDataset reads torch.distributed's world size when built (inside a DataModule's setup,
    under ParcaeStrategy that is a world of N) and then yields 1/N of the stream; every pipeline must read it all."""
    litdata = pytest.importorskip("litdata")
    from litdata.utilities.env import _DistributedEnv

    out = tmp_path / "ld"
    litdata.optimize(fn=_sample, inputs=list(range(8)), output_dir=str(out), chunk_bytes="1KB", num_workers=1)
    dataset = litdata.StreamingDataset(str(out))
    dataset.distributed_env = _DistributedEnv(world_size=2, global_rank=1, num_nodes=1)  # as if built at N = 2
    assert li.whole_stream_for_every_process(dataset)
    assert sorted(int(x) for x in dataset) == list(range(8))
    assert not li.whole_stream_for_every_process(torch.utils.data.TensorDataset(torch.ones(2)))


def _sample(i: int) -> int:
    return i
