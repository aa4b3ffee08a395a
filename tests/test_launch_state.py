"""The launcher's phase machine (``lightning_parcae.launch.state``): legal transitions only, and what each records.

Problem it guards: the launcher's phase was four flags combined in a dozen conditions, so a part could, say, start
a launch while a fallback was still stopping workers. Every change now goes through a ``RunState`` method that
refuses an illegal one; these tests pin the table and the facts each transition records.
"""

from __future__ import annotations

import pytest

from lightning_parcae.launch.state import _LEGAL, Phase, PhaseError, RunState, WorkerReports
from launch_fakes import worker


def _running(generation: int = 0) -> RunState:
    st = RunState()
    st.launched(generation=generation, resume_step=0, instances=2, now=1.0, launch=generation)
    assert st.is_first_step(generation, 1)
    return st


def _fallback(reason: str = "stage lost") -> dict:
    return {"reason": reason, "killed": [], "graceful": True, "t_request": 0.0}


def test_a_launch_starts_then_runs_at_its_first_step_past_the_resume_point() -> None:
    st = RunState()
    assert st.phase is Phase.PENDING and not st.training
    st.launched(generation=3, resume_step=10, instances=4, now=5.0, launch=3)
    assert (st.phase, st.generation, st.launch, st.resume_step, st.started_at) == (Phase.STARTING, 3, 3, 10, 5.0)
    assert st.training
    assert not st.is_first_step(3, 10)  # the resumed step itself is not progress
    assert not st.is_first_step(2, 50)  # an old generation's report does not count
    assert st.is_first_step(3, 11) and st.phase is Phase.RUNNING
    assert not st.is_first_step(3, 12)  # only the first one


def test_a_launch_gives_the_pending_restart_its_new_size() -> None:
    st = _running()
    st.pending_restart = {"old_N": 4}
    st.launched(generation=1, resume_step=0, instances=3, now=2.0)
    assert st.pending_restart == {"old_N": 4, "new_N": 3} and st.phase is Phase.STARTING


def test_a_fallback_goes_to_pending_and_leaves_its_record_as_the_pending_restart() -> None:
    st = _running()
    st.fallback_reason, st.fallback_seen = "why", {"i0"}
    fb = _fallback()
    st.begin_fallback(fb)
    assert st.phase is Phase.FALLBACK and st.fallback is fb and not st.training
    assert st.end_fallback() is fb
    assert st.phase is Phase.PENDING and st.fallback is None and st.pending_restart is fb
    assert st.fallback_reason == "" and st.fallback_seen == set()


def test_a_first_step_reported_during_a_fallback_that_interrupted_the_start_still_counts() -> None:
    """The previous relaunch did reach a step: its restart is completed although the next fallback began."""
    st = RunState()
    st.launched(generation=1, resume_step=5, instances=2, now=0.0, launch=1)
    st.begin_fallback(_fallback())
    assert st.is_first_step(1, 6) and st.phase is Phase.FALLBACK
    assert not st.is_first_step(1, 7)
    running = _running()
    running.begin_fallback(_fallback())
    assert not running.is_first_step(0, 9)  # it had trained already


def test_a_fallback_after_the_end_is_carried_out_but_the_run_stays_finished() -> None:
    st = _running()
    st.finish(9.0)
    st.begin_fallback(_fallback())
    assert st.phase is Phase.FINISHED and st.fallback is not None
    st.end_fallback()
    assert st.phase is Phase.FINISHED and st.finished and st.finished_at == 9.0


def test_the_end_during_a_fallback_finishes_the_run_and_keeps_the_fallback_going() -> None:
    st = _running()
    st.begin_fallback(_fallback())
    st.finish(3.0)
    assert st.phase is Phase.FINISHED and st.fallback is not None


@pytest.mark.parametrize("bad", ["launch_in_fallback", "second_fallback", "end_without_fallback", "relaunch_after_end",
                                 "pause_before_launch", "finish_twice"])
def test_illegal_transitions_raise_a_phase_error_that_names_them(bad: str) -> None:
    st = _running()
    if bad == "launch_in_fallback":
        st.begin_fallback(_fallback())
        with pytest.raises(PhaseError, match="FALLBACK -> STARTING"):
            st.launched(generation=1, resume_step=0, instances=1, now=0.0)
    elif bad == "second_fallback":
        st.begin_fallback(_fallback())
        with pytest.raises(PhaseError, match="another one is in progress"):
            st.begin_fallback(_fallback())
    elif bad == "end_without_fallback":
        with pytest.raises(PhaseError, match="never started"):
            st.end_fallback()
    elif bad == "relaunch_after_end":
        st.finish(1.0)
        with pytest.raises(PhaseError, match="FINISHED -> STARTING"):
            st.launched(generation=1, resume_step=0, instances=1, now=0.0)
    elif bad == "pause_before_launch":
        with pytest.raises(PhaseError, match="PENDING -> PAUSED"):
            RunState().pause()
    else:
        st.finish(1.0)
        with pytest.raises(PhaseError, match="FINISHED -> FINISHED"):
            st.finish(2.0)


def test_the_restart_fallback_pauses_without_instances_and_relaunches_after() -> None:
    st = _running()
    st.pause()
    assert st.phase is Phase.PAUSED and not st.training
    st.launched(generation=1, resume_step=0, instances=1, now=0.0)
    assert st.phase is Phase.STARTING


def test_the_transition_table_only_names_phases_and_finished_is_terminal() -> None:
    assert set(_LEGAL) == set(Phase)
    assert _LEGAL[Phase.FINISHED] == frozenset()
    assert Phase.STARTING not in _LEGAL[Phase.FALLBACK]  # a relaunch waits for every worker to exit


def test_reports_tell_waiting_standbys_from_members_holding_state() -> None:
    rep = WorkerReports(phases={"i1": "standby", "i2": "training", "i3": "migrating"})
    assert rep.waiting(worker("i1", joiner=True)) and rep.waiting(worker("i9", joiner=True))  # not reported yet
    assert not rep.waiting(worker("i2", joiner=True))  # admitted: it holds state now
    assert not rep.waiting(worker("i1"))  # an initial member is never a waiting standby
    assert rep.trains(worker("i3")) and not rep.trains(worker("i1"))
