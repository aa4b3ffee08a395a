"""Does the job change shape only when it should? Generations per change of the instance count, and early leaves.

Problem it measures (issue 21, "exploration that scales"): at N=8 a user saw 9 migrations in the first 60 s of
training (2x2 -> 3x2 -> 2x3 -> 1x5 -> ...), at N=16 the fixed run shrank 8x2 -> 6x2 -> 3x3 -> 4x2 -> 3x2. The issue's
bar: "at most 3 generations per change of the instance count over a replay, and no shape left within two intervals
unless measured slower". This script reads a ``parcae run`` run directory (``events.jsonl``) and reports:

* ``count_changes``: the launcher's ``remove`` / ``add`` events (each changes the instance count);
* ``generations``: the generations the members entered in place (``migration`` events, one per generation) plus
  relaunches (``launch`` events after the first);
* ``per_change``: generations / max(1, count changes);
* ``early_leaves``: every generation left within ``2 x interval_s`` (the run's planning interval in wall seconds)
  of being entered, unless (a) the instance count changed in between (a ``remove`` / ``add``), (b) the leaving
  decision was for a notice, a loss or an operator's request, or (c) the leaving decision moved to a shape
  *measured* faster than the current one (the decision's ``throughput.measured`` against ``throughput.current``).
  Each is listed with its times, shapes and the decision's reason;
* ``exploration``: the issue's "bound the share of time spent exploring" -- tries started (``explore`` events),
  tries the cap refused (``explore_refused``), and the share of wall time spent in tries. The share is the
  leader's own accounting (``explored_s`` over ``elapsed_s``: each try's migrations and trial time, against the
  time since its first step boundary), which ``explore``, ``explore_refused``, ``explore_done`` and ``decision``
  events carry; the latest report is extended to the run's last event (``share``: no try starts without an
  ``explore`` event, so the time after it explored nothing new). A run logged before that accounting existed
  reports ``share`` None (its ``explore`` events say when a try started, not how long it lasted). After a change
  of leader the new leader's account starts from zero.

Everything it reads is what the run logged (real). ``python benchmarks/shape_stability.py RUN_DIR [RUN_DIR ...]``
prints one line per run; ``--json`` the whole report.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["stability", "exploration", "main"]

_FORCED = ("notice", "lost", "recovery", "operator requested", "fallback")


def exploration(events: list[dict[str, Any]]) -> dict[str, Any]:
    """Tries, refused tries and the share of wall time spent exploring in one run's events (module docstring).

    Args:
        events: The run's events (``events.jsonl``), in any order.

    Returns:
        ``tries``, ``refused``, and from the leader's latest accounting ``max_share``, ``explored_s``,
        ``elapsed_s`` and ``share`` (all None when no event carries the accounting).
    """
    reports = []
    for e in events:
        if e.get("event") in ("explore", "explore_refused", "explore_done") and "explored_s" in e:
            reports.append((float(e["time"]), e))
        elif e.get("event") == "decision" and isinstance(e.get("exploration"), dict):
            reports.append((float(e["time"]), e["exploration"]))
    out: dict[str, Any] = {"tries": sum(1 for e in events if e.get("event") == "explore"),
                           "refused": sum(1 for e in events if e.get("event") == "explore_refused"),
                           "max_share": None, "explored_s": None, "elapsed_s": None, "share": None}
    if not reports:
        return out
    at, last = max(reports, key=lambda r: r[0])
    end = max(float(e["time"]) for e in events if "time" in e)
    elapsed = float(last["elapsed_s"]) + max(0.0, end - at)
    explored = float(last["explored_s"])
    out.update(max_share=last.get("max_share"), explored_s=round(explored, 3), elapsed_s=round(elapsed, 3),
               share=round(explored / elapsed, 4) if elapsed > 0 else 0.0)
    return out


def stability(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The stability report of one run's events (see the module docstring)."""
    start = next((e for e in events if e.get("event") == "run_start"), None)
    interval = float(start.get("interval_s", 2.0)) if start else 2.0
    changes = sorted(float(e["time"]) for e in events if e.get("event") in ("remove", "add"))
    launches = [e for e in events if e.get("event") == "launch"]
    entered: dict[int, dict[str, Any]] = {}
    for e in events:
        if e.get("event") == "migration" and "generation" in e and e.get("kind") != "fallback":
            g = int(e["generation"])
            if g not in entered or float(e["time"]) < float(entered[g]["time"]):
                entered[g] = e
    decisions = [e for e in events if e.get("event") == "decision" and e.get("chosen")]
    gens = sorted(entered.values(), key=lambda e: float(e["time"]))
    early = []
    for cur, nxt in zip(gens, gens[1:]):
        t_in, t_out = float(cur["time"]), float(nxt["time"])
        if t_out - t_in >= 2.0 * interval:
            continue
        if any(t_in - 0.5 <= t <= t_out for t in changes):
            continue
        why = [d for d in decisions if t_in <= float(d["time"]) <= t_out
               and list(d["chosen"]) == [nxt["D"], nxt["P"]] and list(d.get("current", [])) == [cur["D"], cur["P"]]]
        d = why[-1] if why else {}
        reason = str(d.get("reason", nxt.get("reason", "")))
        if any(f in reason for f in _FORCED):
            continue
        thr = d.get("throughput") or {}
        measured, current = thr.get("measured"), thr.get("current")
        if measured is not None and current is not None and float(measured) > float(current):
            continue
        early.append({"from": [cur["D"], cur["P"]], "to": [nxt["D"], nxt["P"]], "after_s": round(t_out - t_in, 2),
                      "generation": int(nxt["generation"]), "reason": reason,
                      "explore": any(x.get("event") == "explore" and t_in <= float(x["time"]) <= t_out
                                     for x in events)})
    n_gen = len(gens) + max(0, len(launches) - 1)
    return {"interval_s": interval, "count_changes": len(changes), "generations": n_gen,
            "in_place": len(gens), "relaunches": max(0, len(launches) - 1),
            "per_change": round(n_gen / max(1, len(changes)), 2),
            "shapes": [[g["D"], g["P"]] for g in gens], "early_leaves": early, "exploration": exploration(events)}


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        raise SystemExit(f"{path}: no events.jsonl (give a parcae run --run-dir)")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dirs", nargs="+", type=Path, help="parcae run --run-dir directories")
    ap.add_argument("--json", action="store_true", help="print the whole report as JSON")
    args = ap.parse_args(argv)
    reports = {str(d): stability(_events(d)) for d in args.run_dirs}
    if args.json:
        print(json.dumps(reports, indent=1))
        return 0
    for d, r in reports.items():
        ex = r["exploration"]
        share = "share n/a" if ex["share"] is None else \
            f"{100 * ex['share']:.1f} % of {ex['elapsed_s']:.0f} s exploring (cap {100 * float(ex['max_share']):.0f} %)"
        print(f"{d}: {r['count_changes']} count changes, {r['generations']} generations ({r['in_place']} in place, "
              f"{r['relaunches']} relaunches), {r['per_change']} per change, {len(r['early_leaves'])} early leaves; "
              f"{ex['tries']} tries, {ex['refused']} refused, {share}"
              + "".join(f"\n    {x['from']} -> {x['to']} after {x['after_s']} s ({x['reason']}"
                        f"{', explore' if x['explore'] else ''})" for x in r["early_leaves"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
