"""The stage state: the one record of which layers this process holds, in which generation's groups.

Problem: several parts of the strategy need the same facts about this process's place in the job -- its process
groups, the layer stack's path and layer names, the partition, the measured layer times, this process's stage
module, its proxy inside the user's ``forward`` and its transport to the pipeline neighbours. When each part kept
or wrote its own copy (on the strategy), the partition lived in several places and the join path rewrote what the
layout had built. :class:`StageState` is the single place these facts live.

Ownership: :class:`~lightning_parcae.training.layout.StageLayout` owns it and is the only writer of its fields
(``ProcessSetup`` hands the groups it builds and a joiner's admitted layout to the layout's methods, which store
them). Everyone else -- the strategy's read-only properties (and through them the runtime's ``TrainingHost``
reads of ``groups`` / ``partition`` / ``full_stack`` ...), the step runner, the data path, the checkpoints, the
collectives, the profiler -- only reads it.

Parts outside the stack: the parameters and persistent buffers outside ``stack_path`` (an embedding, a final norm
and head) are classified once, when the module is partitioned (:meth:`LayerProfiler.classify_outside
<lightning_parcae.training.profiling.LayerProfiler.classify_outside>`), into ``"pre"`` (the stack's input depends on
them), ``"post"`` (the loss depends on them other than through the stack's output) and ``"both"`` (tied input and
output embeddings). ``outside`` maps each such state-dict key to its class; the holders of layer 0 hold the
``pre`` and ``both`` keys, the holders of the last layer the ``post`` and ``both`` keys, and they move with those
layers. A key not in ``outside`` (what the classification could not place -- a part the blocks' extra arguments
depend on, an unused one, a tensor shared with the stack, any outside part when no sample could be run) is
*replicated*: every stage keeps it, as before.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from torch import nn

from lightning_parcae.runtime.groups import ProcessGroups
from lightning_parcae.runtime.partition import stage_bounds
from lightning_parcae.runtime.pipeline import P2P, StageProxy

__all__ = ["StageState"]


@dataclass
class StageState:
    """This process's stage of a D x P job (owned and written only by ``StageLayout``; see the module docstring).

    Attributes:
        groups: This generation's process groups (``None`` before the first ``setup_environment``).
        stack_path: Dotted path of the layer stack in the module; ``""``: the model has no cuttable stack and trains
            whole at P = 1; ``None``: not located yet.
        layer_names: Child names of the whole stack, in order (top-level children for a whole model).
        partition: Layers per stage of the current layout.
        layer_times: Measured forward + backward time per layer (may be empty).
        stage: This process's stage module (its layers of the stack), once built.
        proxy: What stands in for the whole stack inside the user's ``forward`` (``None`` for a whole model).
        p2p: The transport to this process's pipeline neighbours, once built.
        full_stack: The whole layer stack's structure (every layer, also those other stages hold; the module for a
            whole model). Only the layers this process holds have parameter storage: the others' parameters and
            persistent buffers are on the ``meta`` device until a migration hands them here with their state.
        no_cut_reason: Why the model trains whole (``None`` when it is cut into stages).
        outside: State-dict key -> ``"pre"`` / ``"post"`` / ``"both"`` of the parts outside the stack that belong to
            a stage (see the module docstring; empty: every outside part is replicated).
    """

    groups: Optional[ProcessGroups] = None
    stack_path: Optional[str] = None
    layer_names: list[str] = field(default_factory=list)
    partition: list[int] = field(default_factory=list)
    layer_times: list[float] = field(default_factory=list)
    stage: Optional[nn.Sequential] = None
    proxy: Optional[StageProxy] = None
    p2p: Optional[P2P] = None
    full_stack: Optional[nn.Module] = None
    no_cut_reason: Optional[str] = None
    outside: dict[str, str] = field(default_factory=dict)

    @property
    def whole_model(self) -> bool:
        """True when the model has no cuttable layer stack and trains at P = 1 only."""
        return self.stack_path == ""

    def layer_key(self, name: str) -> str:
        """The state-dict prefix of layer ``name`` (``"<stack_path>.<name>"``)."""
        return f"{self.stack_path}.{name}" if self.stack_path else name

    def is_stage_key(self, key: str) -> bool:
        """Whether a state-dict / optimizer-state key belongs to a stage -- a layer of the stack or a part outside it
        that rides with the first or the last layer -- not a replicated part."""
        if key in self.outside:
            return True
        if self.stack_path:
            return key.startswith(self.stack_path + ".")
        return key.split(".", 1)[0] in set(self.layer_names)

    def stage_key_set(self) -> set[str]:
        """The state-dict keys (global names) this process holds as a stage: its layers' and the outside parts that
        ride with them."""
        assert self.stack_path is not None and self.stage is not None
        return {self.layer_key(k) for k in self.stage.state_dict().keys()} | self.held_outside()

    @property
    def pre_keys(self) -> set[str]:
        """The outside keys the holders of layer 0 hold (``"pre"`` and ``"both"``)."""
        return {k for k, c in self.outside.items() if c in ("pre", "both")}

    @property
    def post_keys(self) -> set[str]:
        """The outside keys the holders of the last layer hold (``"post"`` and ``"both"``)."""
        return {k for k, c in self.outside.items() if c in ("post", "both")}

    def outside_keys_of(self, index: int) -> list[str]:
        """The outside keys that ride with layer ``index`` (in a migration's payload of that layer), sorted."""
        keys: set[str] = set()
        if index == 0:
            keys |= self.pre_keys
        if index == len(self.layer_names) - 1:
            keys |= self.post_keys
        return sorted(keys)

    def held_outside(self) -> set[str]:
        """The outside keys this process holds (by the layers it holds in ``partition``)."""
        if not self.outside or self.groups is None or not self.partition:
            return set()
        a, b = self.held_bounds()
        held: set[str] = set()
        if a == 0:
            held |= self.pre_keys
        if b == len(self.layer_names):
            held |= self.post_keys
        return held

    def released_outside(self) -> set[str]:
        """The outside keys of a stage this process does not hold (stand-ins here; see ``runtime/stage.py``)."""
        return set(self.outside) - self.held_outside()

    def held_bounds(self) -> tuple[int, int]:
        """``(a, b)``: this process holds the stack's layers ``a .. b - 1`` (by its stage in ``groups``)."""
        assert self.groups is not None
        return stage_bounds(self.partition)[self.groups.coords.stage]
