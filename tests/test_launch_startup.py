"""The launcher's start-up roster decision (``lightning_parcae.launch.startup``).

Problem it guards (issue 20): a launch's first generation used to be fixed at spawn time, so one instance noticed,
lost or silent while the others imported torch made the launcher relaunch everyone. The roster is now decided from
the candidates that arrived: as soon as every live one is there, or as soon as the arrivals give the member count the
others could not raise, or once the arrivals settled (a bounded quiet time); with a fixed P never below P members.
"""

from __future__ import annotations

import pytest

from lightning_parcae.launch.startup import (
    SETTLE_CAP,
    SETTLE_FRACTION,
    SETTLE_MIN_S,
    SEAT_GRACE_S,
    Candidate,
    decide_roster,
    settle_bound,
)

T0 = 1000.0  # the launch's wall time


def _cands(n: int, arrived: dict[int, float]) -> list[Candidate]:
    return [Candidate(f"i{k}", k, arrived.get(k)) for k in range(n)]


def _decide(cands: list[Candidate], now: float, p: str = "1", launch_p: int = 1, fewest: int = 0):  # noqa: ANN202
    return decide_roster(cands, launched_at=T0, now=now, pipeline_stages=p, launch_p=launch_p, fewest=fewest)


def test_nobody_arrived_means_wait() -> None:
    assert _decide(_cands(4, {}), now=T0 + 500) is None


def test_every_live_candidate_arrived_gives_power_of_two_members_oldest_first_and_the_rest_standbys() -> None:
    d = _decide(_cands(6, {k: T0 + 30 - k for k in range(6)}), now=T0 + 30)  # arrival order is not rank order
    assert d is not None and d.feasible
    assert d.members == ("i0", "i1", "i2", "i3") and d.standbys == ("i4", "i5")
    assert "every live candidate arrived" in d.why


def test_the_roster_is_written_once_the_others_could_not_add_a_member() -> None:
    """16 instances, one noticed during start-up: of 15 live candidates 8 are members, so the roster need not wait
    for the other 7 (they start as standbys); the first step comes no later than without the notice."""
    arrived = {k: T0 + 60 + 0.1 * k for k in range(8)}
    d = _decide(_cands(15, arrived), now=T0 + 61)
    assert d is not None and d.members == tuple(f"i{k}" for k in range(8))
    assert d.standbys == tuple(f"i{k}" for k in range(8, 15))
    assert _decide(_cands(15, {k: v for k, v in arrived.items() if k < 7}), now=T0 + 61) is None  # 7: only 4 now


def test_members_are_the_oldest_instances_when_a_younger_one_overtook_an_older_one_by_less_than_the_grace() -> None:
    """Regression (stop 27): of 3 live candidates 2 are members, and the roster was written at the 2nd arrival,
    whoever it was. Which instances became members -- and so which stage the README job's victims held, and which
    migration kinds it showed -- depended on how fast each one imported torch. Now the roster waits a short grace
    for the oldest ones, and only a straggler slower than that loses its seat."""
    arrived = {2: T0 + 10.0, 1: T0 + 10.2}  # i0 (the oldest) 0.5 s behind
    assert _decide(_cands(3, arrived), now=T0 + 10.3) is None
    d = _decide(_cands(3, {**arrived, 0: T0 + 10.7}), now=T0 + 10.7)
    assert d is not None and d.members == ("i0", "i1") and d.standbys == ("i2",)
    assert _decide(_cands(3, arrived), now=T0 + 10.2 + SEAT_GRACE_S - 0.05) is None
    d = _decide(_cands(3, arrived), now=T0 + 10.2 + SEAT_GRACE_S)  # i0 too slow: the arrivals as they are
    assert d is not None and d.members == ("i1", "i2") and d.standbys == ("i0",)


def test_a_silent_candidate_is_left_out_after_the_bounded_settle_time() -> None:
    arrived = {0: T0 + 8.0, 1: T0 + 8.5, 2: T0 + 9.0}  # i3 silent
    assert settle_bound(T0, T0 + 8.0) == SETTLE_MIN_S
    assert _decide(_cands(4, arrived), now=T0 + 9.0 + SETTLE_MIN_S - 0.1) is None
    d = _decide(_cands(4, arrived), now=T0 + 9.0 + SETTLE_MIN_S)
    assert d is not None and d.members == ("i0", "i1") and d.standbys == ("i2", "i3") and "no other for" in d.why


def test_the_settle_time_scales_with_how_long_start_up_takes_and_is_capped() -> None:
    """On a loaded machine (70 s to start) a candidate 10 s behind the others is slow, not silent."""
    assert settle_bound(T0, T0 + 70.0) == pytest.approx(SETTLE_FRACTION * 70.0)
    arrived = {0: T0 + 70.0, 1: T0 + 71.0, 2: T0 + 72.0}
    assert _decide(_cands(4, arrived), now=T0 + 82.0) is None  # 10 s quiet < 17.5 s
    # arrivals that keep trickling in never settle; the cap writes the roster anyway
    trickle = {k: T0 + 70.0 + 10.0 * k for k in range(7)}
    cap = T0 + 70.0 + SETTLE_CAP * settle_bound(T0, T0 + 70.0)
    assert _decide(_cands(16, {k: v for k, v in trickle.items() if v < cap - 1}), now=cap - 1) is None
    d = _decide(_cands(16, trickle), now=cap)
    assert d is not None and d.members == ("i0", "i1", "i2", "i3") and "within" in d.why


def test_a_fixed_pipeline_needs_its_p_members_and_falls_back_when_fewer_are_left() -> None:
    arrived = {0: T0 + 5.0}
    assert _decide(_cands(3, arrived), now=T0 + 500, p="2", launch_p=2) is None  # 1 < P = 2 arrived: wait
    assert _decide(_cands(3, {0: T0 + 5.0, 2: T0 + 6.0}), now=T0 + 6.0, p="2", launch_p=2) is None  # i1's grace
    d = _decide(_cands(3, {0: T0 + 5.0, 2: T0 + 6.0}), now=T0 + 6.0 + SEAT_GRACE_S, p="2", launch_p=2)
    assert d is not None and d.members == ("i0", "i2") and d.standbys == ("i1",)  # 2 of 3: D x P = 1 x 2 either way
    never = _decide(_cands(1, arrived), now=T0 + 6.0, p="2", launch_p=2)
    assert never is not None and not never.feasible and "fewer than the 2 pipeline stages" in never.why
    gone = _decide([], now=T0 + 6.0)
    assert gone is not None and not gone.feasible and "every start-up candidate" in gone.why


def test_auto_p_takes_a_power_of_two_member_count() -> None:
    d = _decide(_cands(3, {0: T0 + 1, 1: T0 + 1, 2: T0 + 1}), now=T0 + 1, p="auto", launch_p=0)
    assert d is not None and d.members == ("i0", "i1") and d.standbys == ("i2",)


def test_auto_p_forms_no_first_generation_smaller_than_the_model_needs() -> None:
    """Regression (issue 21): once a fallback said the model needs 6 instances, an ``auto`` relaunch on 7 formed its
    roster of the 4 that a power of two allows -- a first generation that cannot hold the model. Now all 7 arrivals
    are members, 5 settled arrivals are no roster, and 5 candidates left alive can never form one."""
    every = {k: T0 + 1 for k in range(7)}
    d = _decide(_cands(7, every), now=T0 + 1, p="auto", launch_p=0, fewest=6)
    assert d is not None and d.members == tuple(f"i{k}" for k in range(7)) and d.standbys == ()
    five = {k: T0 + 1 for k in range(5)}
    assert _decide(_cands(7, five), now=T0 + 1 + 50 * SETTLE_MIN_S, p="auto", launch_p=0, fewest=6) is None
    six = {k: T0 + 1 for k in range(6)}
    d = _decide(_cands(7, six), now=T0 + 1 + 50 * SETTLE_MIN_S, p="auto", launch_p=0, fewest=6)
    assert d is not None and len(d.members) == 6 and d.standbys == ("i6",)
    never = _decide(_cands(5, five), now=T0 + 2, p="auto", launch_p=0, fewest=6)
    assert never is not None and not never.feasible and "the 6 instances the model needs" in never.why
