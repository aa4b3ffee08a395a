"""The stop-and-relaunch state machine (``lightning_parcae.launch.relaunch``) with fakes of its collaborators.

Problem it guards: a restart must stop every worker (notice first to the preempted, SIGKILL after the grace),
relaunch with the PARCAE_* contract of a fixed-shape worker resuming from ``last.ckpt``, and report what it cost;
a fallback under ``--elastic`` must stop waiting standbys at once, give members their grace, and leave a relaunch
due only once every worker is gone.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from lightning_parcae.contract import ELASTIC_ENV, GENERATION_BASE_ENV, GENERATION_ENV, RESUME_ENV, STORE_ENV
from lightning_parcae.launch import relaunch as relaunch_mod
from lightning_parcae.launch.processes import RESTART_FALLBACK
from lightning_parcae.launch.relaunch import Relaunch
from lightning_parcae.launch.state import Phase
from launch_fakes import FakeProc, parts, worker


def _relaunch(tmp_path: Path, **cfg: Any) -> tuple[Relaunch, dict[str, Any], list[int]]:
    p = parts(tmp_path, **cfg)
    refreshed: list[int] = []
    r = Relaunch(p["cfg"], p["state"], p["reports"], p["pool"], p["store"], p["events"], p["say"],
                 lambda: refreshed.append(1))
    return r, p, refreshed


def test_start_generation_gives_each_rank_the_fixed_shape_contract_and_the_checkpoint(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[dict[str, str]] = []
    monkeypatch.setattr(relaunch_mod, "start_worker_process", lambda cmd, env, log: started.append(env) or FakeProc())
    r, p, _ = _relaunch(tmp_path, mode=RESTART_FALLBACK)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "last.ckpt").write_text("x")
    p["reports"].latest = {"step": 40}
    r.start_generation(3)  # nothing reported yet: D = 2, one instance idle
    st = p["state"]
    assert (st.phase, st.generation, st.n, st.shape, st.resume_step) == (Phase.STARTING, 0, 3, (2, 1), 40)
    assert [e["RANK"] for e in started] == ["0", "1"] and len(p["pool"].workers) == 2
    env = started[1]
    assert (env[ELASTIC_ENV], env[GENERATION_ENV], env[GENERATION_BASE_ENV]) == ("0", "0", "0")
    assert env[STORE_ENV] == p["store"].url and env[RESUME_ENV] == str(tmp_path / "ckpt" / "last.ckpt")
    assert p["events"].of("launch")[0]["resume_step"] == 40 and st.timeline[-1]["workers"] == 2


def test_stop_generation_notices_the_preempted_first_and_kills_what_outlives_the_grace(tmp_path: Path) -> None:
    r, p, refreshed = _relaunch(tmp_path, grace_s=0.0)
    st, pool = p["state"], p["pool"]
    st.generation, st.n = 2, 3
    pool.workers = [worker(f"r{k}", rank=k) for k in range(3)]
    pool.workers[0].proc.returncode = 0  # rank 0 stopped gracefully by itself
    rec = r.stop_generation(1)
    assert [k for k, _ in p["store"].published] == ["parcae/run/notice/gen2/rank1", "parcae/run/notice/gen2/rank2"]
    assert pool.signals[:2] == [("r1", signal.SIGTERM), ("r2", signal.SIGTERM)]
    assert ("r1", signal.SIGKILL) in pool.signals and ("r0", signal.SIGKILL) not in pool.signals
    assert rec["killed"] == [1, 2] and not rec["graceful"] and (rec["old_N"], rec["new_N"]) == (3, 1)
    assert pool.workers == [] and refreshed == [1]
    assert p["events"].kinds() == ["notice", "stopped"]


def test_a_store_hiccup_does_not_stop_the_notice(tmp_path: Path) -> None:
    r, p, _ = _relaunch(tmp_path, grace_s=0.0)
    p["store"].fail = True
    p["state"].n = 2
    p["pool"].workers = [worker("r0", rank=0), worker("r1", rank=1)]
    r.stop_generation(1)
    assert p["events"].kinds()[0] == "store_error" and ("r1", signal.SIGTERM) in p["pool"].signals


def test_finish_restart_measures_downtime_and_redone_steps_once(tmp_path: Path) -> None:
    r, p, _ = _relaunch(tmp_path)
    st = p["state"]
    assert r.finish_restart({"time": 1.0}) is None
    st.generation, st.resume_step = 4, 50
    st.pending_restart = {"t_request": 100.0, "last_step": 60, "samples_per_s": 20.0}
    p["reports"].latest = {"samples": 800, "step": 100}  # 8 samples a step
    rec = r.finish_restart({"time": 103.0})
    assert rec is not None and rec["downtime_s"] == 3.0 and rec["redo_steps"] == 10
    assert rec["redo_s"] == pytest.approx(4.0) and rec["lost_s"] == pytest.approx(7.0)
    assert (rec["to_generation"], rec["resume_step"]) == (4, 50)
    assert st.restarts == [rec] and st.pending_restart is None and p["events"].kinds() == ["restart_done"]


def test_a_fallback_stops_waiting_standbys_at_once_and_members_after_their_grace(tmp_path: Path) -> None:
    r, p, _ = _relaunch(tmp_path, grace_s=20.0, time_scale=10.0)  # wall grace 2 s: members get max(10, 4) s
    st, pool, rep = p["state"], p["pool"], p["reports"]
    st.launched(generation=0, resume_step=0, instances=3, now=0.0, launch=0)
    rep.phases = {"i0": "training", "i1": "training", "i2": "standby"}
    pool.workers = [worker("i0", instance=0), worker("i1", instance=1), worker("i2", instance=2, joiner=True)]
    r.start_fallback("stage 1 lost")
    assert st.phase is Phase.FALLBACK and st.fallback is not None and st.fallback["reason"] == "stage 1 lost"
    assert pool.signals == [("i2", signal.SIGKILL)] and pool.workers[2].killed
    r.start_fallback("again")  # one at a time
    assert p["events"].kinds() == ["fallback"] and st.fallback["reason"] == "stage 1 lost"
    assert not r.stop_stragglers()  # members still in their grace
    st.fallback["t_request"] = time.time() - 11.0
    assert r.stop_stragglers()
    assert st.fallback["killed"] == ["i0", "i1"] and not st.fallback["graceful"]
    r.end_fallback()
    assert st.phase is Phase.PENDING and st.pending_restart is not None and st.fallback is None
    assert p["events"].kinds() == ["fallback", "stopped"]


def test_a_start_up_fallback_stops_the_others_without_waiting(tmp_path: Path) -> None:
    r, p, _ = _relaunch(tmp_path)
    st, pool = p["state"], p["pool"]
    st.launched(generation=0, resume_step=0, instances=2, now=0.0, launch=0)
    pool.workers = [worker("i0"), worker("i1", instance=1)]
    r.start_fallback("initial member i0 lost during start-up", startup=True)
    assert r.stop_stragglers() and st.fallback["killed"] == ["i0", "i1"]


def test_stop_stragglers_needs_a_fallback(tmp_path: Path) -> None:
    r, _, _ = _relaunch(tmp_path)
    with pytest.raises(ValueError, match="no fallback"):
        r.stop_stragglers()
