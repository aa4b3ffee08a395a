"""Failures at a step: the two-phase step commit, recovery of the survivors, and the fallback to a checkpoint.

Problem: a member can vanish in the middle of a step. Every survivor must then (1) agree whether that step's update
is applied or discarded -- the same answer everywhere, also for members that read it late -- (2) wait until every
old member has announced itself or is dead, (3) agree on one next generation of survivors only and migrate to it,
and, when some stage lost every replica, (4) stop loudly for a restart from the last checkpoint. A member that was
declared dead while silent and wakes up must fence itself. :class:`Recovery` reads the current generation and
returns the record the survivors enter; the :class:`~lightning_parcae.runtime.elastic.ElasticRuntime` leaves the
old groups and switches to it.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Optional, Protocol

from lightning_parcae.contract import FALLBACK_EXIT, FENCED_EXIT
from lightning_parcae.errors import PeerLostError
from lightning_parcae.planning.costmodel import Shape
from lightning_parcae.planning.migration_plan import StageLostError, plan_migration
from lightning_parcae.runtime import steptime
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.lifecycle import Phase, exit_now
from lightning_parcae.runtime.liveness import SilenceClock, dead_key, read_beats
from lightning_parcae.runtime.generation import GenerationRecords, GenerationState
from lightning_parcae.runtime.host import TrainingHost
from lightning_parcae.runtime.part import PartContext

if TYPE_CHECKING:  # pragma: no cover
    import pytorch_lightning as pl

__all__ = ["Recovery", "Loss", "SurvivorShapes"]

log = logging.getLogger("lightning_parcae.elastic")


class SurvivorShapes(Protocol):
    """What recovery asks of the shape choice: a shape for the survivors and its partition, and -- when none fits
    -- the fewest instances one would fit on (the fallback tells the launcher to wait for that many)."""

    def choose(self, n_now: int, n_next: int, observe: bool) -> Optional[Shape]: ...

    def partition_for(self, p: int) -> list[int]: ...

    def fewest_instances(self, above: int) -> Optional[int]: ...


@dataclass(frozen=True)
class Loss:
    """A generation's loss as this process saw it (returned by :meth:`Recovery.begin`).

    Attributes:
        reason: Why the generation was aborted.
        since: When this process began recovering (monotonic seconds).
    """

    reason: str
    since: float


class Recovery:
    """The failure half of one process's live-reconfiguration protocol.

    Args:
        ctx: The connection to the job (store, records, heartbeats, lifecycle, events).
        state: The current generation (read only).
        records: Builds the survivors' and the fallback's records.
        shapes: The shape for the survivors (the runtime's :class:`~.shape_choice.ShapeChooser`).
        host: The training side (its checkpoint before a stop).
        dead_after_s: Silence after which a member is declared dead.
        run_dir: The run directory (a checkpoint before a stop goes there), or None.
    """

    def __init__(self, ctx: PartContext, state: GenerationState, records: GenerationRecords, shapes: SurvivorShapes,
                 host: TrainingHost, dead_after_s: float, run_dir: Optional[str]) -> None:
        self.ctx = ctx
        self.state = state
        self.records = records
        self.shapes = shapes
        self.host = host
        self.dead_after_s = dead_after_s
        self.run_dir = run_dir
        self._rounds: dict[int, int] = {}  # rounds of recovery from each base generation (see survivors_record)

    def propose_fallback(self, step: int, reason: str, checkpoint: bool = False,
                         generation: Optional[int] = None, min_instances: Optional[int] = None) -> dict[str, Any]:
        """Propose a stop for a restart from the checkpoint as the next generation (or ``generation``)."""
        target = self.state.generation + 1 if generation is None else generation
        return self.ctx.coord.propose(self.records.fallback(target, step, reason, checkpoint,
                                                           min_instances=min_instances))

    def decide_commit(self, step: int) -> bool:
        """After a failure inside ``step``: True if the step is applied everywhere, False if discarded everywhere."""
        assert self.state.layout is not None
        g = self.state.generation
        key = Coordinator.commit_key(g, step) + "/decision"
        count = self.ctx.coord.commit_count(g, step)
        proposal = b"apply" if count >= len(self.state.layout.members) else b"discard"
        return bytes(self.ctx.store.compare_set(key, "", proposal)) == b"apply"

    def commit(self, step: int) -> None:
        """Two-phase step: count in and wait until everyone did (or the generation aborts)."""
        with steptime.span("commit"):
            self._commit(step)

    def _commit(self, step: int) -> None:
        assert self.state.layout is not None
        ctx, g = self.ctx, self.state.generation
        key = Coordinator.commit_key(g, step) + "/decision"
        if ctx.coord.commit_arrive(g, step, len(self.state.layout.members), ctx.member):
            won = bytes(ctx.store.compare_set(key, "", b"apply"))
            if won != b"apply":
                raise PeerLostError(f"step {step} was discarded by a survivor before everyone counted in")
            ctx.coord.forget_commit(g, step - 1)  # everyone has passed the step before: the store need not grow
            return
        ctx.live.wait_key(ctx.store, key, f"commit of step {step}")
        if bytes(ctx.store.get(key)) != b"apply":
            raise PeerLostError(f"step {step} was discarded after a failure")

    def begin(self) -> Loss:
        """The generation was lost: enter RECOVERING and abort it for every participant (the runtime then leaves
        its groups and calls :meth:`survivors_record`)."""
        ctx = self.ctx
        reason = ctx.live.reason or "peer lost"
        ctx.life.to(Phase.RECOVERING, generation=self.state.generation, reason=reason)
        loss = Loss(reason=reason, since=time.monotonic())
        ctx.live.abort(reason)
        return loss

    def survivors_record(self, loss: Loss, step: int) -> dict[str, Any]:
        """Announce this survivor, wait until every old member has announced or is dead, and return the record
        of the survivors' generation (fencing this process when the survivors left it out)."""
        assert self.state.layout is not None
        ctx, g, reason, t0 = self.ctx, self.state.generation, loss.reason, loss.since
        ctx.coord.announce_survivor(g, ctx.member, {"step": step})
        old = self.state.layout
        alive: list[str] = []
        # a member declared dead while a later generation formed is dead, even if it announced itself in an
        # earlier round of this recovery (see below)
        declared = self.declared_dead_since(g, old.members)
        clock = SilenceClock(blind_after_s=self.dead_after_s / 3)
        clock.reset(old.members, time.monotonic())
        deadline = time.monotonic() + 4 * self.dead_after_s + 10.0
        while True:
            alive = [m for m in old.members if ctx.coord.survivor(g, m) is not None and m not in declared]
            raws = read_beats(ctx.store, [m for m in old.members if m not in alive and m not in declared])
            now = time.monotonic()
            clock.tick(now)
            pending = [m for m, raw in raws.items() if clock.silent_for(m, raw, now) <= self.dead_after_s]
            if not pending or now > deadline:
                break
            time.sleep(0.05)
        dead = [m for m in old.members if m not in alive]
        ctx.event("recovering", survivors=alive, dead=dead, reason=reason, wait_s=time.monotonic() - t0)
        # Regression (chaos seed 44): a member was SIGKILLed at the step where the leader had just proposed the
        # interval's planned generation g+1 (6 members, 2x3 -> 6x1). The survivors adopted that record -- the dead
        # member in it -- waited 15 s for its process-group key and fell back to the checkpoint, although every
        # stage still had a live replica. The planned record is abandoned instead and the survivors' generation
        # takes the next number.
        # Regression (chaos seed 386): the survivors' generation itself never formed -- a survivor (i3) was
        # SIGKILLed while it formed -- and the next round of recovery from the same base counted i3 alive (its
        # announcement from the first round was still in the store) and re-adopted the survivors' record naming
        # it, whose groups could never form: 128 rounds in 400 s, no step trained. Every record from g+1 on that
        # can no longer form is now skipped, and the announcements of the members declared dead since are not
        # counted.
        # Each further round from the same base needs one more death, so more rounds than old members is a loop
        # nobody foresaw: stop loudly for a restart from the checkpoint instead of retrying forever (a fallback
        # record binds every survivor that reaches it; a survivor still forming an older record times out there
        # and finds it).
        rounds = self._rounds[g] = self._rounds.get(g, 0) + 1
        give_up = rounds > len(old.members) + 2

        def record(target: int) -> dict[str, Any]:
            """Generation ``target``'s record (the existing one, else ours: a fallback once we give up)."""
            if give_up and ctx.coord.generation(target) is None:
                return self.propose_fallback(step, f"{reason}: recovery from generation {g} formed no generation "
                                             f"in {rounds - 1} rounds", generation=target)
            return self._survivors_generation(target, step, alive, dead, reason)

        def skipped(rec: dict[str, Any]) -> bool:
            if give_up:
                return rec.get("kind") != "fallback"  # only a fallback ends a loop nobody foresaw
            return self.abandoned(rec, dead + self.lost_joiners(rec))

        target = g + 1
        rec = record(target)
        while skipped(rec):
            ctx.event("abandoned", generation=target,
                      dead=[m for m in rec.get("transition", ()) if m in dead or m in declared])
            target += 1
            rec = record(target)
        if ctx.member not in rec.get("transition", old.members):
            # e.g. a process that hung (SIGSTOP, a frozen VM) past the heartbeat timeout and then woke up
            msg = (f"{ctx.member} is not a member of generation {rec['generation']} (declared dead while "
                   "silent); exiting")
            log.warning(msg)
            print(msg, file=sys.stderr, flush=True)
            ctx.event("fenced", reason=msg)
            ctx.life.to(Phase.FENCED, reason="not in the survivors' generation")
            exit_now(FENCED_EXIT)
        return rec

    def _survivors_generation(self, target: int, step: int, alive: list[str], dead: list[str],
                              reason: str) -> dict[str, Any]:
        """Generation ``target``'s record: the one already proposed, else the survivors' shape (or a fallback)."""
        assert self.state.layout is not None
        existing = self.ctx.coord.generation(target)
        if existing is not None:
            return existing
        old = self.state.layout
        shape = self.shapes.choose(len(old.members), len(alive), observe=False, available=alive, senders=alive)
        if shape is None:
            return self.propose_fallback(step, f"{reason}: no shape fits {len(alive)}", generation=target,
                                         min_instances=self.shapes.fewest_instances(len(alive)))
        try:
            plan = plan_migration(old, alive, shape, self.shapes.partition_for(shape[1]), self.records.layer_bytes(),
                                  senders=alive)
        except StageLostError as exc:
            return self.propose_fallback(step, f"{reason}: {exc}", generation=target)
        return self.ctx.coord.propose(self.records.record(target, plan.new, plan, plan.kind.value, step, alive=alive,
                                                          reason=f"recovery: {reason}", dead=dead))

    def lost_joiners(self, rec: dict[str, Any]) -> list[str]:
        """The processes of ``rec``'s transition that are not old members and were declared dead while it formed
        (only :meth:`abandoned` reads them, and only for a planned record).

        Regression (the README's main job, slow suite): the trace removed a waiting standby just as the leader
        admitted it. The transition world waited for it, declared it dead, and every old member fell back to the
        checkpoint -- although none of them had applied anything of the new generation and every stage still had
        its replicas. The old members now recover instead (:meth:`~.elastic.ElasticRuntime.switch`), and the
        planned record naming the lost joiner is abandoned like one naming a dead old member. The joiner is not an
        old member, so it never announces itself; its death is read from the key the heartbeat thread that declared
        it wrote (:func:`~.liveness.dead_key`).
        """
        assert self.state.layout is not None
        old = set(self.state.layout.members)
        return [m for m in self._declared_dead(int(rec["generation"]), rec.get("transition", ())) if m not in old]

    def _declared_dead(self, g: int, members: Iterable[str]) -> list[str]:
        """Those of ``members`` a heartbeat declared dead while generation ``g`` formed or ran (their
        :func:`~.liveness.dead_key`)."""
        return [m for m in members if self.ctx.store.check([dead_key(g, m)])]

    def abandoned(self, rec: dict[str, Any], dead: list[str]) -> bool:
        """Whether the survivors skip ``rec``: a generation that can no longer form.

        A fallback binds everyone. A *planned* record (the leader's interval or notice decision, proposed just
        before the loss) can never form if a dead member is in it. The survivors' views of who is dead may differ
        (one waited out a silent member that another then saw announce itself), so the verdict is taken once in
        the store: the first survivor's "abandon" or "keep" holds for all.

        A record made by survivors (it lists ``dead``) binds everyone too -- unless it already failed to form: a
        member of its transition was declared dead while it formed (:func:`~.liveness.dead_key` of its
        generation, which the declaring heartbeat writes before it aborts the generation). That is a fact in the
        store, not a view; its "abandon" is recorded for the others, and no "keep" is ever recorded for such a
        record, so a round of recovery that saw it before the death does not bind a later round to it.
        """
        if rec.get("kind") == "fallback":
            return False
        g = int(rec["generation"])
        key = Coordinator.verdict_key(g)
        if "dead" in rec:
            if not self._declared_dead(g, rec.get("transition", ())):
                return self.ctx.store.check([key]) and bytes(self.ctx.store.get(key)) == b"abandon"
            return bytes(self.ctx.store.compare_set(key, "", b"abandon")) == b"abandon"
        proposal = b"abandon" if any(m in dead for m in rec.get("transition", ())) else b"keep"
        return bytes(self.ctx.store.compare_set(key, "", proposal)) == b"abandon"

    def declared_dead_since(self, g: int, members: Iterable[str]) -> set[str]:
        """Members declared dead while a generation after ``g`` formed (each proposed record from ``g + 1`` on).

        Recovery from generation ``g`` runs again when the survivors' generation fails to form; a member that
        announced itself in the first round and died while that generation formed is dead for the next round.
        """
        members = list(members)
        out: set[str] = set()
        t = g + 1
        while self.ctx.coord.generation(t) is not None:
            out.update(self._declared_dead(t, members))
            t += 1
        return out

    def fallback(self, trainer: "pl.Trainer", rec: dict[str, Any]) -> None:
        """Some stage has no live replica (or no instance is left): say so loudly and exit for a restart from the
        last checkpoint. When every member is still alive (all under notice), a checkpoint is saved first, so
        nothing is lost."""
        ctx = self.ctx
        saved = self._save_before_leaving(trainer) if rec.get("checkpoint") else None
        if saved:
            msg = (f"PARCAE STOP at step {trainer.global_step}: {rec.get('reason')}. Saved {saved}; the job restarts "
                   "from it when instances are back.")
            log.error(msg)
            print(msg, file=sys.stderr, flush=True)
            ctx.event("fallback", reason=rec.get("reason"), step=int(trainer.global_step), checkpoint=saved,
                      min_instances=rec.get("min_instances"))
            ctx.life.to(Phase.FALLBACK, reason=rec.get("reason"))
            exit_now(FALLBACK_EXIT)
        msg = (f"PARCAE FALLBACK at step {trainer.global_step}: {rec.get('reason')}. No live process holds some "
               "layers, so the job must restart from the last checkpoint; the steps since that checkpoint are lost "
               "and will be recomputed.")
        log.error(msg)
        print(msg, file=sys.stderr, flush=True)
        ctx.event("fallback", reason=rec.get("reason"), step=int(trainer.global_step),
                  min_instances=rec.get("min_instances"))
        ctx.life.to(Phase.FALLBACK, reason=rec.get("reason"))
        exit_now(FALLBACK_EXIT)

    def _save_before_leaving(self, trainer: "pl.Trainer") -> Optional[str]:
        """Collective save of ``run_dir/ckpt/last.ckpt`` (every member must call it); None without a run dir."""
        if not self.run_dir:
            return None
        path = os.path.join(self.run_dir, "ckpt", "last.ckpt")
        try:
            self.host.save_before_leaving(trainer, path)
        except Exception as exc:  # noqa: BLE001 -- the periodic checkpoint is still there
            log.error("could not save a checkpoint before stopping: %s", exc)
            return None
        return path
