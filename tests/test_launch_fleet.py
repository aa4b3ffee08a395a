"""The ``--elastic`` instance manager (``lightning_parcae.launch.fleet``) with fakes of its collaborators.

Problem it guards: which instances a trace's drop removes (``parcae run --victims``), how a removed instance is told
(a notice with grace, or SIGKILL for a waiting standby or a start-up candidate), how a launch's first generation is
formed from the candidates that arrived (the start-up roster), what an exit status makes the launcher do (a
standby in the released one's place, a candidate left out of the roster, a fallback, a failed run), and when the
launcher itself starts a fallback. The processes are fakes: no worker is started.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_parcae.contract import (
    FALLBACK_EXIT,
    GENERATION_BASE_ENV,
    JOIN_ENV,
    MEMBER_ENV,
    RELEASED_EXIT,
    ROSTER_ENV,
    SHARED_CORES_ENV,
)
from lightning_parcae.launch import fleet as fleet_mod
from lightning_parcae.launch.fleet import MEMBERS_GONE_S, Fleet, shared_units
from lightning_parcae.launch.processes import RunFailed
from lightning_parcae.launch.relaunch import Relaunch
from lightning_parcae.launch.startup import SETTLE_MIN_S
from lightning_parcae.launch.run import _config
from lightning_parcae.launch.state import Phase
from launch_fakes import FakeProc, config, parts, worker


def _parts_fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch | None = None, **cfg: Any) -> tuple[Fleet, dict]:
    p = parts(tmp_path, **cfg)
    p["started"] = []
    if monkeypatch is not None:
        monkeypatch.setattr(fleet_mod, "start_worker_process",
                            lambda cmd, env, log: p["started"].append(env) or FakeProc())
    relaunch = Relaunch(p["cfg"], p["state"], p["reports"], p["pool"], p["store"], p["events"], p["say"],
                        lambda: None)
    f = Fleet(p["cfg"], p["state"], p["reports"], p["pool"], p["store"], p["events"], p["say"], relaunch,
              lambda: 3)  # three GPUs
    return f, p


def _fleet(victims: str, seed: int = 0, standbys: tuple[int, ...] = ()) -> Fleet:
    f, p = _parts_fleet(Path("/nonexistent"), victims=victims, seed=seed)
    f.instances = {k: worker(f"i{k}", instance=k) for k in range(6)}
    p["reports"].phases = {f"i{k}": ("standby" if k in standbys else "training") for k in range(6)}
    return f


def _launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int = 3, seat: bool = True,
              **cfg: Any) -> tuple[Fleet, dict]:
    """A launch of ``n`` instances; ``seat``: every candidate arrived and the roster is written."""
    f, p = _parts_fleet(tmp_path, monkeypatch, **cfg)
    f.add_instances(n)
    f.launch_instances()
    if seat:
        _arrive(f, p, *[f"i{k}" for k in range(n)])
        assert f.form_roster() is not None
    return f, p


def _arrive(f: Fleet, p: dict, *members: str, at: float | None = None) -> None:
    """``members`` reported their arrival (at wall time ``at``, default now)."""
    for m in members:
        p["reports"].arrived[m] = time.time() if at is None else at


def test_newest_removes_standbys_then_the_newest_members() -> None:
    assert _fleet("newest", standbys=(1,)).removal_order(list(range(6))) == [1, 5, 4, 3, 2, 0]


@pytest.mark.parametrize("seed", range(5))
def test_random_removes_standbys_first_and_is_reproducible_by_seed(seed: int) -> None:
    a = _fleet("random", seed, standbys=(2,)).removal_order(list(range(6)))
    b = _fleet("random", seed, standbys=(2,)).removal_order(list(range(6)))
    assert a == b and a[0] == 2 and sorted(a) == list(range(6))


def test_random_spreads_losses_over_members_not_by_age() -> None:
    """Over many drops the first member removed is every member about equally often (newest-first always took
    instance 5, so a drop of two never left a stage short and no inter-stage migration ever happened)."""
    fleet = _fleet("random", 7)
    firsts = [fleet.removal_order(list(range(6)))[0] for _ in range(600)]
    counts = [firsts.count(k) for k in range(6)]
    assert min(counts) > 60, counts


@pytest.mark.parametrize("seed", range(5))
def test_any_is_reproducible_by_seed_and_does_not_spare_standbys(seed: int) -> None:
    """``--victims any`` draws from every instance, as the planner's cost model does: the standby is removed
    first exactly as often as any member (the other orders always remove it first)."""
    a = _fleet("any", seed, standbys=(2,)).removal_order(list(range(6)))
    assert a == _fleet("any", seed, standbys=(2,)).removal_order(list(range(6))) and sorted(a) == list(range(6))
    fleet = _fleet("any", seed, standbys=(2,))
    firsts = [fleet.removal_order(list(range(6)))[0] for _ in range(600)]
    counts = [firsts.count(k) for k in range(6)]
    assert min(counts) > 60 and counts[2] < 160, counts  # about 100 each: the standby is no exception


def test_stage_removes_standbys_then_the_last_stages_holders_so_a_drop_of_d_empties_a_stage() -> None:
    """``--victims stage`` (the README's job): from 2x2 (ranks i0 i1 / i2 i3, stage = rank % 2) a drop of two takes
    both holders of the last stage -- an inter-stage migration every run. With ``--victims random`` whether the
    drop emptied a stage or a pipeline depended on where the profile's repartition had seated the victims, so the
    every-kind README test saw no inter-stage change in some runs."""
    f = _fleet("stage", standbys=(4,))
    f.store.layout = {"members": ["i0", "i1", "i2", "i3"], "partition": [5, 6]}
    order = f.removal_order(list(range(6)))
    assert order[0] == 4  # the idle standby first
    assert order[1:3] == [3, 1]  # the last stage's holders, newest first
    assert order[3:5] == [2, 0]  # then the first stage's
    assert order[5] == 5  # training but not in that layout (it sorts after the layout's members)


def test_stage_without_a_layout_in_the_store_removes_the_newest_members() -> None:
    f = _fleet("stage", standbys=(1,))
    f.store.layout = None
    assert f.removal_order(list(range(6))) == [1, 5, 4, 3, 2, 0]


def test_victims_option_is_parsed_and_bad_values_rejected(capsys) -> None:
    cfg = _config(["--instances", "2", "--victims", "random", "--seed", "3", "--", "python", "x.py"])
    assert (cfg.victims, cfg.seed) == ("random", 3)
    assert _config(["--instances", "2", "--", "python", "x.py"]).victims == "newest"
    with pytest.raises(SystemExit):
        _config(["--instances", "2", "--victims", "oldest", "--", "python", "x.py"])
    assert "invalid choice: 'oldest'" in capsys.readouterr().err


def test_a_launch_starts_candidates_and_the_roster_makes_power_of_two_members_and_standbys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _launched(tmp_path, monkeypatch, n=3, seat=False)
    st = p["state"]
    assert (st.phase, st.launch, st.generation) == (Phase.STARTING, 0, 0)
    # every instance starts as a candidate: RANK / WORLD_SIZE are placeholders, the roster gives the rank
    assert [(e[MEMBER_ENV], e[JOIN_ENV], e["RANK"], e["WORLD_SIZE"], e[ROSTER_ENV]) for e in p["started"]] == \
        [(f"i{k}", "0", "0", "1", "parcae/startup/0/roster") for k in range(3)]
    assert p["started"][0][GENERATION_BASE_ENV] == "0" and p["started"][0][SHARED_CORES_ENV] == "3"
    assert [e["LOCAL_RANK"] for e in p["started"]] == ["0", "1", "2"]  # one device slot per instance
    assert p["events"].of("launch")[0]["candidates"] == ["i0", "i1", "i2"]
    assert f.form_roster() is None and p["store"].published == []  # nobody arrived yet
    _arrive(f, p, "i2", "i0", "i1")
    roster = f.form_roster()
    assert roster is not None and roster.members == ("i0", "i1") and roster.standbys == ("i2",)
    assert p["store"].published == [("parcae/startup/0/roster", roster.record())]
    w0, w1, w2 = p["pool"].workers
    assert (w0.rank, w1.rank, w0.candidate, w1.joiner, w2.joiner, w2.candidate) == (0, 1, False, False, True, False)
    assert p["events"].of("roster")[0]["members"] == ["i0", "i1"] and p["events"].of("roster")[0]["standbys"] == ["i2"]
    assert f.form_roster() is None  # written once


def test_a_candidate_lost_before_the_roster_is_left_out_while_a_member_lost_after_it_relaunches(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 20): an initial member lost during start-up made the launcher relaunch everyone, although
    nobody held any state yet (`parcae run --instances 16 --trace hh_55_65` lost 120 s of a 400 s run). A
    candidate lost before its launch's roster is now simply not in it -- a fresh standby takes its instance -- and
    only a member of the roster lost before the first generation trained still starts the start-up fallback."""
    f, p = _launched(tmp_path, monkeypatch, n=3, seat=False)
    st = p["state"]
    p["pool"].workers[1].proc.returncode = -signal.SIGKILL  # nobody here sent it
    f.reap()
    assert st.phase is Phase.STARTING and st.fallback is None and "fallback" not in p["events"].kinds()
    assert p["events"].of("left_out")[0]["member"] == "i1" and p["events"].of("lost")[0]["member"] == "i1"
    assert f.instances[1].member == "i1.1" and p["started"][-1][JOIN_ENV] == "1"  # a standby, not a candidate
    _arrive(f, p, "i0", "i2")
    roster = f.form_roster()
    assert roster is not None and roster.members == ("i0", "i2") and roster.left_out == ("i1",)
    p["pool"].workers[2].proc.returncode = -signal.SIGKILL  # i2: in the roster, generation 0 not formed yet
    f.reap()
    assert st.phase is Phase.FALLBACK and st.fallback["startup"]
    assert "initial member i2 lost during start-up (in the roster" in st.fallback["reason"]


def test_a_candidate_noticed_before_the_roster_is_stopped_at_once_and_left_out(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A noticed worker whose SIGTERM handler was not installed yet was only SIGKILLed at the end of its grace; a
    candidate holds no state, so it is stopped at once and the roster forms without it."""
    f, p = _launched(tmp_path, monkeypatch, n=3, seat=False)
    f.change(2)  # newest first: i2
    assert p["events"].of("remove")[0]["victims"] == [{"instance": 2, "member": "i2", "action": "candidate stopped"}]
    assert p["pool"].signals == [("i2", signal.SIGKILL)] and p["store"].published == []  # no notice, no SIGTERM
    f.reap()
    assert p["state"].fallback is None and p["events"].of("left_out")[0]["reason"] == "noticed"
    _arrive(f, p, "i0", "i1")
    roster = f.form_roster()
    assert roster is not None and roster.members == ("i0", "i1") and roster.left_out == ("i2",)


def test_a_member_that_arrived_gets_its_notice_as_sigterm_before_it_reports_a_phase(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its handler is installed before it reports its arrival: SIGTERM is a notice it can act on, not a kill at the
    end of the grace period."""
    f, p = _launched(tmp_path, monkeypatch, n=2)
    assert p["reports"].phases == {}
    f.change(1)
    assert ("i1", signal.SIGTERM) in p["pool"].signals and p["pool"].workers[1].sigterm_sent


def test_a_fixed_pipeline_that_loses_too_many_candidates_relaunches(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _launched(tmp_path, monkeypatch, n=2, seat=False, pipeline_stages="2")
    assert p["started"][0]["PARCAE_PIPELINE_STAGES"] == "2"
    p["pool"].workers[0].proc.returncode = -signal.SIGKILL
    f.reap()
    _arrive(f, p, "i1")
    f.form_roster()
    st = p["state"]
    assert st.phase is Phase.FALLBACK and "no first generation can form" in st.fallback["reason"]


def test_a_silent_candidate_is_left_for_a_standby_once_the_arrivals_settled(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _launched(tmp_path, monkeypatch, n=4, seat=False)
    t0 = p["state"].started_at
    _arrive(f, p, "i0", "i1", "i2", at=t0 + 2.0)
    assert f.form_roster(now=t0 + 3.0) is None  # 3 of 4: 2 members now, 4 if i3 comes
    roster = f.form_roster(now=t0 + 2.0 + SETTLE_MIN_S + 0.1)
    assert roster is not None and roster.members == ("i0", "i1") and roster.standbys == ("i2", "i3")
    assert p["pool"].workers[3].joiner and not p["pool"].workers[3].candidate


def test_shared_units_are_cores_on_a_cpu_machine_and_none_with_emulated_devices(tmp_path: Path) -> None:
    import os

    cores = os.cpu_count() or 1
    assert shared_units(config(tmp_path), lambda: 2 * cores) == cores
    assert shared_units(config(tmp_path), lambda: 3) == 3  # GPUs
    assert shared_units(config(tmp_path, emulated_devices=True), lambda: 3) == 0


def test_a_drop_notices_a_member_with_grace_and_stops_a_waiting_standby(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _launched(tmp_path, monkeypatch, n=3)
    p["reports"].phases = {"i0": "training", "i1": "training", "i2": "standby"}
    f.change(1)
    assert sorted(f.instances) == [0]
    victims = p["events"].of("remove")[0]["victims"]
    assert [(v["member"], v["action"]) for v in victims] == [("i2", "standby stopped"), ("i1", "notice")]
    assert ("i2", signal.SIGKILL) in p["pool"].signals and ("i1", signal.SIGTERM) in p["pool"].signals
    assert p["store"].published[-1][0].endswith("i1") and p["pool"].workers[1].deadline is not None
    # the standby's notice is written too, before it is stopped: a leader planning now must not admit it
    assert [k for k, _ in p["store"].published if "notice" in k] == ["parcae/notice/i2", "parcae/notice/i1"]
    assert p["state"].n == 1 and p["state"].changes[-1]["new_N"] == 1 and p["state"].timeline[-1]["N"] == 1


def test_an_addition_starts_joiners_while_training_and_waits_for_the_launch_otherwise(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _parts_fleet(tmp_path, monkeypatch)
    f.add_instances(1)
    f.change(2)  # before the first launch: the new instance starts with it
    assert p["started"] == [] and "will start at the next launch" in p["say"].lines[-1]
    f.launch_instances()
    f.change(3)
    assert p["started"][-1][JOIN_ENV] == "1" and p["started"][-1][MEMBER_ENV] == "i2"


def test_the_joiners_of_one_trace_event_are_recorded_as_one_launch_batch(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (the README's main job under load): the trace's 2 -> 4 started two joiners together, the leader
    admitted them one planning interval apart as their imports ended. The launcher now records them as one launch
    batch (``parcae/booting/<member>``, signed like every record) so that the leader admits them together; a
    single joiner gets none; a batch member whose process exits is marked gone (nobody waits for it)."""
    f, p = _launched(tmp_path, monkeypatch, n=2)
    before = time.time()
    f.change(4)
    booting = {k: v for k, v in p["store"].published if k.startswith("parcae/booting/")}
    assert sorted(booting) == ["parcae/booting/i2", "parcae/booting/i3"]
    b2, b3 = booting["parcae/booting/i2"], booting["parcae/booting/i3"]
    assert b2["batch"] == b3["batch"] and b2["members"] == b3["members"] == ["i2", "i3"]
    assert before <= b2["t"] <= time.time() and "gone" not in b2
    assert p["events"].of("add")[-1]["batch"] == b2["batch"]
    f.change(5)  # one joiner: no batch
    assert [k for k, _ in p["store"].published if k.startswith("parcae/booting/")] == list(booting)
    assert p["events"].of("add")[-1]["batch"] is None
    f.instances[3].proc.returncode = -9  # type: ignore[union-attr]  # i3 lost while it booted
    f.reap()
    gone = [v for k, v in p["store"].published if k == "parcae/booting/i3"]
    assert len(gone) == 2 and gone[-1] == {**b3, "gone": True}
    f.change(7)  # the next batch has a new id
    later = {k: v for k, v in p["store"].published if k.startswith("parcae/booting/") and k not in booting}
    assert len(later) == 2 and {v["batch"] for v in later.values()} != {b2["batch"]}


def test_a_released_member_comes_back_as_a_standby_but_not_during_a_fallback(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _launched(tmp_path, monkeypatch, n=2)
    p["pool"].workers[1].proc.returncode = RELEASED_EXIT
    f.reap()
    assert f.instances[1].member == "i1.1" and p["started"][-1][JOIN_ENV] == "1"
    p["state"].begin_fallback({"reason": "x", "killed": [], "graceful": True, "t_request": 0.0})
    f.instances[1].proc.returncode = RELEASED_EXIT
    f.reap()
    assert f.instances[1] is None


def test_exit_75_starts_the_fallback_and_a_script_error_fails_the_run(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _launched(tmp_path, monkeypatch, n=2)
    p["pool"].workers[0].proc.returncode = FALLBACK_EXIT
    f.reap()
    assert p["state"].phase is Phase.FALLBACK and "fallback" in p["events"].kinds()
    p["pool"].workers[1].proc.returncode = 1
    with pytest.raises(RunFailed, match="worker i1 .* exited with 1"):
        f.reap()
    assert p["pool"].killed_all == 1


def test_a_roster_member_lost_before_the_first_generation_starts_a_start_up_fallback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _launched(tmp_path, monkeypatch, n=2)
    p["pool"].workers[0].proc.returncode = -signal.SIGKILL  # nobody here sent it
    f.reap()
    st = p["state"]
    assert st.phase is Phase.FALLBACK and st.fallback["startup"]
    assert "initial member i0 lost during start-up" in st.fallback["reason"]


def test_a_lost_member_gets_a_fresh_standby_until_max_restarts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _launched(tmp_path, monkeypatch, n=2, max_restarts=1)
    p["reports"].phases = {"i0": "training", "i1": "training"}
    assert p["state"].is_first_step(0, 1)
    p["pool"].workers[1].proc.returncode = -signal.SIGKILL
    f.reap()
    assert f.instances[1].member == "i1.1" and p["state"].phase is Phase.RUNNING
    f.instances[1].proc.returncode = -signal.SIGKILL
    with pytest.raises(RunFailed, match="lost its process to a signal 2 times"):
        f.reap()


def test_the_launcher_falls_back_itself_only_when_no_member_is_left_for_a_while(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _launched(tmp_path, monkeypatch, n=2)
    st = p["state"]
    standby = worker("i5", instance=5, joiner=True)
    f.check_members_left([standby], now=0.0)
    f.check_members_left([standby], now=MEMBERS_GONE_S + 1)
    assert st.fallback is None  # still starting: nobody trained yet
    assert st.is_first_step(0, 1)
    f.check_members_left([standby], now=10.0)
    f.check_members_left([standby, worker("i0")], now=10.0 + MEMBERS_GONE_S + 1)  # a member is back: reset
    f.check_members_left([standby], now=20.0)
    assert st.fallback is None
    f.check_members_left([standby], now=20.0 + MEMBERS_GONE_S + 0.5)
    assert st.phase is Phase.FALLBACK and "every training member was lost" in st.fallback["reason"]


def test_a_noticed_member_is_killed_when_its_grace_ends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _launched(tmp_path, monkeypatch, n=1)
    w = p["pool"].workers[0]
    p["reports"].phases = {"i0": "training"}
    w.noticed_at, w.deadline = time.time(), time.time() + 60
    f.enforce_deadlines()
    assert p["pool"].signals == [("i0", signal.SIGTERM)] and not w.killed
    w.deadline = time.time() - 1
    f.enforce_deadlines()
    assert w.killed and p["pool"].signals[-1] == ("i0", signal.SIGKILL) and len(p["state"].kill_times) == 1


def test_a_drop_after_the_roster_takes_standbys_before_members_still_forming_generation_0(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Roster members report no phase until generation 0 trains; with `--victims random` they were as likely to be
    removed as the roster's standbys, and a member removed then is a loss in the start-up window (a relaunch)."""
    for seed in range(5):
        f, p = _launched(tmp_path / str(seed), monkeypatch, n=3, victims="random", seed=seed)
        assert f.removal_order([0, 1, 2])[0] == 2  # i2: the roster's standby


def test_start_up_progress_is_the_latest_arrival_or_roster_not_the_launch(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 21, a 24-instance replay on 2 cores): the candidates' imports took 100 s, the roster formed
    at 100.1 s and ``--startup-timeout`` 120 failed the run, counting from the launch, while the first generation was
    still building its groups. The timeout now counts from the latest start-up progress."""
    f, p = _launched(tmp_path, monkeypatch, n=4, seat=False)
    t0 = p["state"].started_at
    assert f.startup_progress_at() == t0  # nobody arrived: the launch is the latest progress
    _arrive(f, p, "i0", at=t0 + 40.0)
    _arrive(f, p, "i9", at=t0 + 500.0)  # not a worker of this launch: does not count
    assert f.startup_progress_at() == t0 + 40.0
    _arrive(f, p, "i1", "i2", "i3", at=t0 + 100.0)
    assert f.startup_progress_at() == t0 + 100.0
    assert f.form_roster(now=t0 + 100.5) is not None
    assert f.startup_progress_at() == t0 + 100.5


@pytest.mark.parametrize("pipeline_stages", ["3", "auto"])
def test_a_launch_started_early_waits_for_the_instances_the_model_needs_and_takes_added_ones_as_candidates(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pipeline_stages: str) -> None:
    """During a pause for want of instances (2 left, the model needs 3) the relaunch starts at once on the two:
    they import meanwhile, but no roster forms on them -- not even once both arrived and the settle time passed --
    the waiting record is published for their roster wait, an instance the trace adds joins as a candidate of the
    same launch, and the roster forms once the third arrived (with ``auto`` too, where two arrivals would otherwise
    have been enough for a roster, and the three are all members: a power of two, 2, would not hold the model)."""
    f, p = _parts_fleet(tmp_path, monkeypatch, pipeline_stages=pipeline_stages)
    f.add_instances(2)
    p["state"].min_instances = 3
    f.launch_when_enough()
    st = p["state"]
    assert st.phase is Phase.STARTING and f.waiting()
    assert [e[ROSTER_ENV] for e in p["started"]] == ["parcae/startup/0/roster"] * 2
    launch = p["events"].of("launch")[0]
    assert launch["waiting_for"] == 3 and launch["P"] == (3 if pipeline_stages == "3" else "auto")
    long_ago = time.time() - 10 * SETTLE_MIN_S
    _arrive(f, p, "i0", "i1", at=long_ago)
    assert f.form_roster() is None
    assert [k for k, _ in p["store"].published] == ["parcae/startup/0/waiting"]
    assert time.time() - f.startup_progress_at() < 1.0  # waiting is not a stalled start-up
    f.change(3)
    added = p["pool"].workers[-1]
    assert added.candidate and not added.joiner and p["started"][-1][ROSTER_ENV] == "parcae/startup/0/roster"
    assert p["started"][-1][JOIN_ENV] == "0"
    assert f.form_roster() is None and not f.waiting()  # three alive: no longer waiting, but only two arrived
    assert p["events"].of("enough")[0]["candidates"] == ["i0", "i1", "i2"]
    _arrive(f, p, "i2")
    roster = f.form_roster()
    assert roster is not None and roster.members == ("i0", "i1", "i2")


def test_a_launch_started_early_waits_again_if_a_loss_leaves_too_few_before_its_roster(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Enough candidates were alive (3 of 3), then one was noticed before the roster: the launch waits for
    instances again (not a start-up stall that ``--startup-timeout`` would fail), and forms once the trace gives a
    third instance and its candidate arrived."""
    f, p = _parts_fleet(tmp_path, monkeypatch, pipeline_stages="3")
    f.add_instances(2)
    p["state"].min_instances = 3
    f.launch_when_enough()
    f.change(3)
    _arrive(f, p, "i0", "i1")
    assert f.form_roster() is None and not f.waiting()
    f.change(2)  # the newest (i2, not arrived) goes
    assert f.form_roster() is None and f.waiting()
    f.change(3)
    _arrive(f, p, "i3")
    roster = f.form_roster()
    assert roster is not None and roster.members == ("i0", "i1", "i3"), roster
