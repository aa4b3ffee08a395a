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


def _slowest(times: list[float], sizes: list[int]) -> float:
    return max(sum(times[a:b]) for a, b in stage_bounds(sizes))


def test_partition_balances_time_if_layers_uneven() -> None:
    assert balance_stages([1, 1, 1, 1, 4], 2) == [4, 1]
    assert _slowest([3, 1, 1, 1, 3, 1], balance_stages([3, 1, 1, 1, 3, 1], 3)) == 4  # e.g. [2, 2, 2] or [1, 3, 2]
    assert sum(balance_stages([1.0] * 7, 3)) == 7


def test_partition_is_min_max_optimal_under_a_memory_limit_on_random_layers() -> None:
    """The runtime's layout comes from the planner's partitioner; brute force over all cuts agrees on its cost."""
    import itertools
    import random

    rng = random.Random(7)
    for _ in range(200):
        n, p = rng.randint(1, 8), rng.randint(1, 4)
        if p > n:
            continue
        times = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(n)]
        memory = [rng.randint(1, 50) for _ in range(n)]
        limit = rng.choice([None, 60, 90])
        best = None
        for cuts in itertools.combinations(range(1, n), p - 1):
            b = [0, *cuts, n]
            if limit is not None and any(sum(memory[x:y]) > limit for x, y in zip(b, b[1:])):
                continue
            cost = max(sum(times[x:y]) for x, y in zip(b, b[1:]))
            best = cost if best is None else min(best, cost)
        if best is None:
            with pytest.raises(StageMemoryError):
                balance_stages(times, p, memory, limit)
            continue
        sizes = balance_stages(times, p, memory, limit)
        assert len(sizes) == p and all(s >= 1 for s in sizes) and sum(sizes) == n
        assert _slowest(times, sizes) == pytest.approx(best)
        if limit is not None:
            assert all(sum(memory[a:b]) <= limit for a, b in stage_bounds(sizes))


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


def test_profiling_a_layer_without_parameter_storage_is_refused_naming_it() -> None:
    stack = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    stack[1].to("meta")  # released: another stage holds it
    with pytest.raises(ModelLayoutError, match=r"cannot profile layers \[1\]: they hold no parameter storage"):
        profile_layer_times(stack, torch.randn(2, 4), repeats=1)


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
