"""How long the leader's read of every member's heartbeat takes: one request per key against the batched read.

Problem (issue 21): the leader watches every member, and each of its heartbeats (5 a second) read the N heartbeat
keys with a ``check`` and a ``get`` each, in series -- 2N requests a beat, 64 at N = 32, each a network round trip
once the store is on another machine. ``liveness.read_beats`` now reads them with one ``check`` of all keys and one
``multi_get``. This script times both forms side by side against real stores on loopback -- torch's ``TCPStore``
(what ``parcae run`` hosts) and, when the ``etcd`` binary is installed, an etcd server (what ``parcae agent`` uses
across machines) -- for N = 4, 8, 16, 32 members, and prints the median per read and the ratio::

    python benchmarks/bench_heartbeat_reads.py
    python benchmarks/bench_heartbeat_reads.py --counts 4 32 --rounds 200 --stores tcp

With etcd it also times one ``get`` of a present key as the job's directory grows (``--directory-sizes``): torch's
``EtcdStore`` reads the whole directory for every request, parcae's etcd store reads the key alone.

Real: the stores, their client libraries, the requests. Not modelled: a network round trip (loopback's is ~50 us;
across machines each of the serial form's 2N requests pays a real one, the batched form's two pay it twice).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, Optional

from lightning_parcae.runtime.liveness import hb_key, read_beats

__all__ = ["serial_read", "time_reads", "main"]


def serial_read(store: Any, members: Sequence[str]) -> dict[str, Optional[bytes]]:
    """The read as it was until stop 35: a ``check`` and a ``get`` per member, in series."""
    return {m: bytes(store.get(hb_key(m))) if store.check([hb_key(m)]) else None for m in members}


def time_reads(store: Any, n: int, rounds: int) -> dict[str, float]:
    """Median milliseconds of one read of ``n`` heartbeats, per form (same store, interleaved rounds)."""
    members = [f"i{k}" for k in range(n)]
    for k, m in enumerate(members):
        store.set(hb_key(m), f'{{"c": {k}, "g": 0, "step": 10, "phase": "training"}}')
    forms: dict[str, Callable[[Any, Sequence[str]], Any]] = {"serial": serial_read, "batched": read_beats}
    assert forms["serial"](store, members) == forms["batched"](store, members)  # same answer
    took: dict[str, list[float]] = {k: [] for k in forms}
    for _ in range(rounds):
        for name, fn in forms.items():
            t0 = time.perf_counter()
            fn(store, members)
            took[name].append(1000.0 * (time.perf_counter() - t0))
    return {k: statistics.median(v) for k, v in took.items()}


def time_directory_growth(url: str, sizes: Sequence[int], rounds: int) -> dict[int, dict[str, float]]:
    """Median ms of one ``get`` of a present key by torch's ``EtcdStore`` and by parcae's, as the job's directory
    grows to each of ``sizes`` keys (rendezvous-like keys, as process groups leave them)."""
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    from lightning_parcae.runtime.store import connect_store

    ours = connect_store(url, token=None, timeout_s=30)
    theirs = EtcdStore(ours.client, ours.prefix, ours.timeout)  # same server, same directory
    probe = "parcae/probe/i0"  # a key of the job's own directory (heartbeats have a directory of their own now)
    ours.set(probe, "{}")
    written, out = 1, {}
    for size in sorted(sizes):
        while written < size:
            ours.set(f"gen/{written // 64}/rank_{written % 64}", "10.0.0.1:29500")
            written += 1
        took: dict[str, list[float]] = {"torch": [], "parcae": []}
        for _ in range(rounds):
            for name, store in (("torch", theirs), ("parcae", ours)):
                t0 = time.perf_counter()
                assert store.get(probe) == b"{}"  # the key's base64 has no '/' or '+': both find it
                took[name].append(1000.0 * (time.perf_counter() - t0))
        out[size] = {k: statistics.median(v) for k, v in took.items()}
    return out


def _stores(kinds: Sequence[str], stack: ExitStack) -> list[tuple[str, Any, str]]:
    out: list[tuple[str, Any, str]] = []
    if "tcp" in kinds:
        from lightning_parcae.runtime.store import host_store

        out.append(("TCPStore", host_store("tcp://127.0.0.1:0", token=None), ""))
    if "etcd" in kinds:
        from lightning_parcae.runtime.store import connect_store
        from lightning_parcae.testing.etcd_server import EtcdServer, etcd_binary

        if etcd_binary() is None:
            print("  etcd: binary not installed, skipped (apt-get install etcd-server)", file=sys.stderr)
        else:
            server = stack.enter_context(EtcdServer())
            out.append(("etcd", connect_store(server.store_url("/parcae/bench"), token=None, timeout_s=30),
                        server.store_url("/parcae/bench-growth")))
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, dict[int, dict[str, float]]]:
    """Time both forms and print the table; returns ``{store: {N: {"serial": ms, "batched": ms}}}``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[4, 8, 16, 32], help="members N")
    ap.add_argument("--rounds", type=int, default=100, help="reads per form and N (median kept)")
    ap.add_argument("--stores", nargs="+", default=["tcp", "etcd"], choices=["tcp", "etcd"])
    ap.add_argument("--directory-sizes", type=int, nargs="*", default=[10, 300, 1000, 3000],
                    help="etcd: keys in the job's directory at which one get is timed (none: skip)")
    args = ap.parse_args(argv)
    if any(n < 1 for n in args.counts) or args.rounds < 1:
        ap.error(f"--counts {args.counts} and --rounds {args.rounds} must be >= 1")
    results: dict[str, dict[int, dict[str, float]]] = {}
    print("one read of every member's heartbeat, median ms (loopback; serial = a check and a get per member, "
          "batched = liveness.read_beats)")
    print(f"  {'store':<9} {'N':>3} {'serial ms':>10} {'batched ms':>11} {'batched/serial':>15}")
    with ExitStack() as stack:
        for name, store, url in _stores(args.stores, stack):
            for n in args.counts:
                got = time_reads(store, n, args.rounds)
                results.setdefault(name, {})[n] = got
                print(f"  {name:<9} {n:>3} {got['serial']:>10.3f} {got['batched']:>11.3f} "
                      f"{got['batched'] / got['serial']:>15.3f}")
            if name == "etcd" and args.directory_sizes:
                growth = time_directory_growth(url, args.directory_sizes, args.rounds)
                results["etcd directory"] = growth  # type: ignore[assignment]
                print("one get of a present key as the job's etcd directory grows, median ms")
                print(f"  {'keys':>6} {'torch EtcdStore':>16} {'parcae':>8} {'parcae/torch':>13}")
                for size, got in growth.items():
                    print(f"  {size:>6} {got['torch']:>16.3f} {got['parcae']:>8.3f} "
                          f"{got['parcae'] / got['torch']:>13.3f}")
    return results


if __name__ == "__main__":
    main()
