"""Mean absolute error and 80 % band coverage of every predictor on every trace family of the corpus.

Problem it answers: does any predictor beat "nothing will change" (persistence) on traces it was not developed
on, and are the bands honest (about 80 % of outcomes inside)?

    python benchmarks/bench_predictors.py                    # dev + held-out, 60 s and 300 s, L = 12 (a few min)
    python benchmarks/bench_predictors.py --split heldout --intervals 300

Each cell is ``MAE / coverage`` pooled over every scored forecast of the family's traces (steps 1..L), walking
each trace online (observe count t, forecast t+1..t+L). Forecasts are unbounded above (``max_instances=None``);
the artifact predictor keeps its W = L window.
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import numpy as np

from lightning_parcae.signals.corpus import corpus
from lightning_parcae.planning.forecast import PREDICTORS, backtest, make_predictor


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", choices=["dev", "heldout", "all"], default="all")
    ap.add_argument("--intervals", nargs="*", type=float, default=[60.0, 300.0])
    ap.add_argument("--horizon", type=int, default=12)
    ap.add_argument("--predictors", nargs="*", default=["persistence", "arima", "hazard", "ensemble", "artifact"])
    a = ap.parse_args()
    names = [n for n in a.predictors if n in PREDICTORS]
    print(f"MAE (instances) / 80 % band coverage over steps 1..{a.horizon}")
    print(f"{'split':<8} {'int':>4} {'family':<12} " + " ".join(f"{n:>16}" for n in names), flush=True)
    for split in (["dev", "heldout"] if a.split == "all" else [a.split]):
        for interval_s in a.intervals:
            fams = defaultdict(list)
            for ct in corpus(split, interval_s=interval_s):
                fams[ct.family].append(ct)
            for fam, members in fams.items():
                cells = []
                for name in names:
                    err = cov = cnt = 0.0
                    for ct in members:
                        kw: dict = dict(min_instances=0, max_instances=None)
                        if name == "artifact":
                            kw["window"] = a.horizon
                        bt = backtest(ct.trace.counts(), make_predictor(name, **kw), a.horizon)
                        ok = bt.n > 0
                        err += float(np.sum(bt.mae[ok] * bt.n[ok]))
                        cov += float(np.sum(bt.coverage[ok] * bt.n[ok]))
                        cnt += float(bt.n[ok].sum())
                    cells.append(f"{err / cnt:>7.3f} / {cov / cnt:>5.3f}" if cnt else f"{'-':>16}")
                print(f"{split:<8} {interval_s:>4.0f} {fam:<12} " + " ".join(cells), flush=True)


if __name__ == "__main__":
    main()
