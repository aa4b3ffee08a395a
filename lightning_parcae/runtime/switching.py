"""Entering the next generation in place: leave the old groups, move state in a transition world, rebuild.

Problem: when the members agree on generation g+1, every process of the old and the new generation must, without
restarting, (1) leave generation g's process groups (destroy them, or abandon them after a failure, since a
shutdown would block on an operation stuck on a dead peer), (2) meet in a *transition world* that includes the
members leaving and the ones joining, (3) send and receive exactly the layers (and, for joiners, the loop state)
the migration plan names, (4) leave if the new generation does not include it, else rebuild its groups, stage and
optimizers for the new layout, and (5) fall back to the checkpoint when the new groups cannot be built. Its steps
act for the runtime as a :class:`~lightning_parcae.runtime.part.RuntimePart`.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from lightning_parcae.contract import RELEASED_EXIT
from lightning_parcae.planning.migration_plan import MigrationPlan
from lightning_parcae.runtime.groups import init_transition_world
from lightning_parcae.runtime.lifecycle import Phase, exit_now, exit_without_destructors_at_shutdown
from lightning_parcae.runtime.migration import exchange, layer_payload
from lightning_parcae.runtime.part import RuntimePart

if TYPE_CHECKING:  # pragma: no cover
    import pytorch_lightning as pl

__all__ = ["Switch", "forget_eval_loaders"]



def forget_eval_loaders(trainer: "pl.Trainer") -> None:
    """Make Lightning rebuild the validation loader (and its distributed sampler) at the next validation.

    Regression: the loader was built once, sharded for the D of the first validation; after a change of D the
    stages of one pipeline read different validation batches and the last stage's output (16 sequences) no longer
    matched its own targets (8) -- "Expected input batch_size (1024) to match target batch_size (512)".
    """
    loop = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "val_loop", None)
    if loop is not None and hasattr(loop, "_combined_loader"):
        loop._combined_loader = None


class Switch(RuntimePart):
    """The generation change of one process's live-reconfiguration protocol."""

    def teardown_groups(self, failed: bool = False) -> None:
        """Leave the current generation's groups: destroy them, or after a failure abandon them (see
        :meth:`ProcessGroups.abandon`: a shutdown could block on an operation stuck on a dead peer)."""
        s = self.rt.s
        if s.groups is None:
            return
        if failed:
            assert self.rt.live is not None
            self.rt.live.park(s.groups.abandon())
            exit_without_destructors_at_shutdown()
        else:
            s.groups.destroy()

    def aborted(self) -> Optional[str]:
        """Why the generation being entered was aborted (a participant declared dead), or None."""
        return self.rt.live.abort_reason() if self.rt.live is not None else None

    def init_transition(self, rec: dict[str, Any]) -> None:
        """Meet the transition world of ``rec`` (every process that sends or receives), within the watchdog's bound
        (:func:`~.groups.init_transition_world`)."""
        transition = list(rec["transition"])
        init_transition_world(self.rt.store, int(rec["generation"]), transition.index(self.rt.member),
                              len(transition), self.rt.stall_timeout, self.aborted)

    def switch(self, trainer: "pl.Trainer", rec: dict[str, Any]) -> None:
        """Move to generation ``rec``: transfer state, rebuild groups and the stage in place (or leave/fall back)."""
        assert self.rt.layout is not None and self.rt.coord is not None and self.rt.live is not None
        t0 = time.monotonic()
        if self.rt.life.phase != Phase.MIGRATING:
            self.rt.life.to(Phase.MIGRATING, generation=rec["generation"], kind=rec["kind"])
        if rec["kind"] == "fallback":
            self.rt.fallback(trainer, rec)
        s = self.rt.s
        plan = MigrationPlan.from_json(rec["plan"])
        new = plan.new
        transition = list(rec["transition"])
        joiners = [m for m in new.members if m not in plan.old.members]
        loop = self.rt.admission.loop_state(trainer) if joiners and rec.get("loop_from") == self.rt.member else None
        self.teardown_groups()
        t_groups = time.monotonic()
        # the transfers belong to the new generation: a death now aborts *it* (and is seen by every participant)
        self.rt.live.set_generation(int(rec["generation"]), [m for m in transition if m != self.rt.member])
        try:
            self.init_transition(rec)
        except RuntimeError as exc:
            self._rendezvous_failed(trainer, rec, exc)
        module = s.lightning_module
        assert module is not None
        opts = [getattr(o, "_optimizer", o) for o in s.optimizers]
        sends: dict[int, dict[str, Any]] = {}
        for t in plan.sends(self.rt.member):
            box = sends.setdefault(transition.index(t.dst), {"layers": {}})
            box["layers"][t.layer] = layer_payload(module, s.layer_key(s.layer_names[t.layer]), opts)
        if loop is not None:
            for j in joiners:
                sends.setdefault(transition.index(j), {"layers": {}})["loop"] = loop
        srcs = sorted({transition.index(t.src) for t in plan.receives(self.rt.member)})
        try:
            inbox = exchange(sends, srcs, "migration state transfer")
        except RuntimeError as exc:  # PeerLostError included
            # Regression (chaos seed 41): a member was declared dead while a generation that admitted a standby
            # was being entered; the transfer raised out of the switch and the job failed. Nothing of the new
            # generation has been applied here, but its members cannot agree in place which state each holds:
            # fall back to the checkpoint, as for a failed rendezvous.
            self._rendezvous_failed(trainer, rec, exc)
        dist.destroy_process_group()
        t_transfer = time.monotonic()
        if self.rt.member not in new.members:
            leaving_reason = "notice" if self.rt.live.noticed.is_set() else "released"
            self.rt.event("left", kind=rec["kind"], reason=leaving_reason, transfer_s=t_transfer - t_groups)
            self.rt.life.to(Phase.FENCED, reason=leaving_reason)
            exit_now(0 if leaving_reason == "notice" else RELEASED_EXIT)
        received: dict[int, Any] = {}
        for blob in inbox.values():
            received.update(blob.get("layers", {}))
        try:
            s.apply_layout(trainer, new, int(rec["generation"]), received, self.rt.group_of)
        except RuntimeError as exc:
            self._rendezvous_failed(trainer, rec, exc)
        forget_eval_loaders(trainer)
        self.rt._enter(rec)
        self.rt.live.set_generation(self.rt.generation, self.rt._watch())
        if self.rt.is_leader:
            self.rt.coord.set_current(self.rt.generation)
        dt = time.monotonic() - t0
        info = {"kind": rec["kind"], "reason": rec.get("reason", ""), "duration_s": round(dt, 4),
                "transfer_s": round(t_transfer - t_groups, 4), "bytes_moved": int(rec.get("bytes_moved", 0)),
                "bytes_received": int(sum(t.nbytes for t in plan.receives(self.rt.member))),
                "D": new.data_parallel, "P": new.pipeline_stages, "N": len(new.members), "step": trainer.global_step,
                "joiners": joiners}
        if self.rt._recovering_since is not None:  # from noticing the loss to training again (detection excluded)
            info["recovery_s"] = round(time.monotonic() - self.rt._recovering_since, 4)
            self.rt._recovering_since = None
        self.rt.migrations.append(info)
        self.rt.event("migration", **info)
        self.rt.life.to(Phase.TRAINING, **{k: info[k] for k in ("kind", "duration_s", "D", "P")})

    def _rendezvous_failed(self, trainer: "pl.Trainer", rec: dict[str, Any], exc: BaseException) -> None:
        """Building a new generation's groups failed (a peer lost or stalled during the rendezvous). The race
        that also ended here ("Connection closed by peer" with every peer alive: chaos seeds 14, 22, 26, 28, 94 and
        CI) was a peer tearing a world down before the other's connect was done; :func:`~.groups.await_connected`
        closes it. The generation cannot be entered consistently; rather than fail the job, fall back: exit 75 and
        let the launcher restart from the last checkpoint (at most the steps since it are lost)."""
        reason = f"process groups of generation {rec['generation']} could not be built: {str(exc).splitlines()[0][:160]}"
        self.rt.event("rendezvous_failed", reason=reason)
        self.rt.fallback(trainer, {"reason": reason})
