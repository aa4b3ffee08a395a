"""Live reconfiguration: the per-process runtime that changes a running job's D x P shape in place.

Problem: while ``Trainer.fit`` runs, instances receive preemption notices, die without notice, or arrive. The job
must (a) decide ahead of time which shape to run next (predictor + liveput optimizer, once per interval, on one
process), (b) get every process to switch at the *same* step, (c) move only the state that has to move between
processes that keep running, (d) survive a sudden loss without any stage applying an optimizer step that another
did not, and (e) let a new process join with the exact model, optimizer and loop state of the running job. This
module is that protocol's spine -- connection, the step-boundary agreement, the generation records -- and owns
one part per phase: :mod:`.shape_choice` (a), :mod:`.switching` (b, c), :mod:`.recovery` (d) and :mod:`.joining`
(e). The strategy above it (a :class:`~lightning_parcae.runtime.host.TrainingHost`) calls into it at a few points.

Ownership: the runtime owns the current generation (:class:`~.generation.GenerationState`) and is the only one that
changes it; the parts are given narrow typed collaborators (:class:`~.part.PartContext`, the host, the state to
read) and *return* what they decided -- the record to enter (:mod:`.recovery`, :mod:`.shape_choice`), what was
moved (:mod:`.switching`), the admitting generation (:mod:`.joining`). Only :meth:`ElasticRuntime.boundary`, and the
few entry points beside it, orchestrate them. The configuration arrives as one
:class:`~.config.RuntimeConfig`, built by the training layer; nothing here reads the environment.

Protocol (see ``docs/elastic.md`` for the user-facing version and :mod:`.lifecycle` for the state machine):

* **Generations.** Every configuration is a generation record in the store (:mod:`.coordinator`): members in
  rank order, partition, the migration plan that leads to it, and why. Process groups of generation ``g`` live
  under the store prefix ``gen/<g>/``; state transfers of the migration into ``g`` run in a transition world under
  ``mig/<g>/``.
* **Agreement at step boundaries.** After every optimizer step (``on_train_batch_end``) all members run one tiny
  all-reduce: the leader's proposed next generation (0 if none) and one notice flag per rank. Every rank gets the
  same answer, so all switch at the same step -- decisions never depend on when a rank happened to read the store.
* **Interval decisions.** The leader (rank 0 of the generation; after a failure, the first survivor) runs the
  predictor and the liveput optimizer -- the simulator's own decision, :func:`~lightning_parcae.planning.policy.decide_with_forecast` -- every ``interval_s`` seconds (or ``interval_steps`` steps), and at once when
  a notice is agreed. It publishes the next generation when the plan changes the shape, uses new standbys, or
  drops a member under notice.
* **Two-phase step.** A step's update is applied only after all members counted themselves in under
  ``parcae/commit/<g>/<step>``. On a failure the first process to look fixes the outcome with ``compare_set``:
  *apply* if everyone had reduced its gradients, else *discard*; everyone obeys that one decision.
* **Sudden loss.** Heartbeats (:mod:`.liveness`) abort the generation within seconds; survivors announce
  themselves, wait until every old member has announced or is dead, and the first proposal for the next
  generation (survivors only) wins. A discarded step is re-run on the new shape with the same global batch.
* **Joiners** (``PARCAE_JOIN=1``) wait as warm standbys (imports done, model built, heartbeating) until a
  generation includes them; they receive their layers from live holders and the loop state (step, epoch, sample
  cursor, schedulers, callbacks) from the leader, then enter ``fit`` through Lightning's own restore path.
* **Leaving.** A member under notice sends what it holds and exits (status 0); a survivor the new shape does not
  use exits with :data:`RELEASED_EXIT` so that a launcher restarts it as a standby.
* **Fallback.** If some layer has no live holder, every member logs it loudly and exits with
  :data:`FALLBACK_EXIT`; ``parcae run`` then restarts the job from the last checkpoint (losing the steps since it).
"""


from __future__ import annotations

import logging
import math
import signal
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from lightning_parcae.contract import FALLBACK_EXIT, RELEASED_EXIT, FENCED_EXIT
from lightning_parcae.errors import ConfigurationError, PeerLostError
from lightning_parcae.events import append_event
from lightning_parcae.planning.migration_plan import Layout
from lightning_parcae.runtime import steptime
from lightning_parcae.runtime.agreement import AGREEMENT_TAG, tree_max
from lightning_parcae.runtime.config import RuntimeConfig
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.generation import GenerationRecords, GenerationState
from lightning_parcae.runtime.host import TrainingHost
from lightning_parcae.runtime.joining import Admission
from lightning_parcae.runtime.lifecycle import Lifecycle, Phase, exit_now
from lightning_parcae.runtime.liveness import Liveness, activate, guarded, guarded_post, guarded_wait
from lightning_parcae.runtime.part import PartContext
from lightning_parcae.runtime.recovery import Recovery
from lightning_parcae.runtime.plan_ahead import PlanAhead
from lightning_parcae.runtime.shape_choice import ShapeChooser
from lightning_parcae.runtime.startup import StartupRoster, arrival_key, await_roster
from lightning_parcae.runtime.switching import GenerationNotEntered, Switch

if TYPE_CHECKING:  # pragma: no cover
    import pytorch_lightning as pl


__all__ = ["ElasticRuntime", "PlanningClock", "FALLBACK_EXIT", "RELEASED_EXIT", "FENCED_EXIT", "LIVE_CHECKPOINT"]

log = logging.getLogger(__name__)

LIVE_CHECKPOINT = "parcae-live://peers"
"""The checkpoint path a joiner 'resumes' from: the state it received from live peers, not a file."""


class PlanningClock:
    """When the leader's next planning interval is due: every ``interval_s`` wall seconds or ``interval_steps``
    optimizer steps, whichever comes first (0 turns either off).

    Args:
        interval_s: The interval in wall seconds.
        interval_steps: The interval in optimizer steps.
    """

    def __init__(self, interval_s: float, interval_steps: int) -> None:
        self.interval_s = float(interval_s)
        self.interval_steps = int(interval_steps)
        self.last_t = time.monotonic()
        self.last_step = 0

    def due(self, step: int) -> bool:
        """Whether an interval is due at ``step`` (and, if so, the next one counts from here)."""
        now = time.monotonic()
        due = (self.interval_steps > 0 and step - self.last_step >= self.interval_steps) or (
            self.interval_s > 0 and now - self.last_t >= self.interval_s
        )
        if due:
            self.last_t, self.last_step = now, step
        return due

    def restart(self, step: int) -> None:
        """Count the next interval from now and ``step`` (a joiner starts training)."""
        self.last_t, self.last_step = time.monotonic(), step


class ElasticRuntime:
    """One process's side of the live-reconfiguration protocol (owned by :class:`ParcaeStrategy`).

    Args:
        host: The training side (its groups, stage and optimizers are rebuilt in place).
        config: Everything the runtime is configured with (the strategy's options and the launcher's contract,
            see :class:`~.config.RuntimeConfig`).

    Attributes:
        state: The current generation (owned here: only this runtime changes it).
        config: The configuration.
        store, coord, live: The connection to the job (``None`` until :meth:`connect`).
        life: This process's lifecycle.
        migrations: Every generation change this process made (the ``migration`` events' fields).
        admitted: Whether this process is (or was) a training member; a joiner becomes one in :meth:`joined`.
    """

    def __init__(self, host: TrainingHost, config: RuntimeConfig) -> None:
        self.host = host
        self.config = config
        self.member = config.member
        self.joining = config.joining
        self.run_dir = config.run_dir
        self.state = GenerationState(member=config.member)
        self.records = GenerationRecords(host, self.state)
        self.store: Optional[dist.Store] = None
        self.coord: Optional[Coordinator] = None
        self.live: Optional[Liveness] = None
        self.life = Lifecycle(config.member, on_transition=self._on_transition)
        self.migrations: list[dict[str, Any]] = []
        self.admitted = not config.joining
        self._join_stats: dict[str, Any] = {}
        self._clock = PlanningClock(config.interval_s, config.interval_steps)
        self._recovering_since: Optional[float] = None
        self.chooser = ShapeChooser(host, self.state, config, self.records, migrations=self.migrations,
                                    event=self.event)
        """The leader's planning state: measured throughput, optimizer, predictor (kept by every process)."""
        self.ahead = PlanAhead(self.chooser, self.event)
        """The leader's planning-interval decision while the job trains (``config.plan_ahead``)."""
        self.admission: Optional[Admission] = None
        self.recovery: Optional[Recovery] = None
        self.switching: Optional[Switch] = None

    # ============================================================================================ state
    @property
    def generation(self) -> int:
        """The current generation's number (-1 before the first)."""
        return self.state.generation

    @property
    def layout(self) -> Optional[Layout]:
        """The current generation's members and partition (``None`` before the first)."""
        return self.state.layout

    @property
    def record(self) -> dict[str, Any]:
        """The record the current generation was entered from."""
        return self.state.record

    @property
    def stats(self) -> dict[str, Any]:
        """The leader's last planning figures (``predicted_N``, ``liveput``, ...) and a joiner's transfer time."""
        return {**self.chooser.stats, **self._join_stats}

    @property
    def stall_timeout(self) -> timedelta:
        """The progress watchdog's bound as a group timeout (see ``RuntimeConfig.stall_after_s``)."""
        return self.config.stall_timeout

    @property
    def is_leader(self) -> bool:
        """Rank 0 of the current generation plans for everyone."""
        return self.state.is_leader

    @property
    def rank(self) -> int:
        """This member's rank in the current generation."""
        return self.state.rank

    # ============================================================================================ connection
    def connect(self) -> dist.Store:
        """Open the main-thread store client, the coordinator and the heartbeat (not started yet)."""
        from lightning_parcae.runtime.store import connect_store  # noqa: PLC0415

        url, token = self.config.store_url, self.config.token
        store = connect_store(url, token=token, timeout_s=30.0)
        live = Liveness(lambda: connect_store(url, token=token, timeout_s=30.0), self.member,
                        interval_s=self.config.heartbeat_s, dead_after_s=self.config.dead_after_s, token=token)
        self.attach(store, Coordinator(store, token), live)
        self.install_signal_handler()
        return store

    def attach(self, store: dist.Store, coord: Coordinator, live: Liveness) -> None:
        """Use this connection to the job and build the parts that act through it (:meth:`connect` opens one;
        a test passes its own)."""
        self.store, self.coord, self.live = store, coord, live
        ctx = PartContext(member=self.member, store=store, coord=coord, live=live, life=self.life, event=self.event)
        self.chooser.coord, self.chooser.store = coord, store
        self.switching = Switch(ctx, self.host, self.state, self.stall_timeout)
        self.recovery = Recovery(ctx, self.state, self.records, self.chooser, self.host, self.config.dead_after_s,
                                 self.run_dir)
        self.admission = Admission(ctx, self.state, self.host, self.stall_timeout)

    def install_signal_handler(self) -> None:
        """SIGTERM = preemption notice: only raise the flag (the next step boundary acts on it)."""
        if threading_main():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        assert self.live is not None
        self.live.noticed.set()

    def _on_transition(self, old: Phase, new: Phase, spent: float, info: dict[str, Any]) -> None:
        if self.live is not None:
            self.live.phase = new.value
        self.event("phase", old=old.value, new=new.value, spent_s=round(spent, 4), **info)

    def event(self, event_name: str, /, **fields: Any) -> None:
        """Append a JSON-lines event to ``run_dir/events.jsonl`` (under ``parcae run``) and log it at debug."""
        ev = {"source": "elastic", "member": self.member, "generation": self.generation, **fields,
              "event": event_name}
        log.debug("%s", ev)
        if self.run_dir:
            try:
                append_event(self.run_dir, _json_safe(ev))
            except OSError as exc:
                log.warning("could not write event: %s", exc)

    # ============================================================================================ boot
    def take_seat(self, pipeline_stages: int = 0) -> StartupRoster:
        """A start-up candidate (``config.roster_key``): report the arrival (an event for ``parcae run``'s
        launcher, a store record for ``parcae agent``'s machines, with the script's ``pipeline_stages``, 0 for the
        strategy's choice), wait for the launch's roster (:mod:`.startup`). A member takes its rank from the
        roster; a candidate not in it becomes a standby (:attr:`joining`; the caller goes on to :meth:`join_wait`).
        A notice while waiting ends the process at once (exit 0: it holds no state yet)."""
        assert self.coord is not None and self.live is not None and self.config.roster_key
        self.event("arrived", roster=self.config.roster_key)
        self.coord.put(arrival_key(self.config.roster_key, self.member),
                       {"member": self.member, "P": int(pipeline_stages or 0)})
        roster = await_roster(self.coord, self.config.roster_key, noticed=self.live.noticed.is_set)
        if roster is None:
            log.warning("%s: preemption notice before the start-up roster; leaving", self.member)
            self.event("candidate_exit", reason="notice")
            self.life.to(Phase.STOPPED)
            exit_now(0)
        assert roster is not None
        if roster.rank_of(self.member) is None:
            self.joining, self.admitted = True, False
        return roster

    def boot_register(self, generation: int, rank: int) -> None:
        """Initial members: publish this process's member id under its boot rank (before groups are used)."""
        assert self.store is not None
        self.state.generation = generation
        self.store.set(f"parcae/boot/{generation}/{rank}", self.member)

    def boot_publish(self, trainer: "pl.Trainer") -> None:
        """After partitioning: agree on generation 0's record and the parameter-group map; start heartbeats."""
        s = self.host
        g = s.groups
        assert g is not None and self.coord is not None and self.live is not None and self.store is not None
        self._publish_group_map(g.generation, g.rank, g.world)
        if g.rank == 0:
            members = []
            for r in range(g.world):
                self.store.wait([f"parcae/boot/{g.generation}/{r}"])
                members.append(bytes(self.store.get(f"parcae/boot/{g.generation}/{r}")).decode())
            layout = Layout(tuple(members), tuple(s.partition))
            self.coord.propose(self.records.record(g.generation, layout, None, "start", 0, reason="initial members"))
            self.coord.set_current(g.generation)
        rec = self.coord.generation(g.generation, timeout_s=None)
        assert rec is not None
        self.state.enter(rec)
        self.live.start()
        self.live.set_generation(self.generation, self.state.watch())
        self.life.to(Phase.TRAINING, generation=self.generation, D=g.data_parallel, P=g.pipeline_stages)

    def _publish_group_map(self, generation: int, rank: int, world: int) -> None:
        """Every rank publishes which optimizer param group each of its parameters is in; all merge all."""
        s = self.host
        module = s.lightning_module
        assert module is not None and self.coord is not None
        names = {id(p): n for n, p in module.named_parameters()}
        mine = []
        for inner in s.torch_optimizers():
            mine.append({names[id(p)]: gi for gi, grp in enumerate(inner.param_groups) for p in grp["params"]
                         if id(p) in names})
        self.coord.put(f"parcae/pgroups/{generation}/{rank}", {"map": mine})
        merged: list[dict[str, int]] = [dict() for _ in mine]
        for r in range(world):
            rec = self.coord.get(f"parcae/pgroups/{generation}/{r}", timeout_s=None)
            assert rec is not None
            for k, part in enumerate(rec["map"]):
                merged[k].update(part)
        self.state.group_of = merged
        if rank == 0:
            self.coord.put("parcae/pgroups", {"map": merged})

    # ============================================================================================ joining
    def join_wait(self) -> dict[str, Any]:
        """Standby: wait until a generation admits this member and receive its state (see
        :meth:`~lightning_parcae.runtime.joining.Admission.join_wait`); enter that generation.

        Returns:
            The admitting generation's record (the caller builds the process groups of it).
        """
        assert self.admission is not None
        admitted = self.admission.join_wait()
        self.state.enter(admitted.record)
        self.state.group_of = admitted.group_of
        self._join_stats["join_transfer_s"] = admitted.transfer_s
        return admitted.record

    def joined(self, trainer: "pl.Trainer") -> None:
        """Called by the strategy once the joiner's stage, optimizers and loop state are in place."""
        assert self.admission is not None
        self.admitted = True
        self._clock.restart(int(trainer.global_step))
        self.admission.joined(trainer, float(self._join_stats.get("join_transfer_s", 0.0)))

    def joiner_checkpoint(self) -> dict[str, Any]:
        """See :meth:`~lightning_parcae.runtime.joining.Admission.joiner_checkpoint`."""
        assert self.admission is not None
        return self.admission.joiner_checkpoint()

    # ============================================================================================ step boundary
    def boundary(self, trainer: "pl.Trainer") -> None:
        """After each committed step: agree on notices and plans; switch, recover or continue."""
        assert self.live is not None and self.coord is not None and self.layout is not None
        step = int(trainer.global_step)
        self.live.step = step
        ended = self.chooser.now()
        self._join_plan()
        with steptime.span("boundary.chooser"):
            self.chooser.record_step(step, ended=ended)
            if self.is_leader:
                self.chooser.note_standbys()
        try:
            with steptime.span("boundary"):
                self._boundary(trainer, step)
        finally:
            # the next step is timed from here: planning, agreement and migrations are not step time
            with steptime.span("boundary.chooser"):
                self.chooser.mark_step(self.generation, int(trainer.global_step))
        self.ahead.go(self.generation)  # the chooser is the thread's from here to the next boundary

    def _plan_reason(self, step: int, admit: bool) -> Optional[str]:
        """Why the leader plans at this step boundary, if it does: ``"interval"`` when its planning interval is
        due, ``"standbys ready: <names>"`` when standbys became ready since its last decision
        (:attr:`~.shape_choice.ShapeChooser.arrival`: a ready instance is not left idle until the next interval);
        None otherwise, on a member that does not lead, and where the step admits no one (``admit`` False)."""
        if not (self.is_leader and admit):
            return None
        if self._clock.due(step):
            return "interval"
        arrived = self.chooser.arrival
        return f"standbys ready: {', '.join(arrived)}" if arrived else None

    def _join_plan(self) -> None:
        """Leader: wait for the decision planning ahead on its thread, if one does (a ``planning`` phase: the
        job stalls for what the step left of it)."""
        if not self.ahead.running:
            return
        self.life.to(Phase.PLANNING, reason="waiting for the decision planned during the step")
        try:
            with steptime.span("boundary.plan_wait"):
                self.ahead.join()
        finally:
            self.life.to(Phase.TRAINING)

    def _plan(self, trainer: "pl.Trainer", step: int, admit: bool) -> int:
        """Leader: publish the decision planned during the last step, or plan at this boundary if an interval is
        due -- on a thread (``config.plan_ahead``: published at a later boundary) or here; returns the
        generation proposed (0: none)."""
        question = self.ahead.take(step, self.generation)
        if question is not None and not admit:
            self.ahead.keep(question)  # this boundary admits no one: publish at the next that does
            return 0
        reason = question.reason if question is not None else self._plan_reason(step, admit)
        if not reason:
            return 0
        self.life.to(Phase.PLANNING, reason=reason)
        with steptime.span("boundary.plan"):
            if question is not None:
                rec = self.chooser.publish(trainer, question)
            elif self.config.plan_ahead:
                self.ahead.ask(self.chooser.gather(reason, (), admit), step)  # answered from the boundary's end
                rec = None
            else:
                rec = self.chooser.decide(trainer, reason=reason, leaving=())
        if not rec:
            self.life.to(Phase.TRAINING)
        return int(rec["generation"]) if rec else 0

    def _boundary(self, trainer: "pl.Trainer", step: int) -> None:
        assert self.live is not None and self.coord is not None and self.layout is not None
        assert self.store is not None
        if self.live.aborted.is_set():
            self.recover(trainer)
            return
        proposal = 0
        # a joiner restored from this step's state would skip the validation the members run right after it
        # (Lightning fast-forwards a validation pending at a train-batch-end checkpoint), or the end of fit if this
        # is the last step, or run the epoch-end hooks from state the members set up long before (see
        # ParcaeStrategy.epoch_ends): admit no one here
        with steptime.span("boundary.validation_follows"):
            admit = (not self.host.validation_follows(trainer) and not self.host.training_ends(trainer)
                     and not self.host.epoch_ends(trainer))
        proposal = self._plan(trainer, step, admit)
        world = len(self.layout.members)
        flags = torch.zeros(1 + world, dtype=torch.float64)
        flags[0] = proposal
        flags[1 + self.rank] = 1.0 if self.live.noticed.is_set() else 0.0
        try:
            with steptime.interval("step agreement", f"g{self.generation}/s{step}" if steptime.ON else ""):
                tree_max(flags, self.rank, world,
                         send=lambda t, dst: guarded_post(lambda: dist.isend(t, dst, tag=AGREEMENT_TAG),
                                                          "step agreement"),
                         recv=lambda t, src: guarded(lambda: dist.irecv(t, src, tag=AGREEMENT_TAG),
                                                     "step agreement"),
                         wait=lambda work: guarded_wait(work, "step agreement"))
        except PeerLostError:
            self.recover(trainer)
            return
        gen = int(flags[0].item())
        noticed = [self.layout.members[i] for i in range(world) if flags[1 + i] > 0]
        if not gen and noticed:
            if self.life.phase == Phase.TRAINING:
                self.life.to(Phase.PLANNING, reason="notice", noticed=noticed)
            if self.is_leader:
                self.ahead.drop("a preemption notice is decided at its boundary")
                rec = self.chooser.decide(trainer, reason=f"preemption notice for {', '.join(noticed)}", leaving=noticed,
                                          admit=admit)
                if rec is None:
                    raise ConfigurationError("internal: a notice produced no new generation")
            gen = self.generation + 1
        if not gen:
            return
        if self.life.phase == Phase.TRAINING:
            self.life.to(Phase.PLANNING, reason="agreed")
        self._enter_when_recorded(trainer, gen, "waiting for the next generation")

    def _enter_when_recorded(self, trainer: "pl.Trainer", gen: int, waiting: str) -> None:
        """Wait for generation ``gen``'s record and switch to it; a member lost meanwhile is recovered from."""
        assert self.live is not None and self.coord is not None and self.store is not None
        try:
            self.live.wait_key(self.store, f"parcae/genrec/{gen}", waiting)
        except PeerLostError:
            self.recover(trainer)
            return
        rec = self.coord.generation(gen)
        assert rec is not None
        self.switch(trainer, rec)

    def split_global_batch(self, trainer: "pl.Trainer") -> None:
        """Before the first step: move to a shape whose D splits the global batch the loader just revealed.

        Called by every member of a generation whose D does not split B (the data path's check: the launcher
        seated it before B was known). The leader proposes the same P with the largest D that splits B
        (:meth:`~.shape_choice.ShapeChooser.split_global_batch`); every member enters it in place, and those it
        leaves out are released (they exit and start again as standbys). A member lost meanwhile is recovered
        from as at any boundary."""
        self.life.to(Phase.PLANNING, reason="global batch does not split")
        gen = self.generation + 1
        if self.is_leader:
            self.chooser.split_global_batch(trainer)
        self._enter_when_recorded(trainer, gen, "waiting for a shape that splits the global batch")

    # ============================================================================================ switching
    def switch(self, trainer: "pl.Trainer", rec: dict[str, Any]) -> None:
        """Enter generation ``rec``: its parts move the state (:class:`~.switching.Switch`), then this runtime
        enters it -- or falls back to the checkpoint when it is a fallback or cannot be formed."""
        assert self.live is not None and self.coord is not None and self.switching is not None
        assert self.recovery is not None and self.admission is not None
        t0 = time.monotonic()
        if self.life.phase != Phase.MIGRATING:
            self.life.to(Phase.MIGRATING, generation=rec["generation"], kind=rec["kind"])
        if rec["kind"] == "fallback":
            self.recovery.fallback(trainer, rec)
        loop = self.admission.loop_state(trainer) if self.switching.hands_loop_state(rec) else None
        try:
            moved = self.switching.switch(trainer, rec, loop)
        except GenerationNotEntered as exc:
            if exc.intact and self.layout is not None and self.member in self.layout.members:
                # an old member that applied nothing of the new generation (a joiner or a mover was lost while
                # they met): recover with the other survivors from the generation it still holds
                self.event("switch_abandoned", generation=rec["generation"], reason=exc.reason)
                self.recover(trainer)
                return
            self.recovery.fallback(trainer, {"reason": exc.reason})
            raise  # not reached: the fallback exits
        self.state.enter(rec)
        self.live.set_generation(self.generation, self.state.watch())
        if self.is_leader:
            self.coord.set_current(self.generation)
        info = moved.report(rec, time.monotonic() - t0, trainer.global_step)
        if self._recovering_since is not None:  # from noticing the loss to training again (detection excluded)
            info["recovery_s"] = round(time.monotonic() - self._recovering_since, 4)
            self._recovering_since = None
        self.migrations.append(info)
        self.event("migration", **info)
        self.life.to(Phase.TRAINING, **{k: info[k] for k in ("kind", "duration_s", "D", "P")})

    # ============================================================================================ failures
    def decide_commit(self, step: int) -> bool:
        """See :meth:`~lightning_parcae.runtime.recovery.Recovery.decide_commit`."""
        assert self.recovery is not None
        return self.recovery.decide_commit(step)

    def commit(self, step: int) -> None:
        """See :meth:`~lightning_parcae.runtime.recovery.Recovery.commit`."""
        assert self.recovery is not None
        return self.recovery.commit(step)

    def recover(self, trainer: "pl.Trainer") -> None:
        """Survivors of an aborted generation agree on the next one (survivors only) and migrate to it."""
        assert self.recovery is not None and self.switching is not None
        self.ahead.drop("a member was lost")
        loss = self.recovery.begin()
        self._recovering_since = loss.since
        self.switching.teardown_groups(failed=True)
        rec = self.recovery.survivors_record(loss, int(trainer.global_step))
        self.switch(trainer, rec)

    def fallback(self, trainer: "pl.Trainer", rec: dict[str, Any]) -> None:
        """See :meth:`~lightning_parcae.runtime.recovery.Recovery.fallback`."""
        assert self.recovery is not None
        return self.recovery.fallback(trainer, rec)

    def close(self, finished: bool = False) -> None:
        """Stop heartbeats (end of fit); ``finished``: tell waiting standbys that the job is over."""
        self.ahead.drop("the run ends")
        if finished:
            self.chooser.save_profile()
        if finished and self.store is not None and self.is_leader:
            try:
                self.store.set("parcae/finished", str(self.generation))
            except Exception as exc:  # noqa: BLE001 -- best effort at exit
                log.debug("could not mark the job finished: %s", exc)
        if self.live is not None:
            activate(None)
            self.live.stop()


def threading_main() -> bool:
    """Whether this is the main thread (signal handlers can only be installed there)."""
    import threading  # noqa: PLC0415

    return threading.current_thread() is threading.main_thread()


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
