"""The opt-in step timers: a shared no-op when off, per-name totals when on."""

from __future__ import annotations

import time

import pytest

from lightning_parcae.runtime import steptime


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steptime, "_totals", {})
    monkeypatch.setattr(steptime, "_intervals", [])


def test_steptime_span_is_one_shared_noop_if_timing_is_off(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steptime, "ON", False)
    assert steptime.span("a") is steptime.span("b")
    with steptime.span("a"):
        pass
    assert steptime.summary() == {}


@pytest.mark.parametrize("calls", [1, 3, 7])
def test_steptime_adds_each_span_to_its_name_if_timing_is_on(fresh: None, monkeypatch: pytest.MonkeyPatch,
                                                              calls: int) -> None:
    monkeypatch.setattr(steptime, "ON", True)
    for _ in range(calls):
        with steptime.span("commit"):
            time.sleep(0.002)
    steptime.add("step", 0.5)
    out = steptime.summary()
    assert out["commit"]["n"] == calls and out["commit"]["total_s"] >= 0.002 * calls * 0.9
    assert out["step"] == {"n": 1, "total_s": 0.5, "mean_ms": 500.0}


def test_steptime_interval_records_nothing_if_timing_is_off(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steptime, "ON", False)
    with steptime.interval("step agreement", "g0/s1"):
        pass
    assert steptime.intervals() == []


def test_steptime_interval_keeps_entry_and_exit_on_the_hosts_monotonic_clock(
        fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steptime, "ON", True)
    before = time.monotonic()
    with steptime.interval("step agreement", "g2/s7"):
        time.sleep(0.003)
    (name, key, t0, t1), = steptime.intervals()
    assert (name, key) == ("step agreement", "g2/s7")
    # another process of the host reads the same clock: entry and exit are comparable across ranks
    assert before - 1e-6 <= t0 and t1 - t0 >= 0.0029 and t1 <= time.monotonic() + 1e-6


def test_steptime_interval_drops_the_late_records_beyond_its_bound(fresh: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steptime, "ON", True)
    monkeypatch.setattr(steptime, "MAX_INTERVALS", 3)
    for k in range(5):
        with steptime.interval("x", str(k)):
            pass
    assert [key for _, key, _, _ in steptime.intervals()] == ["0", "1", "2"]
