"""The data path: Lightning's sampler injection replaced, the sample cursor, its rewind and resume -- with a fake
trainer and fake groups, no processes."""

from __future__ import annotations

import types
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parcae.training.data_path import DataPath
from lightning_parcae.training.stage_state import StageState


def _groups(d: int = 2, replica: int = 1) -> types.SimpleNamespace:
    return types.SimpleNamespace(data_parallel=d, coords=types.SimpleNamespace(replica=replica))


def _path(groups: Any = None, micro: int = 1) -> DataPath:
    return DataPath(StageState(groups=groups), micro, False, lambda batch: batch)


class _Connector:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def _prepare_dataloader(self, dataloader: Any, shuffle: bool, mode: Any) -> Any:
        self.calls.append(mode)
        return "lightning's"


def test_sampler_kwargs_give_every_stage_of_a_pipeline_the_same_shard() -> None:
    assert _path(_groups(4, 3)).sampler_kwargs() == {"num_replicas": 4, "rank": 3}
    assert _path(None).sampler_kwargs() == {"num_replicas": 1, "rank": 0}


def test_training_loaders_are_resharded_and_predict_goes_to_lightning() -> None:
    trainer = types.SimpleNamespace(_data_connector=_Connector())
    path = _path(_groups(2, 1))
    path.install(trainer)  # type: ignore[arg-type]
    loader = DataLoader(TensorDataset(torch.arange(8.0)), batch_size=4)
    new = trainer._data_connector._prepare_dataloader(loader, False, "train")
    assert new is path.train_loader and path.global_batch == 4
    assert [b[0].tolist() for b in new] == [[2.0, 3.0], [6.0, 7.0]]  # replica 1's half of each global batch
    assert trainer._data_connector._prepare_dataloader(loader, False, "predict") == "lightning's"
    path.uninstall(trainer)
    assert trainer._data_connector._prepare_dataloader(loader, False, "train") == "lightning's"


def test_the_cursor_counts_global_batches_and_restarts_with_an_epoch() -> None:
    path = _path(_groups())
    path.global_batch = 8
    path.count_samples(0)
    path.count_samples(0)
    assert path.state()["cursor"] == 16 and path.state()["epoch"] == 0
    path.count_samples(1)
    assert (path.cursor_epoch, path.cursor) == (1, 8)


def test_a_discarded_window_rewinds_to_its_start_and_replays_its_batches_recut_for_the_new_shape() -> None:
    """Two micro-steps of an accumulation window ran at D = 2 (replica 0's halves); the window is discarded and the
    job recovers to D = 1: the cursor goes back to the window's start and each replayed micro-step gets the whole
    global batch rebuilt from the dataset, the last one Lightning's own batch only if the shape is unchanged."""
    state = StageState(groups=_groups(2, 0))
    path = DataPath(state, 1, True, lambda batch: batch)
    trainer = types.SimpleNamespace(_data_connector=_Connector())
    path.install(trainer)  # type: ignore[arg-type]
    loader = trainer._data_connector._prepare_dataloader(
        DataLoader(TensorDataset(torch.arange(16.0)), batch_size=4), False, "train")
    batches = iter(loader)
    for _ in range(2):
        batch = next(batches)
        assert path.effective_batch(batch) is batch  # sliced for this shape: as Lightning gave it
        path.count_samples(0)
    assert [r[2] for r in path.window] == [[0, 1, 2, 3], [4, 5, 6, 7]] and path.last_step_indices == [0, 1, 4, 5]
    records = path.restart_window()
    assert (path.cursor_epoch, path.cursor) == (-1, 0) and path.window == []
    state.groups = _groups(1, 0)
    path.replay_next(records[0], given=False)
    assert path.effective_batch(None)[0].tolist() == [0.0, 1.0, 2.0, 3.0]
    path.count_samples(0)
    stale = [torch.tensor([4.0, 5.0])]  # Lightning's batch for the last micro-step was cut for D = 2
    path.replay_next(records[1], given=True)
    assert path.effective_batch(stale)[0].tolist() == [4.0, 5.0, 6.0, 7.0]
    path.count_samples(0)
    assert path.cursor == 8 and path.last_step_indices == list(range(8)) and len(path.window) == 2
    path.close_window()
    assert path.window == []


def test_a_resumed_cursor_continues_mid_epoch() -> None:
    path = _path(_groups())
    path.resume_from({"epoch": 2, "cursor": 12, "global_batch": 4})
    path.global_batch = 4
    path.count_samples(2)
    assert path.cursor == 16
    assert path.resume == {"epoch": 2, "cursor": 12, "rng": None, "rng_now": None}
