"""When and whom: the launcher's decision of a launch's start-up roster (``parcae run --elastic``).

Problem: a launch's first generation used to be fixed before any worker ran (``RANK`` / ``WORLD_SIZE`` at spawn),
so one instance noticed, lost or silent while the others imported torch (up to a minute on a loaded machine) made
the launcher relaunch everyone. Now every instance of a launch starts as a *candidate*, and the first generation is
whoever has arrived (imported, built its Trainer, connected to the store, :mod:`lightning_parcae.runtime.startup`)
when the launcher writes the roster. The launcher decides from what it sees: which candidates are alive (it polls
their processes), which are gone (noticed: the trace removed the instance, or lost), and when each one's ``arrived``
event came.

The rule (:func:`decide_roster`), over the live candidates of the launch:

* nobody arrived yet: wait (the run's ``--startup-timeout`` bounds it);
* write as soon as every live candidate arrived -- or as soon as the arrivals already give the member count that
  the others could not raise: the first generation's size is the largest ``D * P`` with D a power of two
  (:func:`~.processes.initial_members`), so of 15 live candidates 8 are members, and the roster is written once the
  8 *oldest* live candidates arrived, while the other 7 are still starting (they become standbys). When younger
  ones overtook an older one, the roster waits for it at most :data:`SEAT_GRACE_S` after the last arrival, then
  takes the arrivals as they are: a start-up a few hundred milliseconds out of order keeps the seating (and with
  it which stage each instance holds) of the instance order, so a run is reproducible, and a straggler costs at
  most that grace;
* otherwise write once the arrivals have *settled*: no new arrival for ``settle_s`` (:func:`settle_bound`: a quarter
  of the time the first arrival took, at least :data:`SETTLE_MIN_S`), or :data:`SETTLE_CAP` times that after the
  first arrival, whichever comes first. Candidates still missing then are *silent*: each starts as a standby when
  (if ever) it arrives;
* with a fixed ``--pipeline-stages`` the roster needs the launch's P members (its workers were started with that
  P); when fewer candidates are left alive, no roster can form and the launcher relaunches (:class:`RosterDecision`
  with no members). Likewise once a fallback said how many instances the model needs (``min_instances``, e.g. a
  model that fits on no fewer than 6 stages): no roster of fewer forms, and with ``auto`` a power of two below that
  count gives way to all the arrivals (:func:`~.processes.initial_members`).

Members are the oldest arrived instances, in instance order (rank 0 the oldest), as the fixed ranks were.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from lightning_parcae.launch.processes import initial_members

__all__ = ["Candidate", "RosterDecision", "decide_roster", "settle_bound", "SETTLE_MIN_S", "SETTLE_FRACTION",
           "SETTLE_CAP", "SEAT_GRACE_S"]

SETTLE_MIN_S = 5.0
"""The shortest quiet time (wall seconds, no new arrival) after which a roster is written without the candidates
still missing."""
SETTLE_FRACTION = 0.25
"""The quiet time is at least this fraction of how long the first candidate took to arrive: on a machine where
start-up takes 70 s, a candidate 10 s behind the others is slow, not silent."""
SETTLE_CAP = 3.0
"""At most this many quiet times after the first arrival, the roster is written whatever still trickles in."""
SEAT_GRACE_S = 3.0
"""When the arrivals already give the full member count but an older live candidate is not among them, the roster
waits this long after the last arrival for it (so members are the oldest instances, as with fixed ranks)."""


@dataclass(frozen=True)
class Candidate:
    """One live candidate of a launch, as the launcher sees it.

    Attributes:
        member: Its member id.
        instance: Its instance (members are taken in instance order).
        arrived_at: Wall time of its ``arrived`` event; None while it is still starting.
    """

    member: str
    instance: int
    arrived_at: Optional[float] = None


@dataclass(frozen=True)
class RosterDecision:
    """The roster to write now.

    Attributes:
        members: Member ids in rank order; empty: no roster can form (:attr:`why` says why).
        standbys: The other live candidates, in instance order (arrived or still starting).
        why: Why now (or why never).
    """

    members: tuple[str, ...]
    standbys: tuple[str, ...]
    why: str

    @property
    def feasible(self) -> bool:
        """Whether a first generation can form (False: the launch must be relaunched)."""
        return bool(self.members)


def settle_bound(launched_at: float, first_arrival: float) -> float:
    """The quiet time after which the arrivals count as settled: :data:`SETTLE_FRACTION` of the first arrival's
    start-up time, at least :data:`SETTLE_MIN_S`."""
    return max(SETTLE_MIN_S, SETTLE_FRACTION * max(0.0, first_arrival - launched_at))


def decide_roster(candidates: Sequence[Candidate], *, launched_at: float, now: float, pipeline_stages: str,
                  launch_p: int, fewest: int = 0) -> Optional[RosterDecision]:
    """Whether to write the launch's roster now, and with whom (see the module docstring for the rule).

    Args:
        candidates: The launch's live candidates (noticed and dead ones are not candidates any more).
        launched_at: Wall time of the launch.
        now: Wall time now.
        pipeline_stages: ``--pipeline-stages`` (a number or ``auto``).
        launch_p: The P the launch's workers were started with (0 for ``auto``).
        fewest: The fewest instances the model fits on, once a fallback said (``min_instances``; 0: not known): no
            first generation of fewer forms.

    Returns:
        None: wait. Otherwise the decision; one without members means no roster can ever form.
    """
    need = max(int(launch_p), 1, int(fewest))
    if len(candidates) < need:
        what = (f"the {need} pipeline stages the launch was started with" if need == int(launch_p) else
                f"the {need} instances the model needs")
        return RosterDecision((), tuple(c.member for c in candidates),
                              f"only {len(candidates)} start-up candidate(s) left alive, fewer than {what}"
                              if candidates else
                              "every start-up candidate was noticed or lost before the first generation formed")
    arrived = sorted((c for c in candidates if c.arrived_at is not None), key=lambda c: c.instance)
    if not arrived:
        return None
    total = initial_members(len(candidates), pipeline_stages, fewest)[0]
    now_members = initial_members(len(arrived), pipeline_stages, fewest)[0] if len(arrived) >= need else 0
    times = [float(c.arrived_at) for c in arrived if c.arrived_at is not None]
    settle = settle_bound(launched_at, min(times))
    if len(arrived) == len(candidates):
        why = f"every live candidate arrived ({len(arrived)})"
    elif now_members >= total and (_oldest_arrived(candidates, total) or now - max(times) >= SEAT_GRACE_S):
        why = (f"{len(arrived)} of {len(candidates)} live candidates arrived, enough for the {total} members that "
               f"{len(candidates)} allow; the others start as standbys")
    elif now_members and now - max(times) >= settle:
        why = (f"{len(arrived)} of {len(candidates)} live candidates arrived and no other for {settle:.1f} s; the "
               "silent ones start as standbys when they arrive")
    elif now_members and now - min(times) >= SETTLE_CAP * settle:
        why = (f"{len(arrived)} of {len(candidates)} live candidates arrived within {SETTLE_CAP * settle:.1f} s of "
               "the first; the others start as standbys when they arrive")
    else:
        return None
    members = tuple(c.member for c in arrived[:now_members])
    standbys = tuple(c.member for c in sorted(candidates, key=lambda c: c.instance) if c.member not in members)
    return RosterDecision(members, standbys, why)


def _oldest_arrived(candidates: Sequence[Candidate], count: int) -> bool:
    """Whether the ``count`` oldest live candidates (instance order) have all arrived."""
    return all(c.arrived_at is not None for c in sorted(candidates, key=lambda c: c.instance)[:count])
