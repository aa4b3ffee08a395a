"""Process groups per generation: rank layout, build / destroy / rebuild under a new store prefix."""

from __future__ import annotations

import os
import socket
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.runtime.groups import Coords, ProcessGroups, coords_of, rank_of


def test_groups_map_ranks_to_replica_and_stage_if_contiguous_pipelines() -> None:
    assert coords_of(5, 2) == Coords(replica=2, stage=1)
    assert all(coords_of(rank_of(r, s, 3), 3) == Coords(r, s) for r in range(4) for s in range(3))
    g = ProcessGroups(0, 3, 6, 2, 3, dist.HashStore())
    assert g.pipeline_ranks(1) == [3, 4, 5]
    assert g.data_ranks(2) == [2, 5]
    assert (g.prev_rank(), g.next_rank(), g.is_first_stage) == (None, 4, True)


def test_groups_raise_configuration_error_if_shape_does_not_cover_world() -> None:
    with pytest.raises(ConfigurationError, match="D=2 x P=2 .* 3 processes"):
        ProcessGroups(0, 0, 3, 2, 2, dist.HashStore())


def test_groups_rebuild_in_place_if_generation_advances() -> None:
    if dist.is_initialized():  # left up by an in-process Trainer run in this session
        dist.destroy_process_group()
    store = dist.HashStore()
    g0 = ProcessGroups(0, 0, 1, 1, 1, store).build()
    assert dist.is_initialized() and g0.built
    g1 = g0.rebuilt(1, 1)
    assert g1.generation == 1 and not g0.built and dist.is_initialized()
    t = torch.ones(1)
    dist.all_reduce(t, group=g1.pipeline_group)
    assert store.num_keys() > 0
    g1.destroy()
    assert not dist.is_initialized()


def _worker(rank: int, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    g = ProcessGroups(0, rank, 2, 2, 1, store).build()  # D=2, P=1: the two ranks share a data group
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=g.data_group)
    g = g.rebuilt(1, 2)  # D=1, P=2: now they form one pipeline
    u = torch.tensor([float(rank)])
    if rank == 0:
        dist.send(u + 10, 1)
    else:
        dist.recv(u, 0)
    torch.save({"sum": t.item(), "recv": u.item(), "gen": g.generation}, f"{out}/r{rank}.pt")
    g.destroy()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_groups_rebuild_with_new_shape_if_two_processes(tmp_path: object) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = torch.load(f"{tmp_path}/r0.pt"), torch.load(f"{tmp_path}/r1.pt")
    assert r0["sum"] == r1["sum"] == 3.0
    assert r1["recv"] == 10.0 and r1["gen"] == 1


def _stall_worker(rank: int, port: int, out: str) -> None:
    import time

    os.environ["OMP_NUM_THREADS"] = "1"
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    g = ProcessGroups(0, rank, 2, 2, 1, store).build()  # start-up: the long rendezvous timeout
    g.set_op_timeout(timedelta(seconds=2))  # then the progress watchdog's bound
    result: dict = {}
    if rank == 0:
        # a mismatched collective: rank 1 never joins it (while being perfectly alive)
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=g.data_group)
            result["raised"] = False
        except RuntimeError as exc:
            result["raised"], result["error"] = True, str(exc)[:200]
        result["waited_s"] = time.monotonic() - t0
        # a rebuilt generation whose other member never arrives (declared dead while the groups are built)
        g.abandon()
        t0 = time.monotonic()
        try:
            ProcessGroups(1, 0, 2, 2, 1, store, timeout=timedelta(seconds=2)).build()
            result["init_raised"] = False
        except Exception as exc:  # noqa: BLE001 -- DistStoreError / RuntimeError, by torch version
            result["init_raised"] = True
            result["init_error"] = type(exc).__name__
        result["init_waited_s"] = time.monotonic() - t0
        torch.save(result, f"{out}/stall.pt")
        store.set("done", "1")
        # rank 0 hosts the store: exiting before rank 1 has read "done" closed its connection mid-wait
        # ("Failed to recv, got 0 bytes") -- a flake of this test under load, not of the watchdog
        store.wait(["ack"], timedelta(seconds=60))
    else:
        store.wait(["done"], timedelta(seconds=60))
        store.set("ack", "1")
    os._exit(0)  # the abandoned groups' threads are stuck on purpose


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_groups_fail_a_stalled_collective_and_rendezvous_within_the_watchdog_bound(tmp_path: object) -> None:
    """The progress watchdog (issue 9): a collective that makes no progress while every peer is alive, and the
    rendezvous of a new generation whose member never comes, must fail within the bound (2 s here) -- not at
    gloo's group timeout (5-30 minutes) -- so that the runtime can turn them into a recovery."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_stall_worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    r = torch.load(f"{tmp_path}/stall.pt")
    assert r["raised"], r
    assert 1.5 <= r["waited_s"] < 15.0, r
    assert r["init_raised"] and r["init_waited_s"] < 15.0, r


def test_groups_on_cuda_give_cpu_tensors_gloo_and_cuda_tensors_nccl() -> None:
    """Regression (first run on a GPU, H200): groups built with plain "nccl" refused the runtime's CPU tensors, so
    every step's agreement failed with "No backend type associated with device type cpu" and became a recovery
    (60 in-place "migrations" in 60 steps). On CUDA each device type now gets its own backend."""
    from lightning_parcae.runtime.groups import device_backends

    assert device_backends("nccl") == "cpu:gloo,cuda:nccl"
    assert device_backends("gloo") == "gloo"
