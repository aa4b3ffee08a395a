"""What the live-reconfiguration runtime needs from the training layer above it.

Problem: :class:`~lightning_parcae.runtime.elastic.ElasticRuntime` drives a running job -- it reads the layer
stack's names and measured times, moves layers' parameters and optimizer state between processes, asks for the
loop state a joiner needs and installs a new layout; at each step boundary it asks whether Lightning validates or
ends right after the step, and before a stop it asks for a checkpoint -- but the runtime sits *below* the Lightning strategy and must
not import it (data flows one way: planning -> runtime -> training -> launch). This module names that contract as a
:class:`typing.Protocol`; :class:`~lightning_parcae.training.strategy.ParcaeStrategy` satisfies it (checked by
``tests/test_layering.py``), and any other host -- a test double, a non-Lightning trainer -- can too. Everything
the runtime needs of Lightning's trainer goes through it: no Lightning internal is read under ``runtime/``.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

__all__ = ["TrainingHost"]


@runtime_checkable
class TrainingHost(Protocol):
    """The training side of one process, as the elastic runtime uses it.

    Attributes:
        lightning_module: The user's module (``state_dict``, the layer stack inside it).
        optimizers: The optimizers (possibly Lightning-wrapped: :meth:`torch_optimizers` unwraps them).
        groups: This generation's :class:`~lightning_parcae.runtime.groups.ProcessGroups` (``None`` before start).
        stack_path: Dotted path of the layer stack in the module (``""`` when the model has none: P stays 1).
        layer_names: Child names of the whole stack, in order.
        layer_times: Measured forward + backward time per layer on the global batch (may be empty).
        partition: Layers per stage of the current layout.
        micro_batches: M.
        max_pipeline_stages: Deepest pipeline allowed (``None``: as many as layers).
        max_stage_memory_bytes: Per-stage memory limit, or ``None``.
        optimizer_state_factor: Optimizer state bytes per parameter byte (Adam: 2).
        global_batch: B, once the training loader is known (else ``None``).
        full_stack: The whole layer stack (every layer, also those held by other stages), once built.
    """

    lightning_module: Any
    optimizers: list[Any]
    groups: Any
    stack_path: Optional[str]
    layer_names: list[str]
    layer_times: list[float]
    partition: list[int]
    micro_batches: int
    max_pipeline_stages: Optional[int]
    max_stage_memory_bytes: Optional[int]
    optimizer_state_factor: float

    @property
    def global_batch(self) -> Optional[int]: ...

    @property
    def full_stack(self) -> Any: ...

    def layer_key(self, name: str) -> str:
        """State-dict key prefix of the stack's child ``name``."""
        ...

    def is_stage_key(self, key: str) -> bool:
        """Whether a state-dict / optimizer-state key belongs to a layer of the stack."""
        ...

    def stage_key_set(self) -> set[str]:
        """The state-dict keys of the layers this process holds."""
        ...

    def outside_keys_of(self, index: int) -> list[str]:
        """The state-dict keys outside the stack that ride with layer ``index`` (sent with its payload)."""
        ...

    def local_state_dump(self) -> AbstractContextManager[None]:
        """Within it, Lightning's checkpoint dump is this process's own state (no gather across processes)."""
        ...

    def data_state(self) -> dict[str, Any]:
        """The sample cursor (epoch, samples consumed, global batch, sampler RNG)."""
        ...

    def apply_layout(self, trainer: Any, layout: Any, generation: int, received: Mapping[int, Any],
                     group_of: list[dict[str, int]]) -> None:
        """Install a new (D, P) layout: rebuild groups, keep and receive layers, rebuild the optimizer."""
        ...

    def wait_for_checkpoint(self) -> None:
        """Block until a background checkpoint write has finished."""
        ...

    def torch_optimizers(self) -> list[Any]:
        """The torch optimizers inside :attr:`optimizers` (Lightning's wrappers unwrapped), in the same order."""
        ...

    def validation_follows(self, trainer: Any) -> bool:
        """Whether the trainer runs a validation right after the step that just ended (False when unsure)."""
        ...

    def training_ends(self, trainer: Any) -> bool:
        """Whether the step that just ended is the last one ``fit`` trains (False when unsure)."""
        ...

    def epoch_ends(self, trainer: Any) -> bool:
        """Whether the step that just ended is the last of its epoch (False when unsure)."""
        ...

    def loop_checkpoint(self, trainer: Any) -> dict[str, Any]:
        """The trainer's checkpoint of this process's own state (loops, callbacks, schedulers; no gather)."""
        ...

    def reset_eval_loaders(self, trainer: Any) -> None:
        """Make the trainer rebuild its validation loader (sharded for the current D) at the next validation."""
        ...

    def save_before_leaving(self, trainer: Any, path: str) -> None:
        """Collective: save a checkpoint of the whole job to ``path`` and wait until it is written."""
        ...
