"""The import hook that registers ``strategy="parcae"`` in whichever Lightning namespace a script imports."""

from __future__ import annotations

import sys

import pytest

from lightning_parcae.training import autoregister


def test_install_puts_one_hook_on_the_import_path_however_often_it_is_called() -> None:
    autoregister.install()
    autoregister.install()
    assert sum(isinstance(f, autoregister._RegisterOnImport) for f in sys.meta_path) == 1


def test_the_hook_wraps_only_the_lightning_packages() -> None:
    finder = autoregister._RegisterOnImport()
    assert finder.find_spec("json", None) is None
    spec = finder.find_spec("pytorch_lightning", None)
    assert spec is not None and isinstance(spec.loader, autoregister._Loader)
    assert spec.loader.ns_name == "pytorch_lightning"


def test_installed_namespaces_know_parcae() -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import StrategyRegistry

    autoregister.install()
    assert "parcae" in StrategyRegistry and pl.Trainer is not None


def test_a_failed_registration_never_breaks_the_users_import(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from lightning_parcae.training import strategy

    def broken(ns_name: str) -> type:
        raise RuntimeError("boom")

    monkeypatch.setattr(strategy, "strategy_class", broken)
    autoregister._register("pytorch_lightning")
    assert "could not register strategy 'parcae' in pytorch_lightning: boom" in capsys.readouterr().err
