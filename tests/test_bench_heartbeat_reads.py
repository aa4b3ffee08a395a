"""The heartbeat-read benchmark (benchmarks/bench_heartbeat_reads.py) times what it says on real stores.

Problem: a benchmark nobody runs rots; this one backs a figure in docs/evidence.md ("Store requests at scale").
The fast test runs it on a TCPStore for small N (both forms give the same answer -- the script asserts it -- and
both are timed); the etcd part runs where the etcd binary is installed (it also times the directory growth).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lightning_parcae.testing.etcd_server import EtcdServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_heartbeat_reads  # noqa: E402


def test_both_forms_are_timed_on_a_tcp_store(capsys: pytest.CaptureFixture[str]) -> None:
    out = bench_heartbeat_reads.main(["--counts", "2", "4", "--rounds", "3", "--stores", "tcp"])
    assert set(out["TCPStore"]) == {2, 4}
    for got in out["TCPStore"].values():
        assert got["serial"] > 0 and got["batched"] > 0
    assert "TCPStore" in capsys.readouterr().out


def test_etcd_reads_and_the_directory_growth_are_timed(etcd_server: EtcdServer) -> None:
    out = bench_heartbeat_reads.main(["--counts", "4", "--rounds", "2", "--stores", "etcd",
                                      "--directory-sizes", "5", "40"])
    assert set(out["etcd"]) == {4}
    assert set(out["etcd directory"]) == {5, 40}
    for got in out["etcd directory"].values():
        assert got["torch"] > 0 and got["parcae"] > 0


def test_bad_counts_are_refused_naming_them() -> None:
    with pytest.raises(SystemExit):
        bench_heartbeat_reads.main(["--counts", "0"])
