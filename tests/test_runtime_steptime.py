"""The opt-in step timers: a shared no-op when off, per-name totals when on."""

from __future__ import annotations

import time

import pytest

from lightning_parcae.runtime import steptime


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(steptime, "_totals", {})


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
