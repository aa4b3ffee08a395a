"""What prediction is worth: the simulator's parcae / live-reactive, by how much a migration costs.

Parcae's forecast pays only where a reconfiguration costs enough that holding a shape through a dip, or not
taking one the count will soon take back, saves more than it loses. This prints, from the planning side alone
(no processes; the same optimizer and cost models the runtime plans with):

* ``--windows``: every ``--window-hours`` window of the bundled AWS p3 trace (11.4 h, up to 32 instances) with
  one of the artifact's profiled tables (``--model``), under the artifact's accounting and under this runtime's
  cost model (``DefaultCostModel``, departures noticed) at each ``--gbps`` state bandwidth;
* ``--segments``: the four bundled 1-hour segments (their first ``--intervals`` intervals, scaled to 32 instances,
  as ``benchmarks/bench_replay.py --job gpt15b --max-instances 32`` replays them) with the emulated GPT-1.5B
  workload (``lightning_parcae.testing.emulated_cluster``; the shapes the emulated job can take, P >= 6), at each
  ``--gbps`` state bandwidth -- the simulator's view of what ``bench_replay.py --state-gbps`` will find.

Each line gives parcae / live-reactive (samples), the time each loses to reconfigurations and the seconds one
live-reactive reconfiguration costs on average. All figures are modelled (the simulator), none is measured.

    python benchmarks/bench_prediction_value.py --windows --segments --gbps 10,2.5,1,0.5,0.25
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lightning_parcae.launch.run import _load_schedule  # noqa: E402
from lightning_parcae.planning.costmodel import (  # noqa: E402
    DefaultCostModel, MigrationCostModel, ProfileThroughput, reference_layer_params, TableThroughput)
from lightning_parcae.planning.measured import load_cost_model  # noqa: E402
from lightning_parcae.errors import ConfigurationError  # noqa: E402
from lightning_parcae.planning.policy import check_risk  # noqa: E402
from lightning_parcae.planning.sim import run_policy  # noqa: E402
from lightning_parcae.runtime.shape_choice import RUNTIME_CONSTANTS  # noqa: E402
from lightning_parcae.signals.traces import from_counts, load_trace, bundled_trace_path  # noqa: E402
from lightning_parcae.testing.emulated_cluster import EmulatedWorkload  # noqa: E402

SEGMENTS = ["hh_55_65", "hl_15_25", "lh_80_90", "ll_10_11"]
GBPS = 1.25e8  # bytes per second in one Gbit/s


TAIL: float | None = None  # --tail: the optimizer's terminal value in intervals (None: the policy's default)
RISK: float | None = None  # --risk: the standard deviations of gain a departure must clear (None: the default)


def compare(cm: MigrationCostModel, intervals: Sequence[tuple[int, int, int]], interval_s: float) -> tuple[float, ...]:
    """(parcae / live-reactive, reactive's lost s, parcae's lost s, reactive's reconfigurations)."""
    reactive = run_policy("live-reactive", cm, intervals, interval_s)
    given = {k: v for k, v in (("tail_intervals", TAIL), ("risk", RISK)) if v is not None}
    parcae = run_policy("parcae", cm, intervals, interval_s, look_ahead=12, **given)
    moves = sum(1 for x in reactive.lost_ms if x > 0)
    return (parcae.samples / reactive.samples, sum(reactive.lost_ms) / 1e3, sum(parcae.lost_ms) / 1e3, moves)


def windows(model: str, hours: float, gbps: list[float]) -> None:
    trace = load_trace(bundled_trace_path("p3"))
    n = int(len(trace) * trace.interval_s // (3600 * hours))
    models: list[tuple[str, MigrationCostModel]] = [("artifact", load_cost_model("artifact", model=model))]
    for g in gbps:
        c = replace(RUNTIME_CONSTANTS, bandwidth_bytes_per_s=g * GBPS)
        cm = DefaultCostModel(TableThroughput.from_reference(model), reference_layer_params(model), c,
                              preemption_notice=True)
        models.append((f"runtime, state at {g:g} Gbps", cm))
    print(f"\np3 trace, {n} windows of {hours:g} h, model table {model}: parcae / live-reactive")
    print("| cost model | whole trace | windows: min / mean / max | reactive s per reconfiguration |")
    print("|---|---|---|---|")
    for name, cm in models:
        whole = compare(cm, [(x.prev_n, x.n_in, x.n_out) for x in trace], trace.interval_s)
        ratios = []
        for k in range(n):
            part = trace.slice(k * 3600 * hours, (k + 1) * 3600 * hours)
            ratios.append(compare(cm, [(x.prev_n, x.n_in, x.n_out) for x in part], part.interval_s)[0])
        print(f"| {name} | {whole[0]:.4f} | {min(ratios):.4f} / {sum(ratios) / n:.4f} / {max(ratios):.4f} | "
              f"{whole[1] / max(1, whole[3]):.1f} |", flush=True)


def segments(intervals: int, gbps: list[float]) -> None:
    work = EmulatedWorkload.gpt_1_5b()
    thr = ProfileThroughput(work.layer_profile())
    print(f"\nemulated GPT-1.5B, the bundled segments' first {intervals} intervals at up to 32 instances: "
          "parcae / live-reactive (lost s: reactive / parcae)")
    print("| state link | " + " | ".join(SEGMENTS) + " | reactive s per reconfiguration |")
    print("|---|" + "---|" * (len(SEGMENTS) + 1))
    for g in gbps:
        cm = DefaultCostModel(thr, list(work.params), replace(RUNTIME_CONSTANTS, bandwidth_bytes_per_s=g * GBPS),
                              preemption_notice=True)
        cells, lost, moves = [], 0.0, 0
        for seg in SEGMENTS:
            _, sched = _load_schedule(seg, 60.0, 32)
            iv = [(x.prev_n, x.n_in, x.n_out) for x in from_counts(sched[:intervals], interval_s=60.0, start_n=0)]
            r = compare(cm, iv, 60.0)
            cells.append(f"{r[0]:.4f} ({r[1]:.0f} / {r[2]:.0f})")
            lost, moves = lost + r[1], moves + int(r[3])
        print(f"| {g:g} Gbps | " + " | ".join(cells) + f" | {lost / max(1, moves):.1f} |", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", action="store_true", help="windows of the p3 trace with an artifact table")
    ap.add_argument("--segments", action="store_true", help="the bundled segments with the emulated GPT-1.5B")
    ap.add_argument("--model", default="gpt-1.5b", help="artifact table for --windows (default gpt-1.5b)")
    ap.add_argument("--window-hours", type=float, default=0.5)
    ap.add_argument("--intervals", type=int, default=30, help="--segments: first K intervals (default 30)")
    ap.add_argument("--gbps", default="10,2.5,1,0.5,0.25", help="state bandwidths in Gbit/s")
    ap.add_argument("--tail", type=float, default=None,
                    help="parcae's terminal value: intervals after the look-ahead credited to the shape a plan ends "
                         "in (default: the decision options' default)")
    ap.add_argument("--risk", type=float, default=None,
                    help="standard deviations of gain parcae's departure from reacting must clear (default: the "
                         "decision options' default)")
    a = ap.parse_args()
    global TAIL, RISK
    TAIL, RISK = a.tail, a.risk
    if RISK is not None:
        try:
            check_risk(RISK, "--risk")
        except ConfigurationError as exc:
            ap.error(str(exc))
    if TAIL is not None and TAIL < 0:
        ap.error(f"--tail {a.tail}: give a number of intervals >= 0")
    gbps = [float(x) for x in a.gbps.split(",") if x]
    if not (a.windows or a.segments):
        ap.error("give --windows, --segments or both")
    if any(g <= 0 for g in gbps):
        ap.error(f"--gbps {a.gbps}: every bandwidth must be > 0 Gbit/s")
    if a.windows:
        windows(a.model, a.window_hours, gbps)
    if a.segments:
        segments(a.intervals, gbps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
