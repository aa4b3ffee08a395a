"""The reconfiguration lifecycle: an explicit state machine that every process walks through and logs.

Problem: live reconfiguration interleaves training, planning, state transfer, failure recovery and, in the worst
case, a restart from a checkpoint. Without a written-down state machine it is impossible to say what a process is
allowed to do next (may a process that is recovering accept a plan? may a standby train?), and impossible to see
afterwards where the time went.

States (one process's view)::

    STANDBY ──admitted──▶ MIGRATING
    TRAINING ──interval due / notice seen──▶ PLANNING ──new generation agreed──▶ MIGRATING ──▶ TRAINING
                                              └──no change──▶ TRAINING
    TRAINING / PLANNING / MIGRATING ──peer lost (heartbeat or collective error)──▶ RECOVERING
    RECOVERING ──survivors agree on a generation──▶ MIGRATING
    RECOVERING / MIGRATING ──some stage has no live replica──▶ FALLBACK  (exit; relaunch from the checkpoint)
    any ──not a member of the agreed generation──▶ FENCED (exit)
    TRAINING ──fit ends──▶ STOPPED

Every transition is logged (``lightning_parcae.lifecycle`` logger) with the time spent in the state it leaves,
and handed to an optional ``on_transition`` callback (the strategy turns it into a JSON-lines event).
"""

from __future__ import annotations

import enum
import logging
import sys
from os import _exit as exit_process  # os's documented immediate exit (no cleanup handlers)
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from lightning_parcae.contract import FALLBACK_EXIT, RELEASED_EXIT, FENCED_EXIT

__all__ = ["Phase", "Lifecycle", "IllegalTransitionError", "exit_now", "exit_without_destructors_at_shutdown",
           "track_script_failure", "script_failed", "FALLBACK_EXIT", "RELEASED_EXIT", "FENCED_EXIT"]

log = logging.getLogger("lightning_parcae.lifecycle")

# How a process that leaves the lifecycle ends: its exit status (lightning_parcae.contract) tells the launcher /
# agent what to do next.


class Phase(str, enum.Enum):
    """Where a process is in the reconfiguration lifecycle."""

    STARTING = "starting"
    STANDBY = "standby"
    TRAINING = "training"
    PLANNING = "planning"
    MIGRATING = "migrating"
    RECOVERING = "recovering"
    FALLBACK = "fallback"
    FENCED = "fenced"
    STOPPED = "stopped"


_ALLOWED: dict[Phase, frozenset[Phase]] = {
    Phase.STARTING: frozenset({Phase.TRAINING, Phase.STANDBY, Phase.MIGRATING, Phase.STOPPED}),
    Phase.STANDBY: frozenset({Phase.MIGRATING, Phase.FENCED, Phase.STOPPED}),
    Phase.TRAINING: frozenset({Phase.PLANNING, Phase.RECOVERING, Phase.STOPPED, Phase.FENCED}),
    Phase.PLANNING: frozenset({Phase.TRAINING, Phase.MIGRATING, Phase.RECOVERING, Phase.FENCED}),
    Phase.MIGRATING: frozenset({Phase.TRAINING, Phase.RECOVERING, Phase.FALLBACK, Phase.FENCED, Phase.STOPPED}),
    Phase.RECOVERING: frozenset({Phase.MIGRATING, Phase.FALLBACK, Phase.FENCED, Phase.RECOVERING}),
    Phase.FALLBACK: frozenset({Phase.STOPPED}),
    Phase.FENCED: frozenset({Phase.STOPPED}),
    Phase.STOPPED: frozenset(),
}


class IllegalTransitionError(RuntimeError):
    """A transition the state machine does not allow (a bug in the runtime, never a user error)."""


@dataclass
class Lifecycle:
    """One process's current phase, with timing.

    Args:
        member: Member id (for log lines).
        on_transition: Called as ``on_transition(old, new, seconds_in_old, info)`` after each transition.
    """

    member: str = ""
    on_transition: Optional[Callable[[Phase, Phase, float, dict[str, Any]], None]] = None
    phase: Phase = Phase.STARTING
    since: float = field(default_factory=time.monotonic)
    history: list[tuple[str, str, float]] = field(default_factory=list)

    def to(self, new: Phase, **info: Any) -> float:
        """Move to ``new``; returns the seconds spent in the phase left.

        Raises:
            IllegalTransitionError: if ``new`` is not reachable from the current phase.
        """
        old = self.phase
        if new not in _ALLOWED[old] and new != old:
            raise IllegalTransitionError(f"{self.member}: {old.value} -> {new.value} is not a lifecycle transition")
        now = time.monotonic()
        spent = now - self.since
        self.phase, self.since = new, now
        self.history.append((old.value, new.value, spent))
        extra = " ".join(f"{k}={v}" for k, v in info.items())
        level = logging.WARNING if new in (Phase.RECOVERING, Phase.FALLBACK, Phase.FENCED) else logging.INFO
        log.log(level, "%s: %s -> %s after %.3f s %s", self.member, old.value, new.value, spent, extra)
        if self.on_transition is not None:
            self.on_transition(old, new, spent, info)
        return spent

    def elapsed(self) -> float:
        """Seconds in the current phase."""
        return time.monotonic() - self.since

    @staticmethod
    def allowed(old: Phase, new: Phase) -> bool:
        """Whether ``old -> new`` is a transition of the state machine."""
        return new in _ALLOWED[old]


_HARD_EXIT: list[bool] = []
_SCRIPT_FAILED: list[bool] = []
_FAILURE_HOOKED: list[bool] = []


def track_script_failure() -> None:
    """From now on, remember whether an exception ended the script (``sys.excepthook`` is wrapped once per
    process): what an exit handler that ends the process itself reports as its status (:func:`script_failed`)."""
    if _FAILURE_HOOKED:
        return
    _FAILURE_HOOKED.append(True)
    previous = sys.excepthook

    def hook(kind: Any, value: Any, tb: Any) -> None:
        _SCRIPT_FAILED.append(True)
        previous(kind, value, tb)

    sys.excepthook = hook


def script_failed() -> bool:
    """Whether an exception ended the script (tracked since :func:`track_script_failure`)."""
    return bool(_SCRIPT_FAILED)


def exit_without_destructors_at_shutdown() -> None:
    """After a failure, end the process with ``os._exit`` once the script has finished.

    An abandoned generation keeps gloo threads blocked on the dead peer; C++ destructors that run at normal
    interpreter exit then abort the process ("terminate called without an active exception", status -6) even
    though training finished. The exit status is 1 if an exception escaped the script, else 0; non-daemon threads
    (a background checkpoint write) have finished by the time ``atexit`` handlers run.
    """
    if _HARD_EXIT:
        return
    _HARD_EXIT.append(True)
    import atexit  # noqa: PLC0415

    track_script_failure()
    atexit.register(lambda: exit_now(1 if script_failed() else 0))


def exit_now(code: int) -> None:
    """Leave the job now: flush, then ``os._exit`` (Lightning's teardown would wait on dead process groups)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    exit_process(code)
