"""End-to-end evidence: the same job on the same replayed spot traces under four policies, against the simulator.

Problem it measures: does Parcae (prediction + measured liveput + in-place migration) train more samples than a
reactive elastic policy (in place, no prediction), than the restart fallback (stop and relaunch from a
checkpoint on every change) and than a static cluster of the minimum count -- on real processes, replaying the
bundled AWS segments time-compressed -- and does the simulator, fed the run's own fitted profile
(``run_dir/profile.json``), forecast those numbers?

The job is the GPT example (``examples/gpt``: 8 blocks, byte-level on the stdlib's source, a per-instance memory
budget below the whole model's training memory, so P >= 2). ``--job emulated`` (default) runs ``spot.yaml`` on one
emulated accelerator per instance (``parcae run --emulated-devices``: modelled kernel time dominates a step, so
shapes differ as on separate machines; :mod:`lightning_parcae.testing.emulated_device`); ``--job cpu`` runs
``config.yaml`` on the real CPU compute, where every instance shares the machine's two cores. Per segment:

* ``parcae``   -- ``parcae run --trace SEG`` (look-ahead 12, persistence predictor, measured throughput);
* ``reactive`` -- the same with ``policy: reactive`` of the strategy: each interval takes the throughput-best shape
  for the instances there now, in place, with no plan and no forecast (until stop 47 it was ``look_ahead: 1``, the
  same choice while migrations were priced at the runtime's loopback constants; once the leader prices them by
  what they cost, a one-interval plan refuses moves that live-reactive makes);
* ``restart``  -- ``parcae run --restart-fallback --trace SEG``;
* ``static``   -- ``parcae run --instances N_min`` with no trace (the minimum count of the segment).

Each run is stopped when the replayed trace ends; "samples" is the training progress at that moment (steps x
global batch, so work lost to a restart does not count). "ideal" is every interval at the best statically
measured throughput for its instance count, with no start-up and no migration cost. Before the segments, each
candidate shape is measured statically (``--restart-fallback`` with no trace, so nothing moves), which gives the
best shape per instance count for the "chosen shape within 10 % of the best" check. ``--static-from`` takes that
table from an earlier run, perhaps on another machine: the tables then also price the ideal at this machine's speed
(:func:`machine_factor`).

Where parcae and live-reactive both ran, ``parcae_vs_reactive`` in ``results.json`` (a line under the table) says
where the gap between them comes from (:func:`where_it_differs`): the same moves or not, and how far apart; each
shared shape's steady rate in both runs (:func:`shape_rates`: the global batch over the median step between two
consecutive steps of one shape); and the samples gap split into those rates and the rest (other moves, their
timing, the leader's stalls at step boundaries).

Forecasts: ``parcae`` and ``reactive`` -- the simulator's ``parcae`` (look-ahead 12) and ``live-reactive`` policies; ``restart`` --
its ``throughput`` policy (best shape after every event, paying a restart); ``static`` -- the profile's best
measured throughput at N_min; all from the Parcae run's ``profile.json`` with the restart cost fitted from the
restart run (``restart_done.lost_s``) and the start-up measured in each run. The in-place forecasts price each
interval with the migration constants that run's leader had then (its ``migration_costs`` events:
:func:`constants_schedule`); ``forecast_end_constants`` in ``results.json`` (in brackets in the table) prices the
whole run at the profile's last fit, as the forecast did until stop 50.

    nice -n 5 python benchmarks/bench_replay.py --time-scale 60 --out docs/evidence
    nice -n 5 python benchmarks/bench_replay.py --segments hh_55_65,lh_80_90 --policies parcae,reactive
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
PARCAE = [PY, "-m", "lightning_parcae.launch.run"]
JOBS = {
    # the README's main job: one emulated accelerator per instance (examples/gpt/spot.yaml, parcae run --emulated-devices)
    "emulated": ([PY, str(ROOT / "examples" / "gpt" / "train.py"), "--config", str(ROOT / "examples" / "gpt" / "spot.yaml"),
                  "--trainer.max_steps", "1000000"], ["--emulated-devices"]),
    # real CPU compute only: every instance shares the machine's cores
    "cpu": ([PY, str(ROOT / "examples" / "gpt" / "train.py"), "--config", str(ROOT / "examples" / "gpt" / "config.yaml"),
             "--trainer.max_steps", "1000000", "--trainer.limit_val_batches", "0"], []),
    # issue 21: the emulated cluster faithful to the artifact's GPT-1.5B on p3.2xlarge (P >= 6 by its memory rule;
    # model.time_scale is set to --time-scale, so modelled kernels, links and boots are compressed like the trace)
    "gpt15b": ([PY, str(ROOT / "examples" / "gpt" / "train.py"), "--config",
                str(ROOT / "examples" / "gpt" / "emulated_gpt15b.yaml"), "--trainer.max_steps", "1000000"],
               ["--emulated-devices", "--oversubscribe", "--startup-timeout", "300"]),
}
TRAIN, LAUNCH_EXTRA = JOBS["emulated"]
SEGMENTS = ["hh_55_65", "hl_15_25", "lh_80_90", "ll_10_11"]
POLICIES = ["parcae", "reactive", "restart", "static"]
CLOCK = "launch"
"""``--trace-clock`` of the runs (set by :func:`main`): ``launch`` -- the segment starts at the launch, start-up
counts in it; ``first-step`` -- it starts at the first training step, as the artifact counts a segment."""
STARTUP_WAIT_S = 420.0
"""Under ``first-step``: how long a run may take to its first step before the bench stops waiting for it."""


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return out


def segment_start(ev: list[dict[str, Any]], clock: Optional[str] = None) -> Optional[float]:
    """Wall time the replayed segment starts in a run's events: the launch (``run_start``), or under
    ``--trace-clock first-step`` the launcher's ``trace_clock`` event (the first training step; a run without a
    trace may have none: its first worker step); None while it has not started."""
    clock = CLOCK if clock is None else clock
    if clock != "first-step":
        return next((e["time"] for e in ev if e.get("event") == "run_start"), None)
    t = next((e["time"] for e in ev if e.get("source") == "launcher" and e.get("event") == "trace_clock"), None)
    if t is None:
        t = next((e["time"] for e in ev if e.get("source") == "worker" and e.get("event") == "progress"), None)
    return t


def launch(args: list[str], run_dir: Path, seconds: float, train_extra: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """Run ``parcae run ARGS`` for ``seconds`` after the segment's start (:func:`segment_start`; then SIGINT: it
    stops every worker). Under ``--trace-clock first-step`` the start-up before it may take up to
    :data:`STARTUP_WAIT_S`."""
    run_dir.mkdir(parents=True, exist_ok=True)
    clock = ["--trace-clock", CLOCK] if CLOCK != "launch" else []
    cmd = [*PARCAE, *args, *clock, *LAUNCH_EXTRA, "--run-dir", str(run_dir), "--progress-every", "30", "--no-plot",
           "--", *TRAIN, *train_extra]
    wait = seconds + 60 + (STARTUP_WAIT_S if CLOCK == "first-step" else 0.0)
    with open(run_dir / "launcher.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        t0 = time.time()
        while time.time() - t0 < wait and proc.poll() is None:
            start = segment_start(read_events(run_dir))
            if start is not None and time.time() - start >= seconds:
                break
            time.sleep(0.5)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return read_events(run_dir)


def summarize(ev: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    """Samples trained within the segment (``seconds`` from :func:`segment_start`), start-up, shapes, time lost by
    kind. ``startup_s`` is the launch's time to its first step; ``counted_startup_s`` the part of it inside the
    segment (all of it under the launch clock, none under ``first-step``)."""
    run_start = next(e["time"] for e in ev if e.get("event") == "run_start")
    start = segment_start(ev)
    if start is None:  # never trained: the whole window is start-up
        start = run_start
    end = start + seconds
    prog = [e for e in ev if e.get("source") == "worker" and e.get("event") in ("progress", "start", "end")]
    at_end = [e for e in prog if e["time"] <= end]
    before = [e for e in prog if e["time"] <= start] if start > run_start else []
    samples = (at_end[-1]["samples"] if at_end else 0) - (before[-1]["samples"] if before else 0)
    first = next((e["time"] for e in ev if e.get("source") == "worker" and e.get("event") == "progress"), end)
    lost: dict[str, float] = {}
    seen: dict[int, dict[str, Any]] = {}
    for e in ev:
        if e.get("source") == "elastic" and e.get("event") == "migration" and start <= e["time"] <= end:
            g = int(e["generation"])
            if g not in seen or e["duration_s"] > seen[g]["duration_s"]:
                seen[g] = e
    for m in seen.values():
        lost[m["kind"]] = lost.get(m["kind"], 0.0) + float(m["duration_s"])
    restarts = [e for e in ev if e.get("event") == "restart_done" and e["time"] <= end]
    lost["restart"] = sum(float(e.get("lost_s", 0.0)) for e in restarts)
    shapes = [(int(e["D"]), int(e["P"]), int(e["N"])) for e in sorted(seen.values(), key=lambda m: m["time"])]
    explores = sum(1 for e in ev if e.get("event") == "explore" and start <= e["time"] <= end)
    return {"samples": int(samples), "planning_s": planning_stall(ev, start, end),
            "shape_rates": shape_rates(ev, start, end),
            "startup_s": round(first - run_start, 2),
            "counted_startup_s": round(max(0.0, min(first, end) - start), 2), "clock": CLOCK,
            "explorations": explores, "lost_s": {k: round(v, 3) for k, v in lost.items()},
            "migrations": {k: sum(1 for m in seen.values() if m["kind"] == k) for k in {m["kind"] for m in seen.values()}},
            "restarts": len(restarts), "shapes": shapes,
            "restart_lost_s": [float(e.get("lost_s", 0.0)) for e in restarts], **relaunch_parts(ev)}


def planning_stall(ev: list[dict[str, Any]], start: float, end: float) -> float:
    """Seconds the leader spent in its ``planning`` phase within ``[start, end]``: the step-boundary stall its
    decisions cost the job (every member waits in the agreement meanwhile). Each member's planning phases are summed
    and the largest sum is taken -- the leader's (a follower is in ``planning`` only from the agreement on)."""
    per: dict[str, float] = {}
    for e in ev:
        if e.get("source") == "elastic" and e.get("event") == "phase" and e.get("old") == "planning" and \
                start <= e["time"] <= end:
            member = str(e.get("member"))
            per[member] = per.get(member, 0.0) + float(e.get("spent_s", 0.0))
    return round(max(per.values(), default=0.0), 3)


def shape_rates(ev: list[dict[str, Any]], start: float, end: float) -> dict[str, dict[str, float]]:
    """Per shape ``"DxP"``, the run's steady steps inside ``[start, end]``: ``steps``, ``seconds`` (their sum) and
    ``samples_per_s`` (the global batch over the median step). A step is the time between two consecutive
    ``progress`` events of one generation (steps k and k + 1), so a migration, a validation or a relaunch between
    two steps is not step time."""
    prog = sorted((e for e in ev if e.get("source") == "worker" and e.get("event") == "progress"
                   and start <= e["time"] <= end and "step" in e), key=lambda e: e["time"])
    steps: dict[str, list[float]] = {}
    batch: dict[str, float] = {}
    for a, b in zip(prog, prog[1:]):
        if a.get("generation") != b.get("generation") or int(b["step"]) != int(a["step"]) + 1 or \
                (a.get("D"), a.get("P")) != (b.get("D"), b.get("P")):
            continue
        key = f"{int(b['D'])}x{int(b['P'])}"
        steps.setdefault(key, []).append(float(b["time"]) - float(a["time"]))
        batch[key] = float(b.get("global_batch") or (int(b["samples"]) - int(a["samples"])))
    return {k: {"steps": len(v), "seconds": round(sum(v), 3),
                "samples_per_s": round(batch[k] / statistics.median(v), 3) if statistics.median(v) > 0 else 0.0}
            for k, v in steps.items()}


def _moves(timeline: list) -> list[tuple[float, str]]:
    """(time, "DxP") of each shape a timeline entered, consecutive repeats merged."""
    out: list[tuple[float, str]] = []
    for t, d, p, _n in timeline:
        key = f"{int(d)}x{int(p)}"
        if not out or out[-1][1] != key:
            out.append((float(t), key))
    return out


def where_it_differs(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Where run ``a`` (parcae) gains or loses against run ``b`` (live-reactive): whether both entered the same
    shapes in the same order (``same_moves``; then ``entry_lag_s``: a's entry time minus b's, per move), each
    shared shape's steady rate in both (``rates``: a's, b's samples/s), and the samples difference split into
    ``from_rates`` -- what a's time in each shared shape would have trained at b's rate instead of its own,
    summed -- and ``from_rest`` (the remainder: other shapes or moves, their timing, stalls at step boundaries).

    Args:
        a: A run's summary with ``samples``, ``timeline`` and ``shape_rates`` (:func:`shape_rates`).
        b: The other run's.
    """
    ma, mb = _moves(a.get("timeline") or []), _moves(b.get("timeline") or [])
    same = [k for _, k in ma] == [k for _, k in mb]
    ra, rb = a.get("shape_rates") or {}, b.get("shape_rates") or {}
    shared = [k for k in ra if k in rb]
    from_rates = sum((ra[k]["samples_per_s"] - rb[k]["samples_per_s"]) * ra[k]["seconds"] for k in shared)
    diff = int(a["samples"]) - int(b["samples"])
    return {"same_moves": same, "moves": [k for _, k in ma], "other_moves": [k for _, k in mb],
            "entry_lag_s": [round(x[0] - y[0], 2) for x, y in zip(ma, mb)] if same else [],
            "rates": {k: [ra[k]["samples_per_s"], rb[k]["samples_per_s"]] for k in shared},
            "samples_diff": diff, "from_rates": round(from_rates, 1), "from_rest": round(diff - from_rates, 1)}


def differs_line(seg: str, d: dict[str, Any]) -> str:
    """One Markdown line of :func:`where_it_differs` for parcae against live-reactive."""
    moves = (f"the same moves ({' -> '.join(d['moves'])}; parcae entered each "
             f"{min(d['entry_lag_s'], default=0):+.1f} to {max(d['entry_lag_s'], default=0):+.1f} s from reactive)"
             if d["same_moves"] else
             f"different moves (parcae {' -> '.join(d['moves'])}; reactive {' -> '.join(d['other_moves'])})")
    rates = ", ".join(f"{k} {x:.1f} vs {y:.1f}" for k, (x, y) in d["rates"].items()) or "none shared"
    return (f"- {seg}, parcae vs reactive: {moves}; steady samples/s in shared shapes {rates}; of the "
            f"{d['samples_diff']:+d} samples, {d['from_rates']:+.0f} from those rates and {d['from_rest']:+.0f} from the "
            "rest (moves, their timing, boundary stalls)")


def relaunch_parts(ev: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The two parts of the restart fallback's relaunches, measured apart (the forecast prices them apart):
    ``relaunch_launch_s``, from each relaunch (generation >= 1) to its first step's start, and ``relaunch_stop_s``,
    from a training generation's last step to its processes' exit (the checkpoint and the exit; the step under way
    when the notice came still trains)."""
    launches = {int(e["generation"]): e["time"] for e in ev
                if e.get("source") == "launcher" and e.get("event") == "launch" and int(e.get("generation", 0)) >= 1}
    starts: dict[int, float] = {}
    last_step: dict[int, float] = {}
    for e in ev:
        if e.get("source") != "worker" or "generation" not in e:
            continue
        g = int(e["generation"])
        if e.get("event") == "start":
            starts.setdefault(g, e["time"])
        elif e.get("event") == "checkpoint" and e.get("reason") == "notice":
            last_step[g] = e["time"] - float(e.get("save_s", 0.0))
    stops = [e["time"] - last_step[int(e["generation"])] for e in ev
             if e.get("source") == "launcher" and e.get("event") == "stopped" and e.get("graceful")
             and int(e.get("generation", -1)) in last_step]
    return {"relaunch_launch_s": [round(starts[g] - t, 3) for g, t in sorted(launches.items()) if g in starts],
            "relaunch_stop_s": [round(x, 3) for x in stops]}


def join_delays(ev: list[dict[str, Any]]) -> list[float]:
    """Seconds from each trace arrival (launcher ``add``) to the leader's first decision that counts the joiner
    (as a standby it may admit): process start, imports, the heartbeat watch and the next step boundary (a
    standby that becomes ready is planned in at once:
    :attr:`~lightning_parcae.runtime.shape_choice.ShapeChooser.arrival`)."""
    out = []
    for a in (e for e in ev if e.get("source") == "launcher" and e.get("event") == "add"):
        for j in a.get("joiners") or []:
            t = counted_at(ev, a, j)
            if t is not None:
                out.append(round(t - a["time"], 3))
    return out


def counted_at(ev: list[dict[str, Any]], add: dict[str, Any], joiner: str) -> Optional[float]:
    """When the leader first counted ``joiner`` (added by the launcher's ``add`` event) as a standby: the time of
    the first ``decision`` at or after the add that names it, or None."""
    return next((e["time"] for e in ev if e.get("event") == "decision" and e["time"] >= add["time"]
                 and joiner in (e.get("standbys") or [])), None)


def shape_timeline(ev: list[dict[str, Any]], seconds: float) -> list[tuple[float, int, int, int]]:
    """(time since the segment's start, D, P, N) of each shape the run trained in (in-place migrations and
    launches; under ``first-step`` the first generation's start is at 0)."""
    start = segment_start(ev) or next(e["time"] for e in ev if e.get("event") == "run_start")
    out = []
    for e in ev:
        if e["time"] > start + seconds:
            break
        if e.get("source") == "worker" and e.get("event") == "start":
            out.append((max(0.0, e["time"] - start), int(e["D"]), int(e["P"]), int(e["N"])))
        if e.get("source") == "elastic" and e.get("event") == "migration" and e.get("member") and e.get("D"):
            if not out or out[-1][1:3] != (int(e["D"]), int(e["P"])):
                out.append((max(0.0, e["time"] - start), int(e["D"]), int(e["P"]), int(e["N"])))
    return out


def shape_check(timeline: list[tuple[float, int, int, int]], schedule: list[int], wall_interval: float,
                static: dict[str, float], best_by_n: dict[int, tuple[str, float]]) -> list[dict[str, Any]]:
    """Each shape the run trained in against the best statically measured shape for the instances available."""
    out = []
    for t, d, p, _ in timeline:
        n = schedule[min(int(t / wall_interval), len(schedule) - 1)]
        mine = static.get(f"{d}x{p}")
        best = best_by_n.get(n)
        out.append({"t": round(t, 1), "shape": f"{d}x{p}", "N": n, "static": mine, "best": best,
                    "ratio": (mine / best[1]) if mine and best and best[1] else None})
    return out


def _delay_intervals(join_delay_s: float, wall_interval: float) -> int:
    """A measured join delay as whole wall intervals (what :func:`~lightning_parcae.signals.traces.usable_counts` takes)."""
    return int(round(join_delay_s / wall_interval)) if join_delay_s > 0 else 0


def shape_time_share(timeline: list, schedule: list[int], wall_interval: float, static: dict[str, float],
                     best_by_n: dict, seconds: float, step: float = 0.05, join_delay_s: float = 0.0) -> dict[str, Any]:
    """Share of the training time spent in a shape within 10 % of the best static shape for the instances there
    at that moment, and the time spent below it, by (shape, N). With ``join_delay_s`` an arriving instance counts
    once it can be used (its process started and the leader saw it: :func:`join_delays`); with 0 it counts from
    its interval's start, so the seconds a joiner takes to start count against the shape."""
    from lightning_parcae.signals.traces import usable_counts  # noqa: PLC0415

    schedule = usable_counts(schedule, _delay_intervals(join_delay_s, wall_interval))
    if not timeline:
        return {"share": None, "below": []}
    best = {int(k): v for k, v in best_by_n.items()}
    ok = total = 0.0
    below: dict[tuple[str, int], float] = {}
    t = float(timeline[0][0])
    k = 0
    while t < seconds:
        while k + 1 < len(timeline) and timeline[k + 1][0] <= t:
            k += 1
        d, p = int(timeline[k][1]), int(timeline[k][2])
        n = schedule[min(int(t / wall_interval), len(schedule) - 1)]
        mine, b = static.get(f"{d}x{p}"), best.get(n)
        total += step
        if mine and b and mine >= 0.9 * b[1]:
            ok += step
        else:
            below[(f"{d}x{p}", n)] = below.get((f"{d}x{p}", n), 0.0) + step
        t += step
    return {"share": ok / total if total else None,
            "below": [{"shape": sh, "N": n, "seconds": round(v, 1)} for (sh, n), v in sorted(below.items())]}


def measure_static(shape: tuple[int, int], out: Path, seconds: float) -> float:
    """Samples/s of one shape with nothing moving (median progress rate after the first 5 s of training)."""
    d, p = shape
    ev = launch(["--restart-fallback", "--instances", str(d * p), "--pipeline-stages", str(p)],
                out / f"static_{d}x{p}", seconds)
    prog = [e for e in ev if e.get("source") == "worker" and e.get("event") == "progress"]
    if not prog:
        return 0.0
    t1 = prog[0]["time"] + 5.0
    rates = [e["samples_per_s"] for e in prog if e["time"] >= t1 and e.get("samples_per_s")]
    return float(statistics.median(rates)) if rates else 0.0


def _after(res: Any, startup_s: float) -> float:
    """Samples of a simulated policy result trained after ``startup_s`` seconds (interpolated within an interval)."""
    iv, cum = res.interval_s, res.cumulative
    if not cum or startup_s <= 0:
        return float(res.samples)
    k = min(int(startup_s // iv), len(cum) - 1)
    before_k = cum[k - 1] if k > 0 else 0.0
    before = before_k + min(1.0, (startup_s - k * iv) / iv) * (cum[k] - before_k)
    return float(res.samples - before)


FITTED = ("group_base_ms", "group_per_process_ms", "bandwidth_bytes_per_s", "transfer_latency_ms")
"""The migration constants a leader's ``migration_costs`` event reports (what it refits after each migration)."""


def constants_schedule(ev: list[dict[str, Any]], intervals: int, wall_interval: float, base: Any,
                       clock: Optional[str] = None) -> list[Any]:
    """The migration constants a run's leader priced each interval's decision with, from its events.

    Interval k (from the segment's start) gets the constants of the last ``migration_costs`` event before it
    starts; before the first, the ``prior_profile``'s (when the run had one and could read it) or the runtime's
    loopback constants. Fields a leader does not refit (join, restart, bytes per parameter) are ``base``'s (the
    profile's). Regression (issue 21, stop 49, hl_15_25 at 0.25 Gbps): the forecast priced the whole run at its
    last fit (9.6 kB/s) where the leader had decided its first moves at faster ones, and forecast the run at 0.86
    of what it trained.
    """
    from lightning_parcae.errors import ConfigurationError  # noqa: PLC0415
    from lightning_parcae.runtime.prior import read_prior_profile  # noqa: PLC0415
    from lightning_parcae.runtime.shape_choice import RUNTIME_CONSTANTS  # noqa: PLC0415

    def fitted(src: Any) -> Any:
        get = src.get if isinstance(src, dict) else lambda k: getattr(src, k)
        return replace(base, **{k: float(get(k)) for k in FITTED})

    start = segment_start(ev, clock)
    first = fitted(RUNTIME_CONSTANTS)
    prior = next((e for e in ev if e.get("event") == "prior_profile" and not e.get("error")), None)
    # the file is the event's ``profile`` (before stop 50 its ``source``, which hid the emitter's name)
    path = None if prior is None else prior.get("profile") or prior.get("source")
    if path and path not in ("elastic", "worker", "launcher"):
        try:
            first = fitted(read_prior_profile(str(path)).constants)
        except ConfigurationError:
            pass  # the prior is gone: the loopback constants are the best guess left
    fits = sorted((float(e["time"]), fitted(e)) for e in ev if e.get("event") == "migration_costs"
                  and all(k in e for k in FITTED))
    out, cur, j = [], first, 0
    for k in range(intervals):
        t = (start or 0.0) + k * wall_interval
        while j < len(fits) and fits[j][0] <= t:
            cur = fits[j][1]
            j += 1
        out.append(cur)
    return out


def forecast(profile_path: Path, schedule: list[int], wall_interval: float, startup_s: float,
             restart_s: Optional[float], n_min: int, pipeline_stages: int = 2,
             restart_startup_s: Optional[float] = None, join_delay_s: float = 0.0,
             launch_s: Optional[float] = None, constants: Optional[dict[str, list[Any]]] = None,
             risk: Optional[float] = None, in_place_only: bool = False,
             min_gain: Optional[float] = None, hold_risk: Optional[float] = None) -> dict[str, float]:
    """The simulator's forecast of each policy from the Parcae run's fitted profile (``restart_s``: a relaunch of a
    training generation, its stop included; ``launch_s``: a relaunch while nothing trains; ``constants``: per
    in-place policy, the migration constants of each interval (:func:`constants_schedule`), else the profile's
    last fit prices the whole run; ``risk`` / ``min_gain`` / ``hold_risk``: the parcae run's options, default the
    strategy's;
    ``in_place_only``: parcae and reactive only, not the restart and static runs)."""
    from lightning_parcae.planning.measured import load_cost_model  # noqa: PLC0415
    from lightning_parcae.planning.sim import run_policy  # noqa: PLC0415
    from lightning_parcae.signals.traces import from_counts, usable_counts  # noqa: PLC0415

    # the replay gives every drop a notice and the runtime hands the leaver's state over: no preemption restarts
    # (regression: priced as sudden losses, a 1x3 losing any instance meant a checkpoint restart, and the
    # forecast ran 1x2 on 3 instances "for safety" where the job ran 1x3)
    cm = load_cost_model("default", profile_path=str(profile_path), preemption_notice=True)
    # the job's start (process start, imports, profiling) is cut off by _after below, not priced as a restart:
    # a restart still unfinished when the next decision comes is replaced by that decision's migration in the
    # artifact's accounting, and the optimizer took that to skip most of the start-up
    cm.c = replace(cm.c, restart_ms=0.0, checkpoint_ms=0.0)
    trace = from_counts(schedule, interval_s=wall_interval, start_n=0)
    iv = [(x.prev_n, x.n_in, x.n_out) for x in trace]
    # the in-place runs can use an arriving instance only once its process has started and the leader has seen
    # it (join_delays: ~4.4 s, 3 intervals at 40x); the simulator otherwise lets it train from its interval's
    # start (regression: the in-place forecasts were up to 9 % high on the segments with arrivals)
    live_counts = usable_counts(schedule, _delay_intervals(join_delay_s, wall_interval))
    # the in-place runs start in the first generation the launcher forms (D the largest power of two with D x P
    # within the first count), not paused: their first move away from it is a migration like any other.
    # Regression (issue 21, stop 55): at N = 32 every run started in 4x6 and moved to 4x7 by a 24-27 s
    # repartition the forecast never charged (it started from nothing); with role-blind victims the in-place
    # forecasts were 7-16 % high
    from lightning_parcae.launch.processes import initial_members  # noqa: PLC0415

    members, _ = initial_members(live_counts[0], str(pipeline_stages))
    start_shape = (members // pipeline_stages, pipeline_stages) if members >= pipeline_stages else None
    usable = from_counts(live_counts, interval_s=wall_interval, start_n=live_counts[0] if start_shape else 0)
    iv_live = [(x.prev_n, x.n_in, x.n_out) for x in usable]
    # the in-place policies price only their migrations: the job's own start-up (nothing trains before it) is
    # charged here (regression: without it the forecast of every in-place run was ~1.5 start-ups of samples high)
    constants = constants or {}

    def priced(pol: str) -> Optional[list[Any]]:
        sched = constants.get(pol)
        return None if sched is None else [replace(c, restart_ms=0.0, checkpoint_ms=0.0) for c in sched]

    # the parcae run's decision options that were set (the others keep the strategy's defaults)
    given = {k: v for k, v in dict(risk=risk, min_gain=min_gain, hold_risk=hold_risk).items() if v is not None}
    out = {"parcae": _after(run_policy("parcae", cm, iv_live, wall_interval, look_ahead=12,
                                       constants=priced("parcae"), start_shape=start_shape, **given),
                            startup_s),
           "reactive": _after(run_policy("live-reactive", cm, iv_live, wall_interval, start_shape=start_shape,
                                         constants=priced("reactive")), startup_s)}
    if in_place_only:
        return out
    cm_r = load_cost_model("default", profile_path=str(profile_path))
    cm_r.c = replace(cm_r.c, restart_ms=1000.0 * (restart_s if restart_s is not None else startup_s), checkpoint_ms=0.0)
    # the launcher's restart fallback: P fixed at the run's --pipeline-stages, every change relaunches, a change
    # during a relaunch starts it over (the artifact's "throughput" policy re-picks P and adds a concurrent restart:
    # it forecast 0.82-1.21 of the measured runs); a change while nothing trains pays the launch alone
    out["restart"] = run_policy("relaunch", cm_r, iv, wall_interval, pipeline_stages=pipeline_stages,
                                startup_ms=1000.0 * (restart_startup_s if restart_startup_s is not None else startup_s),
                                launch_ms=None if launch_s is None else 1000.0 * launch_s).samples
    thr = cm.throughput
    best = thr.best(n_min)
    out["static"] = (thr.throughput(*best) if best else 0.0) * max(0.0, len(schedule) * wall_interval - startup_s)
    return out


def _join_delay(seg_dir: Path) -> float:
    """Median arrival-to-usable delay of the segment's in-place runs (0 if no arrival was seen)."""
    d = [x for pol in ("parcae", "reactive") for x in join_delays(read_events(seg_dir / pol))]
    return float(statistics.median(d)) if d else 0.0


def _segment_forecast(seg_dir: Path, r: dict[str, Any], wall_interval: float) -> None:
    """Set ``r["join_delay_s"]`` and ``r["forecast"]`` of one segment from its runs' events and Parcae profile."""
    restart = r["runs"].get("restart", {})
    lost = restart.get("restart_lost_s") or []
    if "relaunch_launch_s" not in restart and (seg_dir / "restart" / "events.jsonl").exists():
        restart.update(relaunch_parts(read_events(seg_dir / "restart")))  # older results.json lack the parts
    launches, stops = restart.get("relaunch_launch_s") or [], restart.get("relaunch_stop_s") or []
    launch_s = statistics.mean(launches) if launches else None
    if launch_s is not None:  # a relaunch of a training generation: its stop, then a launch
        restart_s: Optional[float] = launch_s + (statistics.mean(stops) if stops else 0.0)
    else:  # no relaunch reached a step: the whole losses, or (none measured) what the launch's start-up took
        restart_s = statistics.mean(lost) if lost else r["runs"].get("parcae", {}).get("startup_s")
    r["join_delay_s"] = _join_delay(seg_dir)
    args = dict(pipeline_stages=int(r.get("pipeline_stages", 2)),
                restart_startup_s=counted_startup(restart) if restart else None,
                join_delay_s=r["join_delay_s"], launch_s=launch_s, risk=r.get("risk"), min_gain=r.get("min_gain"))
    profile = seg_dir / "parcae" / "profile.json"
    startup = counted_startup(r["runs"].get("parcae", {}))
    # each in-place run forecast with the constants its leader priced each interval with (its events), and, for
    # comparison, the whole run at the profile's last fit (what the forecast did until stop 50)
    from lightning_parcae.planning.measured import load_cost_model  # noqa: PLC0415

    base = load_cost_model("default", profile_path=str(profile)).c
    schedules = {}
    for pol in ("parcae", "reactive"):
        ev = read_events(seg_dir / pol)
        if any(e.get("event") == "migration_costs" for e in ev):
            schedules[pol] = constants_schedule(ev, len(r["schedule"]), wall_interval, base,
                                                r["runs"].get(pol, {}).get("clock"))
    r["forecast"] = forecast(profile, r["schedule"], wall_interval, startup, restart_s, r["n_min"],
                             constants=schedules, **args)
    if schedules:
        end = forecast(profile, r["schedule"], wall_interval, startup, restart_s, r["n_min"], in_place_only=True,
                       **args)
        r["forecast_end_constants"] = {pol: end[pol] for pol in schedules}
    else:
        r.pop("forecast_end_constants", None)


def counted_startup(run: dict[str, Any]) -> float:
    """The start-up seconds inside a run's segment (results written before ``--trace-clock`` have only
    ``startup_s``: the launch clock, all of it)."""
    return float(run.get("counted_startup_s", run.get("startup_s", 0.0)))


def _sliced(seg: str, intervals: Optional[int], out: Path) -> str:
    """The trace argument of segment ``seg``: its bundled name, or a file of its first ``intervals`` intervals."""
    if intervals is None:
        return seg
    from lightning_parcae.signals.traces import bundled_trace_path  # noqa: PLC0415

    lines = Path(bundled_trace_path(seg)).read_text().splitlines()[:intervals]
    path = out / "traces" / f"{seg}.txt"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def main() -> int:
    from lightning_parcae.launch.run import VICTIM_ORDERS  # noqa: PLC0415 -- parcae run's own choices (no torch)

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--segments", default=",".join(SEGMENTS))
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--time-scale", type=float, default=60.0, help="trace compression (60: a 1-hour segment in 60 s)")
    ap.add_argument("--static-seconds", type=float, default=35.0, help="seconds per static shape measurement")
    ap.add_argument("--shapes", default="1x2,2x2,1x3,1x4", help="shapes measured statically (DxP)")
    ap.add_argument("--out", default="bench_replay_out", help="output folder (runs, results.json, replay.png)")
    ap.add_argument("--static-from", default=None,
                    help="results.json of an earlier run: take its static shape measurements instead of measuring")
    ap.add_argument("--job", choices=sorted(JOBS), default="emulated",
                    help="emulated (default): examples/gpt/spot.yaml on one emulated accelerator per instance; cpu: "
                    "examples/gpt/config.yaml on the shared CPU cores; gpt15b: examples/gpt/emulated_gpt15b.yaml, the "
                    "artifact's GPT-1.5B emulated per layer (use --pipeline-stages 6 and a --max-instances of 6+)")
    ap.add_argument("--max-instances", type=int, default=4,
                    help="each segment's peak count is scaled to this many instances (default 4; the p3 segments' "
                    "real peaks are 18-32)")
    ap.add_argument("--intervals", type=int, default=None,
                    help="replay only the first K intervals of each segment (default: all 60)")
    ap.add_argument("--pipeline-stages", type=int, default=2,
                    help="P the jobs launch with and the restart fallback keeps (default 2; 6 for --job gpt15b)")
    ap.add_argument("--trace-clock", choices=["launch", "first-step"], default="launch",
                    help="when each segment starts (parcae run --trace-clock): at the launch (default; start-up is "
                    "inside the segment), or at the first training step (start-up outside it, as the artifact "
                    "counts a segment: use it where start-up is long against the segment, e.g. --job gpt15b)")
    ap.add_argument("--state-gbps", type=float, default=None,
                    help="--job gpt15b: the modelled bandwidth (Gbit/s) of migration state transfers only "
                    "(model.state_gbps; default: the workload's 10 Gbps): stages that are costly to move")
    ap.add_argument("--prior-profile", default=None, metavar="PROFILE_JSON",
                    help="the in-place policies (parcae, reactive) start from this earlier run's profile.json "
                    "(strategy option prior_profile: its migration costs price the first moves; its step times are "
                    "taken when they are this job's). Use one of another segment: the replayed one stays unseen")
    ap.add_argument("--risk", type=float, default=None,
                    help="the parcae runs' strategy option risk (standard deviations of expected gain a departure from "
                    "the reactive shape must clear; default: the strategy's); the forecast uses the same")
    ap.add_argument("--min-gain", type=float, default=None,
                    help="the parcae runs' strategy option min_gain (least fraction of the reactive plan's expected "
                    "value a departure must gain besides the risk rule; default: the strategy's); the forecast uses "
                    "the same")
    ap.add_argument("--victims", choices=VICTIM_ORDERS, default="any",
                    help="parcae run --victims for every run (default 'any': a drop takes instances drawn from every "
                    "instance present, as a spot provider does and as the simulator's forecast prices it; 'newest': "
                    "parcae run's own default, idle standbys first -- the replays before stop 56 that do not name "
                    "--victims)")
    ap.add_argument("--reforecast", action="store_true",
                    help="recompute the forecasts (and tables, plot) of an earlier run in --out from its saved profiles")
    ap.add_argument("--combine", default=None, metavar="DIR,DIR,...",
                    help="print repeat statistics (mean, range, parcae / reactive) over earlier runs' --out folders")
    a = ap.parse_args()
    if a.combine:
        return combine([Path(x) for x in a.combine.split(",") if x])
    global TRAIN, LAUNCH_EXTRA, CLOCK
    TRAIN, LAUNCH_EXTRA = JOBS[a.job]
    LAUNCH_EXTRA = [*LAUNCH_EXTRA, "--victims", a.victims]
    CLOCK = a.trace_clock
    if a.job == "gpt15b":
        TRAIN = [*TRAIN, "--model.time_scale", str(a.time_scale)]
        if a.state_gbps is not None:
            TRAIN = [*TRAIN, "--model.state_gbps", str(a.state_gbps)]
    elif a.state_gbps is not None:
        raise SystemExit(f"--state-gbps {a.state_gbps} needs --job gpt15b (the only job with a modelled workload)")
    out = Path(a.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if a.reforecast:
        return reforecast(out)
    prior: tuple[str, ...] = ()
    if a.prior_profile:
        prior = ("--trainer.strategy.init_args.prior_profile", str(Path(a.prior_profile).resolve()))
    # the parcae runs' decision options: checked by the strategy's own checks before any job is launched, then
    # passed to the strategy as LightningCLI arguments (and recorded for the forecast)
    from lightning_parcae.errors import ConfigurationError  # noqa: PLC0415
    from lightning_parcae.planning.shape_optimizer import check_min_gain, check_risk  # noqa: PLC0415

    chosen: dict[str, float] = {}
    for name, value, check in (("risk", a.risk, check_risk), ("min_gain", a.min_gain, check_min_gain)):
        if value is None:
            continue
        try:
            chosen[name] = check(value, "--" + name.replace("_", "-"))
        except ConfigurationError as exc:
            raise SystemExit(str(exc)) from None
    decision = tuple(x for name, value in chosen.items() for x in (f"--trainer.strategy.init_args.{name}", str(value)))
    from lightning_parcae.launch.run import _load_schedule  # noqa: PLC0415

    results: dict[str, Any] = {"job": a.job, "time_scale": a.time_scale, "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                               "cores": os.cpu_count(), "trace_clock": CLOCK, "state_gbps": a.state_gbps, "static": {},
                               "prior_profile": a.prior_profile, "victims": a.victims,
                               "segments": {}}
    shapes = [tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",") if s]
    if a.static_from:  # re-run some segments or policies against an earlier run's static measurements
        results["static"] = dict(json.loads(Path(a.static_from).read_text())["static"])
        shapes = []
    for sh in shapes:
        thr = measure_static(sh, out, a.static_seconds)  # type: ignore[arg-type]
        results["static"][f"{sh[0]}x{sh[1]}"] = thr
        print(f"static {sh[0]}x{sh[1]}: {thr:.1f} samples/s", flush=True)
    best_by_n: dict[int, tuple[str, float]] = {}
    for n in range(1, a.max_instances + 1):
        fits = {k: v for k, v in results["static"].items() if int(k.split("x")[0]) * int(k.split("x")[1]) <= n}
        if fits:
            k = max(fits, key=fits.get)  # type: ignore[arg-type]
            best_by_n[n] = (k, fits[k])
    results["best_by_n"] = best_by_n
    wall_interval = 60.0 / a.time_scale
    static_runs: dict[int, dict[str, Any]] = {}
    for seg in [s for s in a.segments.split(",") if s]:
        trace_arg = _sliced(seg, a.intervals, out)
        _, schedule = _load_schedule(trace_arg, 60.0, a.max_instances)
        seconds = len(schedule) * wall_interval
        n_min = min(schedule)
        r: dict[str, Any] = {"schedule": schedule, "seconds": seconds, "n_min": n_min, "runs": {}}
        common = ["--trace", trace_arg, "--time-scale", str(a.time_scale), "--instances", str(max(schedule)),
                  "--pipeline-stages", str(a.pipeline_stages)]
        r["pipeline_stages"] = a.pipeline_stages
        r.update(chosen)
        for pol in [p for p in a.policies.split(",") if p]:
            run_dir = out / seg / pol
            if pol == "parcae":
                ev = launch(common, run_dir, seconds, train_extra=(*prior, *decision))
            elif pol == "reactive":
                ev = launch(common, run_dir, seconds,
                            train_extra=("--trainer.strategy.init_args.policy", "reactive", *prior))
            elif pol == "restart":
                ev = launch(["--restart-fallback", *common], run_dir, seconds)
            elif pol == "static":
                if n_min in static_runs:  # the same static cluster already ran for another segment of this length
                    r["runs"][pol] = static_runs[n_min]
                    continue
                # the best statically measured shape for the minimum count (P=2 on 3 instances would idle one)
                best_p = best_by_n[n_min][0].split("x")[1] if n_min in best_by_n else str(a.pipeline_stages)
                ev = launch(["--instances", str(n_min), "--pipeline-stages", best_p, "--restart-fallback"], run_dir,
                            seconds)
            else:
                raise SystemExit(f"unknown policy {pol!r}: use {', '.join(POLICIES)}")
            s = summarize(ev, seconds)
            s["timeline"] = shape_timeline(ev, seconds)
            s["shape_check"] = shape_check(s["timeline"], schedule, wall_interval, results["static"], best_by_n)
            r["runs"][pol] = s
            if pol == "static":
                static_runs[n_min] = s
            print(f"{seg} {pol}: {s['samples']} samples, start-up {s['startup_s']} s, lost {s['lost_s']}, "
                  f"shapes {s['shapes']}", flush=True)
        # ideal: each interval at the best static throughput for its count, from when training started
        startup = counted_startup(r["runs"].get("parcae", {}))
        ideal = 0.0
        for k, n in enumerate(schedule):
            t_a, t_b = k * wall_interval, (k + 1) * wall_interval
            ideal += best_by_n.get(n, ("", 0.0))[1] * max(0.0, t_b - max(t_a, startup))
        r["ideal_after_startup"] = ideal
        _compare_in_place(r)
        prof = out / seg / "parcae" / "profile.json"
        if prof.exists():
            _segment_forecast(out / seg, r, wall_interval)
            with open(prof) as f:
                r["profile_shapes"] = {k: v["samples_per_s"] for k, v in json.load(f)["shapes"].items()}
            r["machine_factor"] = machine_factor(results["static"], r["profile_shapes"])
        results["segments"][seg] = r
        (out / "results.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    plot(results, out / "replay.png")
    (out / "results.md").write_text(markdown(results))
    return 0


def machine_factor(static: dict[str, float], profile_shapes: dict[str, float]) -> Optional[float]:
    """How fast this machine ran the job against the static table the ideal is priced with: the median, over the
    shapes both hold, of the Parcae run's measured rate (its ``profile.json``, keys ``"D,P"``) over the static one
    (keys ``"DxP"``); None when they share no shape. With ``--static-from`` the table may come from another machine
    (stop 58: this machine ran 4x6 and 4x7 at 0.85-0.92 of stop 48's table, so "vs ideal" read 86 % for runs at 97 %
    of what this machine could do); the tables then also show the ratio to the ideal times this factor."""
    ratios = [v / static[k.replace(",", "x")] for k, v in profile_shapes.items()
              if static.get(k.replace(",", "x")) and v > 0]
    return round(statistics.median(ratios), 4) if ratios else None


def _vs_ideal(samples: int, r: dict[str, Any]) -> str:
    """Samples against the segment's ideal, and in brackets against the ideal at this machine's speed."""
    ideal = r.get("ideal_after_startup") or 0
    if not ideal:
        return "-"
    text = f"{samples / ideal:.1%}"
    if r.get("machine_factor"):
        text += f" ({samples / (ideal * r['machine_factor']):.1%} here)"
    return text


def _compare_in_place(r: dict[str, Any]) -> None:
    """``r["parcae_vs_reactive"]``: :func:`where_it_differs` when the segment ran both in-place policies."""
    runs = r["runs"]
    if "parcae" in runs and "reactive" in runs:
        r["parcae_vs_reactive"] = where_it_differs(runs["parcae"], runs["reactive"])


def reforecast(out: Path) -> int:
    """Recompute every segment's forecast from its saved Parcae profile, and the steady rates per shape and the
    comparison of the in-place runs from their events; rewrite results.json, results.md, the plot."""
    global CLOCK
    results = json.loads((out / "results.json").read_text())
    CLOCK = results.get("trace_clock", CLOCK)  # the clock the runs were replayed under
    wall_interval = 60.0 / float(results["time_scale"])
    for seg, r in results["segments"].items():
        for pol, run in r["runs"].items():
            ev = read_events(out / seg / pol)
            start = segment_start(ev)
            if ev and start is not None:
                run["shape_rates"] = shape_rates(ev, start, start + float(r["seconds"]))
        _compare_in_place(r)
        if r.get("profile_shapes"):
            r["machine_factor"] = machine_factor(results["static"], r["profile_shapes"])
        prof = out / seg / "parcae" / "profile.json"
        if not prof.exists():
            continue
        _segment_forecast(out / seg, r, wall_interval)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print_table(results)
    plot(results, out / "replay.png")
    (out / "results.md").write_text(markdown(results))
    return 0


def combine(outs: list[Path]) -> int:
    """Repeat statistics over several runs of the same segments: per segment and policy the samples of each run,
    their mean and range; parcae / reactive as the ratio of the means and of each pass (a Markdown table)."""
    runs = [json.loads((o / "results.json").read_text()) for o in outs]
    segs = list(dict.fromkeys(seg for r in runs for seg in r["segments"]))
    print("| segment | policy | runs | samples per run | mean | range |")
    print("|---|---|---|---|---|---|")
    means: dict[tuple[str, str], float] = {}
    for seg in segs:
        for pol in POLICIES:
            xs = [r["segments"][seg]["runs"][pol]["samples"] for r in runs
                  if seg in r["segments"] and pol in r["segments"][seg]["runs"]]
            if not xs:
                continue
            m = statistics.mean(xs)
            means[(seg, pol)] = m
            print(f"| {seg} | {pol} | {len(xs)} | {', '.join(map(str, xs))} | {m:.0f} | "
                  f"{(max(xs) - min(xs)) / m:.1%} |")
    print("\n| segment | parcae / reactive (means) | per pass |")
    print("|---|---|---|")
    for seg in segs:
        if (seg, "parcae") in means and (seg, "reactive") in means:
            per = [r["segments"][seg]["runs"]["parcae"]["samples"] / r["segments"][seg]["runs"]["reactive"]["samples"]
                   for r in runs if seg in r["segments"] and {"parcae", "reactive"} <= set(r["segments"][seg]["runs"])]
            print(f"| {seg} | {means[(seg, 'parcae')] / means[(seg, 'reactive')]:.3f} | "
                  f"{', '.join(f'{x:.3f}' for x in per)} |")
    return 0


def markdown(results: dict[str, Any]) -> str:
    """The results as Markdown tables (what docs/evidence.md shows)."""
    lines = ["Static throughput per shape (samples/s): " + ", ".join(
        f"{k} {v:.0f}" for k, v in results["static"].items()) + "; best per instance count: " + ", ".join(
        f"N={n}: {k}" for n, (k, _) in sorted(results["best_by_n"].items(), key=lambda x: int(x[0]))), "",
        "Each segment starts " + ("at the first training step (`--trace-clock first-step`): start-up is outside it "
                                  "and not counted; a relaunch's is" if results.get("trace_clock") == "first-step"
                                  else "at the launch: start-up is inside it") + ". " + (
            f"A drop's victims: `--victims {results['victims']}`." if results.get("victims") else
            "A drop's victims: `parcae run`'s default (idle standbys first)."), "",
        "Forecasts of the in-place runs price each interval with the migration constants the run's leader had then "
        "(its `migration_costs` events); in brackets, the whole run at its last fit.", "",
        "\"vs ideal\": against every interval at the best static shape for its count; in brackets, that ideal at this "
        "machine's speed (the static table times the median ratio of the Parcae run's measured rates to it: "
        "`machine_factor`).", "",
        "| segment | policy | samples | vs ideal | forecast | forecast / measured | start-up s | migrations | time lost s by kind |",
        "|---|---|---|---|---|---|---|---|---|"]
    for seg, r in results["segments"].items():
        for pol, s in r["runs"].items():
            fc = r.get("forecast", {}).get(pol)
            ratio = f"{fc / s['samples']:.2f}" if fc and s["samples"] else "-"
            end = r.get("forecast_end_constants", {}).get(pol)
            if end and s["samples"]:
                ratio += f" ({end / s['samples']:.2f})"
            lost = ", ".join(f"{k} {v:.1f}" for k, v in s["lost_s"].items() if v) or "0"
            if s.get("planning_s"):
                lost += f"; leader planning {s['planning_s']:.1f}"
            migs = ", ".join(f"{k} {v}" for k, v in s["migrations"].items()) or "-"
            if s.get("explorations"):
                migs += f" ({s['explorations']} explorations)"
            lines.append(f"| {seg} | {pol} | {s['samples']} | {_vs_ideal(s['samples'], r)} | "
                         f"{fc or 0:.0f} | {ratio} | {s['startup_s']} | {migs}; restarts {s['restarts']} | {lost} |")
    lines.append("")
    for seg, r in results["segments"].items():
        for pol in ("parcae", "reactive"):
            tl = r["runs"].get(pol, {}).get("timeline")
            if tl:
                iv = 60.0 / float(results["time_scale"])
                raw = shape_time_share(tl, r["schedule"], iv, results["static"], results["best_by_n"], r["seconds"])
                sh = shape_time_share(tl, r["schedule"], iv, results["static"], results["best_by_n"], r["seconds"],
                                      join_delay_s=r.get("join_delay_s") or 0.0)
                lines.append(f"- {seg}, {pol}: {sh['share']:.1%} of the training time in a shape within 10 % of the "
                             f"best for the instances it could use (joiners counted after the measured "
                             f"{r.get('join_delay_s') or 0:.1f} s start), {raw['share']:.1%} counting every "
                             "instance from its interval's start; below: " + (", ".join(
                                 f"{b['shape']} at N={b['N']} {b['seconds']} s" for b in sh["below"]) or "none"))
    for seg, r in results["segments"].items():
        if r.get("parcae_vs_reactive"):
            lines.append(differs_line(seg, r["parcae_vs_reactive"]))
    for seg, r in results["segments"].items():
        checks = r["runs"].get("parcae", {}).get("shape_check", [])
        if checks:
            lines.append(f"- {seg}, parcae: shapes trained in vs the best static shape for the instances available: " +
                         ", ".join(f"{c['shape']} at N={c['N']} ({c['ratio']:.2f} of {c['best'][0]})" if c["ratio"]
                                   else f"{c['shape']} at N={c['N']} (not measured)" for c in checks))
    return "\n".join(lines) + "\n"


def print_table(results: dict[str, Any]) -> None:
    print("\nsegment   policy    samples  vs ideal  forecast  fc/meas  start-up  lost (s) by kind")
    for seg, r in results["segments"].items():
        for pol, s in r["runs"].items():
            fc = r.get("forecast", {}).get(pol)
            end = r.get("forecast_end_constants", {}).get(pol)
            end_ratio = f" (end {end / s['samples']:.2f})" if end and s["samples"] else ""
            print(f"{seg:9} {pol:9} {s['samples']:8d}  {_vs_ideal(s['samples'], r):>7}  "
                  f"{fc or 0:8.0f}  {fc / s['samples'] if fc and s['samples'] else 0:6.2f}{end_ratio}  "
                  f"{s['startup_s']:7.1f}  {s['lost_s']}")
        checks = r["runs"].get("parcae", {}).get("shape_check", [])
        if checks:
            print(f"{seg:9} parcae shapes vs best static for N: " + ", ".join(
                f"{c['shape']}@N={c['N']} {c['ratio']:.2f}" if c["ratio"] else f"{c['shape']}@N={c['N']} ?"
                for c in checks))


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    segs = list(results["segments"])
    if not segs:
        return
    fig, axes = plt.subplots(1, len(segs), figsize=(4.2 * len(segs), 3.8), squeeze=False)
    for ax, seg in zip(axes[0], segs):
        r = results["segments"][seg]
        pols = list(r["runs"])
        xs = range(len(pols))
        ax.bar([x - 0.2 for x in xs], [r["runs"][p]["samples"] for p in pols], width=0.4, label="measured")
        fc = r.get("forecast", {})
        ax.bar([x + 0.2 for x in xs], [fc.get(p, 0) for p in pols], width=0.4, label="simulator forecast", alpha=0.6)
        if r.get("ideal_after_startup"):
            ax.axhline(r["ideal_after_startup"], color="k", ls="--", lw=0.8, label="ideal (after start-up)")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(pols, fontsize=8)
        ax.set_title(f"{seg} (N {min(r['schedule'])}..{max(r['schedule'])})", fontsize=9)
        ax.set_ylabel("samples trained")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"bench_replay: GPT example ({results.get('job', 'cpu')}), bundled segments at "
                 f"{results['time_scale']:g}x", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
