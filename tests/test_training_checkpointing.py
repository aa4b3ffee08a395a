"""Strategy checkpoints: the layout record and sample cursor written, the cursor resumed on load, only held keys
loaded, a layer that is not held refused -- with a fake strategy and fake groups (no gather: rank 0 of one)."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.training.checkpointing import CKPT_KEY, StrategyCheckpoints
from lightning_parcae.training.data_path import DataPath
from lightning_parcae.training.stage_state import StageState


class Module(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))


def _checkpoints() -> tuple[StrategyCheckpoints, DataPath, Module, StageState]:
    module = Module()
    groups = types.SimpleNamespace(data_parallel=2, pipeline_stages=2, coords=types.SimpleNamespace(stage=1, replica=0))
    state = StageState(groups=groups, stack_path="net", layer_names=["0", "1"], partition=[1, 1],  # type: ignore[arg-type]
                       layer_times=[0.25, 0.5])
    host = types.SimpleNamespace(lightning_module=module, optimizers=[], global_rank=0, is_global_zero=True,
                                 root_device=torch.device("cpu"), checkpoint_io=None, elastic_runtime=None)
    data = DataPath(state, 2, False, lambda b: b)
    return StrategyCheckpoints(state, 2, host, data), data, module, state  # type: ignore[arg-type]


def test_a_saved_checkpoint_records_the_layout_and_resumes_the_cursor(tmp_path: Path) -> None:
    ckpts, data, _, _ = _checkpoints()
    data.global_batch, data.cursor_epoch, data.cursor = 8, 1, 24
    path = tmp_path / "last.ckpt"
    ckpts.save({"state_dict": {}}, path)
    saved = torch.load(path, weights_only=True)[CKPT_KEY]
    assert saved["layout"] == {"data_parallel": 2, "pipeline_stages": 2, "partition": [1, 1],
                               "layer_names": ["0", "1"], "stack_path": "net", "micro_batches": 2,
                               "layer_times": [0.25, 0.5], "global_batch": 8, "device": "cpu"}
    fresh, fresh_data, _, _ = _checkpoints()
    fresh.load(path)
    assert fresh_data.resume == {"epoch": 1, "cursor": 24, "rng": None, "rng_now": None}
    assert fresh.resumed_layout is not None and fresh.resumed_layout["layer_times"] == [0.25, 0.5]


def test_a_checkpoint_offers_its_layer_times_only_to_the_same_kind_of_device_and_none_without_them(
        tmp_path: Path) -> None:
    """The layer times a relaunch may reuse instead of profiling were measured on one kind of device: a checkpoint
    written on another (here: a record saying ``cuda:...``) offers none; one of the format before them loads and
    offers none."""
    ckpts, data, _, _ = _checkpoints()
    data.global_batch = 8
    path = tmp_path / "last.ckpt"
    ckpts.save({"state_dict": {}}, path)
    full = torch.load(path, weights_only=True)
    full[CKPT_KEY]["layout"]["device"] = "cuda:Tesla V100-SXM2-16GB"
    torch.save(full, tmp_path / "gpu.ckpt")
    for key in ("layer_times", "global_batch", "device"):
        full[CKPT_KEY]["layout"].pop(key)
    torch.save(full, tmp_path / "old.ckpt")
    fresh, _, _, _ = _checkpoints()
    fresh.load(path)
    assert fresh.resumed_layout is not None
    fresh.load(tmp_path / "gpu.ckpt")
    assert fresh.resumed_layout is None
    fresh.load(tmp_path / "old.ckpt")
    assert fresh.resumed_layout is None


def test_local_state_dump_returns_this_process_own_state() -> None:
    ckpts, _, module, _ = _checkpoints()
    with ckpts.local_state_dump():
        assert set(ckpts.module_state_dict()) == set(module.state_dict())
    assert ckpts.local_dump is False


def test_loading_takes_only_the_keys_this_process_holds_and_refuses_missing_ones() -> None:
    ckpts, _, module, _ = _checkpoints()
    full = {k: torch.full_like(v, 3.0) for k, v in module.state_dict().items()}
    ckpts.load_model_state_dict({"state_dict": {**full, "other.weight": torch.zeros(1)}})
    assert torch.all(module.net[0].weight == 3.0)
    with pytest.raises(ConfigurationError, match="lacks 1 keys"):
        ckpts.load_model_state_dict({"state_dict": {k: v for k, v in full.items() if k != "net.0.bias"}})


def test_layer_state_refuses_a_layer_held_by_another_stage() -> None:
    ckpts, _, _, _ = _checkpoints()
    assert set(ckpts.layer_state(1)) == {"net.1.weight", "net.1.bias"}
    with pytest.raises(ConfigurationError, match="layer 0 is not on this process"):
        ckpts.layer_state(0)


def test_background_writes_are_one_at_a_time_and_waited_for(tmp_path: Path) -> None:
    ckpts, _, _, _ = _checkpoints()
    ckpts.save_in_background({"a": torch.ones(2)}, str(tmp_path / "a.ckpt"))
    ckpts.save_in_background({"b": torch.ones(2)}, str(tmp_path / "b.ckpt"))
    ckpts.wait()
    assert ckpts.writer is None and (tmp_path / "a.ckpt").exists() and (tmp_path / "b.ckpt").exists()
