"""fp16 loss scaling over a D x P job: one scale and one inf/nan verdict for every stage and replica.

Problem: under ``precision="16-mixed"`` Lightning's ``MixedPrecision`` plugin holds a ``torch.amp.GradScaler``. In
one process the scaler multiplies the loss by the scale S before ``backward``, divides the gradients by S before
the optimizer step (``unscale_``), *skips* the step when a gradient is inf or nan, and then halves S (after a
skipped step) or grows it (after ``growth_interval`` good ones). Under ParcaeStrategy three things break that:

1. the backward runs inside the pipeline schedule on each micro-batch, not on the loss Lightning hands the plugin,
   so the micro-batch losses must be multiplied by S there;
2. each process unscales only its own stage's gradients, so its verdict is its own: an fp16 activation gradient
   that overflows on its way from the last stage to stage 0 gives stage 0 infs and the last stage none. A stage
   that steps while another skips leaves the model torn, and since the skipping stages halve S and the others do
   not, every later step unscales gradients by a scale other than the one the loss was multiplied by;
3. the scale and its growth tracker are state: a checkpoint, a resume and a joiner must carry them.

:class:`LossScaling` makes the verdict the job's: after the local ``unscale_`` every rank all-reduces its inf/nan
flag with MAX over the whole world (all stages, all replicas) and hands the scaler the agreed flag, so every rank
skips or steps together and applies the same update to S -- identical on every rank by construction, since every
rank starts from the same S (the script's, a checkpoint's or, for a joiner, the leader's). The step runner
multiplies the micro-batch losses by :meth:`LossScaling.scale`. The state needs nothing new: Lightning saves the
plugin's ``state_dict()`` (the scaler's) in every checkpoint and restores it on resume, and a joiner's live state
is Lightning's own checkpoint dump of the leader (``ParcaeStrategy.loop_checkpoint``), restored through the same
path.

Under live reconfiguration a step that a lost peer interrupts is applied everywhere or discarded everywhere
(two-phase, see ``elastic_hooks``): :meth:`LossScaling.apply_committed` steps through the scaler (skipping by the
agreed verdict, updating S) and :meth:`LossScaling.forget_step` drops an interrupted step's unscaled state so its
re-run can unscale again.

Refused (:class:`~lightning_parcae.errors.ConfigurationError`): a scaler that is not a ``torch.amp.GradScaler``,
and an optimizer that unscales inside its own ``step`` (``fused=True``): its verdict never leaves the optimizer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.runtime.liveness import guarded
from lightning_parcae.runtime.torch_internals import (
    optimizer_unscales_itself,
    scaler_found_inf,
    scaler_unscaled,
    set_scaler_found_inf,
)
from lightning_parcae.training.stage_state import StageState

__all__ = ["LossScaling"]

log = logging.getLogger(__name__)


class LossScaling:
    """The job-wide loss scaling of one strategy's ``GradScaler`` (see the module docstring).

    Args:
        scaler: The precision plugin's ``torch.amp.GradScaler``.
        state: The stage state (read only: this generation's groups, read at every step).
        device: This process's device (where the agreed verdict is reduced: NCCL needs it on the GPU).

    Attributes:
        skipped_steps: Optimizer steps this process skipped because the agreed verdict found an inf or a nan.
    """

    def __init__(self, scaler: torch.amp.GradScaler, state: StageState, device: torch.device) -> None:
        self.scaler = scaler
        self.state = state
        self.device = device
        self.skipped_steps = 0

    @classmethod
    def for_plugin(cls, plugin: Any, state: StageState, device: torch.device) -> Optional["LossScaling"]:
        """The loss scaling of a precision plugin with an enabled scaler, installed on it; ``None`` without one.

        Installing makes the scaler's ``unscale_`` agree on the verdict (an instance attribute wrapping the class's
        method, replaced if installed before).

        Raises:
            ConfigurationError: if the plugin's scaler is not a ``torch.amp.GradScaler``.
        """
        scaler = getattr(plugin, "scaler", None)
        if scaler is None:
            return None
        if not isinstance(scaler, torch.amp.GradScaler):
            raise ConfigurationError(
                f"ParcaeStrategy's fp16 loss scaling needs the precision plugin's scaler to be a torch.amp.GradScaler "
                f"(got {type(scaler).__name__}); pass MixedPrecision('16-mixed', device, "
                "scaler=torch.amp.GradScaler(device)) or precision='16-mixed'"
            )
        if not scaler.is_enabled():
            return None
        scaling = cls(scaler, state, device)
        scaling.install()
        return scaling

    def install(self) -> None:
        """Make ``scaler.unscale_(optimizer)`` unscale locally and then agree on the verdict over the world."""
        local_unscale = type(self.scaler).unscale_.__get__(self.scaler)

        def unscale_(optimizer: torch.optim.Optimizer) -> None:
            local_unscale(optimizer)
            self.agree(optimizer)

        self.scaler.unscale_ = unscale_  # type: ignore[method-assign]

    def scale(self, optimizers: Iterable[Any] = ()) -> float:
        """S, the factor every micro-batch loss is multiplied by before its backward (the same on every rank).

        Args:
            optimizers: The step's torch optimizers, checked to leave unscaling to the scaler.

        Raises:
            ConfigurationError: if an optimizer unscales inside its own ``step`` (``fused=True``).
        """
        for opt in optimizers:
            if optimizer_unscales_itself(opt):
                raise ConfigurationError(
                    f"{type(opt).__name__}(fused=True) unscales its fp16 gradients inside its own step, where "
                    "ParcaeStrategy cannot make its inf/nan verdict agree over the pipeline stages and replicas; "
                    "use the optimizer without fused=True (foreach is fine) under precision='16-mixed'"
                )
        return float(self.scaler.get_scale())

    def agree(self, optimizer: torch.optim.Optimizer) -> bool:
        """After the local ``unscale_``: MAX of every rank's inf/nan flag, made the scaler's verdict for the step.

        Collective over the whole world of this generation (guarded: a lost peer raises ``PeerLostError`` into the
        two-phase optimizer step). A process whose parameters have no gradient this step counts as finite.

        Returns:
            True if the step is skipped (some rank found an inf or a nan).
        """
        device = self.device
        flags = scaler_found_inf(self.scaler, optimizer)
        found = torch.zeros((), dtype=torch.float32, device=device)
        for flag in flags:
            found = torch.maximum(found, flag.to(device=device, dtype=torch.float32).reshape(()))
        groups = self.state.groups
        if groups is not None and groups.world > 1 and dist.is_initialized():
            guarded(lambda: dist.all_reduce(found, op=ReduceOp.MAX, async_op=True), "loss-scale inf/nan verdict",
                    collective=True)
        set_scaler_found_inf(self.scaler, optimizer, found)
        skipped = bool(found.item() > 0)
        if skipped:
            self.skipped_steps += 1
            log.info("fp16 step skipped on every rank (an inf or nan gradient); loss scale %.6g backs off",
                     self.scaler.get_scale())
        return skipped

    def apply_committed(self, optimizer: torch.optim.Optimizer) -> None:
        """Apply a step every rank committed to (all had agreed on the verdict): skipped by that verdict, then S
        updated -- what the ranks whose commit returned did through Lightning's plugin."""
        self.scaler.step(optimizer)
        self.scaler.update()

    def forget_step(self) -> None:
        """Drop an interrupted, discarded step's unscaled state (S and its growth tracker unchanged), so the step's
        re-run can unscale again."""
        if scaler_unscaled(self.scaler):
            self.scaler.update(new_scale=float(self.scaler.get_scale()))
