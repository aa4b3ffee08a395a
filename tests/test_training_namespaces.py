"""The two Lightning namespaces as one interface: each namespace's classes, and a Trainer of the other refused."""

from __future__ import annotations

import pytest

from lightning_parcae.errors import ForeignTrainerError
from lightning_parcae.training.namespaces import check_trainer, namespace, namespace_of


@pytest.mark.parametrize("name", ["pytorch_lightning", "lightning.pytorch"])
def test_each_namespace_names_its_own_classes(name: str) -> None:
    ns = namespace(name)
    assert ns.name == name and ns.pl.__name__ == name
    for cls in (ns.ParallelStrategy, ns.SubprocessScriptLauncher, ns.MultiProcessingLauncher):  # the registry: a dict
        assert cls.__module__.startswith(name)


def test_an_unknown_namespace_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown Lightning namespace"):
        namespace("lightning")


def test_namespace_of_finds_the_namespace_by_class() -> None:
    assert namespace_of(namespace("pytorch_lightning").pl.LightningModule()) == "pytorch_lightning"
    assert namespace_of(namespace("lightning.pytorch").pl.LightningModule()) == "lightning.pytorch"
    assert namespace_of(object()) is None


def test_a_trainer_of_the_other_namespace_is_refused_with_the_import_to_use() -> None:
    trainer = namespace("lightning.pytorch").pl.Trainer(accelerator="cpu", devices=1, logger=False,
                                                        enable_checkpointing=False, enable_progress_bar=False)
    check_trainer(trainer, "lightning.pytorch")
    with pytest.raises(ForeignTrainerError, match="lightning_parcae.lightning import ParcaeStrategy"):
        check_trainer(trainer, "pytorch_lightning")
