"""What the leader's decision on a thread costs its own training thread (issue 21, stop 57).

Problem: ``runtime/plan_ahead.py`` runs the leader's interval decision on a thread while the job trains, so the
members no longer wait for it at the step boundary. But the thread shares the leader's interpreter lock with the
training thread: a pure-Python decision (the liveput DP) holds it, and every small op or wait of the training
thread then queues for it (up to the switch interval, 5 ms by default, each time). Stage 0's leader feeds every
pipeline, so a slower leader step is a slower step for all. In stop 57's hl_15_25 pass (10 Gbps) parcae's job ran
4x7 at 41.3-42.5 samples/s against live-reactive's 43.1-43.3 with the same moves.

This prints, side by side in one run, the time of a step-like loop (small torch ops with short waits, as a
pipeline stage's micro-batch loop) alone, beside the real decision (``ShapeDecider.decide`` over a replay's
measured GPT-1.5B profile at N = 30) on a thread, and beside it with a 0.5 ms switch interval; and the decision's
own time alone and on the thread. Real: this machine's CPU and interpreter. Not modelled: a real step's op mix.

    .venv/bin/python benchmarks/bench_plan_thread.py [--profile docs/evidence/profiles/stop54_hl_V_parcae.json]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def step_loop(ops: int = 400, wait_every: int = 20, wait_s: float = 0.002) -> float:
    """Seconds for ``ops`` small matmuls with a ``wait_s`` sleep every ``wait_every`` (a stage's micro-batches)."""
    x = torch.randn(64, 64)
    t = time.perf_counter()
    for i in range(ops):
        x @ x
        if i % wait_every == 0:
            time.sleep(wait_s)
    return time.perf_counter() - t


def decider(profile: Path):  # noqa: ANN201
    """The leader's decider over ``profile`` (a replay's ``profile.json``), warmed by one decision."""
    sys.path.insert(0, str(ROOT))
    from lightning_parcae.planning.measured import load_cost_model  # noqa: PLC0415
    from lightning_parcae.planning.policy import DecisionOptions, ShapeDecider  # noqa: PLC0415

    cm = load_cost_model("default", profile_path=str(profile), preemption_notice=True)
    opts = DecisionOptions(look_ahead=12, predictor="persistence", max_instances=32)
    dec = ShapeDecider(cm, interval_s=20.0, options=opts, history=[27] * 6 + [28] + [32] * 8 + [31] * 2 + [30] * 3)
    dec.decide((4, 7), (30, 0, 0))
    return dec


def decide(dec, repeats: int) -> float:  # noqa: ANN001
    """Seconds for ``repeats`` warm decisions (prices changed before each, as every interval's are)."""
    t = time.perf_counter()
    for _ in range(repeats):
        dec.prices_changed()
        dec.decide((4, 7), (30, 0, 0))
    return time.perf_counter() - t


def beside(dec, repeats: int, loops: int) -> tuple[float, float]:  # noqa: ANN001
    """Median step-loop seconds while ``repeats`` decisions run on a thread, and the thread's seconds."""
    out: list[float] = []
    th_s: list[float] = []
    th = threading.Thread(target=lambda: th_s.append(decide(dec, repeats)))
    th.start()
    while th.is_alive() and len(out) < loops:
        out.append(step_loop())
    th.join()
    return statistics.median(out) if out else float("nan"), th_s[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--profile", type=Path, default=ROOT / "docs/evidence/profiles/stop54_hl_V_parcae.json",
                    help="a replay's profile.json (the leader's measured model)")
    ap.add_argument("--repeats", type=int, default=20, help="decisions on the thread per measurement")
    a = ap.parse_args()
    dec = decider(a.profile)
    alone = statistics.median(step_loop() for _ in range(15))
    dec_alone = decide(dec, a.repeats) / a.repeats
    default_switch = sys.getswitchinterval()
    with_thread, dec_thread = beside(dec, a.repeats, 1000)
    sys.setswitchinterval(0.0005)
    try:
        short_switch, dec_short = beside(dec, a.repeats, 1000)
    finally:
        sys.setswitchinterval(default_switch)
    print(f"step-like loop alone:                          {1000 * alone:7.1f} ms")
    print(f"  beside the decision thread (switch {1000 * default_switch:.0f} ms):    {1000 * with_thread:7.1f} ms"
          f"  ({with_thread / alone:.2f}x)")
    print(f"  beside the decision thread (switch 0.5 ms):  {1000 * short_switch:7.1f} ms  ({short_switch / alone:.2f}x)")
    print(f"decision alone:                                {1000 * dec_alone:7.1f} ms")
    print(f"  on the thread beside the loop (5 ms):        {1000 * dec_thread / a.repeats:7.1f} ms"
          f"  ({dec_thread / a.repeats / dec_alone:.2f}x)")
    print(f"  on the thread beside the loop (0.5 ms):      {1000 * dec_short / a.repeats:7.1f} ms"
          f"  ({dec_short / a.repeats / dec_alone:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
