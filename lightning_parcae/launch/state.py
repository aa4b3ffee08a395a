"""The state of one ``parcae run``: its phase, the facts its parts share, and what the workers reported.

Problem: the launcher's parts (:mod:`.fleet`, :mod:`.relaunch`, :mod:`.console`) once shared the ``Launcher`` as a
blackboard: each read and wrote ~100 of its private attributes, and the run's phase was four flags (a fallback
record, "a launch is due", "finished", "the generation reported its first step") combined differently in a dozen
conditions. Here the phase is one :class:`Phase`, changed only by :class:`RunState`'s methods, which refuse an
illegal transition (:class:`PhaseError`), and every shared field says who may change it -- the model is
torch.distributed.elastic's ``WorkerState`` driven by one ``_invoke_run`` loop. What the workers report through the
event log is kept apart, in :class:`WorkerReports`, which only the :class:`~.console.Console` writes.

The phases of a run (``--elastic`` and ``--restart-fallback`` alike; PAUSED only in the restart fallback)::

    PENDING --launched--> STARTING --first_step--> RUNNING --finish--> FINISHED
       ^                   |  ^  |                  |  |
       |                   |  +--+-- launched ------+  |  (restart fallback: a relaunch at the new size)
       |                   +-------- pause ------------+--> PAUSED --launched--> STARTING
       +-- end_fallback -- FALLBACK <-- begin_fallback --+  (--elastic: a stage lost every replica)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol

from lightning_parcae.errors import ParcaeError

if TYPE_CHECKING:
    from lightning_parcae.launch.processes import Worker

__all__ = ["Phase", "PhaseError", "RunState", "WorkerReports", "EventSink"]


class Phase(enum.Enum):
    """What the run is doing now."""

    PENDING = "pending"
    """A launch is due and nothing runs: the start of the run, or after a fallback stopped every worker."""
    STARTING = "starting"
    """A generation was launched and has not yet reported a step past the point it resumed from."""
    RUNNING = "running"
    """The generation trains: it reported its first step past the resume point."""
    PAUSED = "paused"
    """``--restart-fallback``: the trace has no instance, so no worker runs."""
    FALLBACK = "fallback"
    """``--elastic``: some stage lost every replica; waiting for every worker to exit, then a relaunch."""
    FINISHED = "finished"
    """The job reported its end (``--elastic``), or every worker exited 0; leftover processes are drained."""


_LEGAL: dict[Phase, frozenset[Phase]] = {
    # a loss reaped late after a fallback may start another one before the relaunch; an end reported late ends it
    Phase.PENDING: frozenset({Phase.STARTING, Phase.FALLBACK, Phase.FINISHED}),
    Phase.STARTING: frozenset({Phase.RUNNING, Phase.STARTING, Phase.PAUSED, Phase.FALLBACK, Phase.FINISHED}),
    Phase.RUNNING: frozenset({Phase.STARTING, Phase.PAUSED, Phase.FALLBACK, Phase.FINISHED}),
    Phase.PAUSED: frozenset({Phase.STARTING}),
    Phase.FALLBACK: frozenset({Phase.PENDING, Phase.FINISHED}),
    Phase.FINISHED: frozenset(),
}
"""Phase -> the phases it may move to."""


class EventSink(Protocol):
    """Appends a launcher event to the run's event log (``Launcher.event``, or a test's list)."""

    def __call__(self, kind: str, /, **fields: Any) -> None:
        """Record event ``kind`` with ``fields``."""


class PhaseError(ParcaeError, RuntimeError):
    """A part of the launcher asked for a phase change the run's state machine does not allow (a bug)."""


@dataclass
class RunState:
    """The launcher's state of one run: the phase and the facts its parts share.

    Owned by the :class:`~.run.Launcher`, which creates it and hands it to its parts. The phase changes only
    through the methods below; each field's docstring says which part may change it. Every other reader only reads.
    """

    phase: Phase = Phase.PENDING
    """The run's phase; changed only by this class's methods."""
    t0: float = 0.0
    """Wall time the run started (set once by ``Launcher.run``)."""
    launch: int = -1
    """``--elastic``: the launch number (0 the first, +1 per relaunch from the checkpoint); set by :meth:`launched`."""
    generation: int = -1
    """The worker generation (``PARCAE_GENERATION``) whose events count: the restart fallback's generation, or
    ``--elastic``'s launch; set by :meth:`launched`."""
    n: int = 0
    """Instances the trace asks for (changed by the launcher's loop, ``Relaunch.start_generation`` and ``Fleet``)."""
    shape: tuple[int, int] = (0, 0)
    """``--restart-fallback``: (D, P) of the running generation; set by ``Relaunch.start_generation``."""
    started_at: float = 0.0
    """When the current generation was launched (for the start-up timeout); set by :meth:`launched`."""
    resume_step: int = 0
    """The step the current generation resumes from (0 without a checkpoint); set by :meth:`launched`."""
    last_ckpt_step: int = 0
    """The step of the latest checkpoint a worker reported; set by the launcher from the event log."""
    pending_restart: Optional[dict[str, Any]] = None
    """A stop-and-relaunch whose new generation has not reported its first step yet (its cost is still being
    measured). Set by the launcher's loop (from ``Relaunch.stop_generation``) and by :meth:`end_fallback`; consumed
    by ``Relaunch.finish_restart``."""
    fallback: Optional[dict[str, Any]] = None
    """The fallback in progress (becomes a ``restarts`` entry); set by :meth:`begin_fallback`, updated by
    ``Relaunch`` while it stops the stragglers, cleared by :meth:`end_fallback`. Present in phase FALLBACK, and in
    FINISHED when the job ended while falling back (its stragglers are still stopped)."""
    interrupted: Optional[Phase] = None
    """The phase the fallback in progress interrupted (STARTING or RUNNING); set by :meth:`begin_fallback`."""
    fallback_reason: str = ""
    """Why the next (or current) fallback happens: from the workers' ``fallback`` events (the launcher) or the
    fleet's own finding; cleared by :meth:`end_fallback`."""
    fallback_seen: set[str] = field(default_factory=set)
    """Members whose ``fallback`` event was seen (the launcher); cleared by :meth:`end_fallback`."""
    min_instances: int = 0
    """The fewest instances the job's model fits on, as a fallback for want of instances said (the launcher, from the
    workers' ``fallback`` events; 0 while unknown). ``--elastic`` relaunches only once the trace has that many."""
    finished_at: Optional[float] = None
    """When the job reported its end; set by :meth:`finish`."""
    kill_times: list[float] = field(default_factory=list)
    """Seconds into the run at which ``Fleet`` SIGKILLed a member whose grace period ended (appended by ``Fleet``;
    the console's recovery costs start there)."""
    timeline: list[dict[str, Any]] = field(default_factory=list)
    """Instances over time: one entry whenever the running group changes (:meth:`mark`, by the launcher's loop,
    ``Fleet.change`` and ``Relaunch.start_generation``)."""
    changes: list[dict[str, Any]] = field(default_factory=list)
    """``--elastic``: the trace's membership changes and what was done (appended by ``Fleet.change``)."""
    restarts: list[dict[str, Any]] = field(default_factory=list)
    """Every measured stop-and-relaunch (appended by ``Relaunch.finish_restart``)."""

    # ---------------------------------------------------------------------------------------------- transitions
    def _move(self, to: Phase, why: str) -> None:
        if to not in _LEGAL[self.phase]:
            raise PhaseError(f"parcae run: illegal phase change {self.phase.name} -> {to.name} ({why}); legal from "
                             f"{self.phase.name}: {sorted(p.name for p in _LEGAL[self.phase]) or 'none'}")
        self.phase = to

    def mark(self, n: int, workers: int, d: int, p: int, generation: int, t: Optional[float] = None) -> None:
        """Append a :attr:`timeline` entry: ``n`` instances, ``workers`` of them running D x P of ``generation``,
        ``t`` seconds into the run (default: now)."""
        self.timeline.append({"t": time.time() - self.t0 if t is None else t, "N": n, "workers": workers, "D": d,
                              "P": p, "generation": generation})

    def launched(self, *, generation: int, resume_step: int, instances: int, now: float,
                 launch: Optional[int] = None) -> None:
        """A new generation of workers was started (PENDING, PAUSED, STARTING or RUNNING -> STARTING).

        Args:
            generation: Its ``PARCAE_GENERATION``.
            resume_step: The step it resumes from.
            instances: Instances it was launched for (a pending restart records it as its ``new_N``).
            now: Wall time of the launch.
            launch: ``--elastic``'s launch number, when this is a launch.
        """
        self._move(Phase.STARTING, f"generation {generation} launched")
        self.generation, self.resume_step, self.started_at = generation, resume_step, now
        if launch is not None:
            self.launch = launch
        if self.pending_restart is not None:
            self.pending_restart["new_N"] = instances

    def is_first_step(self, generation: int, step: int) -> bool:
        """Whether a worker's report of ``step`` in ``generation`` is the current generation's first step past the
        resume point; if so, the run moves on (STARTING -> RUNNING; a fallback that interrupted the start keeps its
        phase but remembers that the generation trained)."""
        if generation != self.generation or step <= self.resume_step:
            return False
        if self.phase is Phase.STARTING:
            self._move(Phase.RUNNING, f"generation {generation} reported step {step}")
            return True
        if self.phase is Phase.FALLBACK and self.interrupted is Phase.STARTING:
            self.interrupted = Phase.RUNNING
            return True
        return False

    def pause(self) -> None:
        """``--restart-fallback``: the trace has no instance (STARTING or RUNNING -> PAUSED)."""
        self._move(Phase.PAUSED, "no instances available")

    def begin_fallback(self, record: dict[str, Any]) -> None:
        """``--elastic``: start stopping everything for a relaunch from the checkpoint (-> FALLBACK).

        A fallback that starts after the job ended (a member exits 75 while the job winds down) is recorded and
        carried out, but the run stays FINISHED: nothing is relaunched.
        """
        if self.fallback is not None:
            raise PhaseError("parcae run: a fallback started while another one is in progress")
        if self.phase is not Phase.FINISHED:
            self.interrupted = self.phase
            self._move(Phase.FALLBACK, str(record.get("reason") or "some stage lost every replica"))
        self.fallback = record

    def end_fallback(self) -> dict[str, Any]:
        """Every worker of the fallback has exited (FALLBACK -> PENDING; FINISHED stays); returns its record, which
        becomes the pending restart."""
        fb = self.fallback
        if fb is None:
            raise PhaseError("parcae run: end of a fallback that was never started")
        if self.phase is not Phase.FINISHED:
            self._move(Phase.PENDING, "every worker of the fallback exited")
        self.fallback, self.interrupted = None, None
        self.fallback_seen.clear()
        self.fallback_reason = ""
        self.pending_restart = fb
        return fb

    def finish(self, now: float) -> None:
        """The job is over (-> FINISHED)."""
        self._move(Phase.FINISHED, "the job reported its end")
        self.finished_at = now

    # ---------------------------------------------------------------------------------------------- questions
    @property
    def training(self) -> bool:
        """A generation is launched and not being stopped (STARTING or RUNNING)."""
        return self.phase in (Phase.STARTING, Phase.RUNNING)

    @property
    def finished(self) -> bool:
        """The job is over."""
        return self.phase is Phase.FINISHED


@dataclass
class WorkerReports:
    """What the workers reported through the event log (``run_dir/events.jsonl``).

    Written only by the :class:`~.console.Console` (``Console.record``), from the events it reads; every other part
    only reads it.
    """

    events: list[dict[str, Any]] = field(default_factory=list)
    """Every event read so far (launcher's and workers'), in log order."""
    latest: dict[str, Any] = field(default_factory=dict)
    """The latest worker event, with the latest progress rate as its ``samples_per_s``."""
    batch: Optional[tuple[int, int]] = None
    """(global batch, micro-batches) as the workers report them (None until the first report)."""
    phases: dict[str, str] = field(default_factory=dict)
    """``--elastic``: member -> its runtime phase (``starting``, ``standby``, ``training``, ...)."""
    arrived: dict[str, float] = field(default_factory=dict)
    """``--elastic``: start-up candidate -> wall time of its ``arrived`` event (it imported, connected to the store
    and installed its SIGTERM handler; it waits for the launch's roster)."""
    migrations: dict[int, dict[str, Any]] = field(default_factory=dict)
    """``--elastic``: generation -> the migration (or recovery) that entered it, merged over its members' reports."""
    decision: dict[str, Any] = field(default_factory=dict)
    """``--elastic``: the leader's latest shape decision."""
    egen: int = -1
    """``--elastic``: the newest runtime generation that trains."""
    shapes: list[dict[str, Any]] = field(default_factory=list)
    """``--elastic``: (t, N members, D, P, generation) whenever the job's shape changed."""

    def waiting(self, w: Worker) -> bool:
        """Whether ``w`` is a joiner that has not been admitted yet (holds no training state)."""
        return w.joiner and self.phases.get(w.member) in (None, "starting", "standby")

    def trains(self, w: Worker) -> bool:
        """Whether ``w``'s member reported a phase that holds training state."""
        return self.phases.get(w.member) in ("training", "planning", "migrating", "recovering")
