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
    SEND_WINDOW,
    StageBoundary,
    StageProxy,
    chunk_batch,
    run_forward_only,
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


def test_pipeline_proxy_keeps_no_last_stage_output_if_tail() -> None:
    """Regression (issue 22): in ``tail`` mode the proxy kept the last stage's output in ``captured`` -- nobody reads
    it there -- so one micro-batch's logits (32 MiB on the benchmark's head stage) stayed alive into the next
    micro-batch's forward and across steps, the last stage's whole gap to torch.distributed.pipelining."""
    stage = nn.Linear(2, 2)
    proxy = StageProxy(stage)
    proxy.mode, proxy.given = "tail", torch.randn(3, 2)
    out = proxy(None)
    assert proxy.captured is None and out.shape == (3, 2)


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


class _CountedSend:
    """A send's work, counted as outstanding from its post until its first wait."""

    def __init__(self, work: object, book: dict[str, int]) -> None:
        self.work, self.book, self.waited = work, book, False
        book["live"] += 1
        book["peak"] = max(book["peak"], book["live"])

    def wait(self, *args: object) -> object:
        result = self.work.wait(*args)  # type: ignore[attr-defined]
        if not self.waited:
            self.waited = True
            self.book["live"] -= 1
        return result

    def is_completed(self) -> bool:
        return self.work.is_completed()  # type: ignore[attr-defined]


def _three_layers() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))


def _counting_worker(rank: int, port: int, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=3)
    book = {"live": 0, "peak": 0}
    real_isend = dist.isend
    dist.isend = lambda *a, **k: _CountedSend(real_isend(*a, **k), book)  # type: ignore[assignment]
    full = _three_layers()
    stage = nn.Sequential(*list(full)[[0, 2, 4][rank]:[2, 4, 5][rank]])
    x, y = torch.randn(12, 4, generator=torch.Generator().manual_seed(1)), torch.arange(12) % 3
    prev, nxt = (None if rank == 0 else rank - 1), (None if rank == 2 else rank + 1)

    def head(mb):  # noqa: ANN001, ANN202
        return stage(mb[0])

    def tail(mb, act):  # noqa: ANN001, ANN202
        return nn.functional.cross_entropy(stage(act), mb[1])

    result: dict[str, object] = {}
    for m in (6, 12):
        stage.zero_grad(set_to_none=True)
        book["peak"] = 0
        run_train_schedule(schedule_ops("1f1b", rank, 3, m), split_micro_batches((x, y), m), stage,
                           P2P(torch.device("cpu")), prev, nxt, head, tail, 1.0 / m)
        result[f"train_peak_{m}"], result[f"live_after_{m}"] = book["peak"], book["live"]
    result["grads"] = {n: p.grad.clone() for n, p in stage.named_parameters()}
    book["peak"] = 0
    with torch.no_grad():
        outs = run_forward_only(split_micro_batches((x, y), 12), stage, P2P(torch.device("cpu")), prev, nxt, head,
                                tail=lambda mb, act: stage(act))
    result["eval_peak"] = book["peak"]
    result["eval_out"] = torch.cat(outs) if outs else None
    torch.save(result, f"{out}/count{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_pipeline_outstanding_sends_do_not_grow_with_micro_batches_if_1f1b(tmp_path: object) -> None:
    """Regression (issue 22): every isend was kept -- and its tensor with it -- until the end of the step, so under
    1F1B a stage held all M micro-batches' sent activations and gradients (stage 0 of 3 at M=12: 24 sends
    outstanding) although only ~P are in flight. Now an activation's send is waited when its gradient comes back
    and gradients sent back are windowed, so the peak is the same at M=6 and M=12 and at most 2 x P (a header and a
    payload per activation in flight); evaluation keeps at most SEND_WINDOW + 1 activations. The three-stage
    result (pre-posted receives, windows, a middle stage) still equals one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_counting_worker, args=(port, str(tmp_path)), nprocs=3, start_method="spawn")
    got = [torch.load(f"{tmp_path}/count{r}.pt") for r in range(3)]
    for rank, res in enumerate(got):
        assert res["train_peak_12"] == res["train_peak_6"] <= 2 * 3, (rank, res["train_peak_6"], res["train_peak_12"])
        assert res["live_after_6"] == res["live_after_12"] == 0, rank  # everything waited by the end of the step
        assert res["eval_peak"] <= 2 * (SEND_WINDOW + 1), (rank, res["eval_peak"])
    full = _three_layers()
    x, y = torch.randn(12, 4, generator=torch.Generator().manual_seed(1)), torch.arange(12) % 3
    nn.functional.cross_entropy(full(x), y).backward()
    offset = {0: 0, 1: 2, 2: 4}
    for rank, res in enumerate(got):
        for name, grad in res["grads"].items():
            i, rest = name.split(".", 1)
            ref = full.get_parameter(f"{int(i) + offset[rank]}.{rest}").grad
            assert torch.allclose(grad, ref, rtol=1e-5, atol=1e-7), (rank, name)
    with torch.no_grad():
        assert torch.allclose(got[2]["eval_out"], full(x), rtol=1e-5, atol=1e-6)
