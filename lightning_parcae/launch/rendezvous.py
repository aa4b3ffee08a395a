"""Rendezvous of ``parcae agent``: machines that share only the store agree on who starts a round, and in which rank.

Problem: one agent runs on each machine and nothing hands them ranks (a Kubernetes Deployment, an autoscaling group
or SkyPilot starts N copies of one command), yet the job's first generation needs ranks ``0..W-1``, and after a
whole-job fallback (some stage lost every replica) the surviving machines -- plus any that arrive meanwhile -- must
agree on *one* relaunch: which checkpoint it resumes from, which generation numbers it uses, who is in it. There is
no server of our own; the store (etcd or a TCPStore) offers ``add`` and ``compare_set``, and that is enough:

``parcae/agents/job``
    MIN and MAX of the job (``compare_set`` by the first agent started with ``--nodes``), for agents started
    with ``--join`` that take part in a relaunch.
``parcae/agents/round/<k>/open``
    Round ``k >= 1`` exists: a relaunch, declared by the first agent whose worker exited 75 (``compare_set``: the
    first declaration wins, every agent reads the winner). It names the checkpoint to resume from, ``MIN:MAX`` and
    why. Round 0 (the job's start) has no such record.
``parcae/agents/round/<k>/count``, ``.../arrival/<i>``
    Arrivals: ``add`` gives each agent its slot ``i``; the agent then writes its id under its slot.
``parcae/agents/round/<k>/beat/<i>``
    A counter the waiting agent in slot ``i`` keeps raising (``add``): an arrival whose counter stood still for
    :data:`DEAD_AFTER_S` while others watched has died and is left out of the roster.
``parcae/agents/round/<k>/roster``
    The round's one roster (``compare_set``): of the first ``min(alive, MAX)`` arrivals in slot order the largest
    power-of-two count (as ``parcae run`` launches; never fewer than MIN) are the members, ranks
    ``0..W-1``, plus the round's checkpoint. Written once at least MIN live agents are there and the settle time
    has passed since this agent saw MIN (or MAX are there) -- by *any* waiting agent, so a dead first arrival
    cannot block the round. Agents not in it, and agents arriving after it, are the round's standbys (``--join``).

Records are signed with the job token when there is one (:mod:`lightning_parcae.runtime.store`), else plain JSON.
A round that cannot form waits, saying every few seconds how many of MIN are there, up to a bound
(:class:`RendezvousTimeout`). Round ``k``'s workers use generation base ``1000 * k``
(:func:`lightning_parcae.contract.worker_contract`'s ``generation``), so its store keys never meet an older
round's.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Union

from lightning_parcae.errors import CoordinationError
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.launch.processes import initial_members

__all__ = ["Rendezvous", "Roster", "Relaunch", "Seat", "RendezvousTimeout", "RendezvousCancelled", "parse_nodes", "DEAD_AFTER_S",
           "BeatWatch"]

DEAD_AFTER_S = 3.0
"""An arrival whose beat counter has not moved for this long (seen by the agent composing the roster) is dead."""
_PREFIX = "parcae/agents/round"
_JOB_KEY = "parcae/agents/job"
_ARRIVAL_WAIT_S = 2.0
"""How long the composer waits for the id of a slot that was counted but not yet written."""


class KeyValueStore(Protocol):
    """The part of ``torch.distributed.Store`` the rendezvous uses."""

    def add(self, key: str, value: int) -> int: ...

    def check(self, keys: list[str]) -> bool: ...

    def get(self, key: str) -> Any: ...

    def set(self, key: str, value: Union[str, bytes]) -> None: ...

    def compare_set(self, key: str, expected_value: Union[str, bytes], desired_value: Union[str, bytes]) -> Any: ...


class RendezvousTimeout(CoordinationError):
    """Fewer than MIN live agents arrived within the bound."""


class RendezvousCancelled(CoordinationError):
    """The waiting agent was told to stop (a preemption notice) before the roster was written."""


def parse_nodes(spec: str) -> tuple[int, int]:
    """``--nodes``: ``N`` (N:N) or ``MIN:MAX`` with ``1 <= MIN <= MAX``.

    Raises:
        ValueError: Anything else (the message says what is expected).
    """
    parts = str(spec).split(":")
    try:
        lo, hi = (int(parts[0]), int(parts[0])) if len(parts) == 1 else (int(parts[0]), int(parts[1]))
    except ValueError:
        raise ValueError(f"--nodes {spec!r}: expected N or MIN:MAX (e.g. 4 or 2:8)") from None
    if len(parts) > 2 or lo < 1 or hi < lo:
        raise ValueError(f"--nodes {spec!r}: expected N or MIN:MAX with 1 <= MIN <= MAX (e.g. 4 or 2:8)")
    return lo, hi


@dataclass(frozen=True)
class Relaunch:
    """Round ``round``'s declaration (``round >= 1``): the whole-job relaunch every live agent takes part in.

    Attributes:
        round: The round number (the workers' generation base is ``1000 * round``).
        checkpoint: Path or URL the round's initial members resume from (None: a fresh start).
        step: The checkpoint's step when known.
        min_nodes: MIN of the round (the declaring agent's ``--nodes``).
        max_nodes: MAX of the round.
        reason: Why it was declared.
        declared_by: The agent that declared it.
    """

    round: int
    checkpoint: Optional[str]
    step: Optional[int]
    min_nodes: int
    max_nodes: int
    reason: str = ""
    declared_by: str = ""

    def record(self) -> dict[str, Any]:
        """The JSON record."""
        return {"round": self.round, "checkpoint": self.checkpoint, "step": self.step, "min": self.min_nodes,
                "max": self.max_nodes, "reason": self.reason, "declared_by": self.declared_by}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Relaunch:
        """Parse :meth:`record`'s output."""
        step = rec.get("step")
        return cls(int(rec["round"]), rec.get("checkpoint"), None if step is None else int(step), int(rec["min"]),
                   int(rec["max"]), str(rec.get("reason", "")), str(rec.get("declared_by", "")))


@dataclass(frozen=True)
class Roster:
    """Round ``round``'s agreed initial members, in rank order.

    Attributes:
        round: The round number.
        members: Agent ids; rank ``r`` is ``members[r]``.
        checkpoint: What the members resume from (the round's :class:`Relaunch` checkpoint; None in round 0).
        written_by: The agent whose proposal won.
    """

    round: int
    members: tuple[str, ...]
    checkpoint: Optional[str] = None
    written_by: str = ""

    def rank_of(self, agent: str) -> Optional[int]:
        """``agent``'s rank, or None for a standby."""
        return self.members.index(agent) if agent in self.members else None

    def record(self) -> dict[str, Any]:
        """The JSON record."""
        return {"round": self.round, "members": list(self.members), "checkpoint": self.checkpoint,
                "written_by": self.written_by}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> Roster:
        """Parse :meth:`record`'s output."""
        return cls(int(rec["round"]), tuple(str(m) for m in rec["members"]), rec.get("checkpoint"),
                   str(rec.get("written_by", "")))


@dataclass(frozen=True)
class Seat:
    """Where one agent starts its worker in a round: a rank of the roster, or a standby (``rank`` None)."""

    round: int
    roster: Roster
    rank: Optional[int]

    @property
    def standby(self) -> bool:
        """Whether the worker starts as a joining standby."""
        return self.rank is None

    @property
    def world(self) -> int:
        """The round's initial world size."""
        return len(self.roster.members)


class Rendezvous:
    """One agent's view of the rendezvous (see the module docstring). The caller's thread owns the store client.

    Args:
        store: A client of the job's store.
        token: The job token (records signed and verified) or None (plain JSON).
        agent: This agent's id (unique in the job).
        min_nodes: MIN of round 0 (relaunch rounds take theirs from their :class:`Relaunch` record).
        max_nodes: MAX of round 0.
        settle_s: After MIN live agents are there, wait this long for more before writing the roster.
        timeout_s: Give up waiting for MIN after this long (:class:`RendezvousTimeout`).
        poll_s: Store polling period.
        report_every_s: How often a waiting agent says how many of MIN are there.
        say: Where progress lines go.
        clock: Monotonic clock (seconds).
    """

    def __init__(self, store: KeyValueStore, token: Optional[str], agent: str, *, min_nodes: int, max_nodes: int,
                 settle_s: float = 2.0, timeout_s: float = 600.0, poll_s: float = 0.25, report_every_s: float = 5.0,
                 say: Optional[Callable[[str], None]] = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.token = token or None
        self.records = Coordinator(store, self.token)  # type: ignore[arg-type]
        """Signed (or, without a token, plain JSON) records of the rounds, first writer wins."""
        self.agent = agent
        self.min_nodes, self.max_nodes = min_nodes, max_nodes
        self.settle_s, self.timeout_s, self.poll_s, self.report_every_s = settle_s, timeout_s, poll_s, report_every_s
        self.say = say or (lambda line: print(line, file=sys.stderr, flush=True))
        self.clock = clock

    # ------------------------------------------------------------------------------------------------ records
    @staticmethod
    def key(round_: int, *parts: object) -> str:
        """Store key of round ``round_`` (``parcae/agents/round/<k>/<parts...>``)."""
        return "/".join([_PREFIX, str(round_), *map(str, parts)])

    # ------------------------------------------------------------------------------------------------ rounds
    def relaunch(self, round_: int) -> Optional[Relaunch]:
        """Round ``round_``'s declaration (None if it was not declared; round 0 never is)."""
        rec = self.records.get(self.key(round_, "open")) if round_ >= 1 else None
        return Relaunch.from_record(rec) if rec is not None else None

    def declare(self, proposal: Relaunch) -> Relaunch:
        """Propose ``proposal`` as its round's relaunch; the first declaration wins and is returned to everyone."""
        return Relaunch.from_record(self.records.claim(self.key(proposal.round, "open"), proposal.record()))

    def newest_round(self) -> int:
        """The newest declared round (0 when no relaunch was ever declared)."""
        k = 0
        while self.store.check([self.key(k + 1, "open")]):
            k += 1
        return k

    def roster(self, round_: int) -> Optional[Roster]:
        """Round ``round_``'s roster (None while it is forming)."""
        rec = self.records.get(self.key(round_, "roster"))
        return Roster.from_record(rec) if rec is not None else None

    def publish_bounds(self) -> tuple[int, int]:
        """Record this agent's MIN:MAX as the job's unless another agent's is there; the job's MIN:MAX."""
        rec = self.records.claim(_JOB_KEY, {"min": self.min_nodes, "max": self.max_nodes})
        return int(rec["min"]), int(rec["max"])

    def bounds(self, round_: int) -> tuple[int, int, Optional[str]]:
        """(MIN, MAX, checkpoint) of round ``round_``: a relaunch's from its record, round 0's from the job's
        record (this agent's own MIN:MAX before one is there)."""
        rel = self.relaunch(round_)
        if rel is not None:
            return rel.min_nodes, rel.max_nodes, rel.checkpoint
        job = self.records.get(_JOB_KEY)
        if job is None:
            return self.min_nodes, self.max_nodes, None
        return int(job["min"]), int(job["max"]), None

    # ------------------------------------------------------------------------------------------------ joining
    def join(self, round_: int, stop: Optional[Callable[[], bool]] = None) -> Seat:
        """Arrive in round ``round_`` and wait for its roster; this agent's seat in it.

        Args:
            round_: The round.
            stop: Polled while waiting; True leaves the rendezvous (this agent's beat stops, so the others leave
                it out of the roster once :data:`DEAD_AFTER_S` has passed).

        Raises:
            RendezvousTimeout: Fewer than MIN live agents arrived within ``timeout_s``.
            RendezvousCancelled: ``stop()`` said so before the roster was written.
        """
        lo, hi, checkpoint = self.bounds(round_)
        existing = self.roster(round_)
        if existing is not None:  # too late for this round: a standby of it
            return Seat(round_, existing, existing.rank_of(self.agent))
        slot = int(self.store.add(self.key(round_, "count"), 1)) - 1
        self.records.put(self.key(round_, "arrival", slot), {"agent": self.agent, "slot": slot})
        watch = BeatWatch(self.clock)
        start = last_report = self.clock()
        enough_since: Optional[float] = None
        while True:
            if stop is not None and stop():
                raise RendezvousCancelled(f"left rendezvous round {round_} before its roster was written")
            self.store.add(self.key(round_, "beat", slot), 1)
            found = self.roster(round_)
            if found is not None:
                return Seat(round_, found, found.rank_of(self.agent))
            now = self.clock()
            count = int(self.store.add(self.key(round_, "count"), 0))
            states = {s: ALIVE if s == slot else watch.state(s, self._beat(round_, s)) for s in range(count)}
            there = [s for s in range(count) if states[s] != DEAD]
            if len(there) >= lo:
                enough_since = now if enough_since is None else enough_since
                settled = len(there) >= hi or now - enough_since >= self.settle_s
                if settled and all(states[s] == ALIVE for s in there[:hi]):  # an unknown one: seen soon
                    members = self._members(round_, there[:hi], hi)
                    # as `parcae run` starts a launch: D a power of two (any usual global batch splits), the others
                    # warm standbys the optimizer admits when a shape that uses them is better -- never below MIN
                    members = members[:max(initial_members(len(members), "auto")[0], min(lo, len(members)))]
                    if len(members) >= lo:
                        proposal = Roster(round_, tuple(members), checkpoint, written_by=self.agent)
                        won = Roster.from_record(self.records.claim(self.key(round_, "roster"), proposal.record()))
                        return Seat(round_, won, won.rank_of(self.agent))
            else:
                enough_since = None
                if now - start >= self.timeout_s:
                    raise RendezvousTimeout(
                        f"rendezvous round {round_}: only {len(there)} of at least {lo} agents arrived within "
                        f"{self.timeout_s:g} s (--rendezvous-timeout); start more agents with the same --store, or "
                        f"lower MIN in --nodes {lo}:{hi}")
                if now - last_report >= self.report_every_s:
                    last_report = now
                    self.say(f"parcae agent {self.agent}: rendezvous round {round_}: {len(there)} of {lo} agents "
                             f"there, waiting for {lo - len(there)} more ({now - start:.0f} s of "
                             f"{self.timeout_s:g} s)")
            time.sleep(self.poll_s)

    def _beat(self, round_: int, slot: int) -> int:
        return int(self.store.add(self.key(round_, "beat", slot), 0))

    def _members(self, round_: int, slots: list[int], hi: int) -> list[str]:
        """Agent ids of ``slots`` in slot order (duplicates and slots whose id never came left out), at most ``hi``."""
        members: list[str] = []
        for s in slots:
            key = self.key(round_, "arrival", s)
            deadline = self.clock() + _ARRIVAL_WAIT_S
            while not self.store.check([key]) and self.clock() < deadline:
                time.sleep(0.05)
            rec = self.records.get(key)
            if rec is not None and rec.get("agent") not in members:
                members.append(str(rec["agent"]))
        return members[:hi]


ALIVE, UNKNOWN, DEAD = "alive", "unknown", "dead"


class BeatWatch:
    """Which arrivals are alive, judged by whether their beat counters move. No clocks are compared across
    machines: only this agent's own clock measures how long a counter stood still. A counter not yet seen moving
    is ``unknown`` (a live waiter moves it within a poll), one that stood still for :data:`DEAD_AFTER_S` ``dead``."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.seen: dict[int, tuple[int, float, bool]] = {}

    def state(self, slot: int, beat: int) -> str:
        """The state of ``slot`` given its counter now."""
        now = self.clock()
        last = self.seen.get(slot)
        if last is None:
            self.seen[slot] = (beat, now, False)
            return UNKNOWN
        if beat != last[0]:
            self.seen[slot] = (beat, now, True)
            return ALIVE
        if now - last[1] >= DEAD_AFTER_S:
            return DEAD
        return ALIVE if last[2] else UNKNOWN
