"""The agents' start-up roster (``lightning_parcae.launch.agent_startup``).

Problem it guards (issue 20): under ``parcae agent`` a round's members were fixed by the agents' rendezvous before
any worker ran, so a machine noticed or silent while the workers imported torch left the others waiting for a rank
that never came, and the whole job relaunched. Now the member agents compose a roster of the workers that arrived
(the launcher's rule), leaving out noticed and silent machines; the first roster written wins.
"""

from __future__ import annotations

import torch.distributed as dist

from lightning_parcae.launch.agent_startup import StartupComposer, worker_member_id
from lightning_parcae.launch.rendezvous import DEAD_AFTER_S
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.liveness import encode_notice, notice_record, write_notice
from lightning_parcae.runtime.startup import arrival_key, roster_key

TOKEN = "t" * 32


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _setup(agents: list[str], round_: int = 0) -> tuple[Coordinator, Clock, dict[str, StartupComposer]]:
    records = Coordinator(dist.HashStore(), TOKEN)
    clock = Clock()
    return records, clock, {a: StartupComposer(records, a, round_, agents, clock) for a in agents}


def _arrive(records: Coordinator, member: str, round_: int = 0, p: int = 0) -> None:
    records.put(arrival_key(roster_key(round_), member), {"member": member, "P": p})


def test_every_worker_arrived_gives_a_roster_in_rendezvous_order_and_the_first_written_wins() -> None:
    records, clock, comp = _setup(["a", "b", "c", "d"])
    for a in ("d", "b", "a"):
        _arrive(records, a)
    assert all(c.poll() is None for c in comp.values())  # c still importing
    _arrive(records, "c")
    clock.t += 0.2
    won = comp["c"].poll()
    assert won is not None and won.members == ("a", "b", "c", "d") and won.standbys == ()
    assert comp["a"].poll() == won and comp["d"].roster() == won


def test_a_noticed_machine_is_left_out_and_the_others_form_the_round_without_a_relaunch() -> None:
    records, clock, comp = _setup(["a", "b", "c"], round_=1)
    b = worker_member_id("b", 1)
    write_notice(records.store, b, notice_record(b, source="agent", why="noticed during start-up"), TOKEN)
    for a in ("a", "c"):
        _arrive(records, worker_member_id(a, 1), round_=1)
    won = comp["a"].poll()
    assert won is not None and won.members == ("a.1", "c.1") and won.left_out == ("b.1",)
    assert comp["a"].infeasible is None


def test_a_silent_machine_is_left_out_once_its_counter_stood_still() -> None:
    records, clock, comp = _setup(["a", "b"])
    comp["b"].poll()  # b beats once, then its link goes down before its worker arrives
    _arrive(records, "a")
    assert comp["a"].poll() is None  # b: seen, not yet judged
    clock.t += DEAD_AFTER_S - 0.1
    assert comp["a"].poll() is None
    clock.t += 0.1
    won = comp["a"].poll()
    assert won is not None and won.members == ("a",) and won.left_out == ("b",)


def test_the_scripts_pipeline_depth_from_the_arrivals_sets_the_member_count() -> None:
    """Three machines, a script with P=2: a 1x2 first generation (D a power of two), the third a standby."""
    records, clock, comp = _setup(["a", "b", "c"])
    for a in ("a", "b", "c"):
        _arrive(records, a, p=2)
    won = comp["b"].poll()
    assert won is not None and won.members == ("a", "b") and won.standbys == ("c",) and won.pipeline_stages == 2


def test_too_few_live_candidates_for_the_scripts_pipeline_means_no_roster_and_a_relaunch() -> None:
    records, clock, comp = _setup(["a", "b"])
    _arrive(records, "a", p=2)
    write_notice(records.store, "b", notice_record("b", source="agent"), TOKEN)
    assert comp["a"].poll() is None
    assert comp["a"].infeasible is not None and "fewer than the 2 pipeline stages" in comp["a"].infeasible.why
    assert comp["a"].roster() is None


def test_a_forged_notice_does_not_leave_a_machine_out_of_the_roster() -> None:
    """Regression: a bare existence check of the notice key let anyone who can write to the store (without the job
    token) leave a live machine out of the round; its worker, which verifies its notice, kept waiting. A notice not
    signed with the job token is ignored with a ``notice_refused`` event (once); the machine stays in."""
    records = Coordinator(dist.HashStore(), TOKEN)
    clock = Clock()
    events: list = []
    comp = StartupComposer(records, "a", 0, ["a", "b"], clock, event=lambda name, **kw: events.append((name, kw)))
    records.store.set("parcae/notice/b", encode_notice("b", notice_record("b", source="agent"), None))
    _arrive(records, "a")
    assert comp.poll() is None  # b is not left out: the roster waits for its worker
    assert comp.poll() is None
    assert [kw["about"] for name, kw in events if name == "notice_refused"] == ["b"]
    _arrive(records, "b")
    clock.t += 0.2
    won = comp.poll()
    assert won is not None and won.members == ("a", "b") and won.left_out == ()
