"""benchmarks/bench_commit_counter.py measures both counters on a real etcd and prints them side by side."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_commit_counter_prints_both_ways_and_their_ratio_per_n(etcd_server) -> None:  # noqa: ARG001 (skip)
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_commit_counter.py"), "--counts",
                          "2,3", "--rounds", "2"], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| 2 ") or
            line.startswith("| 3 ")]
    assert [r[0].strip() for r in rows] == ["2", "3"]
    for _, add, tally, ratio in rows:
        assert float(add) > 0 and float(tally) > 0
        assert abs(float(ratio) - float(add) / float(tally)) < 0.1 * float(ratio) + 0.05
