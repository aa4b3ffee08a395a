"""How the step-boundary agreement's collective grows with N when nothing else runs -- flat, in two levels, and as
the runtime's binomial tree.

Problem it measures (issue 21): in ``bench_scale.py`` the step agreement grew 4.7x from N=4 to N=16 and 13.6x to
N=32 on 2 cores while 4..32 training processes competed for them, and the question left open was how much of that
is the collective and how much the contention. This script starts ``N`` processes on loopback that do nothing but
a MAX over ``1 + N`` float64 flags (``--rounds`` times after a warm-up and a barrier, each round timed on every
rank, the median per rank, then the median over ranks) in five forms:

* ``flat``: one gloo all-reduce over the whole world (the runtime's form until stop 29);
* ``two-level``: the same MAX first over each pipeline (``P`` ranks) and then over each stage's replicas (``D``
  ranks) -- the runtime's form from stop 29 to stop 58;
* ``doubling``: recursive doubling over point-to-point sends (log2 N rounds of pairwise exchanges);
* ``tree``: the runtime's form since stop 59 (:mod:`lightning_parcae.runtime.agreement`: reduce to rank 0 and
  broadcast back along a binomial tree, 2(N-1) messages);
* ``reduce-bcast``: gloo's own ``reduce`` to rank 0 and ``broadcast``.

with ``--busy K`` processes spinning on the CPU beside them (0 by default) to show the contention's share.
Everything is real (processes, gloo over loopback TCP); nothing is modelled. One machine: a message is a process
wake-up here, not a network round trip, so the absolute figures say nothing about a cluster -- the growth with N
and the ratio between the forms do. Every rank checks every round's result (one rank raises its flag; all must see
it, and only it).

    python benchmarks/bench_agreement.py --counts 4 8 16 32 --stages 2
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import time
from typing import Any

__all__ = ["measure", "main"]


FORMS = ("flat", "two-level", "doubling", "tree", "reduce-bcast")


def _doubling_max(flags: Any, rank: int, world: int) -> None:
    """MAX over the world by recursive doubling: ceil(log2 N) (+2 when N is not a power of two) rounds of one
    exchange with a partner, instead of a ring's 2(N-1) hops."""
    import torch.distributed as dist  # noqa: PLC0415

    p = 1 << (world.bit_length() - 1)
    if rank >= p:
        dist.send(flags.clone(), rank - p)
        dist.recv(flags, rank - p)
        return
    got = flags.clone()
    if rank < world - p:
        dist.recv(got, rank + p)
        flags.copy_(flags.maximum(got))
    k = 1
    while k < p:
        partner = rank ^ k
        out = flags.clone()
        works = [dist.isend(out, partner), dist.irecv(got, partner)]
        for w in works:
            w.wait()
        flags.copy_(flags.maximum(got))
        k <<= 1
    if rank < world - p:
        dist.send(flags.clone(), rank + p)


def _tree_max(flags: Any, rank: int, world: int) -> None:
    """The runtime's agreement (:func:`lightning_parcae.runtime.agreement.tree_max`) over plain gloo sends."""
    import torch.distributed as dist  # noqa: PLC0415

    from lightning_parcae.runtime.agreement import AGREEMENT_TAG, tree_max  # noqa: PLC0415

    tree_max(flags, rank, world, send=lambda t, dst: dist.isend(t, dst, tag=AGREEMENT_TAG),
             recv=lambda t, src: dist.recv(t, src, tag=AGREEMENT_TAG), wait=lambda work: work.wait())


def _rank_main(rank: int, world: int, stages: int, port: int, rounds: int, warmup: int, out: Any) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    d = world // stages
    pipes = [dist.new_group([r * stages + s for s in range(stages)]) for r in range(d)]
    reps = [dist.new_group([r * stages + s for r in range(d)]) for s in range(stages)]
    mine_pipe, mine_rep = pipes[rank // stages], reps[rank % stages]
    result: dict[str, Any] = {}
    for form in FORMS:
        times = []
        for i in range(warmup + rounds):
            flags = torch.zeros(1 + world, dtype=torch.float64)
            raiser = i % world  # one rank raises its flag this round: every rank must see it, and only it
            flags[1 + rank] = 1.0 if rank == raiser else 0.0
            dist.barrier()
            t0 = time.perf_counter()
            if form == "flat":
                dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            elif form == "doubling":
                _doubling_max(flags, rank, world)
            elif form == "tree":
                _tree_max(flags, rank, world)
            elif form == "reduce-bcast":
                dist.reduce(flags, 0, op=dist.ReduceOp.MAX)
                dist.broadcast(flags, 0)
            else:
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mine_pipe)
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=mine_rep)
            dt = time.perf_counter() - t0
            want = [1.0 if r == raiser else 0.0 for r in range(world)]
            if [float(x) for x in flags[1:]] != want and "error" not in result:
                result["error"] = f"{form} round {i}: got {flags[1:].tolist()}, want {want}"  # type: ignore[assignment]
            if i >= warmup:
                times.append(dt)
        result[form] = statistics.median(times)
    out.put((rank, result))
    dist.destroy_process_group()


def _spin(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        for _ in range(100000):
            x += 1


def measure(world: int, stages: int, rounds: int = 100, warmup: int = 10, busy: int = 0) -> dict[str, float]:
    """Median over ranks of each rank's median all-reduce time (seconds), per form."""
    import socket  # noqa: PLC0415

    if world % stages:
        raise SystemExit(f"N={world} is not a multiple of --stages {stages}: use counts that P divides")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    stop = ctx.Event()
    spinners = [ctx.Process(target=_spin, args=(stop,)) for _ in range(busy)]
    for p in spinners:
        p.start()
    procs = [ctx.Process(target=_rank_main, args=(r, world, stages, port, rounds, warmup, out)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    errors = [f"rank {rank}: {r['error']}" for rank, r in results if "error" in r]
    for p in procs:
        p.join(60)
    stop.set()
    for p in spinners:
        p.join(10)
    if errors:
        raise AssertionError(f"the agreement's result was wrong: {errors[0]}")
    return {form: statistics.median(r[form] for _, r in results) for form in FORMS}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[4, 8, 16, 32], help="world sizes N")
    ap.add_argument("--stages", type=int, default=2, help="P of the (N/P) x P layout the two-level form uses")
    ap.add_argument("--rounds", type=int, default=100)
    ap.add_argument("--busy", type=int, default=0, help="CPU-spinning processes beside the ranks (contention)")
    a = ap.parse_args(argv)
    rows = []
    for n in a.counts:
        rows.append((n, measure(n, a.stages, a.rounds, busy=a.busy)))
    base = rows[0][1]
    print(f"step agreement all-reduce (1+N float64, MAX, gloo, loopback), {os.cpu_count()} cores, busy={a.busy}, "
          f"P={a.stages}, {a.rounds} rounds; median over ranks of each rank's median")
    print(f"{'N':>4} {'flat ms':>9} {'growth':>7} {'two-level ms':>13} {'growth':>7} {'two-level/flat':>15} "
          f"{'doubling ms':>12} {'growth':>7} {'doubling/two-level':>19} {'tree ms':>8} {'growth':>7} "
          f"{'tree/two-level':>15} {'r+b ms':>8} {'growth':>7} {'r+b/2l':>8}")
    for n, r in rows:
        print(f"{n:>4} {r['flat'] * 1e3:>9.3f} {r['flat'] / base['flat']:>7.2f} {r['two-level'] * 1e3:>13.3f} "
              f"{r['two-level'] / base['two-level']:>7.2f} {r['two-level'] / r['flat']:>15.2f} "
              f"{r['doubling'] * 1e3:>12.3f} {r['doubling'] / base['doubling']:>7.2f} "
              f"{r['doubling'] / r['two-level']:>19.2f} {r['tree'] * 1e3:>8.3f} {r['tree'] / base['tree']:>7.2f} "
              f"{r['tree'] / r['two-level']:>15.2f} {r['reduce-bcast'] * 1e3:>8.3f} "
              f"{r['reduce-bcast'] / base['reduce-bcast']:>7.2f} {r['reduce-bcast'] / r['two-level']:>8.2f}")
    print(f"linear growth from N={rows[0][0]} would be " + ", ".join(f"{n / rows[0][0]:.0f}" for n, _ in rows))


if __name__ == "__main__":
    main()
