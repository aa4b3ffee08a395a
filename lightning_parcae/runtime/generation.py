"""The generation this process is in: one place for its members, shape, partition, number and record.

Problem: every part of the live-reconfiguration protocol asks the same few facts -- which generation is current,
who its members are in rank order, its shape and partition, whether this process leads, which members to watch,
the record it was entered from -- and each part used to read them from its owner's fields (and change them there).
The same fact then lived in several places and any part could move it. :class:`GenerationState` holds them once:
the :class:`~lightning_parcae.runtime.elastic.ElasticRuntime` owns it and is the only one that changes it (by
:meth:`GenerationState.enter`, from the records its parts return); the parts are given it to read.
:class:`GenerationRecords` writes the records that describe a generation (what the next one is, what each layer
weighs), priced alike on every process.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

from lightning_parcae.planning.migration_plan import Layout, MigrationPlan
from lightning_parcae.runtime.torch_internals import child

__all__ = ["GenerationState", "GenerationRecords", "LayerStack", "movers_of"]


@dataclass
class GenerationState:
    """The generation one process is in (see the module docstring).

    Owner: :class:`~lightning_parcae.runtime.elastic.ElasticRuntime`, the only writer: :meth:`enter` when it enters a
    generation, ``group_of`` when the parameter-group map is agreed (at boot, or received by a joiner). The parts
    only read it.

    Attributes:
        member: This process's member id (fixed).
        generation: The current generation's number (-1 before the first).
        layout: Its members in rank order and partition (``None`` before the first).
        record: The record it was entered from (``{}`` before the first).
        group_of: Per optimizer, which param group each parameter name is in (agreed at boot, the same everywhere).
    """

    member: str
    generation: int = -1
    layout: Optional[Layout] = None
    record: dict[str, Any] = field(default_factory=dict)
    group_of: list[dict[str, int]] = field(default_factory=list)

    def enter(self, rec: dict[str, Any]) -> None:
        """Make ``rec`` the current generation (its number, layout and record)."""
        self.record = rec
        self.generation = int(rec["generation"])
        self.layout = Layout.from_json(rec["layout"])

    @property
    def is_leader(self) -> bool:
        """Rank 0 of the current generation plans for everyone."""
        return self.layout is not None and self.layout.members[0] == self.member

    @property
    def rank(self) -> int:
        """This member's rank in the current generation."""
        assert self.layout is not None
        return self.layout.members.index(self.member)

    def watch(self) -> list[str]:
        """The members whose heartbeats this process watches: all of them for the leader, else the leader."""
        assert self.layout is not None
        members = list(self.layout.members)
        return members if members and members[0] == self.member else members[:1]


def movers_of(plan: MigrationPlan, layout: Layout,
              alive: Optional[list[str]] = None) -> tuple[list[str], Optional[str]]:
    """Who meets in the transition world of a migration into ``layout``, and who sends the joiners the loop state.

    Only the processes that move state: every sender and receiver of a layer, the joiners, and -- when there are
    joiners -- the old member that hands them the loop state (the first live one). The others skip the transition
    world: they leave the old groups and build the new ones (or, leaving, exit) at once. A record keeps both
    lists: ``transition`` (every live old member and every new one: who takes part, what recovery's verdicts and
    fencing read) and ``movers`` (this function: who meets).

    Regression (issue 21): the transition world was every live old member plus the joiners. At N=16 a notice to
    one member of an 8x2 job (an intra-stage change to 6x2 that moves 0 bytes) needed all 16 old members, the
    leaver included, to meet; the leaver's grace ended while four late members were still on their way, its rank
    never arrived and the job fell back to a restart. That change's transition world is now empty.

    Args:
        plan: The migration.
        layout: The new generation's layout.
        alive: The old members that take part (after a failure: the survivors), or None for all.

    Returns:
        ``(movers, loop_from)``: old participants in their old order, then the new ones in the new order;
        ``loop_from`` is None if nobody joins.
    """
    old = [m for m in plan.old.members if alive is None or m in alive]
    joiners = [m for m in layout.members if m not in plan.old.members]
    loop_from = old[0] if old and joiners else None
    moving = {t.src for t in plan.transfers} | {t.dst for t in plan.transfers} | set(joiners)
    if loop_from is not None:
        moving.add(loop_from)
    first = [m for m in old if m in moving]
    return first + [m for m in layout.members if m in moving and m not in first], loop_from


class LayerStack(Protocol):
    """What the records need of the training side: the layer stack's names, times and state size."""

    stack_path: Optional[str]
    layer_names: list[str]
    layer_times: list[float]
    optimizer_state_factor: float

    @property
    def full_stack(self) -> Any: ...


class GenerationRecords:
    """Builds generation records and prices layers for migrations, identically on every process.

    Args:
        stack: The layer stack (the training host).
        state: The current generation (its record carries the agreed layer sizes once known).
    """

    def __init__(self, stack: LayerStack, state: GenerationState) -> None:
        self.stack = stack
        self.state = state

    def layer_bytes(self) -> list[int]:
        """Bytes each layer carries in a migration: parameters plus their optimizer state (from the current record
        when known, so every process prices moves identically)."""
        rec = self.state.record
        rec_bytes = rec.get("layer_bytes") if rec else None
        if rec_bytes and len(rec_bytes) == len(self.stack.layer_names):
            return [int(b) for b in rec_bytes]
        full = self.stack.full_stack
        assert full is not None
        factor = 1.0 + self.stack.optimizer_state_factor
        sizes = [int(factor * sum(p.numel() * p.element_size() for p in child(full, n).parameters()))
                 for n in self.stack.layer_names]
        # the parts outside the stack that ride with layer 0 (the embedding) and the last layer (the head) move with
        # them: price them there (their logical size -- a stage without them holds a stand-in of the same shape)
        module = getattr(self.stack, "lightning_module", None)
        riding = getattr(self.stack, "outside_keys_of", None)
        if sizes and module is not None and callable(riding):
            params = dict(module.named_parameters())
            for i in sorted({0, len(sizes) - 1}):
                sizes[i] += int(factor * sum(params[k].numel() * params[k].element_size()
                                             for k in riding(i) if k in params))
        return sizes

    def record(self, generation: int, layout: Layout, plan: Optional[MigrationPlan], kind: str, step: int,
               alive: Optional[list[str]] = None, **extra: Any) -> dict[str, Any]:
        """The record of generation ``generation`` (not proposed: the caller proposes it).

        Args:
            generation: Its number.
            layout: Its members and partition.
            plan: The migration into it (``None``: the first generation).
            kind: The migration's kind (``start``, ``intra-stage``, ...).
            step: The step it starts after.
            alive: The old members that take part (after a failure: the survivors), or None for all.
            **extra: Further fields (``reason``, ``dead``, ...).
        """
        s = self.stack
        rec: dict[str, Any] = {
            "generation": generation, "kind": kind, "step": int(step), "layout": layout.to_json(),
            "D": layout.data_parallel, "P": layout.pipeline_stages, "stack_path": s.stack_path,
            "layer_names": list(s.layer_names), "layer_times": [float(t) for t in s.layer_times],
            "layer_bytes": self.layer_bytes(), "time": time.time(),
            "outside": dict(getattr(s, "outside_parts", None) or {}), **extra,
        }
        if plan is not None:
            rec["plan"] = plan.to_json()
            old = [m for m in plan.old.members if alive is None or m in alive]
            rec["transition"] = old + [m for m in layout.members if m not in old]  # everyone who takes part
            rec["movers"], rec["loop_from"] = movers_of(plan, layout, alive)  # those who meet to move state
            rec["bytes_moved"] = plan.bytes_moved
            rec["bytes_peak"] = plan.peak_bytes
        return rec

    def fallback(self, generation: int, step: int, reason: str, checkpoint: bool = False,
                 min_instances: Optional[int] = None) -> dict[str, Any]:
        """The record of a stop for a restart from the checkpoint as generation ``generation`` (``min_instances``:
        the fewest instances the model fits on, when too few is the reason; the reason then says so too)."""
        assert self.state.layout is not None
        if min_instances:
            reason = f"{reason} (the model needs at least {int(min_instances)})"
        rec = {"generation": generation, "kind": "fallback", "step": step, "reason": reason,
               "layout": self.state.layout.to_json(), "time": time.time(), "checkpoint": checkpoint}
        if min_instances:
            rec["min_instances"] = int(min_instances)
        return rec
