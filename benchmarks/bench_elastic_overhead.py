"""What live reconfiguration costs per step: the same job at the same shape, non-elastic against elastic.

Problem it measures: under ``parcae run`` (``--elastic``, the default) every step also runs the step-boundary
agreement (an all-reduce of the leader's proposal and the notice flags), the two-phase commit through the store,
guarded (abortable) waits for every collective and point-to-point operation, and the runtime's bookkeeping. The
static rows of ``bench_replay.py`` run non-elastic (``--restart-fallback`` with no trace, so nothing moves), so this
cost decides how far any elastic run stays from them.

Each job runs at a fixed shape with nothing moving, alternately (A B A B ...) under ``parcae run --restart-fallback``
(the non-elastic runtime) and ``parcae run --elastic`` (the planning interval is ``parcae run``'s default: 60 trace seconds at
``--time-scale 20``, i.e. the leader plans every 3 wall seconds; ``--time-scale 1`` plans once a minute), for a fixed number of steps, with ``LIGHTNING_PARCAE_STEP_TIMING=1`` so that every rank writes its
per-part timers (:mod:`lightning_parcae.runtime.steptime`) as a ``step_timing`` event. Printed: the median
samples/s of each mode (median of the progress events after the first 5 s of training, as ``bench_replay.py``
measures its static shapes), the per-step time it implies, the ratio elastic / non-elastic, and the mean
milliseconds per step of each timed part of the elastic step (rank 0 and the other ranks).

    nice -n 5 python benchmarks/bench_elastic_overhead.py                      # GPT 1x2 and the MLP 2x1, 2 rounds
    nice -n 5 python benchmarks/bench_elastic_overhead.py --jobs gpt --rounds 3 --out /tmp/eo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_replay import ROOT, PY, TRAIN, launch  # noqa: E402

JOBS: dict[str, dict[str, Any]] = {
    # the README's main job: 8-block GPT, a memory budget that forces P = 2
    "gpt": {"shape": (1, 2), "cmd": [*TRAIN], "steps_flag": "--trainer.max_steps"},
    # the tiny MLP of examples/train_run.py (a step of a few ms: the protocol's fixed cost shows in full)
    "mlp": {"shape": (2, 1), "cmd": [PY, str(ROOT / "examples" / "train_run.py"), "--ckpt-every", "1000000"],
            "steps_flag": "--max-steps"},
}


TIME_SCALE = [20.0]  # parcae run's default: a 60-s trace interval is a 3-s planning interval


def run_once(job: str, elastic: bool, steps: int, out: Path) -> dict[str, Any]:
    """One run of ``job`` at its shape; samples/s, the step time it implies, and every rank's timers."""
    spec = JOBS[job]
    d, p = spec["shape"]
    mode = ["--elastic", "--time-scale", str(TIME_SCALE[0])] if elastic else ["--restart-fallback"]
    os.environ["LIGHTNING_PARCAE_STEP_TIMING"] = "1"
    ev = _launch(spec, mode, d, p, steps, out)
    prog = [e for e in ev if e.get("source") == "worker" and e.get("event") == "progress"]
    rates = [e["samples_per_s"] for e in prog if prog and e["time"] >= prog[0]["time"] + 5.0 and e.get("samples_per_s")]
    batch = next((e.get("global_batch") for e in prog if e.get("global_batch")), None)
    shapes = sorted({(e["D"], e["P"]) for e in prog})
    timing = {int(e.get("rank", 0)): e["parts"] for e in ev if e.get("event") == "step_timing"}
    rate = float(statistics.median(rates)) if rates else 0.0
    return {"job": job, "elastic": elastic, "samples_per_s": rate, "global_batch": batch, "shapes": shapes,
            "step_ms": 1000.0 * batch / rate if rate and batch else None, "timing": timing, "n_progress": len(rates)}


def _launch(spec: dict[str, Any], mode: list[str], d: int, p: int, steps: int, out: Path) -> list[dict[str, Any]]:
    import bench_replay  # noqa: PLC0415

    saved = bench_replay.TRAIN
    try:
        bench_replay.TRAIN = [*spec["cmd"], spec["steps_flag"], str(steps)]
        return launch([*mode, "--instances", str(d * p), "--pipeline-stages", str(p)], out, 900.0)
    finally:
        bench_replay.TRAIN = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", default="gpt,mlp", help="comma-separated: " + ", ".join(JOBS))
    ap.add_argument("--rounds", type=int, default=2, help="A B pairs per job (interleaved)")
    ap.add_argument("--steps", type=int, default=0, help="steps per run (default: gpt 300, mlp 1500)")
    ap.add_argument("--out", default=None, help="run directories and results.json (default: a temporary folder)")
    ap.add_argument("--time-scale", type=float, default=20.0,
                    help="elastic runs: parcae run --time-scale (planning interval 60 s / this; default 20, "
                         "parcae run's own default)")
    a = ap.parse_args()
    TIME_SCALE[0] = a.time_scale
    out = Path(a.out or tempfile.mkdtemp(prefix="parcae_overhead_"))
    results: list[dict[str, Any]] = []
    for job in a.jobs.split(","):
        steps = a.steps or {"gpt": 300, "mlp": 1500}[job]
        for r in range(a.rounds):
            for elastic in (False, True) if r % 2 == 0 else (True, False):
                tag = f"{job}_{'elastic' if elastic else 'static'}_{r}"
                res = run_once(job, elastic, steps, out / tag)
                results.append(res)
                print(f"{tag}: {res['samples_per_s']:.1f} samples/s, shapes {res['shapes']}", flush=True)
        report(job, [x for x in results if x["job"] == job])
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"results: {out / 'results.json'}")
    return 0


def report(job: str, rows: list[dict[str, Any]]) -> None:
    """Medians of each mode side by side, and the elastic step's parts (mean ms per step, median over runs)."""
    st = [x["samples_per_s"] for x in rows if not x["elastic"] and x["samples_per_s"]]
    el = [x["samples_per_s"] for x in rows if x["elastic"] and x["samples_per_s"]]
    d, p = JOBS[job]["shape"]
    if not st or not el:
        print(f"{job}: a run produced no progress (see its launcher.log)")
        return
    ms, me = statistics.median(st), statistics.median(el)
    b = rows[0]["global_batch"] or 0
    print(f"\n{job} at {d}x{p}        non-elastic    elastic    elastic/non-elastic")
    print(f"  samples/s (median)  {ms:11.1f}  {me:9.1f}    {me / ms:.3f}")
    if b:
        print(f"  step ms (implied)   {1000 * b / ms:11.1f}  {1000 * b / me:9.1f}    {ms / me:.3f}")
    print(f"  runs: non-elastic {', '.join(f'{x:.0f}' for x in st)}; elastic {', '.join(f'{x:.0f}' for x in el)}")
    for label, elastic in (("non-elastic", False), ("elastic", True)):
        parts: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for x in rows:
            if x["elastic"] != elastic:
                continue
            for rank, t in x["timing"].items():
                steps = max(1, t.get("step", {}).get("n", 1))
                for name, v in t.items():
                    parts.setdefault((int(rank), name), []).append((1000.0 * v["total_s"] / steps, v["n"] / steps))
        if not parts:
            continue
        print(f"  {label} step parts (median over runs):            ms/step  calls/step")
        for (rank, name), vals in sorted(parts.items()):
            ms_ = statistics.median(v[0] for v in vals)
            calls = statistics.median(v[1] for v in vals)
            print(f"    rank {rank}  {name[:42]:42s} {ms_:8.2f}  {calls:8.2f}")


if __name__ == "__main__":
    sys.exit(main())
