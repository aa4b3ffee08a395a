"""Why the runtime polls the store with ``check`` instead of looping over short ``TCPStore.wait`` calls.

Problem it measures (issue 21): at N=16 four members entered the next generation 5 s after the others, although
the record they waited for was in the store. They were in ``Liveness.wait_key``, which looped over
``store.wait([key], 50 ms)`` so that a lost peer could still end the wait. This script starts a ``TCPStore`` and
``--waiters`` client threads (each with its own connection, as each member has), lets them wait for a key in one of
two ways, sets the key after ``--delay`` s, and prints how long after the set each waiter saw it:

* ``wait-loop``: ``store.wait([key], timedelta(milliseconds=50))`` retried on timeout (the old ``wait_key``);
* ``check-poll``: ``store.check([key])`` then ``time.sleep(0.02)`` (the current ``wait_key``, ``poll_s`` 0.02).

Everything here is real (one machine, loopback). The stall needs c10d's default C++ log level (WARNING, as in
every worker): each timed-out wait logs two "waitForInput ... timed out" warnings, and after ~5 s of them one wait
stalls ~5 s. With ``TORCH_CPP_LOG_LEVEL=ERROR`` the wait-loop sees the key within 2 ms -- so the script leaves the
level alone (its stderr is that log; discard it).

    python benchmarks/tcpstore_wait_stall.py --waiters 16 2>/dev/null
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from datetime import timedelta

__all__ = ["measure", "main"]


def measure(mode: str, waiters: int, delay_s: float) -> list[float]:
    """Seconds from the set of the key to each waiter seeing it, one sample per waiter (sorted)."""
    import torch.distributed as dist  # noqa: PLC0415

    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30), wait_for_workers=False)
    seen: list[float] = []
    set_at = [0.0]
    ready = threading.Barrier(waiters + 1)
    lock = threading.Lock()

    def waiter() -> None:
        client = dist.TCPStore("127.0.0.1", server.port, None, False, timedelta(seconds=30))
        ready.wait()
        while True:
            if mode == "check-poll":
                if client.check(["key"]):
                    break
                time.sleep(0.02)
                continue
            try:
                client.wait(["key"], timedelta(milliseconds=50))
                break
            except Exception as exc:  # noqa: BLE001 -- a timeout: wait again, as the old wait_key did
                if "timeout" not in str(exc).lower() and "timed out" not in str(exc).lower():
                    raise
        with lock:
            seen.append(time.monotonic() - set_at[0])

    threads = [threading.Thread(target=waiter, daemon=True) for _ in range(waiters)]
    for t in threads:
        t.start()
    ready.wait()
    time.sleep(delay_s)
    set_at[0] = time.monotonic()
    server.set("key", "1")
    for t in threads:
        t.join(60)
    return sorted(seen)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--waiters", type=int, default=16, help="client threads, one connection each (default 16)")
    ap.add_argument("--delay", type=float, default=0.73, help="seconds of waiting before the key is set")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per mode (default 2)")
    args = ap.parse_args(argv)
    print(f"{'mode':<11} {'round':>5} {'median s':>9} {'max s':>7}")
    worst: dict[str, float] = {}
    for mode in ("wait-loop", "check-poll"):
        for r in range(args.rounds):
            lat = measure(mode, args.waiters, args.delay)
            worst[mode] = max(worst.get(mode, 0.0), lat[-1])
            print(f"{mode:<11} {r:>5} {statistics.median(lat):>9.3f} {lat[-1]:>7.3f}")
    print(f"worst wait-loop / check-poll: {worst['wait-loop'] / max(worst['check-poll'], 1e-6):.0f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
