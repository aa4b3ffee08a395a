"""The elastic instance manager of ``parcae run``: one process per live instance, changed in place.

Problem: under ``--elastic`` the launcher plays the cloud. It keeps one worker process per instance, starts added
instances as warm standbys (joiners; those of one trace event are recorded as one launch batch, which the leader
admits together: :meth:`Fleet._publish_batch`), delivers preemption notices with a grace period and kills what
outlives it, forms each launch's first generation from the start-up candidates that arrived
(:meth:`Fleet.form_roster`; one noticed, lost or silent before it is left out, not a reason to relaunch), treats
a worker that dies from outside as a lost instance (and starts a fresh standby in its place, up to
``--max-restarts``), restarts members the runtime released or fenced as standbys, relaunches everything from the
checkpoint when a stage lost every replica, and fails the job -- with the worker's log -- when the user's code
fails. :class:`Fleet` is that manager: it owns the instances and their processes' bookkeeping, decides from the
run's :class:`~.state.RunState` phase and the workers' :class:`~.state.WorkerReports`, and starts a fallback through
:class:`~.relaunch.Relaunch`; the launcher's loop calls its steps.
"""

from __future__ import annotations

import functools
import os
import random
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Union

from lightning_parcae.contract import WRONG_TOKEN_EXIT, FALLBACK_EXIT, RELEASED_EXIT, FENCED_EXIT, worker_contract
from lightning_parcae.launch.config import RunConfig
from lightning_parcae.launch.job_store import StoreLink
from lightning_parcae.launch.processes import (
    Worker,
    WorkerControl,
    free_port,
    initial_members,
    start_worker_process,
    worker_environment,
)
from lightning_parcae.launch.relaunch import Relaunch
from lightning_parcae.launch.startup import Candidate, decide_roster
from lightning_parcae.launch.state import EventSink, Phase, RunState, WorkerReports
from lightning_parcae.runtime.startup import StartupRoster, roster_key, waiting_key

__all__ = ["Fleet", "StartupRound", "shared_units"]

MEMBERS_GONE_S = 3.0
"""How long every training member must be gone (standbys waiting) before the launcher starts the fallback itself:
phase events reach the launcher with a delay."""
WAITING_BEAT_S = 60.0
"""How often a launch that waits for instances renews its waiting record (its candidates' roster wait restarts)."""
FINISHED_DRAIN_S = 15.0
"""After the job reported its end, processes still alive this long (e.g. a standby that never heard) get SIGKILL."""


@dataclass
class StartupRound:
    """The start-up of one launch: its candidates wait for the roster (:meth:`Fleet.form_roster`).

    Attributes:
        launch: The launch number.
        p: The P its workers were started with (0: ``auto``).
        launched_at: Wall time of the launch.
        roster: The roster once written (None while the candidates are arriving).
        roster_at: Wall time the roster was written (None before).
        left_out: Candidates noticed or lost before the roster.
        need: Positive for a launch started early, during a pause, on fewer instances than the model fits on
            (:meth:`Fleet.launch_when_enough`): no roster before this many candidates are alive and arrived.
        waiting: While fewer than ``need`` candidates are alive (at the start, or again after a loss before the
            roster): an instance the trace adds joins as a candidate, and the launch is not a stalled start-up.
        enough_at: Wall time the waiting launch had enough candidates (None before, or if it never waited).
        waiting_beat_at: Wall time of the last :func:`~lightning_parcae.runtime.startup.waiting_key` record.
    """

    launch: int
    p: int
    launched_at: float
    roster: Optional[StartupRoster] = None
    roster_at: Optional[float] = None
    left_out: list[str] = field(default_factory=list)
    need: int = 0
    waiting: bool = False
    resume: Optional[Union[str, Path]] = None
    enough_at: Optional[float] = None
    waiting_beat_at: float = 0.0


def shared_units(cfg: RunConfig, host_capacity: Callable[[], int]) -> int:
    """Processing units the workers of this one-machine cluster share: GPUs, else CPU cores (0 with
    ``--emulated-devices``: each instance has its own emulated accelerator, nothing is shared)."""
    if cfg.emulated_devices:
        return 0
    capacity = host_capacity()
    cores = os.cpu_count() or 1
    return cores if capacity == 2 * cores else capacity


class Fleet:
    """Instances and their worker processes of one ``--elastic`` launcher run.

    Args:
        cfg: The run's options.
        state: The run's state; this part may change ``n``, ``launch``/``generation`` (through
            :meth:`~.state.RunState.launched`), ``fallback_reason`` (through :meth:`Relaunch.start_fallback`),
            ``kill_times``, ``timeline`` and ``changes``.
        reports: What the workers reported (read only).
        pool: The worker processes (this part appends the ones it starts).
        store: The run's store (URL and token for the workers, notices).
        events: The launcher's event log.
        say: Prints one console line.
        relaunch: Starts a fallback.
        host_capacity: Instances this machine hosts (for :func:`shared_units`; called once, lazily).
    """

    def __init__(self, cfg: RunConfig, state: RunState, reports: WorkerReports, pool: WorkerControl, store: StoreLink,
                 events: EventSink, say: Callable[[str], None], relaunch: Relaunch,
                 host_capacity: Callable[[], int]) -> None:
        self.cfg, self.state, self.reports, self.pool = cfg, state, reports, pool
        self.store, self.events, self.say, self.relaunch = store, events, say, relaunch
        self._host_capacity = host_capacity
        self.instances: dict[int, Optional[Worker]] = {}
        """Instance id -> its current process (None while it has none); owned by this part."""
        self._next_instance = 0
        self._incarnations: dict[int, int] = {}
        self._slots: dict[int, int] = {}  # instance -> device slot (LOCAL_RANK), see device_slot
        self._lost: dict[int, int] = {}  # instance -> how often its process died by a signal nobody here sent
        self._no_members_since: Optional[float] = None
        self._paused_at: Optional[int] = None
        """The instance count a launch last waited at for want of instances (:meth:`launch_when_enough`)."""
        self._victim_rng = random.Random(int(cfg.seed))  # --victims random
        self.startup: Optional[StartupRound] = None
        """The current launch's start-up (its roster once written); owned by this part."""
        self._batches = 0  # launch batches recorded so far (the batch id's sequence number)
        self._booting: dict[str, dict[str, Any]] = {}  # member -> its launch-batch record, until its process exits

    @functools.cached_property
    def shared_units(self) -> int:
        """:func:`shared_units` of this run (computed once)."""
        return shared_units(self.cfg, self._host_capacity)

    def standbys(self) -> int:
        """Live workers that wait to be admitted."""
        return sum(1 for w in self.pool.workers if w.alive() and self.reports.waiting(w))

    def member_name(self, instance: int) -> str:
        """The member id of a new process of ``instance``: ``i<k>``, then ``i<k>.<restart>``."""
        c = self._incarnations.get(instance, -1) + 1
        self._incarnations[instance] = c
        return f"i{instance}" if c == 0 else f"i{instance}.{c}"

    def device_slot(self, instance: int) -> int:
        """This machine's device index for a new process of ``instance`` (its ``LOCAL_RANK``).

        Regression: every joiner was started with ``LOCAL_RANK=0``, so on a multi-GPU machine all warm standbys --
        and, once admitted, the members they became -- trained on ``cuda:0`` next to the first member. A device
        belongs to the instance, not to a rank (ranks change at every reconfiguration while a process cannot
        change its device): an instance keeps its slot across its restarts, and a new instance takes the lowest
        slot that neither another instance of the cluster nor a still-running worker of a removed one holds
        (``--max-instances`` slots in all; past that, a departing worker's slot is shared until it exits).
        """
        slots = self._slots
        if instance in slots:
            return slots[instance]
        busy = {slots[w.instance] for w in self.pool.workers
                if w.alive() and w.instance != instance and w.instance in slots}
        held = {slots[k] for k in self.instances if k != instance and k in slots}
        free = [k for k in range(self.cfg.max_instances) if k not in busy | held] or \
            [k for k in range(self.cfg.max_instances) if k not in held] or [0]
        slots[instance] = free[0]
        return free[0]

    def spawn(self, instance: int, *, join: bool, rank: int = 0, world: int = 1, p: int = 1,
              resume: Optional[Union[str, Path]] = None, candidate: bool = False) -> Worker:
        """Start one worker process for ``instance``: a start-up candidate of a (re)launch (``candidate``: its rank
        comes from the launch's roster; resuming from ``resume``, a path or URL resolved once for the whole launch),
        an initial member with a fixed ``rank`` of ``world``, or a joiner."""
        cfg, st = self.cfg, self.state
        member = self.member_name(instance)
        slot = self.device_slot(instance)
        parcae = worker_contract(
            elastic=True, store=self.store.url, token=self.store.token, member=member, join=join,
            run_dir=cfg.run_dir, generation=st.launch, pipeline_stages=str(p) if p else "auto", mode=cfg.mode,
            interval_s=cfg.wall_interval_s, stall_s=cfg.stall_timeout_s,
            # every instance of this one-machine cluster shares its cores (the measured model's contention term)
            shared_cores=self.shared_units, resume=resume, checkpoint_dir=cfg.checkpoint_dir,
            max_instances=cfg.max_instances, roster=roster_key(st.launch) if candidate else None,
        )
        if candidate:
            rank, world = 0, 1  # placeholders: the roster says
        env = worker_environment(os.environ, rank=rank, world=world, local_rank=slot,
                                 local_world=max(cfg.max_instances, slot + 1), master_port=free_port(), parcae=parcae)
        logs = cfg.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{member}.log"
        proc = start_worker_process(cfg.command, env, log_path)
        w = Worker(rank if not (join or candidate) else -1, proc, log_path, member=member, instance=instance,
                   joiner=join, candidate=candidate and not join, launch=st.launch, started=time.time())
        self.pool.workers.append(w)
        self.instances[instance] = w
        return w

    def add_instances(self, n: int) -> None:
        """The run starts with ``n`` instances (processes start at the first launch)."""
        for _ in range(n):
            self.instances[self._next_instance] = None
            self._next_instance += 1
        self.state.n = n

    def launch_instances(self, waiting_for: int = 0) -> None:
        """(Re)launch: every instance starts as a start-up candidate; the first generation is formed from those
        that arrive (:meth:`form_roster`: the oldest arrived as members, D a power of two; the others standbys).
        ``waiting_for``: start them early, during a pause, and form nothing before that many are alive."""
        cfg, st = self.cfg, self.state
        ids = sorted(self.instances)
        # a launch started early gets the P of the count it waits for (regression: P = 5 of the 5 instances left,
        # so its roster formed on them and never waited for the sixth)
        _, p = initial_members(max(len(ids), int(waiting_for)), cfg.pipeline_stages)
        launch = st.launch + 1
        ckpt, ckpt_step = cfg.resume_checkpoint() if launch > 0 else (None, None)
        resume = ckpt is not None
        st.launched(generation=launch, launch=launch,
                    resume_step=(st.last_ckpt_step if ckpt_step is None else ckpt_step) if resume else 0,
                    instances=len(ids), now=time.time())
        for k in ids:
            self.spawn(k, join=False, candidate=True, p=p, resume=ckpt)
        st.started_at = time.time()
        self.startup = StartupRound(launch=launch, p=p, launched_at=st.started_at, need=int(waiting_for),
                                    waiting=bool(waiting_for), resume=ckpt)
        candidates = [self.instances[k].member for k in ids]  # type: ignore[union-attr]
        self.events("launch", launch=launch, generation=launch, N=len(ids), candidates=candidates,
                    P=p or "auto", resume_ckpt=str(ckpt) if resume else None, resume_step=st.resume_step,
                    waiting_for=int(waiting_for) or None)
        what = f"relaunch from {'last.ckpt' if cfg.checkpoint_dir is None else ckpt}" if resume else "launch"
        if waiting_for:
            self.say(f"{what} #{launch} started early: start-up candidates {candidates} import and load while the "
                     f"run waits for {waiting_for} instances; the first generation forms once the trace has them")
        else:
            self.say(f"{what} #{launch}: {len(ids)} instances, start-up candidates {candidates} (P={p or 'auto'}); "
                     "the first generation forms from those that arrive")

    def launch_when_enough(self) -> None:
        """A launch is due (PENDING): launch once the trace has at least the fewest instances the model fits on
        (``state.min_instances``, from the workers' fallback); until then the run stays paused, said once per count.

        Regression (issue 21, the GPT-1.5B replay of lh_80_90 at N <= 10, P >= 6 by the memory rule): the trace
        fell to 5 instances, the members saved a checkpoint and stopped ("no shape fits 5 instances"), and the
        launcher relaunched at once on the 5 -- whose first generation cannot hold the model (``StageMemoryError``:
        no split into 5 stages fits): the run failed, under parcae and live-reactive alike, 55 % of the way through
        the segment. It now waits, paused, until the trace has 6 again, then relaunches from the checkpoint.
        """
        n, need = len(self.instances), self.state.min_instances
        if n >= max(1, need):
            self._paused_at = None
            self.launch_instances()
            return
        if self._paused_at != n:
            self._paused_at = n
            why = f"{n} instance(s), fewer than the {need} the model fits on"
            self.events("paused", reason=why, N=n, min_instances=need)
            self.say(f"paused: {why}; relaunching from the checkpoint when the trace has {need}")
        if n >= 1:
            # the instances left start the relaunch now (import, Trainer, checkpoint read) and wait for the others
            # (regression: after lh_80_90's dip the relaunch began only when the trace came back, and six
            # candidates spent 16-23 s importing on two cores before the roster)
            self._paused_at = None
            self.launch_instances(waiting_for=need)

    def waiting(self) -> bool:
        """Whether the current launch was started early and waits for instances (:meth:`launch_when_enough`)."""
        rnd = self.startup
        return bool(rnd is not None and rnd.launch == self.state.launch and rnd.roster is None and rnd.waiting
                    and self.state.phase is Phase.STARTING)

    def _start_instance(self, instance: int) -> Worker:
        """A process for a new (or replaced) instance while a launch is running: a candidate of a launch that
        waits for instances, else a warm standby."""
        rnd = self.startup
        if self.waiting() and rnd is not None:
            return self.spawn(instance, join=False, candidate=True, p=rnd.p, resume=rnd.resume)
        return self.spawn(instance, join=True)

    def form_roster(self, now: Optional[float] = None) -> Optional[StartupRoster]:
        """Write the current launch's start-up roster once its candidates have arrived (the rule:
        :func:`~.startup.decide_roster`), and make each live candidate a member (its rank) or a standby.

        Candidates noticed or lost before it are not in it (they were stopped, or a fresh standby took their
        instance: :meth:`notice`, :meth:`reap`); when too few are left for any first generation, the launch falls
        back to a relaunch.

        Returns:
            The roster written now, or None (not yet, already written, or no start-up in progress).
        """
        rnd, st = self.startup, self.state
        if rnd is None or rnd.roster is not None or rnd.launch != st.launch or st.phase is not Phase.STARTING:
            return None
        now = time.time() if now is None else now
        live = {w.member: w for w in self.pool.workers if w.candidate and w.launch == rnd.launch and w.alive()
                and self.instances.get(w.instance) is w}
        if rnd.need:  # a launch started early, during a pause: the model needs rnd.need instances
            if len(live) < rnd.need:  # too few alive (still, or again after a loss): wait for instances
                rnd.waiting = True
                self._beat_waiting(rnd, now)
                return None
            if rnd.waiting:
                rnd.waiting, rnd.enough_at = False, now
                if st.pending_restart is not None:
                    st.pending_restart["new_N"] = len(self.instances)
                self.events("enough", launch=rnd.launch, candidates=sorted(live), N=len(self.instances))
                self.say(f"the trace has {len(self.instances)} instances: launch #{rnd.launch}'s first generation "
                         "forms from the candidates that arrive")
            if sum(1 for m in live if self.reports.arrived.get(m) is not None) < rnd.need:
                return None  # no first generation of the ones that arrived first
        decision = decide_roster([Candidate(m, w.instance, self.reports.arrived.get(m)) for m, w in live.items()],
                                 launched_at=rnd.launched_at, now=now, pipeline_stages=self.cfg.pipeline_stages,
                                 launch_p=rnd.p, fewest=max(rnd.need, st.min_instances))
        if decision is None:
            return None
        if not decision.feasible:
            self.relaunch.start_fallback(f"no first generation can form: {decision.why}", startup=True)
            return None
        roster = StartupRoster(rnd.launch, decision.members, decision.standbys, tuple(rnd.left_out), rnd.p,
                               decision.why)
        try:
            self.store.publish(roster_key(rnd.launch), roster.record())
        except Exception as exc:  # noqa: BLE001 -- a store hiccup: the candidates keep waiting, tried again next poll
            self.events("store_error", error=str(exc))
            return None
        rnd.roster, rnd.roster_at = roster, now
        for r, m in enumerate(roster.members):
            live[m].candidate, live[m].rank = False, r
        for m in roster.standbys:
            live[m].candidate, live[m].joiner = False, True
        self.events("roster", launch=rnd.launch, generation=rnd.launch, members=list(roster.members),
                    standbys=list(roster.standbys), left_out=list(roster.left_out), P=rnd.p or "auto",
                    why=roster.why, after_s=round(now - rnd.launched_at, 3))
        self.say(f"start-up roster #{rnd.launch} after {now - rnd.launched_at:.1f} s: members {list(roster.members)}"
                 + (f", warm standbys {list(roster.standbys)}" if roster.standbys else "")
                 + (f", left out {list(roster.left_out)}" if roster.left_out else "") + f" ({roster.why})")
        return roster

    def _beat_waiting(self, rnd: StartupRound, now: float) -> None:
        """Tell a waiting launch's candidates it still waits (they would give up after ``ROSTER_WAIT_S``)."""
        if now - rnd.waiting_beat_at < WAITING_BEAT_S:
            return
        try:
            self.store.publish(waiting_key(roster_key(rnd.launch)), {"need": rnd.need, "t": now})
            rnd.waiting_beat_at = now
        except Exception as exc:  # noqa: BLE001 -- a store hiccup: tried again next poll
            self.events("store_error", error=str(exc))

    def startup_progress_at(self) -> float:
        """Wall time of the current launch's latest start-up progress: the launch itself, a candidate's arrival (it
        imported, built its Trainer and reached the store) or the roster.

        The launcher's ``--startup-timeout`` counts from here, not from the launch. Regression (a 24-instance replay
        on 2 cores, issue 21): the candidates' imports alone took 100 s, the roster formed at 100.1 s and the run was
        failed at 120 s as "no training step" while the first generation was building its groups -- a timeout
        that measured the machine's size, not a stall.
        """
        rnd = self.startup
        if rnd is None:
            return self.state.started_at
        if self.waiting():
            return time.time()  # waiting for instances is not a stalled start-up
        ours = {w.member for w in self.pool.workers if w.launch == rnd.launch}
        arrivals = [t for m, t in self.reports.arrived.items() if m in ours]
        marks = [t for t in (rnd.roster_at, rnd.enough_at) if t is not None]
        return max([self.state.started_at, *arrivals, *marks])

    def notice(self, w: Worker) -> str:
        """Remove ``w``'s instance: notice (store key + SIGTERM), or SIGKILL at once if it holds no state -- a
        waiting standby (its notice key is written first, so no leader admits it), or a start-up candidate whose
        launch has no roster yet (it is left out of it)."""
        now = time.time()
        if w.candidate:
            self.pool.signal(w, signal.SIGKILL)
            w.killed, w.noticed_at = True, now
            if self.startup is not None and self.startup.launch == w.launch:
                self.startup.left_out.append(w.member)
            return "candidate stopped"
        if self.reports.waiting(w) or self.state.fallback is not None and w.joiner:
            # its notice first, so that a leader planning now does not admit it (it is stopped at once: no state)
            self._publish_notice(w, now)
            self.pool.signal(w, signal.SIGKILL)
            w.killed = True
            return "standby stopped"
        w.noticed_at, w.deadline = now, now + self.cfg.wall_grace_s
        self._publish_notice(w, w.deadline)
        if self._handler_installed(w):  # SIGTERM is a notice, not a kill
            self.pool.signal(w, signal.SIGTERM)
            w.sigterm_sent = True
        return "notice"

    def _publish_batch(self, members: list[str]) -> Optional[str]:
        """Record that ``members`` (joiners just started for one trace event) form one launch batch: the record
        ``parcae/booting/<member>`` = ``{"batch", "members", "t"}`` each (signed with the job token;
        :func:`~lightning_parcae.runtime.coordinator.booting_key`). The leader then admits the batch in one
        generation instead of one standby per planning interval as their imports finish
        (:data:`~lightning_parcae.runtime.shape_choice.BATCH_GRACE_S`).

        Regression (the README's main job under load): the trace's 2 -> 4 started two joiners at once; their torch
        imports ended seconds apart, so the leader admitted them at two planning intervals (1x2 -> 1x3 -> 2x2, two
        repartitions) where one intra-stage change (1x2 -> 2x2) was meant.

        A single joiner gets no record (it has no batch-mate to wait for); neither does ``parcae agent``, which
        starts one worker per machine. A store hiccup is an event: the joiners are then admitted as they come.

        Returns:
            The batch id, or None when no record was written.
        """
        if len(members) < 2:
            return None
        from lightning_parcae.runtime.coordinator import booting_key  # noqa: PLC0415

        self._batches += 1
        batch = f"{self.state.launch}.{self._batches}"
        now = time.time()
        for m in members:
            try:
                self.store.publish(booting_key(m), {"batch": batch, "members": list(members), "t": now})
            except Exception as exc:  # noqa: BLE001 -- without the record the leader just does not wait for it
                self.events("store_error", error=str(exc))
                continue
            self._booting[m] = {"batch": batch, "members": list(members), "t": now}
        return batch

    def _batch_member_gone(self, w: Worker) -> None:
        """``w`` had a launch-batch record and its process exited: mark it ``gone``, so that a leader holding its
        batch-mates back for it stops waiting (its instance's fresh standby, if any, is a new member)."""
        rec = self._booting.pop(w.member, None)
        if rec is None:
            return
        from lightning_parcae.runtime.coordinator import booting_key  # noqa: PLC0415

        try:
            self.store.publish(booting_key(w.member), {**rec, "gone": True})
        except Exception as exc:  # noqa: BLE001 -- the leader's grace still bounds its wait
            self.events("store_error", error=str(exc))

    def _publish_notice(self, w: Worker, deadline: float) -> None:
        """Write ``w``'s notice key (the one notice format of :mod:`~lightning_parcae.runtime.liveness`, signed with
        the job token by the store's ``encode_record``); a store hiccup is an event, not a stop."""
        from lightning_parcae.runtime.liveness import notice_key, notice_record  # noqa: PLC0415

        try:
            self.store.publish(notice_key(w.member), notice_record(w.member, source="replay", deadline=deadline))
        except Exception as exc:  # noqa: BLE001 -- a store hiccup must not stop the notice itself
            self.events("store_error", error=str(exc))

    def _handler_installed(self, w: Worker) -> bool:
        """Whether ``w``'s SIGTERM handler is installed: it reported a phase, or its arrival as a start-up
        candidate (the runtime installs it when it connects, before either)."""
        return w.member in self.reports.phases or w.member in self.reports.arrived

    def removal_order(self, ids: list[int]) -> list[int]:
        """Instances in the order the trace removes them: those not training in the job (standbys, including
        members released by a shape change and restarted) before members; within each, newest first
        (``--victims newest``), in a seeded random order (``--victims random``: a spot provider does not pick
        by age, so a drop can take any stage -- two at once can leave a stage short, the case an inter-stage
        migration repairs) or the holders of the last stage first (``--victims stage``: :meth:`_stage_order`).
        ``--victims any`` is the seeded random order over every instance, standbys not first: the provider does
        not know which instances train, and the planner's cost model (``settle``, the expectation over victim
        patterns) draws victims from every instance present. Standbys-first spares a policy that keeps idle
        instances the refill the planner priced (issue 21, stop 54: in an ll_10_11 replay live-reactive's 4x6 on
        27 lost two standbys and paid nothing where the simulator had charged it 31 s).

        Regression: a member released by a 4 -> 2 shape change restarts as a standby under its *old* instance
        number, so "newest first" noticed an older training member while the restarted standby (still importing,
        not yet counted by the leader) stayed -- the job found no shape for 1 instance and fell back to the
        checkpoint.

        Members of a launch's start-up roster count as members while they form generation 0: standbys and
        candidates still importing go first (removing a roster member then is a loss in the start-up window).
        """

        def member(k: int) -> bool:
            w = self.instances.get(k)
            if w is None:
                return False
            # a member of the start-up roster that is still forming generation 0 holds no state yet, but the
            # others are building its groups with it: remove standbys and candidates before it
            forming = not (w.joiner or w.candidate) and self.reports.phases.get(w.member) in (None, "starting")
            return self.reports.trains(w) or forming

        if self.cfg.victims == "stage":
            stage = self._stage_order()
            return sorted(ids, key=lambda k: (member(k), stage(k), -k))
        if self.cfg.victims in ("random", "any"):
            shuffled = sorted(ids)
            self._victim_rng.shuffle(shuffled)
            if self.cfg.victims == "any":
                return shuffled
            rank = {k: i for i, k in enumerate(shuffled)}
            return sorted(ids, key=lambda k: (member(k), rank[k]))
        return sorted(ids, key=lambda k: (member(k), -k))

    def _stage_order(self) -> Callable[[int], int]:
        """For ``--victims stage``: instance -> its place in the removal order by pipeline stage (0: it holds the
        last stage of the newest started generation; 1: the stage before; ...; instances outside that layout
        last), from the generation's record in the store.

        Regression (the README's main job in the slow suite): with ``--victims random`` the trace's drop of two
        from 2x2 took i0 and i3, and whether they held one stage (an inter-stage migration) or one pipeline (an
        intra-stage one) depended on where the measured profile's repartition had seated them -- so which
        migration kinds the job showed changed from run to run.
        """
        layout = self.store.current_layout()
        members = list(layout["members"]) if layout else []
        p = len(layout["partition"]) if layout else 1
        place = {m: p - 1 - r % p for r, m in enumerate(members)}

        def order(k: int) -> int:
            w = self.instances.get(k)
            return place.get(w.member, p) if w is not None else p

        return order

    def change(self, target: int) -> None:
        """The trace moved to ``target`` instances: notice some (:meth:`removal_order`), or start joiners."""
        st = self.state
        ids = sorted(self.instances)
        cur = len(ids)
        running = st.training
        if target < cur:
            done = []
            for k in self.removal_order(ids)[: cur - target]:
                w = self.instances.pop(k)
                action = self.notice(w) if w is not None and w.alive() else "no process"
                done.append({"instance": k, "member": w.member if w else None, "action": action})
            self.events("remove", old_N=cur, new_N=target, victims=done, grace_s=self.cfg.wall_grace_s)
            st.changes.append({"t": time.time() - st.t0, "old_N": cur, "new_N": target, "removed": done})
            self.say(f"trace: {cur} -> {target} instances: " + ", ".join(
                f"{d['action']} to {d['member']}" if d["action"] == "notice" else f"{d['member']}: {d['action']}"
                for d in done) + (f" (grace {self.cfg.wall_grace_s:.1f} s)" if any(d["action"] == "notice"
                                                                                  for d in done) else ""))
        else:
            added = []
            for _ in range(target - cur):
                k = self._next_instance
                self._next_instance += 1
                self.instances[k] = None
                if running:
                    added.append(self._start_instance(k).member)
                else:
                    added.append(f"i{k}")
            waiting = self.waiting()
            batch = self._publish_batch(added) if running and not waiting else None
            self.events("add", old_N=cur, new_N=target, joiners=added, batch=batch)
            st.changes.append({"t": time.time() - st.t0, "old_N": cur, "new_N": target, "added": added})
            how = ("started as start-up candidate of the waiting launch" if waiting else
                   "started as warm standby" if running else "will start at the next launch")
            self.say(f"trace: {cur} -> {target} instances: new {', '.join(added)} {how}")
        st.n = target
        shapes = self.reports.shapes
        st.mark(target, len(self.instances), shapes[-1]["D"] if shapes else 0, shapes[-1]["P"] if shapes else 0,
                self.reports.egen)
        if target == 0:
            self.events("paused", reason="no instances available")

    def reap(self) -> None:
        """Account for workers that exited: released ones restart as joiners, 75 starts the fallback, others fail.

        Raises:
            RunFailed: A worker rejected the token, failed in the user's code, or an instance was lost more often
                than ``--max-restarts``; every worker has been stopped.
        """
        st = self.state
        for w in self.pool.workers:
            if w.handled or w.proc.poll() is None:
                continue
            w.handled = True
            rc = int(w.proc.returncode)
            current = self.instances.get(w.instance) is w
            self.events("exit", member=w.member, instance=w.instance, rc=rc, noticed=w.noticed_at is not None,
                        killed=w.killed)
            if current:
                self.instances[w.instance] = None
            self._batch_member_gone(w)
            if rc == WRONG_TOKEN_EXIT:
                self.pool.kill_all()
                raise self.pool.failure("parcae run failed: a worker rejected the job token (wrong or missing "
                                        "PARCAE_JOB_TOKEN); stopped all workers", [w])
            if rc == FALLBACK_EXIT:
                self.relaunch.start_fallback()
                continue
            if rc in (RELEASED_EXIT, FENCED_EXIT):
                why = "released by the new shape" if rc == RELEASED_EXIT else "fenced (declared dead while silent)"
                if current and st.training:
                    self.spawn(w.instance, join=True)
                    self.say(f"{w.member} {why}: restarted as warm standby "
                             f"{self.instances[w.instance].member}")  # type: ignore[union-attr]
                continue
            ours = w.killed or (w.noticed_at is not None and rc in (-signal.SIGTERM, -signal.SIGKILL))
            lost = rc < 0 and not ours  # a signal nobody here sent (kill -9, the OOM killer): a lost instance
            if lost:
                self._count_lost(w, rc)
            if rc == 0 or ours or lost:
                if w.candidate:
                    # gone before its launch's roster: it is simply not in it (nobody waits for it)
                    self._left_out(w, rc, lost=lost, current=current)
                elif (not w.joiner and w.launch == st.launch and w.member not in self.reports.phases
                        and st.phase in (Phase.PENDING, Phase.STARTING, Phase.RUNNING)):
                    # a roster member lost before the first generation formed: the others wait for it while they
                    # build generation 0's groups and cannot go on without it
                    self.relaunch.start_fallback(f"initial member {w.member} lost during start-up (in the roster, "
                                                 "before the first generation formed)", startup=True)
                elif lost and current and st.training:
                    self.spawn(w.instance, join=True)  # the survivors recover in place; a fresh standby for it
                    self.say(f"{w.member} died by signal {-rc} (not sent by parcae run): a lost instance; the "
                             f"others recover in place, restarted as warm standby "
                             f"{self.instances[w.instance].member}")  # type: ignore[union-attr]
                continue
            # an exception in the script (or any exit that is neither a signal nor a protocol status): like
            # Lightning, the job fails with the worker's traceback
            self.pool.kill_all()
            raise self.pool.failure(f"parcae run failed: worker {w.member} (launch {w.launch}) exited with {rc}; "
                                    "stopped all workers", [w])

    def check_members_left(self, alive: list[Worker], now: Optional[float] = None) -> None:
        """Every training member is gone (killed together, or the last one lost) while standbys wait: nobody is
        left to hand state over or to exit 75, so the launcher starts the fallback itself (relaunch from
        last.ckpt). The condition must hold for :data:`MEMBERS_GONE_S`: phase events reach the launcher with a
        delay."""
        members = [w for w in alive if not self.reports.waiting(w)]
        if members or self.state.phase is not Phase.RUNNING:
            self._no_members_since = None
            return
        now = time.time() if now is None else now
        if self._no_members_since is None:
            self._no_members_since = now
        elif now - self._no_members_since > MEMBERS_GONE_S:
            self._no_members_since = None
            self.relaunch.start_fallback("every training member was lost (no live process holds the model)")

    def _left_out(self, w: Worker, rc: int, *, lost: bool, current: bool) -> None:
        """A start-up candidate exited before its launch's roster: record it; a lost one's instance gets a fresh
        warm standby (admitted at a later planning interval), a noticed one's instance is gone already."""
        rnd = self.startup
        if rnd is not None and rnd.launch == w.launch and w.member not in rnd.left_out:
            rnd.left_out.append(w.member)
        why = "noticed" if w.noticed_at is not None else "stopped" if w.killed else "lost" if lost else "exited"
        self.events("left_out", member=w.member, instance=w.instance, launch=w.launch, rc=rc, reason=why)
        if lost and current and self.state.training:
            new = self._start_instance(w.instance)
            self.say(f"start-up candidate {w.member} died by signal {-rc} before the roster: left out of the first "
                     f"generation; {'candidate' if new.candidate else 'warm standby'} {new.member} takes its "
                     "instance")

    def _count_lost(self, w: Worker, rc: int) -> None:
        """Count one unrequested death by signal of ``w``'s instance; past ``--max-restarts`` the run fails."""
        n = self._lost[w.instance] = self._lost.get(w.instance, 0) + 1
        self.events("lost", member=w.member, instance=w.instance, rc=rc, count=n, max_restarts=self.cfg.max_restarts)
        if n > self.cfg.max_restarts:
            self.pool.kill_all()
            raise self.pool.failure(f"parcae run failed: instance {w.instance} lost its process to a signal {n} "
                                    f"times (last: {w.member}, signal {-rc}), more than --max-restarts "
                                    f"{self.cfg.max_restarts}; stopped all workers", [w])

    def enforce_deadlines(self) -> None:
        """SIGTERM a noticed worker once its handler is installed; SIGKILL it when its grace period is over."""
        now = time.time()
        for w in self.pool.workers:
            if not w.alive() or w.noticed_at is None:
                continue
            if not w.sigterm_sent and self._handler_installed(w):
                self.pool.signal(w, signal.SIGTERM)
                w.sigterm_sent = True
            if not w.killed and w.deadline is not None and now >= w.deadline:
                self.pool.signal(w, signal.SIGKILL)
                w.killed = True
                self.state.kill_times.append(now - self.state.t0)
                self.events("kill", member=w.member, instance=w.instance, reason="grace period over")
                self.say(f"{w.member} still alive when its grace period ended: SIGKILL (the others recover)")

    def drain(self, alive: list[Worker], now: Optional[float] = None) -> None:
        """The job is over: SIGKILL what is still alive :data:`FINISHED_DRAIN_S` after the end (e.g. a standby that
        never heard that the job is over)."""
        now = time.time() if now is None else now
        if self.state.finished_at is not None and now - self.state.finished_at > FINISHED_DRAIN_S:
            for w in alive:
                self.pool.signal(w, signal.SIGKILL)
                w.killed = True

    def this_launch(self, joiners: bool = True) -> list[Worker]:
        """The workers started by the current launch (without its joiners if ``joiners`` is False)."""
        return [w for w in self.pool.workers if w.launch == self.state.launch and (joiners or not w.joiner)]
