"""The modelled network hook of state transfers (lightning_parcae.runtime.migration.set_modelled_link): a transfer
of k layers also sleeps the modelled time of those k layers, and without a link nothing is added.

The transport is replaced by a loopback fake (what is sent to peer 1 arrives from peer 1), so no process group is
started; ``exchange`` itself -- packing, sizes first, blobs, unpacking, the charge -- runs as in a migration."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence

import pytest
import torch

from lightning_parcae.runtime import migration
from lightning_parcae.testing.emulated_cluster import EmulatedWorkload, install_modelled_link


@pytest.fixture
def loopback(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    def fake_send_recv(outgoing: Mapping[int, torch.Tensor], incoming: Mapping[int, torch.Tensor], tag: int,
                       what: str) -> None:
        for peer, buf in incoming.items():
            buf.copy_(outgoing[peer])

    monkeypatch.setattr(migration, "_send_recv", fake_send_recv)
    before = migration.set_modelled_link(None)
    yield
    migration.set_modelled_link(before)


class _Recorder:
    def __init__(self, seconds_per_layer: float) -> None:
        self.seconds_per_layer = seconds_per_layer
        self.calls: list[list[int]] = []

    def charge(self, layers: Sequence[int]) -> float:
        self.calls.append(sorted(layers))
        return self.seconds_per_layer * len(layers)


def _blob(layers: Sequence[int]) -> dict:
    return {"layers": {i: {"tensors": {f"layers.{i}.w": torch.ones(2)}, "optim": [{}]} for i in layers},
            "loop": {"step": 3}}


def _timed_exchange(layers: Sequence[int]) -> tuple[float, dict]:
    t0 = time.perf_counter()
    got = migration.exchange({1: _blob(layers)}, [1], "test transfer")
    return time.perf_counter() - t0, got


def test_a_transfer_of_k_layers_sleeps_the_modelled_time_of_those_layers(loopback: None) -> None:
    rec = _Recorder(0.05)
    migration.set_modelled_link(rec)
    elapsed, got = _timed_exchange([2, 5, 7])
    assert sorted(got[1]["layers"]) == [2, 5, 7] and got[1]["loop"] == {"step": 3}  # the real state still moves
    assert rec.calls == [[2, 5, 7], [2, 5, 7]]  # sent and received, both charged on this process's link
    assert 0.15 <= elapsed < 0.15 + 0.1


def test_without_a_link_nothing_is_added(loopback: None) -> None:
    elapsed, got = _timed_exchange([2, 5, 7])
    assert sorted(got[1]["layers"]) == [2, 5, 7]
    assert elapsed < 0.1


def test_a_workload_link_charges_the_scaled_10_gbps_time_of_the_real_model_layers(loopback: None) -> None:
    """Two blocks of an 8-block emulated GPT-1.5B are 12 of its transformer layers: 12 x 30.7 M params x 12 bytes
    at 1.25 GB/s = 3.54 modelled s, 0.118 s at time scale 30."""
    workload = EmulatedWorkload.gpt_1_5b(time_scale=30.0).coarsened(8)
    install_modelled_link(workload)
    want = workload.transfer_s([3, 4])
    assert want == pytest.approx((0.15e-3 + 12 * 12 * 30740800 / 1.25e9) / 30.0)
    elapsed, _ = _timed_exchange([3, 4])
    assert want <= elapsed < want + 0.1
    install_modelled_link(None)
    elapsed, _ = _timed_exchange([3, 4])
    assert elapsed < 0.05 + want / 2
