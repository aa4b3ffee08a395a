"""benchmarks/bench_store_traffic.py counts what it says: etcd's store counters, split by phase of a run.

The script's runs are long (a real job per N, slow); these tests pin the arithmetic that turns the server's
counters and the run's events into requests per phase, so a misread counter or an off-by-one window cannot pass
unnoticed.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench() -> ModuleType:
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    spec = importlib.util.spec_from_file_location("bench_store_traffic",
                                                  os.path.join(ROOT, "benchmarks", "bench_store_traffic.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


METRICS = """# HELP etcd_debugging_store_reads_total Total number of reads action by (get/getRecursive), local to this member.
# TYPE etcd_debugging_store_reads_total counter
etcd_debugging_store_reads_total{action="get"} 40
etcd_debugging_store_reads_total{action="getRecursive"} 2
etcd_debugging_store_watch_requests_total 3
etcd_debugging_store_watchers 1
etcd_debugging_store_writes_total{action="create"} 1
etcd_debugging_store_writes_total{action="set"} 10
etcd_debugging_store_writes_total{action="delete"} 5
etcd_server_proposals_committed_total 99
"""


def test_metrics_count_every_read_write_and_watch_action_and_nothing_else() -> None:
    assert _bench().parse_metrics(METRICS) == {"reads": 42.0, "writes": 16.0, "watches": 3.0}


def test_requests_are_split_at_the_first_step_and_divided_by_members_steps_and_seconds() -> None:
    bench = _bench()
    samples = [(t, {"reads": 10.0 * t, "writes": 2.0 * t, "watches": 0.0}) for t in range(0, 30)]
    events = [{"source": "launcher", "event": "launch", "time": 2.0},
              {"source": "worker", "event": "progress", "time": 10.5, "step": 10},
              {"source": "worker", "event": "progress", "time": 20.0, "step": 30}]
    got = bench.summarize(events, samples, 4)
    assert got["startup"] == pytest.approx(12.0 * (10 - 2))  # the samples at or before each event: t=10 and t=2
    assert got["startup_per_member"] == pytest.approx(12.0 * 8 / 4)
    assert got["train_per_step"] == pytest.approx(12.0 * (20 - 10) / 20)
    assert got["train_per_member_s"] == pytest.approx(12.0 * 10 / 9.5 / 4)
    assert bench.summarize(events[:2], samples, 4) == {"n": 4}  # one progress event: no training window


def test_a_migration_counts_the_requests_of_its_window_less_the_training_rate() -> None:
    bench = _bench()
    # 10 requests a second, plus 200 more between t=20 and t=21 (a migration of 0.8 s ending at 20.9)
    samples = [(t / 4, {"reads": 2.5 * t + (200.0 if t / 4 >= 21 else 0.0), "writes": 0.0, "watches": 0.0})
               for t in range(0, 160)]
    events = [{"source": "elastic", "event": "migration", "generation": 3, "kind": "intra-stage",
               "duration_s": 0.8, "time": 20.9},
              {"source": "elastic", "event": "migration", "generation": 3, "kind": "intra-stage",
               "duration_s": 0.5, "time": 20.9},  # a faster member of the same generation: not counted
              {"source": "elastic", "event": "migration", "generation": 4, "kind": "repartition",
               "duration_s": 0.4, "joiners": ["i9"], "time": 30.1}]
    got = bench.migration_requests(events, samples, 10.0)
    assert [(m["generation"], m["kind"]) for m in got] == [(3, "intra-stage"), (4, "join")]
    assert got[0]["requests"] == pytest.approx(200.0 + 10.0 * 1.0)  # samples at 20.0 and 21.0
    assert got[0]["excess"] == pytest.approx(200.0)
    assert got[1]["excess"] == pytest.approx(0.0)
