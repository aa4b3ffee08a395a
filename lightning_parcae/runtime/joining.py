"""Admission of a new process: wait as a warm standby, receive the layers and loop state, start training.

Problem: a process added to a running job (a new spot instance) must not disturb it while it starts: it imports,
builds the model and heartbeats as a standby until a generation includes it, then receives exactly the layers it
will hold (with their optimizer state) from live holders and the loop state (step, epoch, sample cursor, callbacks,
replicated parameters) from the leader, and resumes as if it had always been there. The leader's side is
:meth:`Admission.loop_state`. :class:`Admission` keeps what the joiner received and returns the admitting
generation (:class:`Admitted`); the :class:`~lightning_parcae.runtime.elastic.ElasticRuntime` enters it.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from lightning_parcae.contract import RELEASED_EXIT
from lightning_parcae.errors import ConfigurationError, PeerLostError
from lightning_parcae.planning.migration_plan import MigrationPlan
from lightning_parcae.runtime.lifecycle import Phase, exit_now
from lightning_parcae.runtime.liveness import activate
from lightning_parcae.runtime.migration import exchange
from lightning_parcae.runtime.generation import GenerationState
from lightning_parcae.runtime.host import TrainingHost
from lightning_parcae.runtime.part import PartContext
from lightning_parcae.runtime.switching import movers, meet_transition

if TYPE_CHECKING:  # pragma: no cover
    import pytorch_lightning as pl

__all__ = ["Admission", "Admitted", "admits"]

log = logging.getLogger("lightning_parcae.elastic")


def admits(rec: dict[str, Any], member: str) -> bool:
    """Whether generation record ``rec`` admits the standby ``member``: it takes part in the transition *and* is
    a member of the new layout (a standby has no state to send, so it is never in a transition only to leave).

    Regression (issue 20's network-namespace test): an agent restarted its released worker as a standby under the
    same member id; the new standby found that id in the transition of the generation that had just released it,
    took it for its admission and crashed on ``loop_from`` (``None``: that generation admitted nobody), exit 1.
    """
    layout = rec.get("layout") or {}
    return member in rec.get("transition", ()) and member in layout.get("members", ())


@dataclass(frozen=True)
class Admitted:
    """The generation that admitted this standby (returned by :meth:`Admission.join_wait`).

    Attributes:
        record: Its record (the runtime enters it; the caller builds its process groups).
        group_of: The job's agreed parameter-group map (per optimizer, parameter name -> param group).
        transfer_s: Seconds the state transfer took.
    """

    record: dict[str, Any]
    group_of: list[dict[str, int]]
    transfer_s: float


class Admission:
    """The joining half of one process's live-reconfiguration protocol.

    Args:
        ctx: The connection to the job (store, records, heartbeats, lifecycle, events).
        state: The current generation (read only).
        host: The training side (its loop state for joiners, its evaluation loaders).
        stall_timeout: The progress watchdog's bound (the transition world's rendezvous).

    Attributes:
        inbox: What this joiner received in its transition world, by sender (layers, the loop state).
    """

    def __init__(self, ctx: PartContext, state: GenerationState, host: TrainingHost, stall_timeout: timedelta) -> None:
        self.ctx = ctx
        self.state = state
        self.host = host
        self.stall_timeout = stall_timeout
        self.inbox: dict[int, Any] = {}

    def join_wait(self) -> Admitted:
        """Standby: register, heartbeat, and wait until a generation admits this member; receive its state.

        Returns:
            The admitting generation (the runtime enters it, the caller builds its process groups).
        """
        ctx = self.ctx
        ctx.life.to(Phase.STANDBY)
        ctx.live.start()
        ctx.coord.register_standby(ctx.member)
        log.info("%s: waiting as a standby to be admitted", ctx.member)
        checked = -1
        while True:
            cur = ctx.coord.current()
            for g in range(max(checked + 1, cur), cur + 2):
                rec = ctx.coord.generation(g)
                if rec is None:
                    continue
                checked = max(checked, g if g <= cur else checked)
                if admits(rec, ctx.member):
                    return self._migrate_in(rec)
            if ctx.live.noticed.is_set():  # a preemption notice while still a standby: nothing to hand over
                log.warning("%s: preemption notice while waiting as a standby; leaving", ctx.member)
                ctx.event("standby_exit", reason="notice")
                ctx.life.to(Phase.STOPPED)
                ctx.live.stop()
                exit_now(0)
            if ctx.store.check(["parcae/finished"]):
                log.warning("%s: the job finished before this standby was needed; exiting", ctx.member)
                ctx.event("standby_exit", reason="job finished")
                ctx.life.to(Phase.STOPPED)
                ctx.live.stop()
                exit_now(0)
            time.sleep(0.05)

    def _migrate_in(self, rec: dict[str, Any]) -> Admitted:
        """A joiner's part of a migration: receive layers + loop state in the transition world."""
        ctx = self.ctx
        ctx.life.to(Phase.MIGRATING, generation=rec["generation"], kind=rec["kind"])
        plan = MigrationPlan.from_json(rec["plan"])
        transition = movers(rec)
        t0 = time.monotonic()
        ctx.live.set_generation(int(rec["generation"]), [m for m in transition if m != ctx.member])
        activate(ctx.live)
        srcs = {transition.index(t.src) for t in plan.receives(ctx.member)}
        srcs.add(transition.index(rec["loop_from"]))
        try:
            meet_transition(ctx.store, rec, ctx.member, self.stall_timeout, ctx.live.abort_reason)
            self.inbox = exchange({}, sorted(srcs), "joining state transfer")
        except (RuntimeError, PeerLostError) as exc:
            # Regression (chaos seeds 18, 24): members were lost while a planned generation that admitted this
            # standby was being entered; its transition world never formed, the members fell back to the
            # checkpoint -- and this standby died with the rendezvous error (exit 1), which failed the whole job.
            self.give_up(int(rec["generation"]), exc)
        dist.destroy_process_group()
        pg = ctx.coord.get("parcae/pgroups", timeout_s=None)
        group_of = [dict(m) for m in pg["map"]] if pg else []
        return Admitted(record=rec, group_of=group_of, transfer_s=time.monotonic() - t0)

    def give_up(self, generation: int, exc: BaseException) -> None:
        """The admission into ``generation`` failed (a member lost while it formed): leave as "released".

        A standby has nothing to hand over, so it exits ``RELEASED_EXIT`` and the launcher starts a fresh one;
        an exit 1 would fail the whole job. Used for a failed transition world and state transfer, and for a
        failure to build the admitting generation's process groups (regression: chaos seed 60, a member killed
        while a standby was admitted -- the joiner's ``new_group`` timed out and it exited 1).
        """
        reason = f"could not join generation {generation}: {(str(exc).splitlines() or [''])[0][:160]}"
        log.warning("%s: %s", self.ctx.member, reason)
        self.ctx.event("join_failed", reason=reason)
        self.ctx.life.to(Phase.FENCED, reason="join failed")
        exit_now(RELEASED_EXIT)

    def joined(self, trainer: "pl.Trainer", transfer_s: float) -> None:
        """The joiner's stage, optimizers and loop state are in place: watch the generation and start training."""
        ctx, state = self.ctx, self.state
        activate(ctx.live)
        ctx.live.set_generation(state.generation, state.watch())
        ctx.life.to(Phase.TRAINING, generation=state.generation, joined=True)
        ctx.event("joined", step=int(trainer.global_step), D=state.layout.data_parallel if state.layout else None,
                  P=state.layout.pipeline_stages if state.layout else None, transfer_s=round(float(transfer_s), 4))
        # Regression (held-out chaos seeds 1001, 1004, 1005: every failing trial validated, no passing one did):
        # the members rebuild their validation loader after a switch (Lightning's loader request ends in a
        # barrier), while a joiner kept the one it built alone at start-up and went straight to the metric
        # reductions -- mismatched collectives, a 15 s stall until the watchdog. A joiner now rebuilds too.
        self.host.reset_eval_loaders(trainer)

    def joiner_checkpoint(self) -> dict[str, Any]:
        """The checkpoint dict a joiner restores from: loop state from the leader + its received layers."""
        loop: Optional[dict[str, Any]] = None
        layers: dict[int, Any] = {}
        for blob in self.inbox.values():
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
        """Leader: everything a joiner needs besides its layers (loop, callbacks, schedulers, replicated params;
        the parts outside the stack that belong to a stage travel with layer 0's or the last layer's payload)."""
        from lightning_parcae.runtime.checkpoint import plain_containers  # noqa: PLC0415

        s = self.host
        ckpt = s.loop_checkpoint(trainer)
        # a stage's keys -- its layers' and the outside parts riding with layer 0 or the last layer -- come with the
        # layers' payloads from their holders (the leader does not hold the last layer's); the rest is replicated
        ckpt["state_dict"] = {k: v.detach().cpu().clone() for k, v in ckpt["state_dict"].items()
                              if not s.is_stage_key(k)}
        for opt in ckpt.get("optimizer_states", []):
            opt["state"] = {k: v for k, v in opt.get("state", {}).items() if not s.is_stage_key(k)}
        ckpt["parcae"] = {"version": 1, "data": s.data_state(), "layout": {}}
        return plain_containers(ckpt)
