"""Single-process pieces of live reconfiguration: data re-slicing and the runtime's throughput model."""

from __future__ import annotations

import torch
from torch.utils.data import SequentialSampler

from lightning_parcae.runtime.data import GlobalBatchSampler
from lightning_parcae.runtime.elastic import RuntimeThroughput


def _sampler(replicas: int, replica: int) -> GlobalBatchSampler:
    return GlobalBatchSampler(SequentialSampler(range(32)), 8, replicas, replica, replicas * 2, False, True)


def test_sampler_records_each_batch_with_the_shape_it_was_cut_for_if_resharded_midway() -> None:
    s = _sampler(2, 1)
    it = iter(s)
    assert next(it) == [4, 5, 6, 7]
    s.reshard(4, 3, 8)  # the job went from D=2 to D=4 between two steps
    assert next(it) == [14, 15]
    assert [r[:2] for r in s.records] == [(2, 1), (4, 3)]
    d, replica, chunk = s.records[0]
    assert chunk == list(range(8))
    # a batch prefetched for D=2 is re-cut for the new shape from its recorded global batch
    assert s.slice_of(chunk, 4, 3) == [6, 7]


def test_runtime_throughput_forbids_shapes_if_d_does_not_split_the_global_batch() -> None:
    thr = RuntimeThroughput([1.0] * 4, global_batch=16, micro_batches=2)
    assert thr.throughput(3, 1) == 0.0  # 16 samples cannot be split over 3 pipelines x 2 micro-batches
    assert thr.throughput(2, 1) > thr.throughput(1, 2) > 0.0
    assert thr.throughput(1, 5) == 0.0  # more stages than layers
    assert thr.candidates(3) == [(1, 2), (1, 3), (2, 1)]
