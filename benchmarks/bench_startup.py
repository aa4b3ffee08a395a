"""Time to the first step with and without a preemption notice during start-up (issue 20), side by side.

Problem it measures: before the start-up roster, an instance noticed while the others imported torch made ``parcae
run`` relaunch everyone (``--instances 16 --trace hh_55_65`` lost 120 s of a 400 s run). Now a candidate noticed
before its launch's roster is stopped at once and left out, and the first generation forms from the others. This
script runs the README's main job (``examples/gpt``, ``spot.yaml``: emulated accelerators, P = 2) under the *same*
``parcae run`` command twice per N -- once with a count trace that holds N, once with one that drops to N-1 at
``--notice-at`` wall seconds after the launch (while every worker is still importing) -- and reports, from each
run's ``events.jsonl``: launch -> first ``progress`` event (the first step), launch -> roster, the roster's size,
who was left out, and the relaunches (fallbacks). Every figure is the wall clock of real processes on this machine
(the accelerator time is modelled, ``device_ms_per_sample``); with many workers on few cores start-up is mostly CPU
contention, so the two runs of one N are run back to back and ``os.getloadavg()`` is printed before each.

Usage::

    nice -n 5 python benchmarks/bench_startup.py --counts 8            # ~2.5 minutes on 2 loaded cores
    nice -n 5 python benchmarks/bench_startup.py --counts 8,16 --out /tmp/startup
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

__all__ = ["first_step", "summarize", "main"]


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def first_step(ev: list[dict[str, Any]]) -> Optional[float]:
    """Seconds from the (first) launch to the first ``progress`` event of any worker."""
    launch = next((e["time"] for e in ev if e.get("source") == "launcher" and e.get("event") == "launch"), None)
    step = next((e["time"] for e in ev if e.get("source") == "worker" and e.get("event") == "progress"), None)
    return None if launch is None or step is None else step - launch


def summarize(ev: list[dict[str, Any]]) -> dict[str, Any]:
    """The start-up figures of one run's events."""
    launcher = [e for e in ev if e.get("source") == "launcher"]
    rosters = [e for e in launcher if e.get("event") == "roster"]
    removes = [v for e in launcher if e.get("event") == "remove" for v in e.get("victims", [])]
    return {
        "first_step_s": first_step(ev),
        "roster_s": rosters[0].get("after_s") if rosters else None,
        "members": len(rosters[0]["members"]) if rosters else None,
        "left_out": rosters[0].get("left_out") if rosters else None,
        "removed": [f"{v['member']}: {v['action']}" for v in removes],
        "fallbacks": [e.get("reason") for e in launcher if e.get("event") == "fallback"],
        "launches": sum(1 for e in launcher if e.get("event") == "launch"),
    }


def _run(n: int, trace: Path, run_dir: Path, steps: int, batch: int, grace: float,
         timeout_s: float) -> dict[str, Any]:
    cmd = [PY, "-m", "lightning_parcae.launch.run", "--instances", str(n), "--trace", str(trace), "--interval", "1",
           "--time-scale", "1", "--grace", f"{grace:g}", "--emulated-devices", "--oversubscribe", "--pipeline-stages", "2",
           "--startup-timeout", "400", "--run-dir", str(run_dir), "--no-plot", "--progress-every", "30", "--",
           PY, str(ROOT / "examples" / "gpt" / "train.py"), "--config", str(ROOT / "examples" / "gpt" / "spot.yaml"),
           "--trainer.max_steps", str(steps), "--data.batch_size", str(batch)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PARCAE_")}
    t0 = time.time()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        try:
            rc: Optional[int] = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                               timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            rc = None
    return {"rc": rc, "wall_s": round(time.time() - t0, 1), **summarize(_events(run_dir)),
            "command": " ".join(cmd)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--counts", default="8", help="comma-separated instance counts (default 8)")
    ap.add_argument("--notice-at", type=float, default=5.0,
                    help="wall seconds after the launch at which the trace drops one instance (default 5: every "
                         "worker is still importing)")
    ap.add_argument("--grace", type=float, default=6.0,
                    help="notice period in wall seconds (default 6: parcae run's default 120 s at --time-scale 20, "
                         "as in the issue's measurement; a noticed member that outlives it is SIGKILLed)")
    ap.add_argument("--only", choices=["quiet", "notice"], default=None, help="run only one of the two")
    ap.add_argument("--steps", type=int, default=30, help="max_steps of each run (default 30)")
    ap.add_argument("--batch-size", type=int, default=96, help="global batch (default 96: D x M = 8 x 4 divides it)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run (default 600)")
    ap.add_argument("--out", default=None, help="run directories and results.json (default: a temporary folder)")
    a = ap.parse_args()
    out = Path(a.out or tempfile.mkdtemp(prefix="parcae_startup_"))
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    for n in (int(x) for x in a.counts.split(",")):
        quiet, noticed = out / f"n{n}_quiet.csv", out / f"n{n}_notice.csv"
        quiet.write_text(f"t_ms,count\n0,{n}\n")
        noticed.write_text(f"t_ms,count\n0,{n}\n{int(a.notice_at * 1000)},{n - 1}\n")
        for name, trace in (("quiet", quiet), ("notice", noticed)):
            if a.only not in (None, name):
                continue
            load = [round(x, 2) for x in os.getloadavg()]
            r = _run(n, trace, out / f"n{n}_{name}", a.steps, a.batch_size, a.grace, a.timeout)
            r["load"] = load
            results[f"{n}/{name}"] = r
            print(f"N={n} {name:6s}: first step {r['first_step_s']} s after the launch (roster at {r['roster_s']} "
                  f"s, {r['members']} members, left out {r['left_out']}, removed {r['removed']}), fallbacks "
                  f"{r['fallbacks']}, launches {r['launches']}, rc {r['rc']}, wall {r['wall_s']} s, load {load}",
                  flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
