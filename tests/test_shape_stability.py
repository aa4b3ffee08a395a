"""benchmarks/shape_stability.py: generations per change of the instance count, and shapes left too early."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from shape_stability import stability  # noqa: E402


def _mig(t: float, g: int, d: int, p: int, reason: str = "interval") -> dict[str, Any]:
    return {"event": "migration", "time": t, "generation": g, "D": d, "P": p, "kind": "repartition", "reason": reason}


def _dec(t: float, cur: list[int], chosen: list[int], reason: str = "interval", measured: Any = None,
         current: Any = 100.0) -> dict[str, Any]:
    return {"event": "decision", "time": t, "current": cur, "chosen": chosen, "reason": reason,
            "throughput": {"measured": measured, "current": current, "chosen": 90.0}}


START = [{"event": "run_start", "time": 0.0, "interval_s": 2.0}, {"event": "launch", "time": 0.0}]


def test_a_shape_left_one_interval_after_it_was_entered_for_nothing_is_an_early_leave() -> None:
    ev = START + [_dec(9.9, [2, 2], [3, 2]), _mig(10.0, 1, 3, 2), _dec(11.9, [3, 2], [2, 3]), _mig(12.0, 2, 2, 3)]
    r = stability(ev)
    assert r["generations"] == 2 and r["count_changes"] == 0 and r["per_change"] == 2.0
    assert [(x["from"], x["to"]) for x in r["early_leaves"]] == [([3, 2], [2, 3])]


def test_a_count_change_a_notice_or_a_measured_faster_shape_justifies_a_quick_leave() -> None:
    base = START + [_mig(10.0, 1, 3, 2)]
    after_remove = base + [{"event": "remove", "time": 11.0}, _dec(11.5, [3, 2], [2, 2]), _mig(11.6, 2, 2, 2)]
    notice = base + [_dec(11.5, [3, 2], [2, 2], reason="preemption notice for i3"), _mig(11.6, 2, 2, 2)]
    measured = base + [_dec(11.5, [3, 2], [2, 2], measured=120.0, current=100.0), _mig(11.6, 2, 2, 2)]
    slower = base + [_dec(11.5, [3, 2], [2, 2], measured=80.0, current=100.0), _mig(11.6, 2, 2, 2)]
    late = base + [_dec(14.5, [3, 2], [2, 2]), _mig(14.6, 2, 2, 2)]
    assert [len(stability(ev)["early_leaves"]) for ev in (after_remove, notice, measured, slower, late)] == \
        [0, 0, 0, 1, 0]
    assert stability(after_remove)["count_changes"] == 1 and stability(after_remove)["per_change"] == 2.0


def test_a_relaunch_counts_as_a_generation() -> None:
    ev = START + [{"event": "remove", "time": 5.0}, {"event": "launch", "time": 20.0}]
    r = stability(ev)
    assert r["relaunches"] == 1 and r["generations"] == 1 and r["per_change"] == 1.0
