"""Emulated accelerators: compute whose time is modelled, so that one small machine can stand in for a cluster.

Problem: ``parcae run`` turns one machine into a cluster of N instances, but on 2 CPU cores N worker processes share
two cores. Every shape then runs at about the same speed (the cores, not the shape, are the limit), the measured
liveput optimizer rightly never moves, and nothing about Parcae's decisions -- which shape is best for N instances,
what a pipeline's bubble costs, when a migration pays -- can be seen. On a real cluster each instance has its own
accelerator, and a step's time is the accelerators' kernel time.

This module emulates that accelerator: :func:`emulated_compute` is an identity on a layer's output whose forward
sleeps ``ms_per_sample`` milliseconds per sample (row of the batch) and whose backward sleeps ``backward_factor``
times as long (a backward pass costs about twice a forward one), or a profiled ``backward_ms_per_sample``
(:mod:`lightning_parcae.testing.emulated_cluster` gives per-layer values from a workload profile). The real
arithmetic still runs -- the model really trains, its loss really falls, its state really moves between processes -- but it is kept small, so the
step time is dominated by the modelled kernel time, which does not contend for the CPU: D pipelines really run D
times as many samples at once, a P-stage pipeline really has its ``(P - 1) / (M + P - 1)`` bubble, and an idle stage
really waits. Migration, communication, start-up and the protocol's own costs are real and measured as they are.

What it is not: a speed claim for any real accelerator. Figures measured with emulated devices say how the
control plane (prediction, liveput, migration) behaves against the modelled compute, not how fast a GPU is.
``parcae run --emulated-devices`` tells the runtime's throughput model that instances do not share the CPU.

Torch only; used by ``examples/gpt`` (``device_ms_per_sample``) and the end-to-end benchmark.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch

__all__ = ["emulated_compute"]


class _EmulatedKernel(torch.autograd.Function):
    """Identity whose forward and backward each sleep for the modelled kernel time of their batch."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:  # type: ignore[override]
        ctx.backward_s = backward_s
        if forward_s > 0:
            time.sleep(forward_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        if ctx.backward_s > 0:
            time.sleep(ctx.backward_s)
        return grad, None, None


def emulated_compute(x: torch.Tensor, ms_per_sample: float, backward_factor: float = 2.0,
                     backward_ms_per_sample: Optional[float] = None) -> torch.Tensor:
    """``x`` unchanged, after sleeping for the modelled forward time of its batch (and, in backward, its backward).

    Args:
        x: A layer's output; its first dimension is the batch (the modelled time is per row).
        ms_per_sample: Modelled forward time per sample in milliseconds; 0 (with no backward time) turns the
            emulation off (``x`` is returned as it is, with no autograd node).
        backward_factor: Backward time as a multiple of the forward time (when ``backward_ms_per_sample`` is
            not given).
        backward_ms_per_sample: Modelled backward time per sample in milliseconds, e.g. from a per-layer profile
            (:mod:`lightning_parcae.testing.emulated_cluster`); overrides ``backward_factor``.

    Returns:
        ``x`` (a view of it when emulating, so that the backward sleep is on the autograd path).

    Raises:
        ValueError: ``ms_per_sample``, ``backward_factor`` or ``backward_ms_per_sample`` is negative.
    """
    if ms_per_sample < 0 or backward_factor < 0 or (backward_ms_per_sample is not None and backward_ms_per_sample < 0):
        raise ValueError(f"ms_per_sample={ms_per_sample}, backward_factor={backward_factor} and "
                         f"backward_ms_per_sample={backward_ms_per_sample} must be >= 0 (0 turns the emulated "
                         "device off)")
    bwd_ms = backward_factor * ms_per_sample if backward_ms_per_sample is None else backward_ms_per_sample
    if ms_per_sample == 0 and bwd_ms == 0:
        return x
    rows = int(x.shape[0]) if x.dim() else 1
    forward_s = ms_per_sample * rows / 1000.0
    if not torch.is_grad_enabled() or not x.requires_grad:
        if forward_s > 0:
            time.sleep(forward_s)
        return x
    return _EmulatedKernel.apply(x, forward_s, bwd_ms * rows / 1000.0)
