"""The two-phase commit's counter on etcd: torch's ``add`` against per-member arrival keys, side by side.

Problem it measures: every member of a generation counts itself in at the end of every step
(:meth:`~lightning_parcae.runtime.coordinator.Coordinator.commit_arrive`), all at about the same time. On etcd,
torch's ``EtcdStore.add`` is a compare-and-swap loop that sleeps a random 0-100 ms after every lost race, so the
last of N concurrent adds waits for many sleeps; the per-member tally
(:func:`~lightning_parcae.runtime.store.count_in`: one write of its own key, one read of the count) has no race to
lose. Here N clients (threads of one process, one etcd connection each, a real etcd 3.4 on loopback) arrive at
once behind a barrier, ten times per N and per way; the figure is the median over the ten of the slowest
arrival.

Real: the etcd server and its requests. Not shown: network round trips between machines (each request is one; the
add needs at least three, more under contention), and N clients on N machines instead of N threads on 2 cores.

    python benchmarks/bench_commit_counter.py --counts 4,8,16,32
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.store import connect_store, host_store
from lightning_parcae.testing.etcd_server import EtcdServer


def slowest_arrival_ms(coords: list[Coordinator], g: int, step: int, tally: bool) -> float:
    """All ``coords`` arrive at once at ``step``'s commit; the slowest arrival's time, ms."""
    n = len(coords)
    barrier, took = threading.Barrier(n), [0.0] * n

    def arrive(i: int) -> None:
        barrier.wait()
        t0 = time.monotonic()
        coords[i].commit_arrive(g, step, n, f"m{i}" if tally else None)
        took[i] = time.monotonic() - t0

    threads = [threading.Thread(target=arrive, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(took) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="4,8,16,32", help="comma-separated member counts N")
    ap.add_argument("--rounds", type=int, default=10, help="concurrent arrivals per N and way (median reported)")
    a = ap.parse_args()
    server = EtcdServer()
    server.start()
    try:
        url = server.store_url("/parcae/bench-commit")
        host_store(url, token=None)
        print("| N | torch add: slowest arrival, ms | per-member tally, ms | add / tally |")
        print("|---|---|---|---|")
        for n in [int(x) for x in a.counts.split(",") if x]:
            coords = [Coordinator(connect_store(url, token=None)) for _ in range(n)]
            add = statistics.median(slowest_arrival_ms(coords, n, s, False) for s in range(a.rounds))
            tally = statistics.median(slowest_arrival_ms(coords, n, a.rounds + s, True) for s in range(a.rounds))
            print(f"| {n} | {add:.1f} | {tally:.1f} | {add / tally:.1f} |", flush=True)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
