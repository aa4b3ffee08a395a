"""Emulated accelerators (lightning_parcae.testing.emulated_device): modelled kernel time per sample, forward and
backward, with values and gradients unchanged."""

from __future__ import annotations

import time

import pytest
import torch

from lightning_parcae.testing.emulated_device import emulated_compute


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


@pytest.mark.parametrize("rows,ms", [(4, 5.0), (16, 2.0), (1, 20.0)])
def test_forward_and_backward_sleep_for_the_rows_of_the_batch(rows: int, ms: float) -> None:
    x = torch.randn(rows, 3, requires_grad=True)
    out: list[torch.Tensor] = []
    fwd = _timed(lambda: out.append(emulated_compute(x * 2.0, ms, backward_factor=2.0)))
    bwd = _timed(lambda: out[0].sum().backward())
    want = ms * rows / 1000.0
    assert want <= fwd < want + 0.05, (fwd, want)
    assert 2 * want <= bwd < 2 * want + 0.05, (bwd, want)


def test_values_and_gradients_are_those_of_the_plain_layer() -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(5, 4)
    x = torch.randn(6, 5)
    plain = layer(x)
    plain.pow(2).sum().backward()
    g_plain = layer.weight.grad.clone()
    layer.zero_grad()
    emulated = emulated_compute(layer(x), 0.1)
    emulated.pow(2).sum().backward()
    assert torch.equal(plain, emulated) and torch.equal(g_plain, layer.weight.grad)


def test_zero_is_off_and_no_grad_sleeps_forward_only() -> None:
    x = torch.randn(8, 2, requires_grad=True)
    assert emulated_compute(x, 0.0) is x  # no autograd node, no sleep
    with torch.no_grad():
        t = _timed(lambda: emulated_compute(x, 5.0))
    assert 0.04 <= t < 0.09  # evaluation: forward time only


@pytest.mark.parametrize("ms,factor", [(-1.0, 2.0), (1.0, -0.5)])
def test_negative_time_is_a_clear_error(ms: float, factor: float) -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        emulated_compute(torch.zeros(1), ms, factor)


def test_profiled_backward_time_overrides_the_factor() -> None:
    """A per-layer profile gives backward times that are not a fixed multiple of the forward (GPT-1.5B's head:
    11.2 ms forward, 23.8 ms backward); the backward sleeps the given time per row, not ``factor * forward``."""
    x = torch.randn(4, 3, requires_grad=True)
    out: list[torch.Tensor] = []
    fwd = _timed(lambda: out.append(emulated_compute(x * 1.0, 2.0, backward_factor=10.0, backward_ms_per_sample=15.0)))
    bwd = _timed(lambda: out[0].sum().backward())
    assert 0.008 <= fwd < 0.008 + 0.05, fwd
    assert 0.060 <= bwd < 0.060 + 0.05, bwd  # 4 rows x 15 ms, not 4 x 2 x 10 ms
    with pytest.raises(ValueError, match="must be >= 0"):
        emulated_compute(x, 1.0, backward_ms_per_sample=-1.0)
