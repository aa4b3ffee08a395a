"""Split a layer stack into P contiguous pipeline stages, balanced by measured time, under a memory limit.

Problem: pipeline throughput is set by the slowest stage, so the L layers of the model's ``nn.Sequential`` must be
cut into P contiguous groups whose *measured* compute times are as equal as possible; parameter counts are a poor
proxy (an attention block and an embedding of the same size differ by orders of magnitude in time). At the same
time, each stage must fit the per-process memory limit: parameters + gradients + optimizer state. This module
measures per-layer forward+backward time on a sample input, estimates per-layer training memory, and cuts with the
planner's min-max partitioner (:func:`~lightning_parcae.planning.costmodel.min_max_partition`, a per-stage memory
limit as its constraint), so the layout built here is the one the simulator and the liveput optimizer price. It
also picks P when the user does not give one, from the same profile.

Everything here is local and deterministic given its inputs; the strategy profiles on one rank and shares the
numbers so that all ranks compute the same partition.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Callable, Optional

import torch
from torch import Tensor, nn

from lightning_parcae.errors import InfeasibleShapeError, ModelLayoutError, StageMemoryError
from lightning_parcae.planning.costmodel import min_max_partition
from lightning_parcae.runtime.pipeline import without_caches

__all__ = [
    "profile_layer_times",
    "layer_memory_bytes",
    "tensors_memory_bytes",
    "balance_stages",
    "stage_bounds",
    "choose_pipeline_stages",
]


def profile_layer_times(layers: nn.Module, sample: torch.Tensor, repeats: int = 3, args: tuple = (),
                        kwargs: Optional[dict] = None) -> list[float]:
    """Measure each layer's forward + backward time on ``sample`` (seconds, median of ``repeats``).

    The sample flows through the stack layer by layer, so each layer is timed on its real input shape. Runs under
    a forked RNG so that profiling does not change the training run's random stream.

    Args:
        layers: the full layer stack (an ``nn.Sequential``, or an ``nn.ModuleList`` of blocks).
        sample: the input of the first layer (batch dimension first).
        repeats: timed repetitions per layer (after one warm-up).
        args: further positional arguments every block gets (masks, positions), after the hidden state.
        kwargs: keyword arguments every block gets. A key/value cache among the arguments (``transformers``
            creates one per forward when ``use_cache`` is on) is dropped: every repetition would append to it and
            reach into the autograd graph of the one before.

    Returns:
        One time per layer, in stack order.

    Raises:
        ModelLayoutError: if a layer's parameters have no storage (``meta``: released because another stage
            holds it).
    """
    released = [i for i, layer in enumerate(layers) if any(t.is_meta for t in layer.parameters())]
    if released:
        raise ModelLayoutError(
            f"cannot profile layers {released}: they hold no parameter storage on this process (their parameters "
            "are on the 'meta' device -- another stage holds them, or the model was built on 'meta'). Profile the "
            "stack before it is cut into stages, with every layer's parameters materialized"
        )
    times: list[float] = []
    args, kwargs = without_caches(tuple(args), dict(kwargs or {}), empty_only=False)
    devices = [sample.device] if sample.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        x = sample.detach()
        for layer in layers:
            samples: list[float] = []
            out: torch.Tensor = x
            for i in range(repeats + 1):
                inp = x.detach().requires_grad_(x.is_floating_point())
                if sample.device.type == "cuda":
                    torch.cuda.synchronize(sample.device)
                t0 = time.perf_counter()
                out = layer(inp, *args, **kwargs)
                if isinstance(out, (tuple, list)):  # a block may return (hidden, extras...)
                    out = out[0]
                if out.requires_grad:
                    out.backward(torch.ones_like(out))
                if sample.device.type == "cuda":
                    torch.cuda.synchronize(sample.device)
                if i > 0:
                    samples.append(time.perf_counter() - t0)
            layer.zero_grad(set_to_none=True)
            times.append(sorted(samples)[len(samples) // 2])
            x = out.detach()
    return times


def layer_memory_bytes(layer: nn.Module, optimizer_state_factor: float = 2.0) -> int:
    """Estimate a layer's resident training memory: parameters, gradients, optimizer state and buffers.

    Args:
        layer: one layer of the stack.
        optimizer_state_factor: optimizer state per parameter byte (Adam: 2, SGD+momentum: 1, plain SGD: 0).

    Returns:
        Bytes (activations are not counted: they depend on the micro-batch size and the schedule).
    """
    return tensors_memory_bytes(list(layer.parameters()), list(layer.buffers()), optimizer_state_factor)


def tensors_memory_bytes(params: Sequence[Tensor], buffers: Sequence[Tensor], optimizer_state_factor: float = 2.0
                         ) -> int:
    """Resident training memory of these parameters (with, if trainable, their gradients and optimizer state) and
    buffers -- :func:`layer_memory_bytes` for tensors that are not one module (the parts outside the stack)."""
    size = sum(p.numel() * p.element_size() for p in params)
    trainable = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    buffered = sum(b.numel() * b.element_size() for b in buffers)
    return int(size + trainable * (1.0 + optimizer_state_factor) + buffered)


def stage_bounds(sizes: Sequence[int]) -> list[tuple[int, int]]:
    """Turn stage sizes (layers per stage) into half-open layer ranges ``[(start, stop), ...]``."""
    bounds, start = [], 0
    for n in sizes:
        bounds.append((start, start + n))
        start += n
    return bounds


def _split(costs: Sequence[float], stages: int, fits: Optional[Callable[[int, int], bool]] = None) -> Optional[list[int]]:
    """Layers per stage of the planner's min-max split (:func:`~lightning_parcae.planning.costmodel.min_max_partition`)."""
    bounds = min_max_partition(costs, stages, fits)
    return None if bounds is None else [b - a for a, b in zip(bounds, bounds[1:])]


def balance_stages(
    times: Sequence[float],
    pipeline_stages: int,
    memory: Optional[Sequence[int]] = None,
    max_stage_memory_bytes: Optional[int] = None,
) -> list[int]:
    """Partition layers into ``pipeline_stages`` contiguous stages minimizing the slowest stage's time.

    Args:
        times: per-layer time (any unit).
        pipeline_stages: P.
        memory: per-layer memory estimate in bytes (needed with ``max_stage_memory_bytes``).
        max_stage_memory_bytes: per-stage memory limit, or ``None`` for no limit.

    Returns:
        Layers per stage (sums to ``len(times)``).

    Raises:
        ModelLayoutError: if there are fewer layers than stages.
        StageMemoryError: if no partition fits the memory limit; names the stage of the most memory-balanced
            partition that exceeds it, its size and the limit.
    """
    n = len(times)
    if pipeline_stages < 1:
        raise ModelLayoutError(f"pipeline_stages must be >= 1, got {pipeline_stages}")
    if n < pipeline_stages:
        raise ModelLayoutError(
            f"cannot split {n} layers into {pipeline_stages} pipeline stages: every stage needs at least one layer; "
            f"use pipeline_stages <= {n} or give the layer stack more children"
        )
    if max_stage_memory_bytes is None or memory is None:
        return _split(times, pipeline_stages)  # type: ignore[return-value]
    mem_prefix = [0]
    for m in memory:
        mem_prefix.append(mem_prefix[-1] + int(m))

    def fits(i: int, j: int) -> bool:
        return mem_prefix[j] - mem_prefix[i] <= max_stage_memory_bytes

    sizes = _split(times, pipeline_stages, fits)
    if sizes is not None:
        return sizes
    # Infeasible: report the worst stage of the partition that minimizes the largest stage memory.
    by_memory = _split(memory, pipeline_stages)
    assert by_memory is not None
    worst, worst_bytes = 0, -1
    for s, (a, b) in enumerate(stage_bounds(by_memory)):
        size = mem_prefix[b] - mem_prefix[a]
        if size > worst_bytes:
            worst, worst_bytes = s, size
    a, b = stage_bounds(by_memory)[worst]
    raise StageMemoryError(
        f"stage {worst} (layers {a}..{b - 1}) needs ~{worst_bytes} bytes (parameters + gradients + optimizer "
        f"state) but max_stage_memory_bytes={max_stage_memory_bytes}; no split into {pipeline_stages} stages fits. "
        "Use more pipeline stages, a smaller model or a larger limit"
    )


def choose_pipeline_stages(
    times: Sequence[float],
    world: int,
    micro_batches: int,
    memory: Optional[Sequence[int]] = None,
    max_stage_memory_bytes: Optional[int] = None,
    comm_seconds_per_boundary: float = 0.0,
) -> int:
    """Pick P (a divisor of ``world``) that maximizes the estimated samples/s of a D x P job.

    Model (kept deliberately simple): a global batch whose single-process step costs ``T = sum(times)`` is split
    over D = world / P pipelines, so each pipeline does ``1 / D`` of the work; with the slowest stage costing
    ``T_max(P)`` (from :func:`balance_stages`) the GPipe step takes
    ``(T_max(P) / D) * (M + P - 1) / M + (P - 1) * comm``. Samples/s is proportional to the inverse. Shapes whose
    stages do not fit the memory limit are skipped; ties go to the smaller P (less communication).

    Args:
        times: per-layer time for the whole global batch.
        world: number of processes.
        micro_batches: M.
        memory: per-layer memory (bytes).
        max_stage_memory_bytes: per-stage limit.
        comm_seconds_per_boundary: added cost per stage boundary per step.

    Returns:
        The chosen P.

    Raises:
        InfeasibleShapeError: if no divisor of ``world`` gives a feasible partition.
    """
    best_p, best_time = None, float("inf")
    for p in range(1, world + 1):
        if world % p or p > len(times):
            continue
        try:
            sizes = balance_stages(times, p, memory, max_stage_memory_bytes)
        except StageMemoryError:
            continue
        t_max = max(sum(times[a:b]) for a, b in stage_bounds(sizes))
        d = world // p
        step = (t_max / d) * (micro_batches + p - 1) / micro_batches + (p - 1) * comm_seconds_per_boundary
        if step < best_time * (1 - 1e-9):
            best_p, best_time = p, step
    if best_p is None:
        raise InfeasibleShapeError(
            f"no pipeline depth P dividing {world} processes gives stages within max_stage_memory_bytes="
            f"{max_stage_memory_bytes}"
        )
    return best_p
