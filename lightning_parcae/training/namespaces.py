"""The two Lightning namespaces, ``pytorch_lightning`` and ``lightning.pytorch``, as one interface.

Problem: Lightning ships the same trainer twice -- the ``pytorch-lightning`` package (``import pytorch_lightning``)
and the ``lightning`` package (``import lightning.pytorch`` / ``import lightning as L``). Their classes are distinct:
a ``lightning.pytorch.Trainer`` refuses a strategy derived from ``pytorch_lightning``'s ``Strategy`` and vice versa,
and each has its own strategy registry, cluster environments and callbacks. ParcaeStrategy's logic is the same
for both, so it is written once (as mixins) and each namespace gets classes of its own hierarchy built over that
namespace's base classes. This module names, per namespace, the few Lightning objects those classes need, and
imports a namespace only when it is asked for (a ``lightning.pytorch`` user never imports ``pytorch_lightning``).
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from lightning_parcae.errors import ForeignTrainerError
from lightning_parcae.training.lightning_internals import launcher_classes

__all__ = ["Namespace", "namespace", "NAMESPACES", "namespace_of", "likely_namespace", "check_trainer"]

NAMESPACES = ("pytorch_lightning", "lightning.pytorch")
_FABRIC = {"pytorch_lightning": "lightning_fabric", "lightning.pytorch": "lightning.fabric"}
IMPORT_HINT = {
    "pytorch_lightning": "`from lightning_parcae import ParcaeStrategy` (or strategy=\"parcae\")",
    "lightning.pytorch": "`from lightning_parcae.lightning import ParcaeStrategy` (or strategy=\"parcae\")",
}


@dataclass(frozen=True)
class Namespace:
    """The Lightning objects of one namespace that ParcaeStrategy builds on.

    Attributes:
        name: ``"pytorch_lightning"`` or ``"lightning.pytorch"``.
        pl: the namespace's top-level module (``Trainer``, ``LightningModule``, ``Callback``).
        ParallelStrategy: base class of the strategy.
        StrategyRegistry: where ``"parcae"`` is registered.
        ClusterEnvironment: base class of the launcher's environment.
        SubprocessScriptLauncher: Lightning's ``popen`` launcher.
        MultiProcessingLauncher: Lightning's ``spawn`` launcher.
    """

    name: str
    pl: Any
    ParallelStrategy: Any
    StrategyRegistry: Any
    ClusterEnvironment: Any
    SubprocessScriptLauncher: Any
    MultiProcessingLauncher: Any

    @property
    def import_hint(self) -> str:
        """How a user gets this namespace's strategy."""
        return IMPORT_HINT[self.name]


@lru_cache(maxsize=None)
def namespace(name: str) -> Namespace:
    """The :class:`Namespace` called ``name`` (imports that Lightning package).

    Raises:
        ValueError: for a name other than ``pytorch_lightning`` / ``lightning.pytorch``.
    """
    if name not in NAMESPACES:
        raise ValueError(f"unknown Lightning namespace {name!r}; expected one of {NAMESPACES}")
    pl = importlib.import_module(name)
    strategies = importlib.import_module(f"{name}.strategies")
    launchers = importlib.import_module(f"{name}.strategies.launchers")
    envs = importlib.import_module(f"{_FABRIC[name]}.plugins.environments")
    subprocess_launcher, multiprocessing_launcher = launcher_classes(launchers)
    return Namespace(
        name=name, pl=pl, ParallelStrategy=strategies.ParallelStrategy, StrategyRegistry=strategies.StrategyRegistry,
        ClusterEnvironment=envs.ClusterEnvironment, SubprocessScriptLauncher=subprocess_launcher,
        MultiProcessingLauncher=multiprocessing_launcher,
    )


def namespace_of(obj: Any) -> str | None:
    """The Lightning namespace an object (Trainer, strategy, module) belongs to, by the module of its class MRO."""
    for cls in type(obj).__mro__:
        mod = cls.__module__ or ""
        if mod == "pytorch_lightning" or mod.startswith("pytorch_lightning."):
            return "pytorch_lightning"
        if mod == "lightning.pytorch" or mod.startswith("lightning.pytorch."):
            return "lightning.pytorch"
    return None


def likely_namespace() -> str:
    """The namespace a caller most likely uses: ``lightning.pytorch`` when only it is imported, else
    ``pytorch_lightning`` (the package this project was written against)."""
    if "lightning.pytorch" in sys.modules and "pytorch_lightning" not in sys.modules:
        return "lightning.pytorch"
    return "pytorch_lightning"


def check_trainer(trainer: Any, ns_name: str = "pytorch_lightning") -> None:
    """Refuse a Trainer of the other Lightning namespace (or anything that is not a Trainer of ``ns_name``).

    Raises:
        ForeignTrainerError: naming the import to use instead.
    """
    found = namespace_of(trainer)
    if found != ns_name or not isinstance(trainer, namespace(ns_name).pl.Trainer):
        hint = IMPORT_HINT.get(found or "", "a Lightning Trainer")
        raise ForeignTrainerError(
            f"this ParcaeStrategy was built for {ns_name}, but got a {type(trainer).__name__} from "
            f"{type(trainer).__module__!r}. With that Trainer use {hint}"
        )
