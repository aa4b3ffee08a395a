"""Pipeline: schedules, micro-batch splitting, stage proxy, and a 2-process 1F1B step against one process."""

from __future__ import annotations

import os
import socket
from collections import namedtuple

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_parcae.errors import BatchSplitError, ConfigurationError
from lightning_parcae.runtime.pipeline import (
    P2P,
    StageBoundary,
    StageProxy,
    chunk_batch,
    run_train_schedule,
    schedule_ops,
    split_micro_batches,
)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("stages", "micro"), [(1, 1), (2, 4), (4, 2), (3, 6)])
def test_pipeline_schedule_runs_every_micro_batch_once_each_way_if_valid(kind: str, stages: int, micro: int) -> None:
    for s in range(stages):
        ops = schedule_ops(kind, s, stages, micro)
        assert [m for k, m in ops if k == "F"] == list(range(micro))
        assert [m for k, m in ops if k == "B"] == list(range(micro))
        for k, m in ops:  # a backward never precedes its forward
            if k == "B":
                assert ops.index(("F", m)) < ops.index(("B", m))


def test_pipeline_1f1b_keeps_at_most_p_micro_batches_in_flight_if_many() -> None:
    ops = schedule_ops("1f1b", 0, 4, 8)
    live = peak = 0
    for k, _ in ops:
        live += 1 if k == "F" else -1
        peak = max(peak, live)
    assert peak == 4
    assert schedule_ops("1f1b", 3, 4, 8)[:2] == [("F", 0), ("B", 0)]


def test_pipeline_schedule_raises_configuration_error_if_unknown() -> None:
    with pytest.raises(ConfigurationError):
        schedule_ops("zigzag", 0, 2, 2)


def test_pipeline_splits_nested_batch_if_divisible() -> None:
    Pair = namedtuple("Pair", "x y")
    batch = {"a": torch.arange(8).view(4, 2), "b": (torch.arange(4), "tag"), "p": Pair(torch.zeros(4), torch.ones(4))}
    parts = split_micro_batches(batch, 2)
    assert len(parts) == 2
    assert parts[1]["a"].tolist() == [[4, 5], [6, 7]]
    assert parts[0]["b"][1] == "tag" and isinstance(parts[0]["p"], Pair)


def test_pipeline_raises_batch_split_error_naming_sizes_if_not_divisible() -> None:
    with pytest.raises(BatchSplitError, match=r"10 samples .*micro_batches=4"):
        split_micro_batches((torch.zeros(10, 2), torch.zeros(10)), 4)
    with pytest.raises(BatchSplitError, match="disagree"):
        split_micro_batches((torch.zeros(4), torch.zeros(6)), 2)


def test_pipeline_chunks_near_equal_if_evaluating() -> None:
    assert [len(c) for c in chunk_batch(torch.arange(7), 3)] == [3, 2, 2]
    assert len(chunk_batch(torch.arange(2), 4)) == 2


def test_pipeline_proxy_modes_behave_if_swapped_in() -> None:
    stage = nn.Linear(2, 2)
    proxy = StageProxy(stage)
    assert list(proxy.parameters()) == []  # the stage is referenced, not registered
    x = torch.randn(3, 2)
    proxy.mode = "head"
    with pytest.raises(StageBoundary):
        proxy(x)
    assert torch.equal(proxy.captured, stage(x))
    proxy.mode, proxy.given = "tail", x
    assert torch.equal(proxy(torch.zeros(1)), stage(x))
    proxy.mode = "given"
    assert proxy(None) is x


def _worker(rank: int, port: int, kind: str, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    stage = full[:2] if rank == 0 else full[2:]
    micro = split_micro_batches((x, y), 4)
    ops = schedule_ops(kind, rank, 2, 4)

    def head(mb):  # noqa: ANN001, ANN202
        return stage(mb[0])

    def tail(mb, act):  # noqa: ANN001, ANN202
        return nn.functional.cross_entropy(stage(act), mb[1])

    run_train_schedule(ops, micro, stage, P2P(torch.device("cpu")), None if rank == 0 else 0,
                       1 if rank == 0 else None, head, tail, 1.0 / 4)
    torch.save({n: p.grad for n, p in stage.named_parameters()}, f"{out}/grads{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_pipeline_two_stage_gradients_match_single_process_if_scheduled(kind: str, tmp_path: object) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(port, kind, str(tmp_path)), nprocs=2, start_method="spawn")
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    x, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    nn.functional.cross_entropy(full(x), y).backward()
    got = {**torch.load(f"{tmp_path}/grads0.pt"), **{f"2.{k[2:]}" if k.startswith("0.") else k: v
                                                      for k, v in torch.load(f"{tmp_path}/grads1.pt").items()}}
    for name, p in full.named_parameters():
        assert torch.allclose(got[name], p.grad, rtol=1e-5, atol=1e-7), name
