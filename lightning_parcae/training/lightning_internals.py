"""Lightning's private internals that ParcaeStrategy depends on, each behind one named function.

Problem: a strategy that runs a pipeline inside Lightning's loops has to reach a few objects Lightning does not
publish -- the data connector's sampler injection, the checkpoint connector's ``resume_start``, the precision
plugin's ``_after_closure``, the epoch loop's SIGTERM broadcast, a module's ``_trainer``, the private launcher
classes, the fit loop's data source, the inner optimizer of a ``LightningOptimizer`` and fabric's optimizer-to-device
helpers. Scattered over the strategy's parts, every Lightning upgrade would be a hunt. This module is the ONE place
they are touched: each function says which Lightning internal it wraps (written against ``pytorch_lightning`` /
``lightning`` 2.6.6, the same in both namespaces) and what breaks if Lightning moves it. Nothing else under
``lightning_parcae/training/`` reads a private attribute of a Lightning object.

When upgrading Lightning: run ``tests/test_training_lightning_internals.py`` first; it checks that every internal
named here still exists with the shape used.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

__all__ = [
    "module_trainer",
    "checkpoint_connector",
    "prepare_dataloader",
    "replace_prepare_dataloader",
    "restore_prepare_dataloader",
    "wrap_after_closure",
    "unwrap_after_closure",
    "silence_sigterm_broadcast",
    "launcher_classes",
    "fit_data_source",
    "inner_optimizer",
    "optimizers_to_device",
    "optimizer_to_device",
    "whole_stream_for_every_process",
]


# ------------------------------------------------------------------------------------------------ module / trainer
def module_trainer(module: Any) -> Optional[Any]:
    """The Trainer a LightningModule is attached to, or ``None`` (no error when there is none).

    Wraps ``LightningModule._trainer`` (Lightning 2.6: the public ``trainer`` property raises when the module is not
    attached). If it moves, ``ParcaeStrategy.teardown`` would no longer undo the data hook and a foreign Trainer
    would not be refused before Lightning's own environment setup.
    """
    return getattr(module, "_trainer", None) if module is not None else None


def checkpoint_connector(trainer: Any) -> Any:
    """The Trainer's checkpoint connector (its ``resume_start`` is patched to resume from another path, once).

    Wraps ``Trainer._checkpoint_connector`` (Lightning 2.6, ``_CheckpointConnector``). If it moves, the launcher's
    fallback resume and a joiner's live restore (``resume_once``) fail with an AttributeError at ``setup``.
    """
    return trainer._checkpoint_connector


# ------------------------------------------------------------------------------------------------ data connector
def prepare_dataloader(trainer: Any) -> Callable[..., Any]:
    """Lightning's own ``_prepare_dataloader(dataloader, shuffle, mode)`` of the Trainer's data connector.

    Wraps ``Trainer._data_connector._prepare_dataloader`` (Lightning 2.6, ``_DataConnector``; it injects the
    distributed sampler). If it moves or changes signature, every loader would get Lightning's sampler instead of
    the global-order resharding, and D x P training would no longer equal one process's.
    """
    return trainer._data_connector._prepare_dataloader


def replace_prepare_dataloader(trainer: Any, prepare: Callable[..., Any]) -> None:
    """Make the Trainer's data connector call ``prepare`` instead of its own ``_prepare_dataloader`` (an
    instance attribute, undone by :func:`restore_prepare_dataloader`). Same internal as :func:`prepare_dataloader`."""
    trainer._data_connector._prepare_dataloader = prepare


def restore_prepare_dataloader(trainer: Any) -> None:
    """Undo :func:`replace_prepare_dataloader` (drop the instance attribute, so the class's method shows again)."""
    trainer._data_connector.__dict__.pop("_prepare_dataloader", None)


# ------------------------------------------------------------------------------------------------ precision plugin
def wrap_after_closure(plugin: Any, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """Replace the precision plugin's ``_after_closure(model, optimizer)`` by ``wrap(<the original>)``, once per
    plugin (a plugin already wrapped is left as it is).

    Wraps ``Precision._after_closure`` (Lightning 2.6: called by ``_wrap_closure`` right after the training-step
    closure, before the optimizer step). If it moves, an elastic job's two-phase commit is never reached: a lost
    peer during the optimizer step would no longer be decided applied-or-discarded everywhere.
    """
    if "_after_closure" not in plugin.__dict__:
        plugin._after_closure = wrap(plugin._after_closure)


def unwrap_after_closure(plugin: Any) -> None:
    """Undo :func:`wrap_after_closure` (drop the instance attribute)."""
    plugin.__dict__.pop("_after_closure", None)


# ------------------------------------------------------------------------------------------------ fit loop
def silence_sigterm_broadcast(trainer: Any) -> None:
    """Stop the fit loop's per-batch broadcast of rank 0's SIGTERM flag.

    Wraps ``_TrainingEpochLoop._broadcast_sigterm_tensor`` (Lightning 2.6, ``trainer.fit_loop.epoch_loop``). The
    broadcast runs before every batch outside any guarded wait, so a lost or hung rank 0 would block the others for
    the group timeout. If it moves, the assignment is a harmless no-op attribute and that blocking comes back
    (chaos trials with rank 0 killed would hang until the timeout).
    """
    trainer.fit_loop.epoch_loop._broadcast_sigterm_tensor = lambda: None


def fit_data_source(trainer: Any) -> Optional[Any]:
    """The fit loop's data source (``.dataloader()`` gives the training loader before the loop has built it), or
    ``None``.

    Wraps ``_FitLoop._data_source`` (Lightning 2.6, ``_DataLoaderSource``). If it moves, profiling finds no sample
    batch and balances stages by parameter count (with a warning) instead of by measured times.
    """
    return getattr(trainer.fit_loop, "_data_source", None)


# ------------------------------------------------------------------------------------------------ launchers
def launcher_classes(launchers: Any) -> tuple[Any, Any]:
    """``(SubprocessScriptLauncher, MultiProcessingLauncher)`` of a namespace's ``strategies.launchers`` module.

    Wraps ``_SubprocessScriptLauncher`` and ``_MultiProcessingLauncher`` (Lightning 2.6; private names, used by its
    own DDP strategy). If they move, building the namespace's strategy class fails at import.
    """
    return launchers._SubprocessScriptLauncher, launchers._MultiProcessingLauncher


# ------------------------------------------------------------------------------------------------ optimizers
def inner_optimizer(optimizer: Any) -> Any:
    """The torch optimizer inside a ``LightningOptimizer`` (the optimizer itself if it is not wrapped).

    Wraps ``LightningOptimizer._optimizer`` (Lightning 2.6). If it moves, optimizer state is read from (and steps are
    applied to) the wrapper, whose ``state`` / ``step`` forward differently: checkpoints and migrations would break.
    """
    return getattr(optimizer, "_optimizer", optimizer)


def optimizers_to_device(optimizers: Any, device: Any) -> None:
    """Move every optimizer's state to ``device``.

    Wraps ``lightning_fabric.utilities.optimizer._optimizers_to_device`` (Lightning 2.6; what Lightning's own
    strategies call in ``setup``). If it moves, ``setup`` fails with an ImportError.
    """
    from lightning_fabric.utilities.optimizer import _optimizers_to_device  # noqa: PLC0415

    _optimizers_to_device(optimizers, device)


def optimizer_to_device(optimizer: Any, device: Any) -> None:
    """Move one optimizer's state to ``device`` (``lightning_fabric.utilities.optimizer._optimizer_to_device``,
    Lightning 2.6). If it moves, loading a checkpoint's optimizer state fails with an ImportError."""
    from lightning_fabric.utilities.optimizer import _optimizer_to_device  # noqa: PLC0415

    _optimizer_to_device(optimizer, device)


# ------------------------------------------------------------------------------------------------ the elastic runtime
# (appended for runtime/host.py's TrainingHost, implemented by ParcaeStrategy: what the runtime asks of Lightning)
def validation_follows(trainer: Any) -> bool:
    """Whether the fit loop runs a validation right after the step that just ended (False when unsure).

    Wraps ``fit_loop.epoch_loop._should_check_val_fx(fit_loop._data_fetcher)`` (Lightning 2.6). If it moves, this
    answers False: planned admissions are then no longer held back at a validation step (held-out chaos seed 1102:
    a joiner restored past the pending validation and trained while the members validated).
    """
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
    if loop is None:
        return False
    try:
        return bool(loop._should_check_val_fx(fetcher))
    except Exception:  # noqa: BLE001 -- Lightning internals: when in doubt, do not hold admissions back
        return False


def forget_val_loader(trainer: Any) -> None:
    """Make the validation loop rebuild its loader (and its distributed sampler) at the next validation.

    Wraps ``fit_loop.epoch_loop.val_loop._combined_loader`` (Lightning 2.6: set to ``None``, the loop re-requests
    its loaders). If it moves, a validation after a change of D reads batches sharded for the old D.
    """
    loop = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "val_loop", None)
    if loop is not None and hasattr(loop, "_combined_loader"):
        loop._combined_loader = None


def trainer_devices_argument(unknown: Any) -> Any:
    """The ``devices`` argument the script passed to ``Trainer(...)``, read from the Trainer's ``__init__`` frame.

    Lightning replaces ``"auto"`` by a count before the strategy sees the devices, so "absent" and "``devices=1``"
    cannot be told apart from the device list alone. Wraps the local variable ``devices`` of ``Trainer.__init__``
    (Lightning 2.6; found through ``sys._getframe``). If it is renamed, this returns ``unknown`` and
    ``resolve_devices`` treats a single device as "not given". Returns ``unknown`` when no Trainer frame is on the
    stack.
    """
    import sys  # noqa: PLC0415

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "__init__":
            obj = frame.f_locals.get("self")
            cls = type(obj)
            if cls.__name__ == "Trainer" or any(c.__name__ == "Trainer" and c.__module__.endswith("trainer.trainer")
                                                for c in cls.__mro__):
                if "devices" in frame.f_locals:
                    return frame.f_locals["devices"]
        frame = frame.f_back  # type: ignore[assignment]
    return unknown


# ------------------------------------------------------------------------------------------------ LitData
def whole_stream_for_every_process(dataset: Any) -> bool:
    """Make a LitData ``StreamingDataset`` yield the whole stream on this process; True if it was one.

    Wraps ``litdata.streaming.dataset.StreamingDataset.distributed_env`` and ``litdata.utilities.env._DistributedEnv``
    (litdata 0.2.x, written against 0.2.76): the dataset reads ``torch.distributed``'s world size once, when it is
    constructed, and then yields only its rank's share. Under ParcaeStrategy every pipeline reads the whole global
    stream and keeps its rows (``runtime.data.GlobalStream``), and the world changes with every generation, so the
    dataset must see a world of one. If litdata renames these, a StreamingDataset built after the process group
    would silently yield a fraction of the stream per rank: ``tests/test_training_lightning_internals.py`` checks
    they exist.
    """
    env = getattr(dataset, "distributed_env", None)
    if env is None or type(dataset).__module__.split(".")[0] != "litdata":
        return False
    from litdata.utilities.env import _DistributedEnv  # noqa: PLC0415

    dataset.distributed_env = _DistributedEnv(world_size=1, global_rank=0, num_nodes=1)
    return True
