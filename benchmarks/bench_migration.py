"""Time to handle each kind of membership change in place, against restarting every process from a checkpoint.

Problem it measures: Parcae's claim is that moving a running job to a new shape in place (intra-stage: only the
process groups change; inter-stage: a process takes over another stage's state from a live replica; repartition: P
changes and each process receives only the layers it lacks) costs a fraction of what a torchrun-style restart
costs (stop everything, relaunch, rendezvous, load the checkpoint). Each scenario below runs the same job (the
test job of ``tests/elastic_job.py``: an MLP stack, Adam, global batch 24, M=2) as real worker processes on
loopback and provokes one kind of change:

* ``intra-stage``   (3,2), a notice for one stage-1 member: the survivors regroup as (2,2), nothing moves;
* ``inter-stage``   (3,2), notices for two stage-1 members: a stage-0 survivor takes stage 1 from a live replica;
* ``repartition``   (2,2), an operator request for (4,1): every process receives the layers it lacks;
* ``join``          (1,2) plus a warm standby: the new instance receives its stage and the loop state;
* ``restart``       (2,2) killed right after a checkpoint and relaunched from it (the baseline).

Reported per scenario: the migration's duration (longest member, from the workers' events), and the *training
stall*: the gap between the last step before and the first step after the change, minus one normal step time.
For the restart the stall runs from the kill to the first step of the relaunched job.

    python benchmarks/bench_migration.py                # hidden=1024 (~2.1 M parameters, ~25 MB of state)
    python benchmarks/bench_migration.py --hidden 2048  # ~8.4 M parameters
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from elastic_harness import ElasticJob  # noqa: E402

from lightning_parcae.runtime.coordinator import Coordinator  # noqa: E402
from lightning_parcae.runtime.store import connect_store  # noqa: E402


def _steps_by_time(job: ElasticJob) -> list[tuple[float, int]]:
    seen: dict[int, float] = {}
    for r in job.steps():
        seen[r["step"]] = min(seen.get(r["step"], r["t"]), r["t"])
    return sorted((t, s) for s, t in seen.items())


def _stall(job: ElasticJob, t_event: float) -> tuple[float, float]:
    """Largest gap between consecutive steps after ``t_event``'s neighbourhood, minus the median step time."""
    times = [t for t, _ in _steps_by_time(job)]
    gaps = [(b - a, a) for a, b in zip(times, times[1:])]
    typical = statistics.median(g for g, _ in gaps) if gaps else 0.0
    around = [g for g, a in gaps if a >= t_event - 5.0]
    return max(0.0, (max(around) if around else 0.0) - typical), typical


def _migrations(job: ElasticJob, kind: str) -> list[dict[str, Any]]:
    by_gen: dict[int, dict[str, Any]] = {}
    for e in job.events():
        if e.get("event") == "migration" and e.get("kind") == kind:
            g = e["generation"]
            if g not in by_gen or e["duration_s"] > by_gen[g]["duration_s"]:
                by_gen[g] = e
    return list(by_gen.values())


def _run(out: Path, args: list[str], n: int, act: Any, max_wait: float = 240.0) -> ElasticJob:
    job = ElasticJob(out, args)
    try:
        job.start(n)
        act(job)
        job.wait(max_wait)
    finally:
        job.stop()
    return job


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    opts = ap.parse_args()
    base = ["--batch-size", "24", "--samples", "480", "--hidden", str(opts.hidden), "--max-steps", str(opts.steps), "--interval-steps",
            "1"]  # later flags override earlier ones
    rows: list[tuple[str, float, float, float, int]] = []
    tmp = Path(tempfile.mkdtemp(prefix="parcae-bench-"))
    marks: dict[str, float] = {}

    def ask(job: ElasticJob, d: int, p: int, rid: int) -> None:
        Coordinator(connect_store(job.url, token=job.token), job.token).put("parcae/request",
                                                                            {"id": rid, "D": d, "P": p})

    def notice(*members: str) -> Any:
        def act(job: ElasticJob) -> None:
            ask(job, 2, 2, 1)  # the shape to move to (the optimizer would pick P=1 for this small model)
            job.wait_step(4)
            marks["t"] = time.time()
            for m in members:
                job.notice(m)
        return act

    # slow steps (0.5 s) so that two notices sent together are seen at the same step boundary
    for kind, n, act in (("intra-stage", 6, notice("m5")), ("inter-stage", 6, notice("m3", "m5"))):
        job = _run(tmp / kind, [*base, "--pipeline-stages", "2", "--interval-steps", "0", "--delay", "0.5"], n, act)
        migs = _migrations(job, kind)
        stall, step = _stall(job, marks["t"])
        rows.append((kind, max((m["duration_s"] for m in migs), default=float("nan")), stall, step - 0.5,
                     max((m.get("bytes_moved", 0) for m in migs), default=0)))

    def request(job: ElasticJob) -> None:
        job.wait_step(2)
        marks["t"] = time.time()
        ask(job, 4, 1, 2)

    job = _run(tmp / "repartition", [*base, "--pipeline-stages", "2", "--interval-steps", "4"], 4, request)
    migs = _migrations(job, "repartition")
    stall, step = _stall(job, marks["t"])
    rows.append(("repartition", max((m["duration_s"] for m in migs), default=float("nan")), stall, step,
                 max((m.get("bytes_moved", 0) for m in migs), default=0)))

    def join(job: ElasticJob) -> None:
        job.wait_step(1)
        marks["t"] = time.time()
        job.add()

    # the leader looks for standbys every 6 steps; the joiner needs a few seconds to import and build the model
    join_args = [*base, "--pipeline-stages", "2", "--delay", "0.5", "--interval-steps", "6", "--max-steps", "30"]
    job = _run(tmp / "join", join_args, 2, join)
    migs = [e for e in job.events() if e.get("event") == "migration" and e.get("joiners")]
    t_join = float(migs[0]["time"]) - float(migs[0]["duration_s"]) if migs else marks["t"]
    stall, step = _stall(job, t_join)
    rows.append(("join (" + (migs[0]["kind"] if migs else "none") + ")",
                 max((m["duration_s"] for m in migs), default=float("nan")), stall, step - 0.5,
                 max((m.get("bytes_moved", 0) for m in migs), default=0)))

    # the baseline: kill everything right after a checkpoint and relaunch from it (torchrun-style)
    rjob = ElasticJob(tmp / "restart", [*base, "--pipeline-stages", "2", "--ckpt-every", "4", "--interval-steps",
                                        "0"])
    try:
        rjob.start(4)
        rjob.wait_step(5)
        t_kill = time.time()
        for m in list(rjob.procs):
            rjob.kill(m)
        rjob.start(4, resume=True)
        rjob.wait(240)
    finally:
        rjob.stop()
    after = [t for t, s in _steps_by_time(rjob) if t > t_kill]
    step_t = _stall(rjob, 0.0)[1]
    restart = (min(after) - t_kill) if after else float("nan")
    rows.append(("restart (baseline)", restart, restart, step_t, 0))

    print(f"\nhidden={opts.hidden}; one normal step ~ {statistics.median(r[3] for r in rows) * 1000:.0f} ms; "
          f"work dir {tmp}\n")
    print(f"{'change':<22}{'migration s':>13}{'training stall s':>18}{'stall / restart':>17}{'bytes moved':>14}")
    for kind, dur, stall, _, nbytes in rows:
        ratio = stall / restart if restart == restart and restart > 0 else float("nan")
        print(f"{kind:<22}{dur:>13.3f}{stall:>18.3f}{ratio:>17.3f}{nbytes:>14,}")


if __name__ == "__main__":
    main()
