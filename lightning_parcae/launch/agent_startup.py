"""The start-up roster of ``parcae agent``: machines that share only the store agree on who forms a round's first
generation, once its workers have arrived.

Problem: the agents' rendezvous (:mod:`lightning_parcae.launch.rendezvous`) fixes a round's members *before* any
worker runs, and a worker takes seconds to minutes to import torch, build its Trainer and load its data. A machine
noticed or silenced in that time left the others waiting in generation 0's rendezvous for a rank that never came:
the round failed and every agent relaunched (issue 20: "a notice during start-up relaunches everything").
``parcae run`` solved this with a roster its launcher writes once the candidates arrived
(:mod:`lightning_parcae.launch.startup`); a multi-machine job has no such launcher, so every member agent of the
round composes the roster and the first one written wins (``compare_set``), as the rendezvous does.

The round's member agents start their workers as *candidates* (:data:`~lightning_parcae.contract.ROSTER_ENV` is
:func:`~lightning_parcae.runtime.startup.roster_key` of the round). While its worker waits, each agent

* raises its counter ``parcae/agents/round/<k>/cbeat/<agent>`` (a machine whose counter stands still for
  :data:`~lightning_parcae.launch.rendezvous.DEAD_AFTER_S`, measured on the watcher's own clock, is silent);
* reads each candidate's state: *noticed* (a notice signed with the job token is there: its agent wrote it, the
  worker leaves at once; one that fails verification -- a forged key -- is ignored with a warning and an event),
  *dead* (its counter stood still), *arrived* (its worker wrote its arrival record, seen at this agent's time);
* applies the launcher's rule, :func:`~lightning_parcae.launch.startup.decide_roster`, to the live candidates
  (instance order = the rendezvous' rank order; P from the arrivals' records) and claims the roster key with the
  result. A candidate not in the roster -- late, or on a machine that went quiet and came back -- starts as a warm
  standby, exactly as under ``parcae run``.

When no roster can form (fewer live candidates than the P their script fixes), the agent declares the next
relaunch round instead (the caller does: :attr:`StartupComposer.infeasible`).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional, Sequence

from lightning_parcae.launch.rendezvous import ALIVE, DEAD, BeatWatch, Rendezvous
from lightning_parcae.launch.startup import Candidate, RosterDecision, decide_roster
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.liveness import NoticeCheck
from lightning_parcae.runtime.startup import StartupRoster, arrival_key, roster_key

log = logging.getLogger(__name__)

__all__ = ["StartupComposer", "worker_member_id"]


def worker_member_id(agent: str, round_: int) -> str:
    """The member id of ``agent``'s worker in rendezvous round ``round_`` (the agent's id in round 0)."""
    return agent if round_ == 0 else f"{agent}.{round_}"


class StartupComposer:
    """One member agent's part in round ``round_``'s start-up roster (see the module docstring).

    Args:
        records: The job's records (the agent's rendezvous coordinator: signed with the job token).
        agent: This agent's id.
        round_: The rendezvous round.
        agents: The round's member agents in rank order (the rendezvous roster).
        clock: Monotonic clock (seconds); every time compared is this agent's own.
        event: The agent's event sink (``event(name, **fields)``; default: none -- a refused notice is still
            logged as a warning).
    """

    def __init__(self, records: Coordinator, agent: str, round_: int, agents: Sequence[str],
                 clock: Callable[[], float] = time.monotonic,
                 event: Optional[Callable[..., None]] = None) -> None:
        self.records, self.store = records, records.store
        self.event: Callable[..., None] = event if event is not None else (lambda name, /, **fields: None)
        self._noticed = NoticeCheck(records.token, lambda name, /, **f: self.event(name, **f), "start-up candidate")
        self.agent, self.round = agent, int(round_)
        self.agents = list(agents)
        self.clock = clock
        self.key = roster_key(self.round)
        self.started = clock()
        self.arrived_at: dict[str, float] = {}
        self.p_of: dict[str, int] = {}
        self.watch = BeatWatch(clock)
        self.infeasible: Optional[RosterDecision] = None
        """Set when no roster can form: the caller declares the next relaunch round."""

    def _beat_key(self, agent: str) -> str:
        return Rendezvous.key(self.round, "cbeat", agent)

    def noticed(self, member: str) -> bool:
        """Whether ``member``'s worker has a valid notice (:class:`~lightning_parcae.runtime.liveness.NoticeCheck`
        with the job token of :attr:`records`: a forged one does not leave a live machine out of the round)."""
        return self._noticed(self.store, member)

    def roster(self) -> Optional[StartupRoster]:
        """The round's roster once written (by any agent)."""
        rec = self.records.get(self.key)
        return StartupRoster.from_record(rec) if rec is not None else None

    def poll(self) -> Optional[StartupRoster]:
        """Beat, then write the roster if the rule says so now; the roster once there (None: not yet, or
        :attr:`infeasible`)."""
        self.store.add(self._beat_key(self.agent), 1)
        found = self.roster()
        if found is not None or self.infeasible is not None:
            return found
        now = self.clock()
        live: list[Candidate] = []
        left_out: list[str] = []
        for i, agent in enumerate(self.agents):
            member = worker_member_id(agent, self.round)
            state = ALIVE if agent == self.agent else self.watch.state(i, int(self.store.add(self._beat_key(agent), 0)))
            if state == DEAD or self.noticed(member):
                left_out.append(member)
                continue
            rec: Optional[dict[str, Any]] = None
            if member not in self.arrived_at:
                rec = self.records.get(arrival_key(self.key, member))  # one check (+ get once it is there)
            if rec is not None:
                self.p_of[member] = int(rec.get("P", 0) or 0)
                self.arrived_at[member] = now
            live.append(Candidate(member, i, self.arrived_at.get(member)))
        p = max(self.p_of.values(), default=0)  # the script's P (every worker runs the same command)
        decision = decide_roster(live, launched_at=self.started, now=now, pipeline_stages=str(p) if p else "auto",
                                 launch_p=p)
        if decision is None:
            return None
        if not decision.feasible:
            self.infeasible = decision
            return None
        why = decision.why + (f"; left out {left_out}" if left_out else "")
        proposal = StartupRoster(self.round, decision.members, decision.standbys, tuple(left_out), p, why)
        return StartupRoster.from_record(self.records.claim(self.key, proposal.record()))
