"""How the leader's planning cost grows with the instance count: ``ShapeChooser.decide`` offline, N = 4..32.

Problem it measures (issue 21): in ``bench_scale.py`` the step-boundary agreement grew 49x from N=4 to N=16, and
the leader's planning (``boundary.plan``) was nearly all of it (29 ms -> 1,987 ms a call on 2 loaded cores).
This script times the very same ``ShapeChooser.decide`` the leader runs at a planning interval -- the measured
throughput model, the liveput decision over the forecast, the exploration and veto rules, the standby scan, the
migration plan and the profile write -- without processes or contention: an in-memory store, a generation of N
members at (N/2) x 2, the README's GPT job's shape (10 layers, global batch 96 (192 at N=32), M=4), 20 measured
steps of the current shape, one new step before each decision. It prints the mean ms per decision and its growth
from the smallest N (linear would be N / N_min).

Real: the wall clock of the decision on this machine (one process). Not included: the step agreement's
all-reduce, heartbeats, contention of N processes (``bench_scale.py`` measures those).

    python benchmarks/bench_planning_scale.py                 # N = 4, 8, 16, 32
    python benchmarks/bench_planning_scale.py --counts 16 --profile    # with a cProfile of the decisions
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from types import SimpleNamespace
from typing import Any

__all__ = ["decide_ms", "main"]


def decide_ms(n: int, decisions: int = 10, profile: bool = False) -> float:
    """Mean milliseconds of ``ShapeChooser.decide`` for a generation of ``n`` members at (n/2) x 2."""
    import torch.distributed as dist  # noqa: PLC0415

    from lightning_parcae.planning.migration_plan import Layout  # noqa: PLC0415
    from lightning_parcae.runtime.config import RuntimeConfig  # noqa: PLC0415
    from lightning_parcae.runtime.coordinator import Coordinator  # noqa: PLC0415
    from lightning_parcae.runtime.generation import GenerationRecords, GenerationState  # noqa: PLC0415
    from lightning_parcae.runtime.shape_choice import ShapeChooser  # noqa: PLC0415

    layer_s = [0.002] + [0.01] * 8 + [0.004]  # embedding, 8 blocks, head (seconds, as the strategy profiles)
    batch = 96 if n <= 16 else 192
    host = SimpleNamespace(global_batch=batch, layer_names=[str(i) for i in range(len(layer_s))],
                           layer_times=layer_s, optimizer_state_factor=2.0, max_stage_memory_bytes=None,
                           full_stack=None, micro_batches=4, max_pipeline_stages=None, stack_path="net")
    members = tuple(f"i{k}" for k in range(n))
    state = GenerationState(member=members[0])
    state.enter({"generation": 0, "layout": Layout(members, (5, 5)).to_json(), "layer_bytes": [3e4] * len(layer_s)})
    store = dist.HashStore()
    coord = Coordinator(store)
    with tempfile.TemporaryDirectory() as run_dir:
        config = RuntimeConfig(store_url="unused", token=None, member=members[0], interval_s=1.0, interval_steps=0,
                               look_ahead=12, predictor="persistence", heartbeat_s=0.2, dead_after_s=3.0,
                               stall_after_s=60.0, throughput="measured", max_instances=n, run_dir=run_dir)
        chooser = ShapeChooser(host, state, config, GenerationRecords(host, state), coord=coord,  # type: ignore[arg-type]
                               store=store)
        model = chooser.model()
        assert model is not None
        d = n // 2
        for _ in range(20):
            model.record(d, 2, 300.0)
        trainer: Any = SimpleNamespace(global_step=5)
        chooser.decide(trainer, reason="interval", leaving=())  # the first builds the optimizer
        prof = cProfile.Profile() if profile else None
        t0 = time.perf_counter()
        if prof:
            prof.enable()
        for i in range(decisions):
            model.record(d, 2, 300.0 + i)
            chooser.decide(trainer, reason="interval", leaving=())
        if prof:
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(15)
        return 1000.0 * (time.perf_counter() - t0) / decisions


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--counts", default="4,8,16,32", help="instance counts (default 4,8,16,32)")
    ap.add_argument("--decisions", type=int, default=10, help="decisions timed per N (default 10)")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of each N's decisions")
    args = ap.parse_args(argv)
    counts = [int(x) for x in args.counts.split(",")]
    print(f"{'N':>3} {'ms/decision':>12} {'growth':>7} {'linear':>7}")
    base = None
    for n in counts:
        ms = decide_ms(n, args.decisions, args.profile)
        base = base or ms
        print(f"{n:>3} {ms:>12.1f} {ms / base:>7.2f} {n / counts[0]:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
