"""Register ``strategy="parcae"`` in whichever Lightning namespace a script imports, whenever it imports it.

Problem: Lightning resolves ``Trainer(strategy="parcae")`` in its ``StrategyRegistry`` while the Trainer is built,
so the name must be registered before that -- in ``pytorch_lightning`` *and* in ``lightning.pytorch``, and without
importing the namespace a script does not use. ``import lightning_parcae`` installs :class:`_RegisterOnImport`, an
import hook that waits for either package to finish importing and then registers the strategy class built for it
(namespaces imported earlier are registered at once). Under ``parcae run`` / ``parcae agent`` the workers get
``lightning_parcae/training/boot`` on ``PYTHONPATH``, whose ``sitecustomize`` imports ``lightning_parcae`` at
start-up, so a script needs no import of this package at all.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from typing import Any, Optional, Sequence

__all__ = ["install"]

_WATCHED = {"pytorch_lightning": "pytorch_lightning", "lightning": "lightning.pytorch"}


def _register(ns_name: str) -> None:
    try:
        from lightning_parcae.training.strategy import strategy_class  # noqa: PLC0415

        strategy_class(ns_name)
    except Exception as exc:  # noqa: BLE001 -- never break the user's import of Lightning
        print(f"lightning_parcae: could not register strategy 'parcae' in {ns_name}: {exc}", file=sys.stderr)


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: Any, ns_name: str) -> None:
        self.inner = inner
        self.ns_name = ns_name

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        _register(self.ns_name)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Wraps the loader of ``pytorch_lightning`` / ``lightning`` so that ``"parcae"`` is registered after them."""

    def find_spec(self, fullname: str, path: Optional[Sequence[str]], target: Any = None) -> Any:
        ns_name = _WATCHED.get(fullname)
        if ns_name is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return None
        spec.loader = _Loader(spec.loader, ns_name)
        return spec


def install() -> None:
    """Install the hook (once) and register the namespaces that are already imported."""
    if not any(isinstance(f, _RegisterOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
    for top, ns_name in _WATCHED.items():
        mod = sys.modules.get(top)
        if mod is not None and getattr(mod, "__spec__", None) is not None and hasattr(
                sys.modules.get(ns_name), "Trainer"):
            _register(ns_name)
