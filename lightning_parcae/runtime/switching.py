"""Entering the next generation in place: leave the old groups, move state in a transition world, rebuild.

Problem: when the members agree on generation g+1, every process of the old and the new generation must, without
restarting, (1) leave generation g's process groups (destroy them, or abandon them after a failure, since a
shutdown would block on an operation stuck on a dead peer), (2) meet in a *transition world* that includes the
members leaving and the ones joining, (3) send and receive exactly the layers (and, for joiners, the loop state)
the migration plan names, (4) leave if the new generation does not include it, else rebuild its groups, stage and
optimizers for the new layout. When the new generation cannot be formed, :meth:`Switch.switch` raises
:class:`GenerationNotEntered`, saying whether this process's old state is intact (a peer lost while the processes
met, moved state or built the new groups: nothing of the new layout was installed). An old member whose state is
intact recovers with the other survivors from the old generation; otherwise the runtime falls back to the
checkpoint. The switch reads the current generation
(:class:`~.generation.GenerationState`) and returns what it moved (:class:`Moved`); the
:class:`~lightning_parcae.runtime.elastic.ElasticRuntime` then enters the new generation.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch.distributed as dist

from lightning_parcae.contract import RELEASED_EXIT
from lightning_parcae.errors import PeerLostError, RendezvousError
from lightning_parcae.planning.migration_plan import MigrationPlan
from lightning_parcae.runtime.generation import GenerationState
from lightning_parcae.runtime.groups import init_transition_world
from lightning_parcae.runtime.host import TrainingHost
from lightning_parcae.runtime.lifecycle import Phase, exit_now, exit_without_destructors_at_shutdown
from lightning_parcae.runtime.liveness import left_key
from lightning_parcae.runtime.migration import exchange, layer_payload
from lightning_parcae.runtime.part import PartContext

if TYPE_CHECKING:  # pragma: no cover
    import pytorch_lightning as pl

__all__ = ["Switch", "Moved", "GenerationNotEntered", "meet_transition", "movers", "joiners_of"]


class GenerationNotEntered(Exception):
    """The next generation's transition world, state transfer or process groups could not be formed here.

    Attributes:
        reason: What failed, for the fallback's message.
        intact: Whether this process still holds exactly the old generation's state: the failure came from a
            lost or silent peer while the processes met, moved state or built the new groups -- before anything of
            the new layout was installed here. An old member that fails so can recover with the other survivors
            instead of falling back to the checkpoint.
    """

    def __init__(self, reason: str, intact: bool = False) -> None:
        super().__init__(reason)
        self.reason = reason
        self.intact = intact


def movers(rec: dict[str, Any]) -> list[str]:
    """The processes that meet in ``rec``'s transition world (:func:`~.generation.movers_of`; a record written
    before ``movers`` existed names everyone in ``transition``)."""
    return list(rec.get("movers", rec["transition"]))


def meet_transition(store: dist.Store, rec: dict[str, Any], member: str, bound: timedelta,
                    aborted: Callable[[], Optional[str]]) -> None:
    """Meet the transition world of ``rec`` (every process that sends or receives), within the watchdog's bound
    (:func:`~.groups.init_transition_world`)."""
    world = movers(rec)
    init_transition_world(store, int(rec["generation"]), world.index(member), len(world), bound, aborted)


def joiners_of(plan: MigrationPlan) -> list[str]:
    """The members of the plan's new layout that were not in its old one."""
    return [m for m in plan.new.members if m not in plan.old.members]


@dataclass(frozen=True)
class Moved:
    """What one process did to enter a generation (returned by :meth:`Switch.switch`).

    Attributes:
        plan: The migration plan it followed.
        joiners: Members the generation admitted.
        t_groups: When the old groups were left (monotonic seconds).
        t_transfer: When the state transfer was done.
        bytes_received: Bytes of layer state this process received.
    """

    plan: MigrationPlan
    joiners: list[str]
    t_groups: float
    t_transfer: float
    bytes_received: int

    def report(self, rec: dict[str, Any], duration_s: float, step: int) -> dict[str, Any]:
        """The ``migration`` event's fields for entering ``rec`` in ``duration_s`` at ``step``."""
        new = self.plan.new
        return {"kind": rec["kind"], "reason": rec.get("reason", ""), "duration_s": round(duration_s, 4),
                "transfer_s": round(self.t_transfer - self.t_groups, 4), "bytes_moved": int(rec.get("bytes_moved", 0)),
                "bytes_peak": int(rec.get("bytes_peak", rec.get("bytes_moved", 0))),
                "bytes_received": self.bytes_received, "D": new.data_parallel, "P": new.pipeline_stages,
                "N": len(new.members), "step": step, "joiners": self.joiners}


class Switch:
    """The generation change of one process's live-reconfiguration protocol.

    Args:
        ctx: The connection to the job (store, heartbeats, lifecycle, events).
        host: The training side (its groups, module, optimizers; it installs the new layout).
        state: The current generation (read only: its agreed parameter-group map goes to the new layout).
        stall_timeout: The progress watchdog's bound (the transition world's rendezvous).
    """

    def __init__(self, ctx: PartContext, host: TrainingHost, state: GenerationState, stall_timeout: timedelta) -> None:
        self.ctx = ctx
        self.host = host
        self.state = state
        self.stall_timeout = stall_timeout

    def teardown_groups(self, failed: bool = False) -> None:
        """Leave the current generation's groups: destroy them, or after a failure abandon them (see
        :meth:`ProcessGroups.abandon`: a shutdown could block on an operation stuck on a dead peer)."""
        groups = self.host.groups
        if groups is None:
            return
        if failed:
            self.ctx.live.park(groups.abandon())
            exit_without_destructors_at_shutdown()
        else:
            groups.destroy()

    def hands_loop_state(self, rec: dict[str, Any]) -> bool:
        """Whether this process sends the loop state to the joiners of ``rec`` (it is named ``loop_from``)."""
        return bool(joiners_of(MigrationPlan.from_json(rec["plan"]))) and rec.get("loop_from") == self.ctx.member

    def switch(self, trainer: "pl.Trainer", rec: dict[str, Any], loop: Optional[dict[str, Any]]) -> Moved:
        """Move to generation ``rec``: transfer state, rebuild groups and the stage in place (or leave).

        Args:
            trainer: The trainer (the new layout is installed into it).
            rec: The generation record to enter.
            loop: The loop state to send to its joiners (this process is ``loop_from``), else None.

        Raises:
            GenerationNotEntered: the transition world, the transfer or the new groups failed.
        """
        ctx, s = self.ctx, self.host
        plan = MigrationPlan.from_json(rec["plan"])
        new = plan.new
        transition = movers(rec)
        joiners = joiners_of(plan)
        self.teardown_groups()
        t_groups = time.monotonic()
        # the transfers belong to the new generation: a death now aborts *it* (and is seen by every participant);
        # a member that stays watches the new generation's members too while its groups form
        staying = ctx.member in new.members
        watch = [m for m in dict.fromkeys(transition + (list(new.members) if staying else [])) if m != ctx.member]
        ctx.live.set_generation(int(rec["generation"]), watch)
        inbox: dict[int, Any] = {}
        if ctx.member in transition:  # only the processes that move state meet (generation.movers_of)
            inbox = self._transfer(rec, plan, transition, joiners, loop)
        t_transfer = time.monotonic()
        if ctx.member not in new.members:
            leaving_reason = "notice" if ctx.live.noticed.is_set() else "released"
            # said in the store before the heartbeat stops: the members building the new generation's groups still
            # watch this one, and must not take its planned silence for a death (liveness.left_key)
            ctx.store.set(left_key(int(rec["generation"]), ctx.member), leaving_reason)
            ctx.event("left", kind=rec["kind"], reason=leaving_reason, transfer_s=t_transfer - t_groups)
            ctx.life.to(Phase.FENCED, reason=leaving_reason)
            exit_now(0 if leaving_reason == "notice" else RELEASED_EXIT)
        received: dict[int, Any] = {}
        for blob in inbox.values():
            received.update(blob.get("layers", {}))
        try:
            s.apply_layout(trainer, new, int(rec["generation"]), received, self.state.group_of)
        except RuntimeError as exc:
            # a lost peer can only surface while the groups are built, before the layout is installed
            raise self._rendezvous_failed(rec, exc, intact=isinstance(exc, (PeerLostError, RendezvousError))) \
                from exc
        s.reset_eval_loaders(trainer)
        return Moved(plan=plan, joiners=joiners, t_groups=t_groups, t_transfer=t_transfer,
                     bytes_received=int(sum(t.nbytes for t in plan.receives(ctx.member))))

    def _transfer(self, rec: dict[str, Any], plan: MigrationPlan, transition: list[str], joiners: list[str],
                  loop: Optional[dict[str, Any]]) -> dict[int, Any]:
        """Meet the transition world, send and receive this process's layers (and the loop state), leave it."""
        ctx, s = self.ctx, self.host
        try:
            meet_transition(ctx.store, rec, ctx.member, self.stall_timeout, ctx.live.abort_reason)
        except RuntimeError as exc:
            raise self._rendezvous_failed(rec, exc, intact=True) from exc
        module = s.lightning_module
        assert module is not None
        opts = s.torch_optimizers()
        sends: dict[int, dict[str, Any]] = {}
        for t in plan.sends(ctx.member):
            box = sends.setdefault(transition.index(t.dst), {"layers": {}})
            box["layers"][t.layer] = layer_payload(module, s.layer_key(s.layer_names[t.layer]), opts,
                                                   s.outside_keys_of(t.layer))  # the embedding / head ride along
        if loop is not None:
            for j in joiners:
                sends.setdefault(transition.index(j), {"layers": {}})["loop"] = loop
        srcs = sorted({transition.index(t.src) for t in plan.receives(ctx.member)})
        try:
            inbox = exchange(sends, srcs, "migration state transfer")
        except RuntimeError as exc:  # PeerLostError included
            # Regression (chaos seed 41): a member was declared dead while a generation that admitted a standby
            # was being entered; the transfer raised out of the switch and the job failed. Nothing of the new
            # generation has been applied here, but its members cannot agree in place which state each holds:
            # fall back to the checkpoint, as for a failed rendezvous -- unless this is an old member, which
            # still holds all its old state (nothing was applied) and recovers with the other survivors.
            raise self._rendezvous_failed(rec, exc, intact=True) from exc
        dist.destroy_process_group()
        return inbox

    def _rendezvous_failed(self, rec: dict[str, Any], exc: BaseException, intact: bool = False) -> GenerationNotEntered:
        """Building a new generation's groups failed (a peer lost or stalled during the rendezvous). The race
        that also ended here ("Connection closed by peer" with every peer alive: chaos seeds 14, 22, 26, 28, 94 and
        CI) was a peer tearing a world down before the other's connect was done; :func:`~.groups.await_connected`
        closes it. The generation cannot be entered consistently; rather than fail the job, the runtime falls
        back: exit 75 and let the launcher restart from the last checkpoint (at most the steps since it are lost)."""
        reason = f"process groups of generation {rec['generation']} could not be built: {str(exc).splitlines()[0][:160]}"
        self.ctx.event("rendezvous_failed", reason=reason, intact=intact)
        return GenerationNotEntered(reason, intact=intact)
