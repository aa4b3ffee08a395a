"""Samples trained by each policy on the full p3 trace, for every bundled model table and look-ahead.

Problem it answers: does the liveput policy (with a *predicted* future) train more than the reactive,
throughput-optimal restart baseline on every model, under the artifact's own accounting?

    python benchmarks/bench_policies.py                      # all models, L = 8 10 12 (about 15-30 min on 2 cores)
    python benchmarks/bench_policies.py --models gpt-1.5b --look-aheads 8 --json out.json

Prints one row per (model, L): ideal, throughput, parcae, parcae-oracle samples and the ratios parcae/throughput
and oracle/throughput.
"""

from __future__ import annotations

import argparse
import json
import time

from lightning_parcae.planning.costmodel import ArtifactCostModel, reference_models
from lightning_parcae.planning.sim import run_policy
from lightning_parcae.signals.traces import bundled_trace_path, load_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=reference_models())
    ap.add_argument("--look-aheads", nargs="*", type=int, default=[8, 10, 12])
    ap.add_argument("--predictor", default="persistence")
    ap.add_argument("--oracle", action="store_true", help="also run parcae-oracle (true future)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    a = ap.parse_args()
    intervals = load_trace(bundled_trace_path("p3")).as_tuples()
    rows = []
    print(f"{'model':<10} {'L':>3} {'ideal':>12} {'throughput':>12} {'parcae':>12} {'parcae/thr':>10} {'oracle':>12} {'oracle/thr':>10} {'sec':>6}", flush=True)
    for model in a.models:
        cm = ArtifactCostModel(model)
        ideal = run_policy("ideal", cm, intervals).samples
        thr = run_policy("throughput", cm, intervals).samples
        for L in a.look_aheads:
            t0 = time.time()
            par = run_policy("parcae", cm, intervals, look_ahead=L, predictor=a.predictor).samples
            ora = run_policy("parcae-oracle", cm, intervals, look_ahead=L).samples if a.oracle else float("nan")
            dt = time.time() - t0
            rows.append(dict(model=model, look_ahead=L, ideal=ideal, throughput=thr, parcae=par, oracle=ora, seconds=dt))
            print(f"{model:<10} {L:>3} {ideal:>12.1f} {thr:>12.1f} {par:>12.1f} {par / thr:>10.4f} {ora:>12.1f} {ora / thr:>10.4f} {dt:>6.0f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
