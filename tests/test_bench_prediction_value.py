"""benchmarks/bench_prediction_value.py: the simulator's parcae / live-reactive grows as migrations get costlier.

The claim it supports (issue 21, stop 47): at this runtime's migration costs the forecast has nothing to save on
the p3 segments (parcae and live-reactive tie), and it pays where a reconfiguration costs tens of seconds. The
test holds the mechanism, not the numbers: on a trace with a dip that comes back, a costly state link makes
parcae hold its shape and gain, a free one makes the two policies the same.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_prediction_value as bpv  # noqa: E402

from lightning_parcae.planning.costmodel import DefaultCostModel, ProfileThroughput  # noqa: E402
from lightning_parcae.runtime.shape_choice import RUNTIME_CONSTANTS  # noqa: E402
from lightning_parcae.signals.traces import from_counts  # noqa: E402
from lightning_parcae.testing.emulated_cluster import EmulatedWorkload  # noqa: E402


def _cm(gbps: float) -> DefaultCostModel:
    work = EmulatedWorkload.gpt_1_5b()
    return DefaultCostModel(ProfileThroughput(work.layer_profile()), list(work.params),
                            replace(RUNTIME_CONSTANTS, bandwidth_bytes_per_s=gbps * bpv.GBPS), preemption_notice=True)


def test_a_dip_that_comes_back_is_held_through_only_when_moving_is_costly() -> None:
    counts = [28] * 6 + [24] * 6 + [28, 24] * 6 + [28] * 6  # one instance group flickering in and out
    iv = [(x.prev_n, x.n_in, x.n_out) for x in from_counts(counts, interval_s=60.0, start_n=0)]
    free, slow = bpv.compare(_cm(10.0), iv, 60.0), bpv.compare(_cm(0.1), iv, 60.0)
    assert abs(free[0] - 1.0) < 0.005  # migrations of ~1 s: nothing to gain by planning
    assert slow[0] > 1.02 and slow[2] < slow[1]  # costly ones: parcae loses less time to them and trains more


def test_risk_and_tail_reach_the_parcae_policy(monkeypatch) -> None:
    """``--risk`` and ``--tail`` (the studies of stop 51) change the parcae runs they name: a risk no departure can
    clear makes parcae react, so the dip that pays above is worth nothing; a tail is passed to the optimizer."""
    counts = [28] * 6 + [24] * 6 + [28, 24] * 6 + [28] * 6
    iv = [(x.prev_n, x.n_in, x.n_out) for x in from_counts(counts, interval_s=60.0, start_n=0)]
    monkeypatch.setattr(bpv, "RISK", 1e9)
    assert bpv.compare(_cm(0.1), iv, 60.0)[0] == 1.0
    seen = []
    real = bpv.run_policy
    monkeypatch.setattr(bpv, "run_policy", lambda *a, **kw: seen.append(kw) or real(*a, **kw))
    monkeypatch.setattr(bpv, "TAIL", 6.0)
    bpv.compare(_cm(0.1), iv, 60.0)
    assert seen[-1]["tail_intervals"] == 6.0 and seen[-1]["risk"] == 1e9
