"""Checkpoints of a D x P job: one full, layout-free file written from rank 0, read back into any layout.

Problem: under ParcaeStrategy no process holds the whole model -- stage ``s`` holds only its layers and their
optimizer state -- yet a checkpoint must be a single ordinary Lightning file that resumes at *any* (D, P), and a
save must neither tear ``last.ckpt`` nor stall an elastic job on the disk. This part of the strategy gathers the
stages of replica 0 into one state dict with global keys and one name-keyed optimizer state, writes it atomically
(from a background thread when the job is elastic), and on load hands each process only the keys it holds. The
parts outside the stack that belong to a stage (the embedding on the first, the head on the last) are gathered
from their holders and loaded only there; a checkpoint written before they had owners (every key on every stage)
reads the same way.

Where it goes: a path as Lightning gives it, or -- when the launcher names a checkpoint directory
(``--checkpoint-dir``, :data:`~lightning_parcae.contract.CHECKPOINT_DIR_ENV`) and the save targets that directory --
a new checkpoint in that :class:`~lightning_parcae.runtime.checkpoint_store.CheckpointStore` (local, shared mount or
object storage; complete-or-invisible, retried, pruned). A store outage never stops training: the failed save is
reported and the previous complete checkpoint stays the resume point. Loads of a store's URL are checked against
its manifest and read with ``weights_only=True`` like any other.

The strategy owns one :class:`StrategyCheckpoints` and forwards Lightning's checkpoint hooks to it.
"""

from __future__ import annotations

import io
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Optional, Protocol

import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.runtime.checkpoint_store import CheckpointStore, SaveFailed, read_url
from lightning_parcae.runtime.stage import is_released
from lightning_parcae.runtime.checkpoint import (
    to_cpu,
    atomic_save,
    gather_objects,
    layer_state,
    load_named_optimizer_state,
    merge_named_optimizer_states,
    named_optimizer_state,
    plain_containers,
)
from lightning_parcae.training.lightning_internals import inner_optimizer, optimizer_to_device
from lightning_parcae.training.stage_state import StageState

if TYPE_CHECKING:
    from lightning_parcae.training.data_path import DataPath

__all__ = ["StrategyCheckpoints", "CheckpointHost", "CKPT_KEY", "CKPT_VERSION"]

CKPT_KEY = "parcae"
CKPT_VERSION = 1


def device_kind(device: torch.device) -> str:
    """What a checkpoint records of the device its layer times were measured on: ``cpu``, or ``cuda:<name>``."""
    if device.type == "cuda" and torch.cuda.is_available():
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return device.type


class CheckpointHost(Protocol):
    """What the checkpoints need from the strategy: module, optimizers, rank, device, checkpoint IO, runtime."""

    @property
    def lightning_module(self) -> Any: ...

    @property
    def optimizers(self) -> list[Any]: ...

    @property
    def global_rank(self) -> int: ...

    @property
    def is_global_zero(self) -> bool: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def checkpoint_io(self) -> Any: ...

    @property
    def elastic_runtime(self) -> Any: ...


class StrategyCheckpoints:
    """Gather, write and load checkpoints for one strategy (see the module docstring).

    Args:
        state: The stage state (read only: groups, partition, layer names, stack path).
        micro_batches: M (recorded in the checkpoint's layout).
        host: The strategy (module, optimizers, rank, device, checkpoint IO, elastic runtime).
        data: The data path (its sample cursor is saved, and resumed from a loaded checkpoint).
        checkpoint_dir: The launcher's checkpoint directory (``--checkpoint-dir``), or None. A save whose path is
            this directory adds a checkpoint to its store.
        member: This process's member id (recorded as the writer of each checkpoint).
    """

    def __init__(self, state: StageState, micro_batches: int, host: CheckpointHost, data: "DataPath",
                 checkpoint_dir: Optional[str] = None, member: str = "") -> None:
        self.state = state
        self.micro_batches = micro_batches
        self.host = host
        self.data = data
        self.checkpoint_dir = checkpoint_dir
        self.member = member
        self._store: Optional[CheckpointStore] = None
        self.failed_saves = 0
        """Saves into the store that failed every attempt (training went on; the previous checkpoint stays)."""
        self.writer: Optional[threading.Thread] = None
        self.local_dump = False  # True while the runtime wants this process's own keys only (no gather)
        self.resumed_layout: Optional[dict[str, Any]] = None
        """The layout record of the checkpoint last loaded, when it was saved on the same kind of device (its layer
        times may then spare the relaunch a profile: :meth:`StageLayout.saved_layer_times`)."""

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
        g = self.state.groups
        assert g is not None
        if g.coords.replica != 0:
            return None
        return gather_objects(obj, 0, g.pipeline_group_of(0))

    def _held_state(self, module: Any) -> dict[str, Any]:
        """``module``'s state dict (tensors as they are) without the parts this process does not hold -- another
        stage's embedding or head, a stand-in here, known by its mark and by its key: its holder saves and loads
        it."""
        released = self.state.released_outside()
        return {k: v for k, v in module.state_dict(keep_vars=True).items()
                if not is_released(v) and k not in released}

    def module_state_dict(self) -> dict[str, Any]:
        """The full state dict with global keys (complete on rank 0)."""
        s = self.host
        module = s.lightning_module
        assert module is not None
        local = {k: v.detach().cpu() for k, v in self._held_state(module).items()}
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
        s = self.host
        inner = inner_optimizer(optimizer)
        assert s.lightning_module is not None
        local = named_optimizer_state(inner, s.lightning_module)
        if self.local_dump:
            return local
        parts = self._replica0_gather(local)
        if parts is None or s.global_rank != 0:
            return local
        return merge_named_optimizer_states(parts)

    @property
    def store(self) -> Optional[CheckpointStore]:
        """The launcher's checkpoint store (None without ``--checkpoint-dir``); opened on first use."""
        if self._store is None and self.checkpoint_dir:
            self._store = CheckpointStore(self.checkpoint_dir)
        return self._store

    def targets_store(self, filepath: Any) -> bool:
        """Whether a save to ``filepath`` adds a checkpoint to the launcher's store (``filepath`` is its URL)."""
        store = self.store
        return store is not None and str(filepath).rstrip("/") == store.url.rstrip("/")

    def save(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None) -> None:
        """Write the gathered checkpoint from rank 0: atomically (temp file + ``os.replace``) to a path, or as a new
        complete checkpoint of the launcher's store when ``filepath`` is its directory."""
        s, st = self.host, self.state
        checkpoint[CKPT_KEY] = {
            "version": CKPT_VERSION,
            "data": self.data.state(),
            "layout": {
                "data_parallel": st.groups.data_parallel if st.groups is not None else 1,
                "pipeline_stages": st.groups.pipeline_stages if st.groups is not None else 1,
                "partition": list(st.partition),
                "layer_names": list(st.layer_names),
                "stack_path": st.stack_path or "",
                "micro_batches": self.micro_batches,
                # what the layer times were measured on: a relaunch with the same reuses them (no new profile)
                "layer_times": [float(t) for t in st.layer_times],
                "global_batch": int(self.data.global_batch or 0),
                "device": device_kind(self.host.root_device),
            },
        }
        if s.is_global_zero:
            checkpoint = plain_containers(checkpoint)
            if self.targets_store(filepath):
                step = int(checkpoint.get("global_step", 0))
                if s.elastic_runtime is not None:
                    self._start_writer(self._save_to_store, to_cpu(checkpoint), step)
                else:
                    self._save_to_store(checkpoint, step)
            elif storage_options is not None or "://" in str(filepath):
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
        self._start_writer(atomic_save, to_cpu(checkpoint), path)  # copies: the optimizer keeps updating the tensors

    def _start_writer(self, target: Any, *args: Any) -> None:
        if self.writer is not None:
            self.writer.join()
        self.writer = threading.Thread(target=target, args=args, name="parcae-ckpt", daemon=False)
        self.writer.start()

    def _save_to_store(self, checkpoint: dict[str, Any], step: int) -> None:
        """One checkpoint into the store; a store that stays away is reported, never raised into training."""
        store = self.store
        assert store is not None
        try:
            store.save(lambda f: torch.save(checkpoint, f), step, writer=self.member,
                       extra={"epoch": int(checkpoint.get("epoch", 0))})
        except SaveFailed as exc:
            self.failed_saves += 1
            print(f"[parcae] {exc}", file=sys.stderr, flush=True)

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

        s = self.host
        if checkpoint_path == LIVE_CHECKPOINT and s.elastic_runtime is not None:
            checkpoint = s.elastic_runtime.joiner_checkpoint()
        elif "://" in str(checkpoint_path):  # a store's URL: checked against its manifest, then weights_only
            checkpoint = torch.load(io.BytesIO(read_url(str(checkpoint_path))), map_location="cpu", weights_only=True)
        else:
            checkpoint = torch.load(checkpoint_path, map_location="cpu", weights_only=True)
        parcae = checkpoint.get(CKPT_KEY)
        self.resumed_layout = None
        if isinstance(parcae, Mapping) and isinstance(parcae.get("layout"), Mapping):
            layout = dict(parcae["layout"])
            if layout.get("device") == device_kind(self.host.root_device):
                self.resumed_layout = layout
        if isinstance(parcae, Mapping) and "data" in parcae:
            self.data.resume_from(parcae["data"])
            saved_b = int(parcae["data"].get("global_batch", 0))
            b = self.data.global_batch
            if saved_b and b and saved_b != b:
                warnings.warn(f"checkpoint global batch {saved_b} differs from {b}", stacklevel=3)
        return checkpoint

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Load the keys this process holds from a full (any-layout) state dict (a part outside the stack that
        another stage holds is neither loaded nor required here)."""
        module = self.host.lightning_module
        assert module is not None
        own = set(self._held_state(module))
        full = checkpoint["state_dict"]
        missing = sorted(own - set(full.keys()))
        if strict and missing:
            raise ConfigurationError(f"checkpoint lacks {len(missing)} keys of this model, e.g. {missing[:3]}")
        module.load_state_dict({k: v for k, v in full.items() if k in own}, strict=False)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load name-keyed optimizer state (positional state only when it came from the same single stage)."""
        s = self.host
        module = s.lightning_module
        assert module is not None
        for optimizer, state in zip(s.optimizers, checkpoint["optimizer_states"]):
            inner = inner_optimizer(optimizer)
            keys = list(state.get("state", {}).keys())
            if keys and not isinstance(keys[0], str):
                if self.state.groups is not None and self.state.groups.pipeline_stages != 1:
                    raise ConfigurationError(
                        "this checkpoint's optimizer state is keyed by position (not written by ParcaeStrategy); it "
                        "can only be resumed with pipeline_stages=1"
                    )
                inner.load_state_dict(state)
            else:
                load_named_optimizer_state(inner, module, state)
            optimizer_to_device(inner, s.root_device)

    def layer_state(self, index: int) -> dict[str, Tensor]:
        """All tensors of global layer ``index`` held here: parameters, buffers and optimizer state, by name.

        Raises:
            ConfigurationError: if this process does not hold that layer.
        """
        s, st = self.host, self.state
        assert st.groups is not None and s.lightning_module is not None
        a, b = st.held_bounds()
        if not a <= index < b:
            raise ConfigurationError(f"layer {index} is not on this process (it holds layers {a}..{b - 1})")
        opts = [inner_optimizer(o) for o in s.optimizers]
        return layer_state(s.lightning_module, st.layer_key(st.layer_names[index]), opts)
