"""Failures at a step: the two-phase step commit, recovery of the survivors, and the fallback to a checkpoint.

Problem: a member can vanish in the middle of a step. Every survivor must then (1) agree whether that step's update
is applied or discarded -- the same answer everywhere, also for members that read it late -- (2) wait until every
old member has announced itself or is dead, (3) agree on one next generation of survivors only and migrate to it,
and, when some stage lost every replica, (4) stop loudly for a restart from the last checkpoint. A member that was
declared dead while silent and wakes up must fence itself. Its steps
act for the runtime as a :class:`~lightning_parcae.runtime.part.RuntimePart`.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import TYPE_CHECKING, Any, Optional

from lightning_parcae.contract import FALLBACK_EXIT, FENCED_EXIT
from lightning_parcae.errors import PeerLostError
from lightning_parcae.planning.migration_plan import StageLostError, plan_migration
from lightning_parcae.runtime import steptime
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.lifecycle import Phase, exit_now
from lightning_parcae.runtime.liveness import SilenceClock, hb_key
from lightning_parcae.runtime.part import RuntimePart

if TYPE_CHECKING:  # pragma: no cover
    import pytorch_lightning as pl

__all__ = ["Recovery"]

log = logging.getLogger("lightning_parcae.elastic")


class Recovery(RuntimePart):
    """The failure half of one process's live-reconfiguration protocol."""

    def propose_fallback(self, step: int, reason: str, checkpoint: bool = False,
                         generation: Optional[int] = None) -> dict[str, Any]:
        """Propose a stop for a restart from the checkpoint as the next generation (or ``generation``)."""
        assert self.rt.coord is not None and self.rt.layout is not None
        target = self.rt.generation + 1 if generation is None else generation
        rec = {"generation": target, "kind": "fallback", "step": step, "reason": reason,
               "layout": self.rt.layout.to_json(), "time": time.time(), "checkpoint": checkpoint}
        return self.rt.coord.propose(rec)

    def decide_commit(self, step: int) -> bool:
        """After a failure inside ``step``: True if the step is applied everywhere, False if discarded everywhere."""
        assert self.rt.coord is not None and self.rt.layout is not None
        key = Coordinator.commit_key(self.rt.generation, step) + "/decision"
        count = self.rt.coord.commit_count(self.rt.generation, step)
        proposal = b"apply" if count >= len(self.rt.layout.members) else b"discard"
        return bytes(self.rt.store.compare_set(key, "", proposal)) == b"apply"

    def commit(self, step: int) -> None:
        """Two-phase step: count in and wait until everyone did (or the generation aborts)."""
        with steptime.span("commit"):
            self._commit(step)

    def _commit(self, step: int) -> None:
        assert self.rt.coord is not None and self.rt.layout is not None and self.rt.live is not None
        key = Coordinator.commit_key(self.rt.generation, step) + "/decision"
        if self.rt.coord.commit_arrive(self.rt.generation, step, len(self.rt.layout.members)):
            won = bytes(self.rt.store.compare_set(key, "", b"apply"))
            if won != b"apply":
                raise PeerLostError(f"step {step} was discarded by a survivor before everyone counted in")
            self._forget_commit(step - 1)
            return
        self.rt.live.wait_key(self.rt.store, key, f"commit of step {step}")
        if bytes(self.rt.store.get(key)) != b"apply":
            raise PeerLostError(f"step {step} was discarded after a failure")

    def _forget_commit(self, step: int) -> None:
        """Delete a finished step's commit keys (everyone has passed it), so the store does not grow per step."""
        base = Coordinator.commit_key(self.rt.generation, step)
        for key in (base, base + "/decision"):
            try:
                self.rt.store.delete_key(key)
            except Exception:  # noqa: BLE001 -- a store without delete (older etcd v2 API) just keeps them
                return

    def recover(self, trainer: "pl.Trainer") -> None:
        """Survivors of an aborted generation agree on the next one (survivors only) and migrate to it."""
        assert self.rt.layout is not None and self.rt.coord is not None and self.rt.live is not None
        g = self.rt.generation
        reason = self.rt.live.reason or "peer lost"
        self.rt.life.to(Phase.RECOVERING, generation=g, reason=reason)
        t0 = time.monotonic()
        self.rt._recovering_since = t0
        self.rt.live.abort(reason)
        self.rt.switching.teardown_groups(failed=True)
        self.rt.coord.announce_survivor(g, self.rt.member, {"step": int(trainer.global_step)})
        old = self.rt.layout
        alive: list[str] = []
        clock = SilenceClock(blind_after_s=self.rt.dead_after_s / 3)
        clock.reset(old.members, time.monotonic())
        deadline = time.monotonic() + 4 * self.rt.dead_after_s + 10.0
        while True:
            alive = [m for m in old.members if self.rt.coord.survivor(g, m) is not None]
            raws = {m: bytes(self.rt.store.get(hb_key(m))) if self.rt.store.check([hb_key(m)]) else None
                    for m in old.members if m not in alive}
            now = time.monotonic()
            clock.tick(now)
            pending = [m for m, raw in raws.items() if clock.silent_for(m, raw, now) <= self.rt.dead_after_s]
            if not pending or now > deadline:
                break
            time.sleep(0.05)
        dead = [m for m in old.members if m not in alive]
        self.rt.event("recovering", survivors=alive, dead=dead, reason=reason, wait_s=time.monotonic() - t0)
        step = int(trainer.global_step)
        rec = self._survivors_generation(g + 1, step, alive, dead, reason)
        if self.abandoned(rec, dead):
            # Regression (chaos seed 44): a member was SIGKILLed at the step where the leader had just proposed
            # the interval's planned generation g+1 (6 members, 2x3 -> 6x1). The survivors adopted that record --
            # the dead member in it -- waited 15 s for its process-group key and fell back to the checkpoint,
            # although every stage still had a live replica. The planned record is abandoned instead and the
            # survivors' generation takes the next number.
            self.rt.event("abandoned", generation=g + 1, dead=[m for m in dead if m in rec.get("transition", ())])
            rec = self._survivors_generation(g + 2, step, alive, dead, reason)
        if self.rt.member not in rec.get("transition", old.members):
            # e.g. a process that hung (SIGSTOP, a frozen VM) past the heartbeat timeout and then woke up
            msg = (f"{self.rt.member} is not a member of generation {rec['generation']} (declared dead while "
                   "silent); exiting")
            log.warning(msg)
            print(msg, file=sys.stderr, flush=True)
            self.rt.event("fenced", reason=msg)
            self.rt.life.to(Phase.FENCED, reason="not in the survivors' generation")
            exit_now(FENCED_EXIT)
        self.rt.switching.switch(trainer, rec)

    def _survivors_generation(self, target: int, step: int, alive: list[str], dead: list[str],
                              reason: str) -> dict[str, Any]:
        """Generation ``target``'s record: the one already proposed, else the survivors' shape (or a fallback)."""
        assert self.rt.layout is not None and self.rt.coord is not None
        existing = self.rt.coord.generation(target)
        if existing is not None:
            return existing
        old = self.rt.layout
        shape = self.rt.chooser.choose(len(old.members), len(alive), observe=False)
        if shape is None:
            return self.propose_fallback(step, f"{reason}: no shape fits {len(alive)}", generation=target)
        try:
            plan = plan_migration(old, alive, shape, self.rt.chooser.partition_for(shape[1]), self.rt._layer_bytes(),
                                  senders=alive)
        except StageLostError as exc:
            return self.propose_fallback(step, f"{reason}: {exc}", generation=target)
        return self.rt.coord.propose(self.rt._record(target, plan.new, plan, plan.kind.value, step, alive=alive,
                                                     reason=f"recovery: {reason}", dead=dead))

    def abandoned(self, rec: dict[str, Any], dead: list[str]) -> bool:
        """Whether the survivors skip ``rec``, a *planned* generation whose transition names a member now dead.

        A record made by survivors (it lists ``dead``) or a fallback binds everyone. A planned one (the leader's
        interval or notice decision, proposed just before the loss) can never form if a dead member is in it. The
        survivors' views of who is dead may differ (one waited out a silent member that another then saw announce
        itself), so the verdict is taken once in the store: the first survivor's "abandon" or "keep" holds for all.
        """
        if rec.get("kind") == "fallback" or "dead" in rec:
            return False
        proposal = b"abandon" if any(m in dead for m in rec.get("transition", ())) else b"keep"
        key = Coordinator.verdict_key(int(rec["generation"]))
        return bytes(self.rt.store.compare_set(key, "", proposal)) == b"abandon"

    def fallback(self, trainer: "pl.Trainer", rec: dict[str, Any]) -> None:
        """Some stage has no live replica (or no instance is left): say so loudly and exit for a restart from the
        last checkpoint. When every member is still alive (all under notice), a checkpoint is saved first, so
        nothing is lost."""
        saved = self._save_before_leaving(trainer) if rec.get("checkpoint") else None
        if saved:
            msg = (f"PARCAE STOP at step {trainer.global_step}: {rec.get('reason')}. Saved {saved}; the job restarts "
                   "from it when instances are back.")
            log.error(msg)
            print(msg, file=sys.stderr, flush=True)
            self.rt.event("fallback", reason=rec.get("reason"), step=int(trainer.global_step), checkpoint=saved)
            self.rt.life.to(Phase.FALLBACK, reason=rec.get("reason"))
            exit_now(FALLBACK_EXIT)
        msg = (f"PARCAE FALLBACK at step {trainer.global_step}: {rec.get('reason')}. No live process holds some "
               "layers, so the job must restart from the last checkpoint; the steps since that checkpoint are lost "
               "and will be recomputed.")
        log.error(msg)
        print(msg, file=sys.stderr, flush=True)
        self.rt.event("fallback", reason=rec.get("reason"), step=int(trainer.global_step))
        self.rt.life.to(Phase.FALLBACK, reason=rec.get("reason"))
        exit_now(FALLBACK_EXIT)

    def _save_before_leaving(self, trainer: "pl.Trainer") -> Optional[str]:
        """Collective save of ``run_dir/ckpt/last.ckpt`` (every member must call it); None without a run dir."""
        if not self.rt.run_dir:
            return None
        path = os.path.join(self.rt.run_dir, "ckpt", "last.ckpt")
        try:
            trainer.save_checkpoint(path)
            self.rt.s.wait_for_checkpoint()
        except Exception as exc:  # noqa: BLE001 -- the periodic checkpoint is still there
            log.error("could not save a checkpoint before stopping: %s", exc)
            return None
        return path
