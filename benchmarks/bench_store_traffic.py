"""Store requests of the control plane at N instances, counted by a real etcd server -- not timed, counted.

Problem it measures (issue 21): "no control-plane cost grows faster than linearly from N = 4 to 32" cannot be read
off wall clocks on a 2-core machine, where N processes contend for the cores and every cost grows with N for that
reason alone. What the protocol *asks of the shared store* does not depend on the cores: this script runs the
README's GPT job (``examples/gpt/spot.yaml``, emulated accelerators) under ``parcae run --instances N --elastic
--oversubscribe --pipeline-stages 2 --store etcd://...`` against a throw-away etcd 3.4 server
(:class:`lightning_parcae.testing.etcd_server.EtcdServer`, loopback) for a fixed number of steps, samples the
server's own counters (``/metrics``: ``etcd_debugging_store_reads_total``, ``..._writes_total``,
``..._watch_requests_total``) every 0.25 s, and reports per N:

- **start-up**: requests from the launch to the first training step (arrival barriers, gloo's address exchange,
  the roster, records), in all and per member;
- **training**: requests per second and per step while the job trains in one shape (heartbeats, abort and notice
  checks, the two-phase commit, the step agreement's store side), in all and per member;
- **keys** left in the job's etcd directory at the end (its top-level entries, and all keys with scopes');
- with ``--changes``, a second run per N whose count trace goes N -> N-1 (a notice to the newest member) -> N (a
  standby joins) 15 s into training: the requests **of each migration** -- counted over the slowest member's
  ``migration`` event (its ``duration_s`` before the event), less what the fixed run's training sends in as long.

A cost linear in N shows as a constant per member. Some of the traffic is paced by time rather than by work
(heartbeats every 0.2 s, waits that poll every 20 ms until others arrive), so a slower machine adds polls: the
start-up figure is an upper bound of what faster members would send; the training figure per member per second is
set by the heartbeat period.

    python benchmarks/bench_store_traffic.py                      # N = 4, 8, 16 (about 6 minutes on 2 cores)
    python benchmarks/bench_store_traffic.py --counts 4,8,16,32 --batch-size 192
    python benchmarks/bench_store_traffic.py --pythonpath /tmp/old-checkout   # an older checkout's code, same job
    python benchmarks/bench_store_traffic.py --changes                 # + the requests of each migration

Real: every request, counted by the etcd server. Not measured: the cost of a request on a network (each is a round
trip there), and anything the processes exchange outside the store (gloo's own connections).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import launch  # noqa: E402
from bench_scale import change_trace, slowest_migrations  # noqa: E402

__all__ = ["parse_metrics", "counter_at", "summarize", "migration_requests", "main"]

METRICS = ("reads", "writes", "watches")


def parse_metrics(text: str) -> dict[str, float]:
    """The v2 store's request counters from etcd's Prometheus text: reads (``get``, ``getRecursive``), writes
    (every action: set, create, update, delete, compareAndSwap, ...) and watch requests.

    Args:
        text: The body of ``GET /metrics``.

    Returns:
        ``{"reads": ..., "writes": ..., "watches": ...}`` (0 for a counter not present).
    """
    out = dict.fromkeys(METRICS, 0.0)
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith("etcd_debugging_store_reads_total"):
            out["reads"] += float(value)
        elif name.startswith("etcd_debugging_store_writes_total"):
            out["writes"] += float(value)
        elif name.startswith("etcd_debugging_store_watch_requests_total"):
            out["watches"] += float(value)
    return out


def _sample_at(samples: list[tuple[float, dict[str, float]]], t: float) -> Optional[tuple[float, dict[str, float]]]:
    """The last ``(time, counters)`` sample taken at or before wall time ``t`` (None: none was)."""
    best = None
    for sample in samples:
        if sample[0] > t:
            break
        best = sample
    return best


def counter_at(samples: list[tuple[float, dict[str, float]]], t: float) -> Optional[dict[str, float]]:
    """The counters of the last sample taken at or before wall time ``t`` (None: none was)."""
    sample = _sample_at(samples, t)
    return None if sample is None else sample[1]


class MetricsProbe:
    """Samples an etcd server's store counters every ``period_s`` seconds on a side thread."""

    def __init__(self, client_url: str, period_s: float = 0.25) -> None:
        self.url = client_url.rstrip("/") + "/metrics"
        self.period_s = period_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="etcd-metrics", daemon=True)

    def read(self) -> dict[str, float]:
        """The counters now."""
        with urllib.request.urlopen(self.url, timeout=5) as resp:
            return parse_metrics(resp.read().decode())

    def __enter__(self) -> "MetricsProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.samples.append((time.time(), self.read()))
            except OSError:
                pass
            self._stop.wait(self.period_s)


def _sum(c: dict[str, float]) -> float:
    return sum(c[k] for k in METRICS)


def summarize(events: list[dict[str, Any]], samples: list[tuple[float, dict[str, float]]], n: int) -> dict[str, Any]:
    """Requests per phase from a run's events and the counter samples.

    Args:
        events: The run's ``events.jsonl``.
        samples: ``(wall time, counters)`` in time order.
        n: Instances.

    Returns:
        ``startup`` (requests launch -> first step), ``startup_per_member``, ``train_per_s``, ``train_per_step``,
        their per-member forms, and the counters' split (reads / writes / watches) of each phase.
    """
    launch_t = next((e["time"] for e in events if e.get("source") == "launcher" and e.get("event") == "launch"), None)
    progress = [e for e in events if e.get("source") == "worker" and e.get("event") == "progress"]
    out: dict[str, Any] = {"n": n}
    if launch_t is None or len(progress) < 2 or not samples:
        return out
    first, last = progress[0], progress[-1]
    c0, c1 = counter_at(samples, launch_t) or samples[0][1], counter_at(samples, first["time"])
    c2 = counter_at(samples, last["time"])
    if c1 is None or c2 is None:
        return out
    start = {k: c1[k] - c0[k] for k in METRICS}
    train = {k: c2[k] - c1[k] for k in METRICS}
    secs, steps = last["time"] - first["time"], int(last["step"]) - int(first["step"])
    out.update(startup=_sum(start), startup_split=start, startup_per_member=_sum(start) / n,
               startup_s=first["time"] - launch_t, train_s=secs, train_steps=steps, train_split=train)
    if secs > 0 and steps > 0:
        out.update(train_per_s=_sum(train) / secs, train_per_member_s=_sum(train) / secs / n,
                   train_per_step=_sum(train) / steps, train_per_member_step=_sum(train) / steps / n,
                   step_s=secs / steps)
    return out


def migration_requests(events: list[dict[str, Any]], samples: list[tuple[float, dict[str, float]]],
                       per_s: float) -> list[dict[str, Any]]:
    """The requests of each migration: counted over the slowest member's ``migration`` event of each generation
    (from ``duration_s`` before it to the event), less ``per_s`` (the training traffic) over as long.

    Args:
        events: A run's ``events.jsonl``.
        samples: ``(wall time, counters)`` in time order.
        per_s: Requests per second of the same job training in one shape.

    Returns:
        One ``{"generation", "kind", "duration_s", "requests", "excess"}`` per migration, in order.
    """
    out = []
    for e in slowest_migrations(events):
        g = int(e["generation"])
        t1, dur = float(e["time"]), float(e["duration_s"])
        # from the last sample before the migration to the next one after its event: the window is at least the
        # migration and at most 0.5 s longer
        first, after = _sample_at(samples, t1 - dur), _sample_at(samples, t1 + 0.25)
        if first is None or after is None:
            continue
        (t_lo, c0), (t_hi, c1) = first, after
        total = _sum(c1) - _sum(c0)
        kind = "join" if e.get("joiners") else str(e.get("kind"))
        out.append({"generation": g, "kind": kind, "duration_s": dur, "requests": total,
                    "excess": total - per_s * max(0.0, t_hi - t_lo)})
    return out


def _keys(client_url: str, prefix: str) -> tuple[int, int]:
    """(top-level entries of the job's directory, all keys under it)."""
    def get(recursive: bool) -> dict[str, Any]:
        q = "?recursive=true" if recursive else ""
        with urllib.request.urlopen(f"{client_url}/v2/keys{prefix}{q}", timeout=10) as resp:
            return json.loads(resp.read())["node"]

    def leaves(node: dict[str, Any]) -> int:
        return sum(leaves(c) for c in node.get("nodes", [])) if node.get("dir") else 1

    return len(get(False).get("nodes", [])), leaves(get(True))


def main(argv: Optional[list[str]] = None) -> dict[int, dict[str, Any]]:
    """Run every N, print the table; returns the summaries (for tests)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="4,8,16", help="comma-separated instance counts (default 4,8,16)")
    ap.add_argument("--steps", type=int, default=60, help="training steps of each run (default 60)")
    ap.add_argument("--batch-size", type=int, default=96,
                    help="global batch (default 96: D x M = 8 x 4 divides it; N=32 at P=2 needs 192)")
    ap.add_argument("--pythonpath", default=None,
                    help="run the job with this checkout's lightning_parcae first on PYTHONPATH (old vs new code)")
    ap.add_argument("--changes", action="store_true",
                    help="also run N -> N-1 -> N per N and count the requests of each migration")
    ap.add_argument("--out", default=None, help="run directories and results.json (default: a temporary folder)")
    a = ap.parse_args(argv)
    from lightning_parcae.testing.etcd_server import EtcdServer

    counts = [int(x) for x in a.counts.split(",")]
    if any(n < 2 for n in counts):
        ap.error(f"--counts {a.counts}: every N must be >= 2 (P = 2)")
    out = Path(a.out or tempfile.mkdtemp(prefix="parcae_store_traffic_"))
    if a.pythonpath:
        # and run from there: the launcher is started as ``python -m``, which puts the working directory on
        # sys.path *before* PYTHONPATH (regression: from this checkout, the launcher ran this checkout's code and
        # only the workers the other's)
        os.environ["PYTHONPATH"] = os.pathsep.join([a.pythonpath, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        out = out.resolve()
        os.chdir(a.pythonpath)
    base = ["--elastic", "--oversubscribe", "--pipeline-stages", "2", "--startup-timeout", "300"]
    results: dict[int, dict[str, Any]] = {}
    t_all = time.time()
    for n in counts:
        with EtcdServer() as server:
            url = server.store_url("/parcae/traffic")
            client = url.replace("etcd://", "http://").split("/parcae")[0]
            with MetricsProbe(client) as probe:
                events = launch([*base, "--instances", str(n), "--store", url], out / f"n{n}",
                                120.0 + 10.0 * n + 3.0 * a.steps,
                                ("--trainer.max_steps", str(a.steps), "--data.batch_size", str(a.batch_size)))
                time.sleep(0.5)
            results[n] = summarize(events, probe.samples, n)
            results[n]["keys_top"], results[n]["keys_all"] = _keys(client, "/parcae/traffic")
        if a.changes and results[n].get("train_per_s"):
            with EtcdServer() as server:
                url = server.store_url("/parcae/traffic")
                client = url.replace("etcd://", "http://").split("/parcae")[0]
                change_trace(out / f"n{n}_trace.csv", n, 15.0, 30.0)
                with MetricsProbe(client) as probe:
                    events = launch([*base, "--instances", str(n), "--store", url, "--trace",
                                     str(out / f"n{n}_trace.csv"), "--victims", "newest", "--time-scale", "30",
                                     "--trace-clock", "first-step"], out / f"n{n}_changes",
                                    2.0 * float(results[n].get("startup_s") or 4.0 * n) + 60.0,
                                    ("--data.batch_size", str(a.batch_size)))
                    time.sleep(0.5)
                results[n]["migrations"] = migration_requests(events, probe.samples, results[n]["train_per_s"])
        print(f"N={n}: {json.dumps({k: v for k, v in results[n].items() if not isinstance(v, dict)})}", flush=True)
    (out / "results.json").write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    _print(results, time.time() - t_all, a.pythonpath, out)
    return results


def _print(results: dict[int, dict[str, Any]], wall_s: float, pythonpath: Optional[str], out: Path) -> None:
    ns = sorted(results)
    rows = [("start-up requests (launch -> first step)", "startup"),
            ("  per member", "startup_per_member"),
            ("training requests per s", "train_per_s"),
            ("  per member per s", "train_per_member_s"),
            ("training requests per step", "train_per_step"),
            ("  per member per step", "train_per_member_step"),
            ("step, s", "step_s"),
            ("start-up, s", "startup_s"),
            ("keys: entries of the job's directory at the end", "keys_top"),
            ("keys: all, scopes included", "keys_all")]
    code = f"code from {pythonpath}" if pythonpath else "this checkout's code"
    print(f"\nbench_store_traffic: the README's GPT job, parcae run --emulated-devices --oversubscribe "
          f"--pipeline-stages 2 --store etcd (loopback), {code}; {os.cpu_count()} cores, {wall_s:.0f} s; {out}")
    lo, hi = ns[0], ns[-1]
    head = ["figure", *[f"N={n}" for n in ns], f"growth {lo}->{hi}", f"linear {hi / lo:g}x"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for label, key in rows:
        vals = [results[n].get(key) for n in ns]
        a, b = vals[0], vals[-1]
        growth = f"{b / a:.2f}" if a and b is not None else "n/a"
        cells = ["n/a" if v is None else f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" for v in vals]
        print("| " + " | ".join([label, *cells, growth, ""]) + " |")
    for n in ns:
        for m in results[n].get("migrations", []):
            print(f"N={n}: migration into generation {m['generation']} ({m['kind']}, {m['duration_s']:.2f} s): "
                  f"{m['requests']:.0f} requests in its window, {m['excess']:.0f} above training "
                  f"({m['excess'] / n:.1f} per member)")
    for n in ns:
        r = results[n]
        if "startup_split" in r:
            print(f"N={n}: start-up reads/writes/watches {r['startup_split']}; training {r['train_split']}")


if __name__ == "__main__":
    main()
