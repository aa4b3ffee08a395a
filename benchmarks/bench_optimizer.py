"""How long one liveput decision takes -- cold (first of a run) and warm -- and a whole 683-interval simulation.

Problem it answers: the runtime calls the optimizer once per interval (60 s); a decision must take milliseconds
at 32 instances and well under a second at 1024, including the first one.

    python benchmarks/bench_optimizer.py

N = 32 uses the artifact's gpt-1.5b table and cost model; N = 256 and 1024 use a per-layer GPT-1.5B-like profile
(ProfileThroughput + DefaultCostModel), since no profiled table exists at that scale. Each decision plans
L = 12 intervals ahead over a future with a preemption of 2 instances and an arrival of 1.

Columns (every measurement on a fresh cost model, so no cache is shared between columns):

* ``no prep`` -- the first ``plan`` call with nothing tabulated (what a decision cost before ``prepare``);
* ``prepare`` -- :meth:`LiveputOptimizer.prepare(N, max_out=2)`, run once when the job starts;
* ``cold`` -- the first ``plan`` after ``prepare`` (the target: < 50 ms at N = 32, < 200 ms at N = 1024);
* ``warm`` -- the same call again (steady state);
* ``decide cold/warm`` -- the parcae policy's full decision (:meth:`LiveputOptimizer.decide`: the known interval,
  three scenario paths, the reactive candidate) on a fresh cost model after ``prepare``, then again.

Times are process CPU time (``time.process_time``), so other jobs on a shared machine inflate them less than
wall time; the whole-trace line is wall time.
"""

from __future__ import annotations

import time
from typing import Callable, List, Tuple

from lightning_parcae.planning.costmodel import ArtifactCostModel, DefaultCostModel, LayerProfile, MigrationCostModel, ProfileThroughput
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


def _scenarios(n: int) -> Tuple[list, list]:
    base = _future(n)
    paths = []
    for extra in (-1, 0, 1):
        path, cur = [], n
        for i, (_, n_in, n_out) in enumerate(base[1:]):
            if i == 5:
                n_in, n_out = n_in + max(extra, 0), n_out + max(-extra, 0)
            path.append((cur, n_in, n_out))
            cur += n_in - n_out
        paths.append(path)
    return paths, [0.25, 0.5, 0.25]


def _cpu(fn: Callable[[], object]) -> Tuple[float, object]:
    t0 = time.process_time()
    out = fn()
    return time.process_time() - t0, out


def _row(make: Callable[[], MigrationCostModel], n: int, shape: tuple, label: str) -> List[str]:
    opt = LiveputOptimizer(make(), look_ahead=12)
    no_prep, _ = _cpu(lambda: opt.plan(n, shape, _future(n)))
    opt = LiveputOptimizer(make(), look_ahead=12)
    prep, _ = _cpu(lambda: opt.prepare(n, max_out=2))
    cold, plan = _cpu(lambda: opt.plan(n, shape, _future(n)))
    warm, _ = _cpu(lambda: opt.plan(n, shape, _future(n)))
    opt = LiveputOptimizer(make(), look_ahead=12)
    opt.prepare(n, max_out=2)
    sc, w = _scenarios(n)
    d_cold, dec = _cpu(lambda: opt.decide(n, shape, _future(n)[0], sc, w))
    d_warm, _ = _cpu(lambda: opt.decide(n, shape, _future(n)[0], sc, w))
    cands = len(opt.targets(n)[0])
    return [
        f"{n:>5} {label:<28} {cands:>5} {no_prep * 1e3:>9.1f} {prep * 1e3:>9.1f} {cold * 1e3:>9.1f} {warm * 1e3:>8.1f} "
        f"{d_cold * 1e3:>11.1f} {d_warm * 1e3:>11.1f}  {plan.next_shape} / {dec.next_shape}"  # type: ignore[attr-defined]
    ]


def main() -> None:
    print(f"{'N':>5} {'model':<28} {'cand.':>5} {'no prep':>9} {'prepare':>9} {'cold ms':>9} {'warm ms':>8} {'decide cold':>11} {'decide warm':>11}  plan / decide")
    for line in _row(lambda: ArtifactCostModel("gpt-1.5b"), 32, (4, 8), "artifact gpt-1.5b table"):
        print(line, flush=True)
    prof = LayerProfile.synthetic_transformer(layers=48, global_batch=2048, micro_batch=1)

    def make() -> MigrationCostModel:
        thr = ProfileThroughput(prof)
        return DefaultCostModel(thr, [b / 2 for b in prof.param_bytes])

    for n in (256, 1024):
        thr = make().throughput
        best = thr.best(n) if n <= 256 else max(thr.candidates(n), key=lambda s: thr.throughput(*s))
        for line in _row(make, n, best, "per-layer profile (default)"):
            print(line, flush=True)
    intervals = load_trace(bundled_trace_path("p3")).as_tuples()
    for name, la in (("parcae", 12), ("parcae-oracle", 12)):
        t0 = time.perf_counter()
        res = run_policy(name, ArtifactCostModel("gpt-1.5b"), intervals, look_ahead=la)
        dt = time.perf_counter() - t0
        print(f"whole p3 trace (683 intervals), {name}, L={la}: {dt:.1f} s wall, {1e3 * dt / len(intervals):.1f} ms per interval, {res.samples:.0f} samples", flush=True)


if __name__ == "__main__":
    main()
