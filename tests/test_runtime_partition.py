"""Stage partition: time balance, memory limit, choice of P."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parcae.errors import InfeasibleShapeError, ModelLayoutError, StageMemoryError
from lightning_parcae.runtime.partition import (
    balance_stages,
    choose_pipeline_stages,
    layer_memory_bytes,
    profile_layer_times,
    stage_bounds,
)


def test_partition_balances_time_if_layers_uneven() -> None:
    assert balance_stages([1, 1, 1, 1, 4], 2) == [4, 1]
    assert balance_stages([3, 1, 1, 1, 3, 1], 3) == [1, 3, 2]
    assert sum(balance_stages([1.0] * 7, 3)) == 7


def test_partition_raises_model_layout_error_if_more_stages_than_layers() -> None:
    with pytest.raises(ModelLayoutError, match="3 layers into 4"):
        balance_stages([1, 1, 1], 4)


def test_partition_respects_memory_limit_if_time_balance_would_exceed_it() -> None:
    # time alone prefers [2, 2]; layer 0 is heavy in memory so it must stand alone
    sizes = balance_stages([1, 1, 1, 1], 2, memory=[90, 20, 20, 20], max_stage_memory_bytes=100)
    assert sizes == [1, 3]


def test_partition_raises_stage_memory_error_naming_stage_size_limit_if_nothing_fits() -> None:
    with pytest.raises(StageMemoryError, match=r"stage 0 \(layers 0\.\.0\) needs ~150 bytes .*=100"):
        balance_stages([1, 1, 1], 2, memory=[150, 10, 10], max_stage_memory_bytes=100)


def test_partition_estimates_memory_with_grads_and_optimizer_state_if_asked() -> None:
    layer = nn.Linear(10, 10)  # 110 float32 parameters = 440 bytes
    assert layer_memory_bytes(layer, optimizer_state_factor=2.0) == 440 * 4
    assert layer_memory_bytes(layer, optimizer_state_factor=0.0) == 440 * 2


def test_partition_profiles_each_layer_if_given_a_sample() -> None:
    stack = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 8))
    sample = torch.randn(32, 8)
    state = torch.get_rng_state()
    times = profile_layer_times(stack, sample, repeats=2)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert torch.equal(state, torch.get_rng_state())
    assert all(p.grad is None for p in stack.parameters())


def test_partition_chooses_pipeline_depth_if_not_given() -> None:
    # perfectly divisible work, many micro-batches: deeper pipelines cost only the bubble, D x P is the same work
    assert choose_pipeline_stages([1.0] * 4, world=4, micro_batches=8) == 1
    # a stage limit forces P >= 2
    assert choose_pipeline_stages([1.0] * 4, world=4, micro_batches=8, memory=[60] * 4,
                                  max_stage_memory_bytes=120) == 2
    with pytest.raises(InfeasibleShapeError):
        choose_pipeline_stages([1.0] * 2, world=4, micro_batches=8, memory=[200] * 2, max_stage_memory_bytes=100)


def test_partition_bounds_are_contiguous_if_sizes_given() -> None:
    assert stage_bounds([2, 1, 3]) == [(0, 2), (2, 3), (3, 6)]
