"""The modelled network of an emulated cluster (lightning_parcae.runtime.link) at the step's two kinds of traffic.

Problem it guards: the emulated cluster charged its modelled 10 Gbps link for migrations only. The pipeline's
activation and gradient messages and the data-parallel gradient all-reduce were free, so on an emulated GPT-1.5B a
wide D cost nothing extra over a deep P and a measured emulated step was faster than the workload's own ``step_s``
(docs/emulation.md, "Not modelled yet"). Now each pipeline send sleeps the boundary charge *before* it is posted
(a blocking send: the peer gets the data when the real bytes would have arrived) and the D-way all-reduce sleeps
the ring all-reduce of the stage's gradients; without a link, or with a link that models migrations only, nothing
is added.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import pytest
import torch

from lightning_parcae.runtime import link, migration, pipeline
from lightning_parcae.runtime.pipeline import P2P


class _Recorder:
    """A link that records what it is asked, and when, and charges a fixed time per call."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds
        self.calls: list[tuple[str, object, int, float]] = []

    def charge(self, layers: Sequence[int]) -> float:
        return 0.0

    def boundary_s(self, layer: int, samples: int) -> float:
        self.calls.append(("boundary", layer, samples, time.perf_counter()))
        return self.seconds

    def allreduce_s(self, layers: Sequence[int], replicas: int) -> float:
        self.calls.append(("allreduce", list(layers), replicas, time.perf_counter()))
        return self.seconds


class _MigrationOnly:
    """A link as written before the per-step traffic was modelled: ``charge`` only."""

    def charge(self, layers: Sequence[int]) -> float:
        return 1.0


@pytest.fixture
def no_link() -> Iterator[None]:
    before = link.set_modelled_link(None)
    yield
    link.set_modelled_link(before)


def test_without_a_link_per_step_traffic_is_free(no_link: None) -> None:
    t0 = time.perf_counter()
    assert link.charge_boundary(3, 8) == 0.0 and link.charge_allreduce([1, 2], 4) == 0.0
    assert time.perf_counter() - t0 < 0.05


def test_a_link_that_models_migrations_only_adds_nothing_per_step(no_link: None) -> None:
    link.set_modelled_link(_MigrationOnly())
    t0 = time.perf_counter()
    assert link.charge_boundary(3, 8) == 0.0 and link.charge_allreduce([1, 2], 4) == 0.0
    assert time.perf_counter() - t0 < 0.05


def test_charges_sleep_what_the_link_says_and_one_replica_has_no_all_reduce(no_link: None) -> None:
    rec = _Recorder(0.05)
    link.set_modelled_link(rec)
    t0 = time.perf_counter()
    assert link.charge_boundary(3, 8) == 0.05
    assert link.charge_allreduce(range(2, 5), 4) == 0.05
    assert link.charge_allreduce([2, 3], 1) == 0.0 and link.charge_allreduce([], 4) == 0.0
    assert 0.1 <= time.perf_counter() - t0 < 0.1 + 0.1
    assert [c[:3] for c in rec.calls] == [("boundary", 3, 8), ("allreduce", [2, 3, 4], 4)]


def test_the_migration_module_still_installs_the_same_link(no_link: None) -> None:
    """``migration.set_modelled_link`` (the old home of the hook) and ``link.set_modelled_link`` are one switch."""
    rec = _Recorder()
    migration.set_modelled_link(rec)
    assert link.modelled_link() is rec
    assert link.set_modelled_link(None) is rec


@pytest.fixture
def fake_isend(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, tuple[int, ...], float]]:
    posted: list[tuple[int, tuple[int, ...], float]] = []

    class _Work:
        def wait(self) -> None:
            pass

    def isend(t: torch.Tensor, dst: int, tag: int = 0) -> _Work:
        posted.append((tag, tuple(t.shape), time.perf_counter()))
        return _Work()

    monkeypatch.setattr(pipeline.dist, "isend", isend)
    return posted


def test_a_pipeline_send_charges_its_boundary_before_it_is_posted(no_link: None, fake_isend: list) -> None:
    """A stage holding layers 3..5 sends activations across the boundary after layer 5 and gradients across the
    one after layer 2, each for the micro-batch's samples (dim 0), and the message is posted only after the sleep."""
    rec = _Recorder(0.05)
    link.set_modelled_link(rec)
    p2p = P2P(torch.device("cpu"), layers=(3, 6))
    t0 = time.perf_counter()
    p2p.send(torch.ones(4, 16, 8), dst=1, tag=0)  # an activation (with its header)
    p2p.send(torch.ones(4, 16, 8), dst=0, tag=0, with_header=False)  # a gradient back
    assert [c[:3] for c in rec.calls] == [("boundary", 5, 4), ("boundary", 2, 4)]
    header_posted = fake_isend[0][2]
    assert header_posted - t0 >= 0.05 and header_posted >= rec.calls[0][3] + 0.05
    assert fake_isend[2][2] >= rec.calls[1][3] + 0.05  # the gradient, after its own charge
    p2p.wait_all()


def test_a_transport_without_layers_charges_nothing(no_link: None, fake_isend: list) -> None:
    """A transport not told its stage's layers (P = 1, a model without a layer stack) never asks the link."""
    rec = _Recorder(0.05)
    link.set_modelled_link(rec)
    p2p = P2P(torch.device("cpu"))
    p2p.send(torch.ones(4, 8), dst=1, tag=0)
    assert rec.calls == [] and len(fake_isend) == 2
    p2p.wait_all()


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_strategy_pipeline_charges_every_message_at_its_stage_boundary(tmp_path: object) -> None:
    """ParcaeStrategy at 1 x 2 (layers [0, 1] | [2, 3], M = 2, batch 8, 3 steps) with a recording link installed
    in the module's ``setup``: stage 0 charges each activation it sends across the boundary after layer 1, stage 1
    each gradient it sends back across the same boundary, 4 samples a message, 2 a step each way; D = 1, so no
    all-reduce is charged (tests/modelled_link_worker.py)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from modelled_link_worker import launch

    ranks = launch(str(tmp_path))
    for rank in ranks:
        assert not [c for c in rank["calls"] if c[0] == "allreduce"], rank["calls"]
        boundary = [c for c in rank["calls"] if c[0] == "boundary"]
        assert boundary == [["boundary", 1, 4]] * 6, boundary  # 3 steps x 2 micro-batches, one message each
