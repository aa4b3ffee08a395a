"""How long one liveput decision takes, and a whole 683-interval simulation.

Problem it answers: the runtime calls the optimizer once per interval (60 s); a decision must take milliseconds
at 32 instances and under a second at 1024.

    python benchmarks/bench_optimizer.py

N = 32 uses the artifact's gpt-1.5b table and cost model; N = 256 and 1024 use a per-layer GPT-1.5B-like profile
(ProfileThroughput + DefaultCostModel), since no profiled table exists at that scale. Each decision plans
L = 12 intervals ahead over a forecast with a preemption of 2 instances and an arrival of 1. "cold" is the first
call (every transition cost computed), "warm" a repeat (costs cached, as in steady state).
"""

from __future__ import annotations

import time

from lightning_parcae.planning.costmodel import ArtifactCostModel, DefaultCostModel, LayerProfile, ProfileThroughput
from lightning_parcae.planning.shape_optimizer import LiveputOptimizer
from lightning_parcae.planning.sim import run_policy
from lightning_parcae.signals.traces import bundled_trace_path, load_trace


def _future(n: int, steps: int = 12) -> list:
    fut, cur = [], n
    for i in range(steps):
        n_in, n_out = (0, 2) if i == 3 else ((1, 0) if i == 7 else (0, 0))
        fut.append((cur, n_in, n_out))
        cur += n_in - n_out
    return fut


def _decide(opt: LiveputOptimizer, n: int, shape: tuple) -> tuple:
    t0 = time.perf_counter()
    plan = opt.plan(n, shape, _future(n))
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    opt.plan(n, shape, _future(n))
    warm = time.perf_counter() - t0
    return cold, warm, plan


def main() -> None:
    print(f"{'N':>5} {'model':<28} {'candidates':>10} {'cold ms':>9} {'warm ms':>9}  plan")
    cm = ArtifactCostModel("gpt-1.5b")
    opt = LiveputOptimizer(cm, look_ahead=12)
    cold, warm, plan = _decide(opt, 32, (4, 8))
    print(f"{32:>5} {'artifact gpt-1.5b table':<28} {len(opt.targets(32)[0]):>10} {cold * 1e3:>9.1f} {warm * 1e3:>9.1f}  {plan.next_shape}")
    for n in (256, 1024):
        prof = LayerProfile.synthetic_transformer(layers=48, global_batch=2048, micro_batch=1)
        thr = ProfileThroughput(prof)
        dcm = DefaultCostModel(thr, [b / 2 for b in prof.param_bytes])
        opt = LiveputOptimizer(dcm, look_ahead=12)
        best = thr.best(n) if n <= 256 else max(thr.candidates(n), key=lambda s: thr.throughput(*s))
        cold, warm, plan = _decide(opt, n, best)
        print(f"{n:>5} {'per-layer profile (default)':<28} {len(opt.targets(n, [n - 2, n - 1])[0]):>10} {cold * 1e3:>9.1f} {warm * 1e3:>9.1f}  {plan.next_shape}")
    intervals = load_trace(bundled_trace_path("p3")).as_tuples()
    for name, la in (("parcae", 12), ("parcae-oracle", 12)):
        t0 = time.perf_counter()
        res = run_policy(name, ArtifactCostModel("gpt-1.5b"), intervals, look_ahead=la)
        dt = time.perf_counter() - t0
        print(f"whole p3 trace (683 intervals), {name}, L={la}: {dt:.1f} s total, {1e3 * dt / len(intervals):.1f} ms per interval, {res.samples:.0f} samples")


if __name__ == "__main__":
    main()
