"""The ``--elastic`` instance manager (``lightning_parcae.launch.fleet``) with fakes of its collaborators.

Problem it guards: which instances a trace's drop removes (``parcae run --victims``), how a removed instance is told
(a notice with grace, or SIGKILL for a waiting standby), what an exit status makes the launcher do (a standby in
the released one's place, a fallback, a failed run), and when the launcher itself starts a fallback. The processes
are fakes: no worker is started.
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
    SHARED_CORES_ENV,
)
from lightning_parcae.launch import fleet as fleet_mod
from lightning_parcae.launch.fleet import MEMBERS_GONE_S, Fleet, shared_units
from lightning_parcae.launch.processes import RunFailed
from lightning_parcae.launch.relaunch import Relaunch
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


def _launched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, n: int = 3, **cfg: Any) -> tuple[Fleet, dict]:
    f, p = _parts_fleet(tmp_path, monkeypatch, **cfg)
    f.add_instances(n)
    f.launch_instances()
    return f, p


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


def test_victims_option_is_parsed_and_bad_values_rejected(capsys) -> None:
    cfg = _config(["--instances", "2", "--victims", "random", "--seed", "3", "--", "python", "x.py"])
    assert (cfg.victims, cfg.seed) == ("random", 3)
    assert _config(["--instances", "2", "--", "python", "x.py"]).victims == "newest"
    with pytest.raises(SystemExit):
        _config(["--instances", "2", "--victims", "oldest", "--", "python", "x.py"])
    assert "invalid choice: 'oldest'" in capsys.readouterr().err


def test_a_launch_starts_power_of_two_members_and_the_rest_as_standbys(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    f, p = _launched(tmp_path, monkeypatch, n=3)
    st = p["state"]
    assert (st.phase, st.launch, st.generation) == (Phase.STARTING, 0, 0)
    assert [(e[MEMBER_ENV], e[JOIN_ENV], e["RANK"], e["WORLD_SIZE"]) for e in p["started"]] == \
        [("i0", "0", "0", "2"), ("i1", "0", "1", "2"), ("i2", "1", "0", "1")]
    assert p["started"][0][GENERATION_BASE_ENV] == "0" and p["started"][0][SHARED_CORES_ENV] == "3"
    assert [e["LOCAL_RANK"] for e in p["started"]] == ["0", "1", "2"]  # one device slot per instance
    assert p["events"].of("launch")[0]["standbys"] == ["i2"]


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
    assert p["store"].published[0][0].endswith("i1") and p["pool"].workers[1].deadline is not None
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


def test_an_initial_member_lost_before_the_first_generation_starts_a_start_up_fallback(
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
