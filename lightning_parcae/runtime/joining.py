"""Admission of a new process: wait as a warm standby, receive the layers and loop state, start training.

Problem: a process added to a running job (a new spot instance) must not disturb it while it starts: it imports,
builds the model and heartbeats as a standby until a generation includes it, then receives exactly the layers it
will hold (with their optimizer state) from live holders and the loop state (step, epoch, sample cursor, callbacks,
replicated parameters) from the leader, and resumes as if it had always been there. The leader's side is
:meth:`Admission.loop_state`. Its steps
act for the runtime as a :class:`~lightning_parcae.runtime.part.RuntimePart`.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from lightning_parcae.contract import RELEASED_EXIT
from lightning_parcae.errors import ConfigurationError, PeerLostError
from lightning_parcae.planning.migration_plan import MigrationPlan
from lightning_parcae.runtime.lifecycle import Phase, exit_now
from lightning_parcae.runtime.liveness import activate
from lightning_parcae.runtime.migration import exchange
from lightning_parcae.runtime.part import RuntimePart
from lightning_parcae.runtime.switching import forget_eval_loaders

if TYPE_CHECKING:  # pragma: no cover
    import pytorch_lightning as pl

__all__ = ["Admission"]

log = logging.getLogger("lightning_parcae.elastic")


class Admission(RuntimePart):
    """The joining half of one process's live-reconfiguration protocol."""

    def join_wait(self) -> dict[str, Any]:
        """Standby: register, heartbeat, and wait until a generation admits this member; receive its state.

        Returns:
            The admitting generation's record (the caller builds the process groups of it).
        """
        assert self.rt.coord is not None and self.rt.live is not None
        self.rt.life.to(Phase.STANDBY)
        self.rt.live.start()
        self.rt.coord.register_standby(self.rt.member)
        log.info("%s: waiting as a standby to be admitted", self.rt.member)
        checked = -1
        while True:
            cur = self.rt.coord.current()
            for g in range(max(checked + 1, cur), cur + 2):
                rec = self.rt.coord.generation(g)
                if rec is None:
                    continue
                checked = max(checked, g if g <= cur else checked)
                if self.rt.member in rec.get("transition", ()):
                    self._migrate_in(rec)
                    return rec
            if self.rt.live.noticed.is_set():  # a preemption notice while still a standby: nothing to hand over
                log.warning("%s: preemption notice while waiting as a standby; leaving", self.rt.member)
                self.rt.event("standby_exit", reason="notice")
                self.rt.life.to(Phase.STOPPED)
                self.rt.live.stop()
                exit_now(0)
            if self.rt.store.check(["parcae/finished"]):
                log.warning("%s: the job finished before this standby was needed; exiting", self.rt.member)
                self.rt.event("standby_exit", reason="job finished")
                self.rt.life.to(Phase.STOPPED)
                self.rt.live.stop()
                exit_now(0)
            time.sleep(0.05)

    def _migrate_in(self, rec: dict[str, Any]) -> None:
        """A joiner's part of a migration: receive layers + loop state in the transition world."""
        self.rt.life.to(Phase.MIGRATING, generation=rec["generation"], kind=rec["kind"])
        plan = MigrationPlan.from_json(rec["plan"])
        transition = list(rec["transition"])
        t0 = time.monotonic()
        assert self.rt.live is not None
        self.rt.live.set_generation(int(rec["generation"]), [m for m in transition if m != self.rt.member])
        activate(self.rt.live)
        srcs = {transition.index(t.src) for t in plan.receives(self.rt.member)}
        srcs.add(transition.index(rec["loop_from"]))
        try:
            self.rt.switching.init_transition(rec)
            self.rt.join_inbox = exchange({}, sorted(srcs), "joining state transfer")
        except (RuntimeError, PeerLostError) as exc:
            # Regression (chaos seeds 18, 24): members were lost while a planned generation that admitted this
            # standby was being entered; its transition world never formed, the members fell back to the
            # checkpoint -- and this standby died with the rendezvous error (exit 1), which failed the whole job.
            self.give_up(int(rec["generation"]), exc)
        dist.destroy_process_group()
        self.rt._enter(rec)
        pg = self.rt.coord.get("parcae/pgroups", timeout_s=None) if self.rt.coord else None
        self.rt.group_of = [dict(m) for m in pg["map"]] if pg else []
        self.rt.stats["join_transfer_s"] = time.monotonic() - t0

    def give_up(self, generation: int, exc: BaseException) -> None:
        """The admission into ``generation`` failed (a member lost while it formed): leave as "released".

        A standby has nothing to hand over, so it exits ``RELEASED_EXIT`` and the launcher starts a fresh one;
        an exit 1 would fail the whole job. Used for a failed transition world and state transfer, and for a
        failure to build the admitting generation's process groups (regression: chaos seed 60, a member killed
        while a standby was admitted -- the joiner's ``new_group`` timed out and it exited 1).
        """
        reason = f"could not join generation {generation}: {(str(exc).splitlines() or [''])[0][:160]}"
        log.warning("%s: %s", self.rt.member, reason)
        self.rt.event("join_failed", reason=reason)
        self.rt.life.to(Phase.FENCED, reason="join failed")
        exit_now(RELEASED_EXIT)

    def joined(self, trainer: "pl.Trainer") -> None:
        """Called by the strategy once the joiner's stage, optimizers and loop state are in place."""
        assert self.rt.live is not None
        activate(self.rt.live)
        self.rt.live.set_generation(self.rt.generation, self.rt._watch())
        self.rt.admitted = True
        self.rt.life.to(Phase.TRAINING, generation=self.rt.generation, joined=True)
        self.rt.event("joined", step=int(trainer.global_step), D=self.rt.layout.data_parallel if self.rt.layout else None,
                   P=self.rt.layout.pipeline_stages if self.rt.layout else None,
                   transfer_s=round(float(self.rt.stats.get("join_transfer_s", 0.0)), 4))
        self.rt._last_interval_t = time.monotonic()
        self.rt._last_interval_step = int(trainer.global_step)
        # Regression (held-out chaos seeds 1001, 1004, 1005: every failing trial validated, no passing one did):
        # the members rebuild their validation loader after a switch (Lightning's loader request ends in a
        # barrier), while a joiner kept the one it built alone at start-up and went straight to the metric
        # reductions -- mismatched collectives, a 15 s stall until the watchdog. A joiner now rebuilds too.
        forget_eval_loaders(trainer)

    def joiner_checkpoint(self) -> dict[str, Any]:
        """The checkpoint dict a joiner restores from: loop state from the leader + its received layers."""
        loop: Optional[dict[str, Any]] = None
        layers: dict[int, Any] = {}
        for blob in self.rt.join_inbox.values():
            if "loop" in blob:
                loop = blob["loop"]
            layers.update(blob.get("layers", {}))
        if loop is None:
            raise ConfigurationError("the admitting generation sent no loop state to this joiner")
        ckpt = dict(loop)
        state = dict(ckpt.get("state_dict", {}))
        opt_states = [dict(o) for o in ckpt.get("optimizer_states", [])]
        for payload in layers.values():
            state.update(payload["tensors"])
            for k, per in enumerate(payload["optim"]):
                if k < len(opt_states):
                    opt_states[k]["state"] = {**opt_states[k].get("state", {}), **per}
        ckpt["state_dict"] = state
        ckpt["optimizer_states"] = opt_states
        return ckpt

    def loop_state(self, trainer: "pl.Trainer") -> dict[str, Any]:
        """Leader: everything a joiner needs besides its layers (loop, callbacks, schedulers, replicated params)."""
        from lightning_parcae.runtime.checkpoint import plain_containers  # noqa: PLC0415

        s = self.rt.s
        with s.local_state_dump():
            ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        stage_keys = s.stage_key_set()
        ckpt["state_dict"] = {k: v.detach().cpu().clone() for k, v in ckpt["state_dict"].items()
                              if k not in stage_keys}
        for opt in ckpt.get("optimizer_states", []):
            opt["state"] = {k: v for k, v in opt.get("state", {}).items() if not s.is_stage_key(k)}
        ckpt["parcae"] = {"version": 1, "data": s.data_state(), "layout": {}}
        return plain_containers(ckpt)
