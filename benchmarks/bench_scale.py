"""How the control plane's costs grow with the instance count N: start-up, migrations, step agreement, heartbeats.

Problem it measures (issue 21): every end-to-end figure of the project comes from 4-6 instances. At N=16 a user saw
an intra-stage change take ~5 s (0.1-0.5 s at N=4) and start-up take over 48 s, and nobody knew which part grows
and how fast. This script runs the README's main job (``examples/gpt``, ``spot.yaml``: emulated accelerators, every
shape a pipeline P >= 2) under ``parcae run --instances N --emulated-devices --oversubscribe --pipeline-stages 2``
for each N, twice:

* a **fixed** run (no trace, ``LIGHTNING_PARCAE_STEP_TIMING=1``, a fixed number of steps): start-up and every rank's
  step-part timers (:mod:`lightning_parcae.runtime.steptime`: the step-boundary agreement ``boundary``, the
  two-phase ``commit``), written as ``step_timing`` events at the end of training;
* a **changes** run: a count trace that holds N for 15 s of training (``--trace-clock first-step``), drops to N-1 (a preemption
  notice to the newest member: usually an intra-stage change) and goes back to N (an addition: a cold standby
  boots and joins); every ``migration`` event of the workers, by kind, and the delay from the launcher's ``add``
  to the leader's first decision that counts the joiner (``bench_replay.join_delays``).

During both runs a side thread of this script connects to the run's store as one more client and every 0.5 s
reads each member's heartbeat key (``parcae/hb/<member>``, a counter written every 0.2 s by every member):
the achieved heartbeat rate per member, the longest gap between two counter changes, and the latency of those
reads (a real store operation under the load of N members).

What is real and what is modelled: every figure is the wall clock of real processes on this machine, except the
step's accelerator time, which is modelled (``device_ms_per_sample``, sleeps: no CPU). With N processes on few
cores the real parts also include CPU contention, which this script cannot separate from the protocol's own
growth; the ``load`` line records ``os.getloadavg()`` before each run. The heartbeat store operations per second
are derived, not counted: the measured beat rate times the operations one beat issues in
``runtime/liveness.py``: the leader's beat is its own write, the abort and notice checks, and the read of all N
heartbeats -- counted by running ``liveness.read_beats`` for N members against an in-process store
(:func:`leader_requests_per_beat`): 5 requests whatever N, one ``check`` and one ``multi_get`` for the heartbeats
(until stop 35 a check and a get per member, 3 + 2 N requests in series, which earlier tables show); any other
member: 5, it watches the leader.

    nice -n 5 python benchmarks/bench_scale.py                    # N = 4, 8, 16 (684 s on 2 loaded cores, 2026-12-02)
    nice -n 5 python benchmarks/bench_scale.py --counts 4,8,16,32 --batch-size 192 --out /tmp/scale
    python benchmarks/bench_scale.py --retable /tmp/scale       # the table again from an earlier --out
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import counted_at, join_delays, launch, read_events  # noqa: E402

__all__ = ["HeartbeatProbe", "arrival_split", "join_parts", "change_trace", "summarize", "table", "main"]

HEARTBEAT_S = 0.2
"""The members' heartbeat period (``Liveness(interval_s=0.2)``, the runtime's default)."""
WAKE_SLEEP_S = 0.001
"""The probe's control: how late a thread of the side client wakes from a sleep this long. A store get is a request
and a reply, two such wake-ups (the store's thread, then the client's) plus the store's work; at N processes on
two cores the wake-ups grow with the run queue whatever the store does, so the two rows read side by side."""

# (label, key in a summary, real or modelled/derived, unit)
ROWS: list[tuple[str, str, str]] = [
    ("start-up: launch -> first step, s (median of 2 runs)", "startup_s", "real"),
    ("runtime 'starting' phase, s (max over members)", "starting_phase_s", "real"),
    ("migration intra-stage, s", "migration:intra-stage", "real"),
    ("  of which not state transfer (groups, commit), s", "rest:intra-stage", "real"),
    ("migration inter-stage, s", "migration:inter-stage", "real"),
    ("migration repartition, s", "migration:repartition", "real"),
    ("  of which not state transfer, s", "rest:repartition", "real"),
    ("migration with a joiner, s", "migration:join", "real"),
    ("join delay: add -> leader counts the standby, s", "join_delay_s", "real"),
    ("  process start and imports: add -> runtime starts, s", "join_process_s", "real"),
    ("  runtime start-up: -> standby (store, heartbeats), s", "join_runtime_s", "real"),
    ("  standby -> the leader counts it, s", "join_counted_s", "real"),
    ("migrations in the changes run (count)", "n_migrations", "real"),
    ("step-boundary agreement, ms/step (median rank)", "boundary_ms", "real"),
    ("step-boundary agreement, ms/step (slowest rank)", "boundary_max_ms", "real"),
    ("  of which waiting in its all-reduce, ms/step (median rank)", "agreement_wait_ms", "real"),
    ("    for the last member to arrive, ms/step (median rank)", "agreement_arrival_ms", "real"),
    ("    in the all-reduce once all arrived, ms/step (median rank)", "agreement_after_ms", "real"),
    ("two-phase commit, ms/step (median rank)", "commit_ms", "real"),
    ("gradient all-reduce wait, ms/step (median rank)", "grad_wait_ms", "real"),
    ("  for the last replica to arrive, ms/call (median rank)", "grad_arrival_ms", "real"),
    ("  in the all-reduce once all arrived, ms/call (median rank)", "grad_after_ms", "real"),
    ("step, ms (median rank; modelled compute + real)", "step_ms", "mixed"),
    ("heartbeats per member per s (nominal 5)", "hb_rate", "real"),
    ("longest heartbeat gap seen, s", "hb_gap_s", "real"),
    ("store get latency p50, ms (side client)", "store_p50_ms", "real"),
    ("store get latency p95, ms (side client)", "store_p95_ms", "real"),
    ("a thread's wake-up delay p50, ms (side client, no store)", "wake_p50_ms", "real"),
    ("a thread's wake-up delay p95, ms (side client, no store)", "wake_p95_ms", "real"),
    ("heartbeat store ops/s, whole job", "hb_ops_per_s", "derived"),
    ("heartbeat store requests per leader beat", "leader_ops_per_beat", "counted"),
]


class HeartbeatProbe:
    """A side client of a run's store that samples every member's heartbeat counter and times the reads.

    Args:
        run_dir: The run directory (its ``events.jsonl`` names the store URL and the members).
        period_s: Seconds between two sweeps over the members.
    """

    def __init__(self, run_dir: Path, period_s: float = 0.5) -> None:
        self.run_dir = run_dir
        self.period_s = period_s
        self.latencies_ms: list[float] = []
        self.wake_ms: list[float] = []
        self.rates: list[float] = []
        self.max_gap_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hb-probe", daemon=True)

    def __enter__(self) -> "HeartbeatProbe":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _connect(self) -> tuple[Any, list[str]]:
        import torch.distributed as dist  # noqa: PLC0415 -- only the probe needs torch

        while not self._stop.is_set():
            ev = read_events(self.run_dir)
            start = next((e for e in ev if e.get("event") == "run_start"), None)
            if start and str(start.get("store", "")).startswith("tcp://"):
                url = urlparse(start["store"])
                store = dist.TCPStore(url.hostname, url.port, None, False, timedelta(seconds=10))
                return store, []
            time.sleep(0.5)
        return None, []

    def _members(self) -> list[str]:
        names: list[str] = []
        for e in read_events(self.run_dir):
            # a launch names its start-up candidates (the roster event then says who became a member); older runs
            # named members and standbys in the launch event itself
            if e.get("source") == "launcher" and e.get("event") in ("launch", "roster", "add"):
                names += [m for m in [*(e.get("candidates") or []), *(e.get("members") or []),
                                      *(e.get("standbys") or []), *(e.get("joiners") or [])] if m not in names]
        return names

    def _run(self) -> None:
        try:
            store, _ = self._connect()
        except Exception:  # noqa: BLE001 -- no store, no probe (the table shows n/a)
            return
        if store is None:
            return
        seen: dict[str, tuple[int, float, float]] = {}  # member -> (counter, first seen at, last change at)
        first: dict[str, tuple[int, float]] = {}
        members: list[str] = []
        sweeps = 0
        while not self._stop.wait(self.period_s):
            if sweeps % 10 == 0:
                members = self._members()
            sweeps += 1
            for _ in range(4):  # the machine's own scheduling delay at this load, beside the store's reads
                t0 = time.perf_counter()
                time.sleep(WAKE_SLEEP_S)
                self.wake_ms.append(1000 * (time.perf_counter() - t0 - WAKE_SLEEP_S))
            for m in members:
                key = f"parcae/hb/{m}"
                try:
                    t0 = time.perf_counter()
                    if not store.check([key]):
                        continue
                    raw = bytes(store.get(key))
                    self.latencies_ms.append(1000 * (time.perf_counter() - t0))
                    c = int(json.loads(raw)["c"])
                except Exception:  # noqa: BLE001 -- the store went away at the end of the run
                    self._stop.set()
                    break
                now = time.monotonic()
                first.setdefault(m, (c, now))
                prev = seen.get(m)
                if prev is None or c != prev[0]:
                    if prev is not None:  # silence between two observed changes (resolution: one sweep)
                        self.max_gap_s = max(self.max_gap_s, now - prev[2])
                    seen[m] = (c, prev[1] if prev else now, now)
        for m, (c, t_first) in first.items():
            last = seen.get(m)
            if last and last[2] - t_first > 5.0:
                self.rates.append((last[0] - c) / (last[2] - t_first))


def _startup(ev: list[dict[str, Any]]) -> Optional[float]:
    launch_t = next((e["time"] for e in ev if e.get("source") == "launcher" and e.get("event") == "launch"), None)
    step_t = next((e["time"] for e in ev if e.get("source") == "worker" and e.get("event") == "progress"), None)
    return None if launch_t is None or step_t is None else step_t - launch_t


def slowest_migrations(ev: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The slowest member's ``migration`` event of each generation."""
    by_gen: dict[int, dict[str, Any]] = {}
    for e in ev:
        if e.get("source") == "elastic" and e.get("event") == "migration":
            g = int(e["generation"])
            if g not in by_gen or e["duration_s"] > by_gen[g]["duration_s"]:
                by_gen[g] = e
    return [by_gen[g] for g in sorted(by_gen)]


def _percentile(xs: list[float], q: float) -> Optional[float]:
    """The sample at fraction ``q`` of ``xs`` sorted (index ``int(q * len)``, the last at most), or None if empty."""
    if not xs:
        return None
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def _median(xs: list[float]) -> Optional[float]:
    return float(statistics.median(xs)) if xs else None


class _CountingStore:
    """A store that counts the requests made through it."""

    def __init__(self, store: Any) -> None:
        self.store, self.requests = store, 0

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self.store, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.requests += 1
            return fn(*args, **kwargs)

        return counted


def leader_requests_per_beat(n: int) -> int:
    """Store requests in one heartbeat of the leader watching ``n`` members: its write, the abort and notice
    checks, and ``liveness.read_beats`` of every member (counted against an in-process ``HashStore``)."""
    import torch.distributed as dist

    from lightning_parcae.runtime.liveness import hb_key, read_beats

    members = [f"i{k}" for k in range(n)]
    base = dist.HashStore()
    for m in members:
        base.set(hb_key(m), "{}")
    store = _CountingStore(base)
    read_beats(store, members)  # type: ignore[arg-type]
    return 3 + store.requests


def arrival_split(ev: list[dict[str, Any]], name: str) -> dict[int, tuple[float, float, int]]:
    """Each rank's time in the collective ``name`` split at the last participant's arrival.

    Reads the ``intervals`` of the ``step_timing`` events (:func:`lightning_parcae.runtime.steptime.interval`:
    per call, when a rank entered and left, on the host's one monotonic clock). A call counts where every
    participant recorded it: for the step agreement (keys ``g<generation>/s<step>``) every rank that wrote timing
    events of that generation, for a gradient all-reduce (keys ``<ranks>/<dtype>/<k>``) the ranks its key names.

    Args:
        ev: ``events.jsonl`` of a run with ``LIGHTNING_PARCAE_STEP_TIMING=1``.
        name: The interval's name (``"step agreement"``, ``"gradient all-reduce"``).

    Returns:
        ``{rank: (seconds waiting for the last participant to arrive, seconds in the collective after that, calls)}``
        summed over the complete calls the rank took part in.
    """
    calls: dict[str, list[tuple[int, float, float]]] = {}
    for e in ev:
        if e.get("event") != "step_timing":
            continue
        for n, key, t0, t1 in e.get("intervals") or []:
            if n == name:
                calls.setdefault(str(key), []).append((int(e["rank"]), float(t0), float(t1)))
    expected: dict[str, int] = {}
    for key, rows in calls.items():  # the agreement: everyone seen in the generation takes part in each call
        if key.startswith("g"):
            gen = key.split("/")[0]
            expected[gen] = max(expected.get(gen, 0), len({r for r, _, _ in rows}))
    out: dict[int, tuple[float, float, int]] = {}
    for key, rows in calls.items():
        want = expected.get(key.split("/")[0]) if key.startswith("g") else len(key.split("/")[0].split(","))
        if len({r for r, _, _ in rows}) != want or len(rows) != want:
            continue
        last = max(t0 for _, t0, _ in rows)
        for r, t0, t1 in rows:
            w, a, n = out.get(r, (0.0, 0.0, 0))
            out[r] = (w + (last - t0), a + max(0.0, t1 - last), n + 1)
    return out


def join_parts(ev: list[dict[str, Any]]) -> list[tuple[float, float, float]]:
    """Each joiner's join delay (:func:`bench_replay.join_delays`) in three parts, in seconds: the launcher's ``add``
    -> its runtime starts (process start, imports, Lightning's set-up: the ``standby`` phase event's time less
    the seconds it spent ``starting``), -> it is a standby (the runtime's start-up: store, heartbeats), -> the
    leader's first decision that counts it."""
    out = []
    for a in (e for e in ev if e.get("source") == "launcher" and e.get("event") == "add"):
        for j in a.get("joiners") or []:
            ready = next((e for e in ev if e.get("event") == "phase" and e.get("member") == j
                          and e.get("new") == "standby" and e["time"] >= a["time"]), None)
            counted = counted_at(ev, a, j)
            if ready is None or counted is None:
                continue
            spent = float(ready.get("spent_s", 0.0))
            out.append((round(float(ready["time"]) - spent - a["time"], 3), round(spent, 3),
                        round(counted - float(ready["time"]), 3)))
    return out


def summarize(fixed: list[dict[str, Any]], changes: list[dict[str, Any]], probes: list[HeartbeatProbe] | None = None,
              n: int = 0) -> dict[str, Any]:
    """One N's figures from the events of its fixed and changes runs (and the heartbeat probes of both).

    Args:
        fixed: ``events.jsonl`` of the fixed run (with ``step_timing`` events).
        changes: ``events.jsonl`` of the changes run.
        probes: The heartbeat probes of the runs (None: no heartbeat figures).
        n: The instance count (for the derived heartbeat operation counts).

    Returns:
        ``{key: value or None}`` for every key of :data:`ROWS`, plus ``kinds`` (migrations per kind).
    """
    out: dict[str, Any] = {}
    out["startup_s"] = _median([s for s in (_startup(fixed), _startup(changes)) if s is not None])
    starting = [float(e["spent_s"]) for e in [*fixed, *changes]
                if e.get("event") == "phase" and e.get("old") == "starting" and e.get("generation") == 0]
    out["starting_phase_s"] = max(starting) if starting else None
    migs = slowest_migrations(changes)
    kinds: dict[str, list[dict[str, Any]]] = {}
    for m in migs:
        kinds.setdefault("join" if m.get("joiners") else str(m["kind"]), []).append(m)
    for kind in ("intra-stage", "inter-stage", "repartition", "join"):
        ms = kinds.get(kind, [])
        out[f"migration:{kind}"] = _median([float(m["duration_s"]) for m in ms])
        out[f"rest:{kind}"] = _median([float(m["duration_s"]) - float(m.get("transfer_s", 0.0)) for m in ms])
    out["kinds"] = {k: len(v) for k, v in kinds.items()}
    out["n_migrations"] = float(len(migs))
    out["join_delay_s"] = _median(join_delays(changes))
    per_rank: dict[str, list[float]] = {}
    for e in fixed:
        if e.get("event") != "step_timing":
            continue
        parts = e["parts"]
        steps = max(1, int(parts.get("step", {}).get("n", 1)))
        for name in ("boundary", "commit", "step", "wait: step agreement", "wait: gradient all-reduce"):
            if name in parts:
                total = float(parts[name]["total_s"])
                if name == "boundary":  # the leader's wait for a decision planned during the step is a stall too
                    total += float(parts.get("boundary.plan_wait", {}).get("total_s", 0.0))
                per_rank.setdefault(name, []).append(1000.0 * total / steps)
    out["boundary_ms"] = _median(per_rank.get("boundary", []))
    out["boundary_max_ms"] = max(per_rank["boundary"]) if per_rank.get("boundary") else None
    out["commit_ms"] = _median(per_rank.get("commit", []))
    out["agreement_wait_ms"] = _median(per_rank.get("wait: step agreement", []))
    out["grad_wait_ms"] = _median(per_rank.get("wait: gradient all-reduce", []))
    out["step_ms"] = _median(per_rank.get("step", []))
    for name, prefix in (("step agreement", "agreement"), ("gradient all-reduce", "grad")):
        split = arrival_split(fixed, name)  # per call: the agreement runs once per step boundary
        out[f"{prefix}_arrival_ms"] = _median([1000 * w / calls for w, _, calls in split.values() if calls])
        out[f"{prefix}_after_ms"] = _median([1000 * a / calls for _, a, calls in split.values() if calls])
    parts = join_parts(changes)
    out["join_process_s"] = _median([p[0] for p in parts])
    out["join_runtime_s"] = _median([p[1] for p in parts])
    out["join_counted_s"] = _median([p[2] for p in parts])
    wake = [x for p in probes or [] for x in p.wake_ms]
    out["wake_p50_ms"], out["wake_p95_ms"] = _percentile(wake, 0.5), _percentile(wake, 0.95)
    lat = [x for p in probes or [] for x in p.latencies_ms]
    rates = [r for p in probes or [] for r in p.rates]
    out["store_p50_ms"], out["store_p95_ms"] = _percentile(lat, 0.5), _percentile(lat, 0.95)
    out["hb_rate"] = _median(rates)
    out["hb_gap_s"] = max((p.max_gap_s for p in probes or []), default=None) if probes else None
    rate = out["hb_rate"] if out["hb_rate"] is not None else 1.0 / HEARTBEAT_S
    leader = float(leader_requests_per_beat(n)) if n else None
    out["leader_ops_per_beat"] = leader
    out["hb_ops_per_s"] = rate * (leader + 5 * (n - 1)) if n and leader is not None else None
    return out


def _fmt(v: Optional[float]) -> str:
    if v is None:
        return "n/a"
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.2f}" if abs(v) >= 1 else f"{v:.3f}"


def table(results: dict[int, dict[str, Any]]) -> str:
    """The figures of every N side by side, with the growth from the smallest to the largest N.

    Args:
        results: ``{N: summarize(...)}``.

    Returns:
        A Markdown table: one row per figure of :data:`ROWS`, one column per N, ``growth a->b`` (the ratio of the
        largest N's figure to the smallest's; n/a when either is missing or the smallest is 0) and ``linear``
        (b / a, what a cost linear in N would show).
    """
    ns = sorted(results)
    lo, hi = ns[0], ns[-1]
    head = ["figure", "kind", *[f"N={n}" for n in ns], f"growth {lo}->{hi}", f"linear {hi / lo:.0f}x"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, kind in ROWS:
        vals = [results[n].get(key) for n in ns]
        a, b = vals[0], vals[-1]
        growth = f"{b / a:.2f}" if a and b is not None else "n/a"
        lines.append("| " + " | ".join([label, kind, *map(_fmt, vals), growth, ""]) + " |")
    return "\n".join(lines)


def change_trace(path: Path, n: int, hold_s: float, scale: float) -> None:
    """Counts: N for ``hold_s`` wall seconds, N-1 for 6 intervals (12 s at scale 30), then N again."""
    t1 = int(hold_s * scale * 1000)
    t2 = t1 + 6 * 60_000
    path.write_text(f"t_ms,count\n0,{n}\n{t1},{n - 1}\n{t2},{n}\n{t2 + 8 * 60_000},{n}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="4,8,16", help="comma-separated instance counts (default 4,8,16)")
    ap.add_argument("--steps", type=int, default=80, help="steps of each fixed run (default 80)")
    ap.add_argument("--batch-size", type=int, default=96,
                    help="global batch of every run (default 96: D x M = 8 x 4 divides it, as N=16 at P=2 needs; "
                         "N=32 at P=2 needs 192 (the README's 48 fails at D=8 with M=4: BatchSplitError))")
    ap.add_argument("--time-scale", type=float, default=30.0, help="changes runs: parcae run --time-scale")
    ap.add_argument("--out", default=None, help="run directories and results.json (default: a temporary folder)")
    ap.add_argument("--retable", default=None, metavar="DIR",
                    help="print the table again from DIR (an earlier --out): events re-read from its run "
                         "directories, heartbeat and store figures from its results.json; runs nothing")
    a = ap.parse_args()
    if a.retable:
        return _retable(Path(a.retable))
    counts = [int(x) for x in a.counts.split(",")]
    out = Path(a.out or tempfile.mkdtemp(prefix="parcae_scale_"))
    base = ["--elastic", "--oversubscribe", "--pipeline-stages", "2", "--startup-timeout", "300"]
    results: dict[int, dict[str, Any]] = {}
    loads: dict[int, list[float]] = {}
    t_all = time.time()
    for n in counts:
        loads[n] = [round(x, 2) for x in os.getloadavg()]
        os.environ["LIGHTNING_PARCAE_STEP_TIMING"] = "1"
        t0 = time.time()
        with HeartbeatProbe(out / f"n{n}_fixed") as p1:
            fixed = launch([*base, "--instances", str(n)], out / f"n{n}_fixed", 120.0 + 10.0 * n + 3.0 * a.steps,
                           ("--trainer.max_steps", str(a.steps), "--data.batch_size", str(a.batch_size)))
        os.environ.pop("LIGHTNING_PARCAE_STEP_TIMING", None)
        # the trace's clock starts at the first training step (--trace-clock first-step): the change comes 15 s
        # into training however long start-up takes (regression: by wall clock from launch, a start-up slowed by
        # a loaded machine took the notice before the first generation formed and the N=4 run relaunched)
        hold = 15.0
        startup = _startup(fixed) or 4.0 * n
        change_trace(out / f"n{n}_trace.csv", n, hold, a.time_scale)
        with HeartbeatProbe(out / f"n{n}_changes") as p2:
            changes = launch([*base, "--instances", str(n), "--trace", str(out / f"n{n}_trace.csv"), "--victims",
                              "newest", "--time-scale", str(a.time_scale), "--trace-clock", "first-step"],
                             out / f"n{n}_changes", 2.0 * startup + hold + 40.0,
                             ("--data.batch_size", str(a.batch_size)))
        results[n] = summarize(fixed, changes, [p1, p2], n)
        results[n]["load"] = loads[n]
        results[n]["wall_s"] = round(time.time() - t0, 1)
        print(f"N={n}: {results[n]['wall_s']} s, load before {loads[n]}, migrations {results[n]['kinds']}",
              flush=True)
    (out / "results.json").write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))
    _print(results, out, time.time() - t_all)
    return 0


PROBE_KEYS = ("store_p50_ms", "store_p95_ms", "wake_p50_ms", "wake_p95_ms", "hb_rate", "hb_gap_s", "hb_ops_per_s", "leader_ops_per_beat")


def _retable(out: Path) -> int:
    saved = {int(k): v for k, v in json.loads((out / "results.json").read_text()).items()}
    results: dict[int, dict[str, Any]] = {}
    for n, old in sorted(saved.items()):
        results[n] = summarize(read_events(out / f"n{n}_fixed"), read_events(out / f"n{n}_changes"), None, n)
        results[n].update({k: old.get(k) for k in (*PROBE_KEYS, "load", "wall_s")})
    _print(results, out, sum(float(r.get("wall_s") or 0) for r in results.values()))
    return 0


def _print(results: dict[int, dict[str, Any]], out: Path, wall_s: float) -> None:
    loads = {n: r.get("load") for n, r in results.items()}
    print(f"\nbench_scale: the README's GPT job (examples/gpt/spot.yaml, global batch from --batch-size), parcae run --emulated-devices --oversubscribe "
          f"--pipeline-stages 2, {os.cpu_count()} CPU cores, {wall_s:.0f} s in all; work dir {out}")
    print("real = wall clock of real processes on this machine's shared cores (contention of N processes included);"
          " mixed = modelled accelerator compute (sleeps) plus real; derived = measured beat rate x the store "
          "operations one beat issues in runtime/liveness.py\n")
    print(table(results))
    print("\nload average (1, 5, 15 min) before each N: " + "; ".join(f"N={n}: {v}" for n, v in loads.items()))
    print("migrations by kind in the changes runs: " + "; ".join(f"N={n}: {r.get('kinds')}" for n, r in results.items()))


if __name__ == "__main__":
    sys.exit(main())
