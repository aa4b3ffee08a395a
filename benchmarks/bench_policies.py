"""Samples trained by each policy on every trace family, model table and interval length of the corpus.

Problem it answers: does the liveput policy (with a *predicted* future) train at least as much as the reactive,
throughput-optimal restart baseline on traces it was not tuned on -- outages down to 0, flapping around the
smallest shape, slow declines, bursts, calm -- and not only on the bundled p3 trace?

    python benchmarks/bench_policies.py                           # dev + held-out, 60 s and 300 s, all models
    python benchmarks/bench_policies.py --split heldout --intervals 300 --models gpt-1.5b
    python benchmarks/bench_policies.py --p3                      # the p3 headline: every model x L = 8 10 12

Corpus: :func:`lightning_parcae.signals.corpus.corpus` (the bundled p3 trace and its four segments in ``dev``; five
generated families at caps 32 and 16, seeds 0-1 in ``dev`` and 1000-1001 in ``heldout``). The cost model is the
artifact's (``ArtifactCostModel``). One row per (split, interval, family, model): samples summed over the family's
traces for ideal / throughput / restart / live-reactive / parcae, the ratios parcae/throughput, parcae/ideal and
parcae/live-reactive (what planning over the forecast adds beyond live migration), and the worst single trace's
parcae/throughput ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from lightning_parcae.signals.corpus import corpus
from lightning_parcae.planning.costmodel import ArtifactCostModel, reference_models
from lightning_parcae.planning.shape_optimizer import DEFAULT_RISK
from lightning_parcae.planning.sim import run_policy
from lightning_parcae.signals.traces import bundled_trace_path, load_trace

POLICIES = ("ideal", "throughput", "restart", "live-reactive", "parcae")


def _p3(a: argparse.Namespace) -> None:
    intervals = load_trace(bundled_trace_path("p3")).as_tuples()
    print(f"{'model':<10} {'L':>3} {'ideal':>12} {'throughput':>12} {'parcae':>12} {'parcae/thr':>10} {'oracle':>12} {'oracle/thr':>10} {'sec':>6}", flush=True)
    rows = []
    for model in a.models:
        cm = ArtifactCostModel(model)
        ideal = run_policy("ideal", cm, intervals).samples
        thr = run_policy("throughput", cm, intervals).samples
        for L in a.look_aheads:
            t0 = time.time()
            par = run_policy("parcae", cm, intervals, look_ahead=L, predictor=a.predictor, risk=a.risk).samples
            ora = run_policy("parcae-oracle", cm, intervals, look_ahead=L).samples if a.oracle else float("nan")
            dt = time.time() - t0
            rows.append(dict(model=model, look_ahead=L, ideal=ideal, throughput=thr, parcae=par, oracle=ora, seconds=dt))
            print(f"{model:<10} {L:>3} {ideal:>12.1f} {thr:>12.1f} {par:>12.1f} {par / thr:>10.4f} {ora:>12.1f} {ora / thr:>10.4f} {dt:>6.0f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", nargs="*", default=reference_models())
    ap.add_argument("--split", choices=["dev", "heldout", "all"], default="all")
    ap.add_argument("--intervals", nargs="*", type=float, default=[60.0, 300.0])
    ap.add_argument("--look-ahead", type=int, default=12)
    ap.add_argument("--look-aheads", nargs="*", type=int, default=[8, 10, 12], help="with --p3")
    ap.add_argument("--predictor", default="persistence")
    ap.add_argument("--risk", type=float, default=DEFAULT_RISK, help="parcae's risk aversion (std devs of the gain)")
    ap.add_argument("--families", nargs="*", default=None, help="only these families")
    ap.add_argument("--p3", action="store_true", help="only the p3 headline table (every model x look-ahead)")
    ap.add_argument("--oracle", action="store_true", help="with --p3: also run parcae-oracle (true future)")
    ap.add_argument("--json", default=None, help="write the numbers here")
    a = ap.parse_args()
    if a.p3:
        _p3(a)
        return
    splits = ["dev", "heldout"] if a.split == "all" else [a.split]
    head = (
        f"{'split':<8} {'int':>4} {'family':<12} {'model':<10} {'n':>2} {'ideal':>11} {'throughput':>11} {'restart':>11} "
        f"{'live-react':>11} {'parcae':>11} {'par/thr':>8} {'par/ideal':>9} {'par/live':>8} {'worst p/t':>9} {'sec':>5}"
    )
    print(f"look-ahead {a.look_ahead}, predictor {a.predictor}, risk {a.risk}, artifact cost model")
    print(head)
    print("-" * len(head), flush=True)
    rows = []
    worst_overall = float("inf")
    for split in splits:
        for interval_s in a.intervals:
            traces = corpus(split, interval_s=interval_s)
            fams = defaultdict(list)
            for ct in traces:
                if a.families is None or ct.family in a.families:
                    fams[ct.family].append(ct)
            for family, members in fams.items():
                for model in a.models:
                    cm = ArtifactCostModel(model)
                    t0 = time.time()
                    tot = dict.fromkeys(POLICIES, 0.0)
                    worst = float("inf")
                    for ct in members:
                        iv = ct.trace.as_tuples()
                        got = {
                            p: run_policy(p, cm, iv, interval_s, look_ahead=a.look_ahead, predictor=a.predictor, risk=a.risk).samples
                            for p in POLICIES
                        }
                        for p in POLICIES:
                            tot[p] += got[p]
                        if got["throughput"] > 0:
                            worst = min(worst, got["parcae"] / got["throughput"])
                        elif got["parcae"] < 0:
                            worst = min(worst, 0.0)
                    dt = time.time() - t0
                    pt = tot["parcae"] / tot["throughput"] if tot["throughput"] > 0 else float("nan")
                    pi = tot["parcae"] / tot["ideal"] if tot["ideal"] > 0 else float("nan")
                    pl = tot["parcae"] / tot["live-reactive"] if tot["live-reactive"] > 0 else float("nan")
                    worst_overall = min(worst_overall, worst)
                    rows.append(dict(split=split, interval_s=interval_s, family=family, model=model, traces=len(members), **tot,
                                     parcae_over_throughput=pt, parcae_over_ideal=pi, parcae_over_live_reactive=pl,
                                     worst_parcae_over_throughput=worst, seconds=dt))
                    print(
                        f"{split:<8} {interval_s:>4.0f} {family:<12} {model:<10} {len(members):>2} {tot['ideal']:>11.0f} "
                        f"{tot['throughput']:>11.0f} {tot['restart']:>11.0f} {tot['live-reactive']:>11.0f} {tot['parcae']:>11.0f} "
                        f"{pt:>8.4f} {pi:>9.4f} {pl:>8.4f} {worst:>9.4f} {dt:>5.0f}",
                        flush=True,
                    )
    print(f"worst single-trace parcae/throughput over everything above: {worst_overall:.4f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
