"""benchmarks/bench_replay.py counts a run's samples within its replayed segment, from the clock the run used.

Regression (issue 21, the GPT-1.5B replay at 9-12 instances): the segment always started at the launch, so of a
180 s segment the 75-140 s start-up of 12 processes on 2 cores took most of the window, and the replay compared
start-ups rather than policies. Under ``--trace-clock first-step`` the segment starts at the first training step
(the launcher's ``trace_clock`` event), as the artifact counts one: the samples are those trained in the
``seconds`` after it and the start-up is reported but not counted (the forecast and the ideal leave it out).

No processes: synthetic ``events.jsonl`` records shaped like those of ``parcae run``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import bench_replay  # noqa: E402


def _run(startup: float, with_clock_event: bool = True) -> list[dict[str, Any]]:
    """A run launched at t=100 whose first step comes ``startup`` s later; 10 samples per second afterwards and an
    intra-stage migration 5 s into training."""
    first = 100.0 + startup
    ev: list[dict[str, Any]] = [{"source": "launcher", "event": "run_start", "time": 100.0},
                                {"source": "worker", "event": "start", "time": first - 0.5, "D": 1, "P": 2, "N": 2,
                                 "samples": 0}]
    if with_clock_event:
        ev.append({"source": "launcher", "event": "trace_clock", "time": first})
    ev += [{"source": "worker", "event": "progress", "time": first + t, "samples": int(10 * t)} for t in range(0, 61)]
    ev.append({"source": "elastic", "event": "migration", "generation": 1, "kind": "intra-stage", "duration_s": 0.3,
               "time": first + 5.0, "member": "i0", "D": 1, "P": 3, "N": 3})
    return sorted(ev, key=lambda e: e["time"])


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    def use(name: str) -> None:
        monkeypatch.setattr(bench_replay, "CLOCK", name)
    return use


@pytest.mark.parametrize("startup", [2.0, 30.0, 45.0])
def test_launch_clock_counts_the_start_up_inside_the_segment(clock, startup: float) -> None:  # type: ignore[no-untyped-def]
    clock("launch")
    s = bench_replay.summarize(_run(startup), 50.0)
    assert s["samples"] == int(10 * (50.0 - startup))
    assert s["startup_s"] == s["counted_startup_s"] == startup


@pytest.mark.parametrize("startup", [2.0, 30.0, 45.0])
def test_first_step_clock_counts_the_segment_after_the_first_step(clock, startup: float) -> None:  # type: ignore[no-untyped-def]
    clock("first-step")
    s = bench_replay.summarize(_run(startup), 50.0)
    assert s["samples"] == 500  # the same whatever the start-up took
    assert s["startup_s"] == startup and s["counted_startup_s"] == 0.0
    assert s["migrations"] == {"intra-stage": 1}
    tl = bench_replay.shape_timeline(_run(startup), 50.0)
    assert tl[0][0] == 0.0 and tl[1][0] == pytest.approx(5.0)  # timeline from the segment's start, none negative


def test_first_step_without_a_trace_starts_at_the_first_worker_step(clock) -> None:  # type: ignore[no-untyped-def]
    """A run without the launcher's ``trace_clock`` event (e.g. older logs) starts at its first worker step."""
    clock("first-step")
    ev = _run(30.0, with_clock_event=False)
    assert bench_replay.segment_start(ev) == pytest.approx(130.0)
    assert bench_replay.summarize(ev, 20.0)["samples"] == 200


def test_a_run_that_never_trained_counts_nothing(clock) -> None:  # type: ignore[no-untyped-def]
    clock("first-step")
    ev = [{"source": "launcher", "event": "run_start", "time": 100.0}]
    s = bench_replay.summarize(ev, 50.0)
    assert s["samples"] == 0 and s["counted_startup_s"] == 50.0


def test_older_results_without_the_counted_field_read_as_the_launch_clock() -> None:
    assert bench_replay.counted_startup({"startup_s": 12.5}) == 12.5
    assert bench_replay.counted_startup({"startup_s": 12.5, "counted_startup_s": 0.0}) == 0.0


def test_a_relaunch_is_measured_as_a_launch_and_a_stop_apart() -> None:
    """Regression (issue 21): the restart fallback's forecast priced every change at the mean whole loss of the
    completed relaunches (stop, checkpoint and launch: 31.7 s on lh_80_90), also a change that killed a relaunch
    still starting, which pays no stop (0.71 of the measured run). The launch (to the first step's start) and the
    stop (the last step's end to the exit) are read apart: a generation killed before it trained has no launch,
    one noticed before its first step (no notice checkpoint) no stop."""
    ev: list[dict[str, Any]] = [
        {"source": "launcher", "event": "launch", "generation": 0, "time": 0.0},
        {"source": "worker", "event": "start", "generation": 0, "time": 40.0},
        {"source": "worker", "event": "checkpoint", "reason": "notice", "generation": 0, "time": 70.0, "save_s": 0.5},
        {"source": "launcher", "event": "stopped", "generation": 0, "graceful": True, "time": 74.0},
        {"source": "launcher", "event": "launch", "generation": 1, "time": 74.0},
        {"source": "launcher", "event": "stopped", "generation": 1, "graceful": True, "time": 96.0},  # before a step
        {"source": "launcher", "event": "launch", "generation": 2, "time": 96.0},
        {"source": "worker", "event": "start", "generation": 2, "time": 117.0},
        {"source": "worker", "event": "checkpoint", "reason": "periodic", "generation": 2, "time": 130.0, "save_s": 1},
        {"source": "worker", "event": "checkpoint", "reason": "notice", "generation": 2, "time": 140.0, "save_s": 1.0},
        {"source": "launcher", "event": "stopped", "generation": 2, "graceful": True, "time": 144.0},
        {"source": "launcher", "event": "launch", "generation": 3, "time": 144.0},
        {"source": "launcher", "event": "stopped", "generation": 3, "graceful": False, "time": 144.1},  # killed
    ]
    parts = bench_replay.relaunch_parts(ev)
    assert parts == {"relaunch_launch_s": [21.0], "relaunch_stop_s": [4.5, 5.0]}


@pytest.mark.parametrize("with_prior", [None, "profile", "source"])
def test_each_interval_is_forecast_with_the_constants_its_leader_had_then(clock, tmp_path: Path,  # type: ignore[no-untyped-def]
                                                                            with_prior: Optional[str]) -> None:
    """Regression (issue 21, stop 49, hl_15_25 at 0.25 Gbps): the forecast priced a whole run at the constants its
    leader had fitted by the end (9.6 kB/s), though the leader had decided -- and its first moves had run -- at
    faster ones; it forecast the run at 0.86 of what it trained. The schedule gives interval k the constants of
    the last ``migration_costs`` event before it starts; before the first, the prior profile's (if the run had
    one) or the runtime's loopback constants; fields a leader does not refit come from the profile."""
    import json  # noqa: PLC0415

    from lightning_parcae.planning.costmodel import MigrationConstants  # noqa: PLC0415
    from lightning_parcae.planning.measured import PROFILE_FORMAT  # noqa: PLC0415
    from lightning_parcae.runtime.shape_choice import RUNTIME_CONSTANTS  # noqa: PLC0415

    clock("first-step")
    ev = _run(10.0)  # the segment starts at t = 110
    if with_prior:
        prior = tmp_path / "profile.json"
        prior.write_text(json.dumps({"format": PROFILE_FORMAT, "migration_constants": dict(vars(MigrationConstants(
            bandwidth_bytes_per_s=5e4, group_base_ms=900.0)))}))
        # the event names the file ``profile`` (stop 49's runs: ``source``, which hid the emitter's name)
        ev.insert(1, {"source": "elastic", "event": "prior_profile", "time": 104.0, with_prior: str(prior)})
    fit = {"group_base_ms": 2000.0, "group_per_process_ms": 1.0, "bandwidth_bytes_per_s": 9.6e3,
           "transfer_latency_ms": 50.0}
    ev.append({"event": "migration_costs", "time": 125.5, "migrations": 3, **fit})  # during interval 3 (5 s each)
    base = MigrationConstants(join_ms=777.0)
    sched = bench_replay.constants_schedule(ev, 6, 5.0, base)
    assert len(sched) == 6 and all(c.join_ms == 777.0 for c in sched)
    first = 5e4 if with_prior else RUNTIME_CONSTANTS.bandwidth_bytes_per_s
    assert [c.bandwidth_bytes_per_s for c in sched] == [first] * 4 + [9.6e3] * 2
    assert sched[0].group_base_ms == (900.0 if with_prior else RUNTIME_CONSTANTS.group_base_ms)
    assert sched[4].group_base_ms == 2000.0 and sched[5].transfer_latency_ms == 50.0


@pytest.mark.parametrize("first, stages, start", [(32, 6, (4, 6)), (28, 6, (4, 6)), (12, 2, (4, 2)), (9, 4, (2, 4)),
                                                   (5, 6, None)])
def test_the_in_place_forecasts_start_in_the_launchers_first_generation(monkeypatch: pytest.MonkeyPatch,
                                                                        first: int, stages: int,
                                                                        start: Optional[tuple[int, int]]) -> None:
    """Regression (issue 21, stop 55): ``parcae run`` forms the first generation before any decision -- D the
    largest power of two with D x P within the count (4x6 of 32) -- and every 0.25 Gbps run at N = 32 moved from
    it to 4x7 by a 24-27 s repartition the forecast did not charge: its in-place policies started paused. They
    now start in that shape on the first count (the relaunch policy still starts from nothing: it launches); a
    first count below P starts paused, as before."""
    import lightning_parcae.planning.measured as measured  # noqa: PLC0415
    import lightning_parcae.planning.sim as sim  # noqa: PLC0415

    calls: list[tuple[str, list[Any], dict[str, Any]]] = []

    class _Result:
        samples, interval_s, cumulative = 1.0, 1.0, [1.0]

    def fake_run_policy(name: str, cm: Any, iv: list[Any], interval_s: float, **kw: Any) -> _Result:
        calls.append((name, list(iv), kw))
        return _Result()

    from lightning_parcae.planning.costmodel import MigrationConstants  # noqa: PLC0415

    class _Thr:
        def best(self, n: int) -> None:
            return None

    cm = type("CM", (), {"c": MigrationConstants(), "throughput": _Thr()})()
    monkeypatch.setattr(sim, "run_policy", fake_run_policy)
    monkeypatch.setattr(measured, "load_cost_model", lambda *a, **k: cm)
    schedule = [first, first, first - 1, first - 1]
    bench_replay.forecast(Path("unused.json"), schedule, 20.0, 0.0, None, min(schedule), pipeline_stages=stages)
    by_name = {name: (iv, kw) for name, iv, kw in calls}
    for name in ("parcae", "live-reactive"):
        iv, kw = by_name[name]
        assert kw["start_shape"] == start
        assert iv[0] == ((first, 0, 0) if start else (0, first, 0)) and iv[2] == (first, 0, 1)
    iv, kw = by_name["relaunch"]
    assert "start_shape" not in kw and iv[0] == (0, first, 0)


@pytest.mark.parametrize("victims", ["any", "newest", None])
def test_the_tables_say_whose_instances_a_drop_took(victims) -> None:
    """Stops 54-55 replayed with role-blind victims (``--victims any``) beside earlier replays with idle standbys
    taken first, and nothing in a results file said which: the results now record ``victims`` (``any`` by default,
    as the simulator's forecast prices a drop) and the tables' header names it; a file from before says the old
    default."""
    results = {"static": {"4x6": 39.6}, "best_by_n": {"24": ["4x6", 39.6]}, "trace_clock": "first-step",
               "segments": {}}
    if victims is not None:
        results["victims"] = victims
    text = bench_replay.markdown(results)
    if victims is None:
        assert "A drop's victims: `parcae run`'s default (idle standbys first)." in text
    else:
        assert f"A drop's victims: `--victims {victims}`." in text


def test_the_leaders_planning_stall_is_its_planning_phases_inside_the_segment(clock) -> None:  # type: ignore[no-untyped-def]
    """The replay reports the seconds the job waited for the leader's decisions (issue 21, stop 57: planning during
    the step took them off the boundary): the leader's ``planning`` phases inside the segment, not a follower's
    (shorter: it is in ``planning`` from the agreement on) and not those before the segment's first step."""
    clock("first-step")
    ev = _run(30.0)

    def phase(t: float, member: str, spent: float) -> dict[str, Any]:
        return {"source": "elastic", "event": "phase", "old": "planning", "new": "training", "member": member,
                "spent_s": spent, "time": t}

    ev += [phase(120.0, "i0", 5.0),  # before the segment's first step (t = 130)
           phase(131.0, "i0", 0.4), phase(140.0, "i0", 0.25), phase(141.0, "i1", 0.1), phase(150.0, "i1", 0.2),
           phase(200.0, "i0", 9.0)]  # after the segment's 50 s
    assert bench_replay.summarize(sorted(ev, key=lambda e: e["time"]), 50.0)["planning_s"] == pytest.approx(0.65)
    assert bench_replay.summarize(_run(30.0), 50.0)["planning_s"] == 0.0


def _steps(t0: float, step0: int, n: int, step_s: float, shape: tuple[int, int], generation: int = 0,
           batch: int = 128) -> list[dict[str, Any]]:
    """``n`` progress events of the leader, one per step of ``step_s`` seconds, in ``shape``."""
    return [{"source": "worker", "event": "progress", "time": t0 + i * step_s, "step": step0 + i,
             "samples": (step0 + i) * batch, "D": shape[0], "P": shape[1], "N": shape[0] * shape[1],
             "generation": generation, "global_batch": batch} for i in range(n)]


def test_steady_rates_per_shape_leave_out_what_happens_between_steps() -> None:
    """A shape's rate is the global batch over its median step (issue 21, stop 58: the comparison of parcae and
    live-reactive in the same shape that stop 57 did by hand); a step that spans a migration (the shape changes
    between two progress events), a relaunch (the generation changes) or a gap in the steps is not a step, and only
    steps inside the segment count."""
    ev = (_steps(0.0, 0, 5, 1.0, (4, 6))  # 4 steps of 1 s: 128 samples/s
          + _steps(14.0, 5, 6, 0.8, (4, 7))  # 10 s of migration between step 4 and 5; then 5 steps of 0.8 s
          + _steps(30.0, 10, 3, 2.0, (4, 7), generation=1)  # a relaunch: step 9 -> 10 across generations
          + _steps(40.0, 20, 2, 0.5, (4, 7), generation=1)  # steps 12 -> 20: a gap, not a step
          + _steps(100.0, 22, 3, 0.1, (2, 9), generation=1))  # outside the segment
    rates = bench_replay.shape_rates(ev, 0.0, 50.0)
    assert set(rates) == {"4x6", "4x7"}
    assert rates["4x6"] == {"steps": 4, "seconds": pytest.approx(4.0), "samples_per_s": pytest.approx(128.0)}
    # 4x7: five 0.8 s steps, two 2 s steps after the relaunch, one 0.5 s step: median 0.8 s
    assert rates["4x7"]["steps"] == 8
    assert rates["4x7"]["seconds"] == pytest.approx(5 * 0.8 + 2 * 2.0 + 0.5)
    assert rates["4x7"]["samples_per_s"] == pytest.approx(160.0)


def _summary(samples: int, moves: list[tuple[float, int, int]], rates: dict[str, tuple[float, float]]) -> dict[str, Any]:
    return {"samples": samples, "timeline": [(t, d, p, d * p) for t, d, p in moves],
            "shape_rates": {k: {"steps": 10, "seconds": s, "samples_per_s": r} for k, (r, s) in rates.items()}}


def test_where_parcae_differs_splits_the_gap_into_rates_and_the_rest() -> None:
    """Stop 57's pass F lost 0.964 with the same moves as live-reactive: the rate in the shared shapes, not the
    decisions. The comparison says so: the same moves and how far apart they came, each shared shape's two rates,
    and the samples a's time in each shape would have trained at b's rate (``from_rates``), the rest apart."""
    a = _summary(23_936, [(0.0, 4, 6), (140.0, 4, 7)], {"4x6": (36.0, 130.0), "4x7": (42.0, 400.0)})
    b = _summary(24_832, [(0.0, 4, 6), (138.0, 4, 7)], {"4x6": (36.0, 128.0), "4x7": (43.2, 405.0)})
    d = bench_replay.where_it_differs(a, b)
    assert d["same_moves"] and d["moves"] == ["4x6", "4x7"] and d["entry_lag_s"] == [0.0, 2.0]
    assert d["rates"] == {"4x6": [36.0, 36.0], "4x7": [42.0, 43.2]}
    assert d["samples_diff"] == -896
    assert d["from_rates"] == pytest.approx((42.0 - 43.2) * 400.0)
    assert d["from_rest"] == pytest.approx(-896 - (42.0 - 43.2) * 400.0)
    line = bench_replay.differs_line("hl_15_25", d)
    assert "the same moves (4x6 -> 4x7" in line and "4x7 42.0 vs 43.2" in line and "-480 from those rates" in line

    other = _summary(24_000, [(0.0, 4, 6), (150.0, 2, 9)], {"4x6": (36.0, 150.0), "2x9": (30.0, 300.0)})
    d = bench_replay.where_it_differs(other, b)
    assert not d["same_moves"] and d["entry_lag_s"] == [] and d["rates"] == {"4x6": [36.0, 36.0]}
    assert d["from_rates"] == 0.0 and d["from_rest"] == -832
    assert "different moves (parcae 4x6 -> 2x9; reactive 4x6 -> 4x7)" in bench_replay.differs_line("x", d)


def test_the_tables_compare_the_in_place_runs_when_both_ran() -> None:
    """results.md carries the comparison line for a segment that ran parcae and reactive, none for one without."""
    runs = {"parcae": {**_summary(100, [(0.0, 1, 2)], {"1x2": (10.0, 10.0)}), "startup_s": 1.0, "migrations": {},
                       "restarts": 0, "lost_s": {}},
            "reactive": {**_summary(90, [(0.0, 1, 2)], {"1x2": (9.0, 10.0)}), "startup_s": 1.0, "migrations": {},
                         "restarts": 0, "lost_s": {}}}
    seg = {"runs": runs, "ideal_after_startup": 200.0, "schedule": [2], "seconds": 10.0}
    bench_replay._compare_in_place(seg)
    alone = {"runs": {"parcae": runs["parcae"]}, "ideal_after_startup": 200.0, "schedule": [2], "seconds": 10.0}
    bench_replay._compare_in_place(alone)
    assert "parcae_vs_reactive" not in alone
    text = bench_replay.markdown({"static": {}, "best_by_n": {}, "time_scale": 60.0,
                                  "segments": {"both": seg, "alone": alone}})
    assert "- both, parcae vs reactive: the same moves (1x2" in text
    assert "alone, parcae vs reactive" not in text


def test_the_ideal_is_also_priced_at_this_machines_speed() -> None:
    """Regression (issue 21, stop 58): with ``--static-from`` the ideal came from stop 48's static table, measured
    on a faster machine; this one ran 4x6 and 4x7 at 0.91 and 0.85 of it, so the pass read 86 % of ideal for runs at
    ~97 % of what this machine could do. The factor is the median ratio of the Parcae run's measured rates to the
    table over the shapes both hold, and the tables show the ratio to the ideal at that speed beside the plain one."""
    static = {"4x6": 39.64, "4x7": 43.40, "4x8": 43.49}
    factor = bench_replay.machine_factor(static, {"4,6": 36.26, "4,7": 37.09, "2,9": 30.0})  # 2x9 not in the table
    assert factor == pytest.approx((36.26 / 39.64 + 37.09 / 43.40) / 2, abs=1e-4)
    assert bench_replay.machine_factor(static, {"2,9": 30.0}) is None
    r = {"ideal_after_startup": 25_600.0, "machine_factor": 0.8}
    assert bench_replay._vs_ideal(22_016, r) == "86.0% (107.5% here)"
    assert bench_replay._vs_ideal(22_016, {"ideal_after_startup": 25_600.0}) == "86.0%"
    assert bench_replay._vs_ideal(1, {}) == "-"
