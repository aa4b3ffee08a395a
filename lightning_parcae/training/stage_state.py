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

    @property
    def whole_model(self) -> bool:
        """True when the model has no cuttable layer stack and trains at P = 1 only."""
        return self.stack_path == ""

    def layer_key(self, name: str) -> str:
        """The state-dict prefix of layer ``name`` (``"<stack_path>.<name>"``)."""
        return f"{self.stack_path}.{name}" if self.stack_path else name

    def is_stage_key(self, key: str) -> bool:
        """Whether a state-dict / optimizer-state key belongs to a layer of the stack (not a replicated part)."""
        if self.stack_path:
            return key.startswith(self.stack_path + ".")
        return key.split(".", 1)[0] in set(self.layer_names)

    def stage_key_set(self) -> set[str]:
        """The state-dict keys (global names) of the layers this process holds."""
        assert self.stack_path is not None and self.stage is not None
        return {self.layer_key(k) for k in self.stage.state_dict().keys()}

    def held_bounds(self) -> tuple[int, int]:
        """``(a, b)``: this process holds the stack's layers ``a .. b - 1`` (by its stage in ``groups``)."""
        assert self.groups is not None
        return stage_bounds(self.partition)[self.groups.coords.stage]
