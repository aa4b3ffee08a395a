"""The global-batch data path (runtime.data): any D re-slices the same global batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_parcae.errors import BatchSplitError, ConfigurationError
from lightning_parcae.runtime.data import reshard_dataloader, rows_of


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


# ------------------------------------------------------------------------------------------------ streams
class _Stream(torch.utils.data.IterableDataset):
    """A stream of the numbers 0..n-1 that counts how often it was iterated."""

    def __init__(self, n: int) -> None:
        self.n, self.exhausted = n, False

    def __iter__(self):  # type: ignore[no-untyped-def]
        self.exhausted = False
        yield from (torch.tensor([float(i)]) for i in range(self.n))
        self.exhausted = True


class _SizedStream(_Stream):
    def __len__(self) -> int:
        return self.n


def test_a_stream_is_handed_out_whole_and_each_pipeline_keeps_its_rows() -> None:
    """Regression (issue 23): an IterableDataset was refused ('needs a map-style dataset'). Every pipeline now
    reads the whole stream; the records give the batch's positions, rows_of cuts this replica's part."""
    stream, sampler = reshard_dataloader(DataLoader(_Stream(8), batch_size=4), 2, 1, micro_batches=1, train=True)
    assert stream is sampler
    batches = list(stream)
    assert [b.squeeze(1).tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]  # whole global batches
    assert [r[2] for r in sampler.records] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert rows_of(batches[1], 2, 1).squeeze(1).tolist() == [6.0, 7.0]
    assert sampler.slice_of([4, 5, 6, 7], 2, 1) == [6, 7]


def test_a_resumed_stream_rereads_and_skips_what_was_consumed() -> None:
    stream, sampler = reshard_dataloader(DataLoader(_Stream(12), batch_size=4), 1, 0, micro_batches=1, train=True)
    sampler.set_epoch(3)
    sampler.start_at(3, 4)
    assert [b.squeeze(1).tolist() for b in stream] == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert [r[2][0] for r in sampler.records] == [4, 8]  # positions in the epoch's stream, not in what was read
    assert [len(list(stream))] == [3]  # the next epoch starts at the beginning


def test_a_partial_last_batch_of_a_stream_is_dropped_under_live_reconfiguration() -> None:
    stream, _ = reshard_dataloader(DataLoader(_Stream(10), batch_size=4), 2, 0, micro_batches=1, train=True,
                                   fixed_epoch=True)
    with pytest.warns(UserWarning, match="dropping a partial global batch of 2 samples"):
        assert len(list(stream)) == 2


def test_a_sized_stream_stops_after_its_length_without_being_exhausted() -> None:
    """LitData's StreamingDataset draws the next epoch's shuffle when exhausted; Lightning stops a sized loader after
    its last batch in one process, so the stream must not be exhausted here either (it was: 0.19 off one process)."""
    data = _SizedStream(8)
    stream, _ = reshard_dataloader(DataLoader(data, batch_size=4), 1, 0, micro_batches=1, train=True)
    assert len(stream) == 2 and len(list(stream)) == 2
    assert not data.exhausted


def test_an_evaluation_stream_is_given_whole_to_every_pipeline() -> None:
    loader = DataLoader(_Stream(8), batch_size=4)
    assert reshard_dataloader(loader, 3, 2, micro_batches=1, train=False) == (loader, None)


def test_a_stream_without_a_batch_size_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"DataLoader\(dataset, batch_size=B\)"):
        reshard_dataloader(DataLoader(_Stream(8), batch_size=None), 1, 0, micro_batches=1, train=True)
