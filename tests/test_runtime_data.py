"""The global-batch data path (runtime.data): any D re-slices the same global batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parcae.errors import BatchSplitError
from lightning_parcae.runtime.data import reshard_dataloader


def _loader(n: int, batch: int) -> DataLoader:
    return DataLoader(TensorDataset(torch.arange(n)), batch_size=batch)


def test_evaluation_batch_that_does_not_split_is_given_whole_to_every_pipeline() -> None:
    """Regression (chaos seed 1005): training batch 120 allowed D = 5; the validation loader's batch of 12 then
    raised BatchSplitError at the next validation and the job died. Every pipeline now evaluates the whole batch."""
    for replica in range(5):
        with pytest.warns(UserWarning, match="evaluation batch size 12 does not split over D=5"):
            loader, _ = reshard_dataloader(_loader(30, 12), 5, replica, micro_batches=2, train=False)
        batches = [b[0].tolist() for b in loader]
        assert batches == [list(range(12)), list(range(12, 24)), list(range(24, 30))]


@pytest.mark.parametrize("d", [1, 2, 3, 4, 6])
def test_evaluation_batch_that_splits_is_cut_into_disjoint_slices(d: int) -> None:
    parts = []
    for replica in range(d):
        loader, _ = reshard_dataloader(_loader(24, 12), d, replica, micro_batches=1, train=False)
        parts.append([i for b in loader for i in b[0].tolist()])
    assert sorted(i for p in parts for i in p) == list(range(24))


def test_training_batch_that_does_not_split_is_refused() -> None:
    with pytest.raises(BatchSplitError, match="12 cannot be split evenly over D=5"):
        reshard_dataloader(_loader(30, 12), 5, 0, micro_batches=1, train=True)
