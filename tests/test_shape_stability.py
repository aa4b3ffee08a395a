"""benchmarks/shape_stability.py: generations per change of the instance count, shapes left too early, and the share
of wall time spent in exploration tries."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from shape_stability import exploration, main, stability  # noqa: E402


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


def _account(event: str, t: float, explored: float, elapsed: float, tries: int, refused: int) -> dict[str, Any]:
    """An event that carries the leader's exploration account (as ``ShapeChooser`` writes it)."""
    return {"event": event, "time": t, "max_share": 0.1, "explored_s": explored, "elapsed_s": elapsed,
            "share": round(explored / elapsed, 4), "tries": tries, "refused": refused}


def test_the_share_of_time_spent_exploring_is_the_leaders_latest_account_extended_to_the_runs_end() -> None:
    """The leader's last account (here a ``decision`` at t=60 s: 3 s explored in 50 s of training) is extended to
    the last event of the run (t=90 s): 3 s of 80 s; tries and refusals are counted from their events."""
    ev = START + [_account("explore", 12.0, 0.0, 2.0, 1, 0), _account("explore_done", 15.0, 3.0, 5.0, 1, 0),
                  _account("explore_refused", 30.0, 3.0, 20.0, 1, 1),
                  {**_dec(60.0, [2, 2], [3, 2]), "exploration": {"max_share": 0.1, "explored_s": 3.0,
                                                                 "elapsed_s": 50.0, "share": 0.06, "tries": 1,
                                                                 "refused": 1}},
                  {"event": "progress", "time": 90.0}]
    x = stability(ev)["exploration"]
    assert (x["tries"], x["refused"], x["max_share"], x["explored_s"], x["elapsed_s"]) == (1, 1, 0.1, 3.0, 80.0)
    assert x["share"] == 0.0375


def test_a_run_logged_before_the_exploration_account_reports_no_share(tmp_path: Path, capsys: Any) -> None:
    """An ``explore`` event alone says when a try started, not how long it lasted: the share is None ("n/a")."""
    ev = START + [{"event": "explore", "time": 5.0, "current": [1, 2], "chosen": [1, 3]}, _mig(5.5, 1, 1, 3)]
    assert exploration(ev) == {"tries": 1, "refused": 0, "max_share": None, "explored_s": None, "elapsed_s": None,
                               "share": None}
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in ev))
    assert main([str(tmp_path)]) == 0
    assert "1 tries, 0 refused, share n/a" in capsys.readouterr().out
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in
                                                   START + [_account("explore", 5.0, 1.0, 10.0, 2, 3)]))
    assert main([str(tmp_path)]) == 0  # with the account: the share, of how long, under which cap
    assert "1 tries, 0 refused, 10.0 % of 10 s exploring (cap 10 %)" in capsys.readouterr().out
