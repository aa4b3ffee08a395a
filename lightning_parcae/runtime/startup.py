"""The start-up roster: who forms a launch's first generation, decided once its candidates have arrived.

Problem: under ``parcae run`` every initial member of a launch used to be started with a fixed ``RANK`` /
``WORLD_SIZE``, and generation 0 was built with exactly those ranks. A worker takes seconds to a minute to import
torch and Lightning (8 CPU-seconds each; 16 of them on 2 cores start in ~70 s); an instance noticed, lost or silent
in that time left the others waiting for a rank that would never come, so the launcher relaunched everyone and a
noticed worker whose SIGTERM handler was not installed yet was only SIGKILLed at the end of its grace.

Now the instances of a launch start as *candidates* (:data:`~lightning_parcae.contract.ROSTER_ENV` set; ``RANK`` /
``WORLD_SIZE`` are 0 / 1 placeholders): once a candidate has imported, built its Trainer and connected to the store
(its SIGTERM handler is installed then), it reports its arrival (an ``arrived`` event in the run's event log) and
waits for the launch's roster (:func:`await_roster`). The launcher -- which sees every process, every notice and
every arrival -- writes the roster from the arrivals (:mod:`lightning_parcae.launch.startup` decides when and whom).
A member takes its rank from it; a candidate that is not in it (it arrived late, or after the roster was written)
starts as a warm standby and is admitted at a later planning interval, like any joiner.

Key (one record, written once by the launcher, signed with the job token like every record):

``parcae/startup/<launch>/roster``
    ``members`` in rank order, ``standbys`` (the live candidates left out), ``left_out`` (candidates noticed or lost
    before it), the launch's ``P`` and why it was written when it was.
``parcae/startup/<launch>/arrived/<member>``
    Each candidate's arrival (its member id and the P its script configures, 0 for the strategy's choice), for
    writers that do not see its event log: ``parcae agent``'s machines (:mod:`lightning_parcae.launch.agent_startup`).

This module owns the key and the record's format (the launcher encodes it with :meth:`StartupRoster.record`, the
worker decodes it with :meth:`StartupRoster.from_record`) and the worker's wait. It imports no torch: the launcher
uses it too.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from lightning_parcae.errors import CoordinationError

__all__ = ["StartupRoster", "RosterTimeout", "roster_key", "arrival_key", "waiting_key", "await_roster",
           "ROSTER_WAIT_S"]

ROSTER_WAIT_S = 900.0
"""How long a candidate waits for its launch's roster before it gives up (the launcher's ``--startup-timeout``
normally stops the run much earlier)."""
_PREFIX = "parcae/startup"


def roster_key(launch: int) -> str:
    """Store key of launch ``launch``'s start-up roster."""
    return f"{_PREFIX}/{int(launch)}/roster"


def waiting_key(roster: str) -> str:
    """Store key under which the launcher says that the launch of the roster under key ``roster`` waits for
    instances (renewed while it waits; each renewal restarts its candidates' :data:`ROSTER_WAIT_S`)."""
    return f"{roster.rsplit('/', 1)[0]}/waiting"


def arrival_key(roster: str, member: str) -> str:
    """Store key of ``member``'s arrival among the candidates of the roster under key ``roster``."""
    return f"{roster.rsplit('/', 1)[0]}/arrived/{member}"


class RecordReader(Protocol):
    """What the wait needs of :class:`~lightning_parcae.runtime.coordinator.Coordinator`: a verified record read."""

    def get(self, key: str, timeout_s: Optional[float] = 0.0) -> Optional[dict[str, Any]]:
        """The record under ``key`` (None while it is absent)."""


class RosterTimeout(CoordinationError):
    """A start-up candidate waited :data:`ROSTER_WAIT_S` for its launch's roster and none was written."""


@dataclass(frozen=True)
class StartupRoster:
    """A launch's first generation as the launcher fixed it.

    Attributes:
        launch: The launch number (``PARCAE_GENERATION``).
        members: Member ids in rank order; rank ``r`` is ``members[r]``.
        standbys: Live candidates not in it: each starts as a warm standby once it arrives.
        left_out: Candidates noticed or lost before the roster (they are gone).
        pipeline_stages: P of the launch (0: the strategy chooses).
        why: Why the roster was written when it was (every candidate arrived, the rest could only be standbys, or
            the settle time passed).
    """

    launch: int
    members: tuple[str, ...]
    standbys: tuple[str, ...] = ()
    left_out: tuple[str, ...] = ()
    pipeline_stages: int = 0
    why: str = ""

    def rank_of(self, member: str) -> Optional[int]:
        """``member``'s rank in the first generation, or None: it starts as a standby."""
        return self.members.index(member) if member in self.members else None

    @property
    def world(self) -> int:
        """The first generation's size."""
        return len(self.members)

    def record(self) -> dict[str, Any]:
        """The JSON record."""
        return {"launch": self.launch, "members": list(self.members), "standbys": list(self.standbys),
                "left_out": list(self.left_out), "P": self.pipeline_stages, "why": self.why}

    @classmethod
    def from_record(cls, rec: dict[str, Any]) -> "StartupRoster":
        """Parse :meth:`record`'s output."""
        return cls(int(rec["launch"]), tuple(str(m) for m in rec["members"]),
                   tuple(str(m) for m in rec.get("standbys", ())), tuple(str(m) for m in rec.get("left_out", ())),
                   int(rec.get("P", 0) or 0), str(rec.get("why", "")))


def await_roster(records: RecordReader, key: str, *, noticed: Callable[[], bool],
                 timeout_s: float = ROSTER_WAIT_S, poll_s: float = 0.1,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> Optional[StartupRoster]:
    """A candidate's wait for its launch's roster (after it reported its arrival).

    Args:
        records: Verified reads of the job's records (the worker's coordinator).
        key: The roster's key (:func:`roster_key`; the worker has it from ``PARCAE_ROSTER``).
        noticed: Polled while waiting; True -- a preemption notice -- ends the wait: the candidate holds no state
            and leaves at once.
        timeout_s: Give up after this long (:class:`RosterTimeout`) -- unless the launcher renewed the launch's
            :func:`waiting_key` record since the last time this wait checked it (the launch waits for instances).
        poll_s: Store polling period.
        clock: Monotonic clock (seconds).
        sleep: Sleeps ``poll_s``.

    Returns:
        The roster, or None when a notice came first.

    Raises:
        RosterTimeout: No roster within ``timeout_s``.
    """
    start = clock()
    renewed: Optional[float] = None
    while True:
        if noticed():
            return None
        rec = records.get(key)
        if rec is not None:
            return StartupRoster.from_record(rec)
        if clock() - start >= timeout_s:
            waiting = records.get(waiting_key(key))  # the launch was started early and waits for instances
            t = float(waiting.get("t", 0.0)) if waiting else None
            if t is not None and t != renewed:
                renewed, start = t, clock()
                continue
            raise RosterTimeout(
                f"no start-up roster under {key!r} within {timeout_s:g} s: the launcher that started this candidate "
                "writes it once enough candidates arrived; is it still running, and does this worker use its store "
                "(PARCAE_STORE)?")
        sleep(poll_s)
