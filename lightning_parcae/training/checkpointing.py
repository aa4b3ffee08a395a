"""Checkpoints of a D x P job: one full, layout-free file written from rank 0, read back into any layout.

Problem: under ParcaeStrategy no process holds the whole model -- stage ``s`` holds only its layers and their
optimizer state -- yet a checkpoint must be a single ordinary Lightning file that resumes at *any* (D, P), and a
save must neither tear ``last.ckpt`` nor stall an elastic job on the disk. This part of the strategy gathers the
stages of replica 0 into one state dict with global keys and one name-keyed optimizer state, writes it atomically
(from a background thread when the job is elastic), and on load hands each process only the keys it holds.

The strategy owns one :class:`StrategyCheckpoints` and forwards Lightning's checkpoint hooks to it.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Optional

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.runtime.checkpoint import (
    _to_cpu,
    atomic_save,
    gather_objects,
    layer_state,
    load_named_optimizer_state,
    merge_named_optimizer_states,
    named_optimizer_state,
    plain_containers,
)
from lightning_parcae.runtime.partition import stage_bounds

__all__ = ["StrategyCheckpoints", "CKPT_KEY", "CKPT_VERSION"]

CKPT_KEY = "parcae"
CKPT_VERSION = 1


class StrategyCheckpoints:
    """Gather, write and load checkpoints for one strategy (see the module docstring).

    Args:
        strategy: The owning ParcaeStrategy (its groups, layout, module, optimizers and data cursor are read).
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.writer: Optional[threading.Thread] = None
        self.local_dump = False  # True while the runtime wants this process's own keys only (no gather)

    @contextmanager
    def local_state_dump(self) -> Iterator[None]:
        """Within it, :meth:`module_state_dict` and :meth:`optimizer_state` return this process's own state."""
        self.local_dump = True
        try:
            yield
        finally:
            self.local_dump = False

    def _replica0_gather(self, obj: Any) -> Optional[list[Any]]:
        """Gather ``obj`` from the stages of replica 0 to global rank 0 (other replicas skip)."""
        g = self.strategy.groups
        assert g is not None
        if g.coords.replica != 0:
            return None
        return gather_objects(obj, 0, g.pipeline_group_of(0))

    def module_state_dict(self) -> dict[str, Any]:
        """The full state dict with global keys (complete on rank 0)."""
        s = self.strategy
        module = s.lightning_module
        assert module is not None
        local = {k: v.detach().cpu() for k, v in module.state_dict().items()}
        if self.local_dump:
            return local
        parts = self._replica0_gather(local)
        if parts is None or s.global_rank != 0:
            return local
        full: dict[str, Any] = {}
        for part in parts:
            full.update(part)
        return full

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Optimizer state keyed by parameter name, merged over the stages (complete on rank 0)."""
        s = self.strategy
        inner = getattr(optimizer, "_optimizer", optimizer)
        assert s.lightning_module is not None
        local = named_optimizer_state(inner, s.lightning_module)
        if self.local_dump:
            return local
        parts = self._replica0_gather(local)
        if parts is None or s.global_rank != 0:
            return local
        return merge_named_optimizer_states(parts)

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write the gathered checkpoint from rank 0, atomically (temp file + ``os.replace``)."""
        s = self.strategy
        checkpoint[CKPT_KEY] = {
            "version": CKPT_VERSION,
            "data": s.data_state(),
            "layout": {
                "data_parallel": s.data_parallel,
                "pipeline_stages": s.pipeline_stages,
                "partition": list(s.partition),
                "layer_names": list(s.layer_names),
                "stack_path": s.stack_path or "",
                "micro_batches": s.micro_batches,
            },
        }
        if s.is_global_zero:
            checkpoint = plain_containers(checkpoint)
            if storage_options is not None or "://" in str(filepath):
                s.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
            elif s.elastic_runtime is not None:
                self.save_in_background(checkpoint, str(filepath))
            else:
                atomic_save(checkpoint, filepath)

    def save_in_background(self, checkpoint: dict[str, Any], path: str) -> None:
        """Write a (gathered, copied) checkpoint from a thread so training does not wait for the disk.

        One write at a time: a new save first waits for the previous one, so ``last.ckpt`` is never older than the
        newest finished write and never torn (the write itself is atomic).
        """
        snapshot = _to_cpu(checkpoint)  # copies: the optimizer keeps updating the live tensors
        if self.writer is not None:
            self.writer.join()
        self.writer = threading.Thread(target=atomic_save, args=(snapshot, path), name="parcae-ckpt", daemon=False)
        self.writer.start()

    def wait(self) -> None:
        """Block until a background checkpoint write has finished."""
        if self.writer is not None:
            self.writer.join()
            self.writer = None

    def load(self, checkpoint_path: Any) -> dict[str, Any]:
        """Read a checkpoint (always ``weights_only=True``) and hand its sample cursor to the data path.

        A joiner's checkpoint is not a file: it is the state it received from live peers.
        """
        from lightning_parcae.runtime.elastic import LIVE_CHECKPOINT  # noqa: PLC0415

        s = self.strategy
        if checkpoint_path == LIVE_CHECKPOINT and s.elastic_runtime is not None:
            checkpoint = s.elastic_runtime.joiner_checkpoint()
        else:
            checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
        parcae = checkpoint.get(CKPT_KEY)
        if isinstance(parcae, Mapping) and "data" in parcae:
            s.data.resume = {"epoch": int(parcae["data"]["epoch"]), "cursor": int(parcae["data"]["cursor"]),
                             "rng": parcae["data"].get("rng"), "rng_now": parcae["data"].get("rng_now")}
            saved_b = int(parcae["data"].get("global_batch", 0))
            if saved_b and s.global_batch and saved_b != s.global_batch:
                warnings.warn(f"checkpoint global batch {saved_b} differs from {s.global_batch}", stacklevel=3)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the keys this process holds from a full (any-layout) state dict."""
        module = self.strategy.lightning_module
        assert module is not None
        own = set(module.state_dict().keys())
        full = checkpoint["state_dict"]
        missing = sorted(own - set(full.keys()))
        if strict and missing:
            raise ConfigurationError(f"checkpoint lacks {len(missing)} keys of this model, e.g. {missing[:3]}")
        module.load_state_dict({k: v for k, v in full.items() if k in own}, strict=False)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load name-keyed optimizer state (positional state only when it came from the same single stage)."""
        from lightning_fabric.utilities.optimizer import _optimizer_to_device  # noqa: PLC0415

        s = self.strategy
        module = s.lightning_module
        assert module is not None
        for optimizer, state in zip(s.optimizers, checkpoint["optimizer_states"]):
            inner = getattr(optimizer, "_optimizer", optimizer)
            keys = list(state.get("state", {}).keys())
            if keys and not isinstance(keys[0], str):
                if s.pipeline_stages != 1:
                    raise ConfigurationError(
                        "this checkpoint's optimizer state is keyed by position (not written by ParcaeStrategy); it "
                        "can only be resumed with pipeline_stages=1"
                    )
                inner.load_state_dict(state)
            else:
                load_named_optimizer_state(inner, module, state)
            _optimizer_to_device(inner, s.root_device)

    def layer_state(self, index: int) -> dict[str, Tensor]:
        """All tensors of global layer ``index`` held here: parameters, buffers and optimizer state, by name.

        Raises:
            ConfigurationError: if this process does not hold that layer.
        """
        s = self.strategy
        assert s.groups is not None and s.lightning_module is not None
        a, b = stage_bounds(s.partition)[s.groups.coords.stage]
        if not a <= index < b:
            raise ConfigurationError(f"layer {index} is not on this process (it holds layers {a}..{b - 1})")
        opts = [getattr(o, "_optimizer", o) for o in s.optimizers]
        return layer_state(s.lightning_module, s.layer_key(s.layer_names[index]), opts)
