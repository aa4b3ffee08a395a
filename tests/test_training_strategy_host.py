"""What the runtime asks of Lightning (runtime/host.py's TrainingHost), as ParcaeStrategy answers it: whether a
validation or the end of fit follows a step, the validation loader's reset, the save before a stop."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lightning_parcae.runtime.host import TrainingHost
from lightning_parcae.training.strategy import ParcaeStrategy, epoch_ends, training_ends


def _trainer(step: int, max_steps: int, epoch: int = 0, max_epochs: int = 1000, last_batch: bool = False) -> Any:
    progress = SimpleNamespace(is_last_batch=last_batch)
    loop = SimpleNamespace(max_epochs=max_epochs, epoch_loop=SimpleNamespace(batch_progress=progress))
    return SimpleNamespace(global_step=step, max_steps=max_steps, current_epoch=epoch, fit_loop=loop)


def test_nobody_is_admitted_at_the_step_that_ends_fit() -> None:
    """Regression (chaos seed 49, under load): a standby admitted at step 22 of ``max_steps=22`` restored a loop
    that was already done and skipped the end-of-fit collectives the member ran; the code after ``fit`` then ran
    one collective apart and ``save_checkpoint``'s barrier failed (exit 1). The last step admits no one."""
    assert training_ends(_trainer(22, 22))
    assert not training_ends(_trainer(21, 22))
    assert not training_ends(_trainer(21, -1))  # no step limit, not the last epoch
    assert training_ends(_trainer(40, -1, epoch=1, max_epochs=2, last_batch=True))  # the last epoch's last batch
    assert not training_ends(_trainer(39, -1, epoch=1, max_epochs=2, last_batch=False))
    assert not training_ends(_trainer(20, -1, epoch=0, max_epochs=2, last_batch=True))  # an earlier epoch's end
    assert ParcaeStrategy(pipeline_stages=1).training_ends(_trainer(22, 22))


def test_a_validation_after_the_step_holds_admissions_back_and_doubt_does_not() -> None:
    s = ParcaeStrategy(pipeline_stages=1)
    fetchers: list[Any] = []

    def trainer(answer: Any) -> Any:
        def should_check(fetcher: Any) -> bool:
            fetchers.append(fetcher)
            if isinstance(answer, Exception):
                raise answer
            return answer

        epoch_loop = SimpleNamespace(_should_check_val_fx=should_check)
        return SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=epoch_loop, _data_fetcher="the fetcher"))

    assert s.validation_follows(trainer(True)) is True
    assert s.validation_follows(trainer(False)) is False
    assert s.validation_follows(trainer(RuntimeError("moved"))) is False
    assert fetchers == ["the fetcher"] * 3
    assert s.validation_follows(SimpleNamespace(fit_loop=SimpleNamespace())) is False


def test_the_validation_loader_is_rebuilt_after_a_change_of_d() -> None:
    val_loop = SimpleNamespace(_combined_loader="built for D=2")
    trainer = SimpleNamespace(fit_loop=SimpleNamespace(epoch_loop=SimpleNamespace(val_loop=val_loop)))
    ParcaeStrategy(pipeline_stages=1).reset_eval_loaders(trainer)
    assert val_loop._combined_loader is None


def test_nobody_is_admitted_at_the_last_step_of_an_epoch() -> None:
    """Regression (issue 23): a standby admitted at an epoch's last step ran the epoch-end hooks from a state that had
    never loaded the validation loader (ModelCheckpoint saved at the training epoch's end: a barrier the members did
    not make), and the members stalled 60 s. Such a step admits no one."""
    assert epoch_ends(_trainer(40, -1, last_batch=True))
    assert not epoch_ends(_trainer(39, -1, last_batch=False))
    assert not epoch_ends(SimpleNamespace(fit_loop=SimpleNamespace()))  # unsure: do not hold admissions back
    assert ParcaeStrategy(pipeline_stages=1).epoch_ends(_trainer(40, -1, last_batch=True))


def test_the_save_before_a_stop_waits_for_the_write(monkeypatch: Any) -> None:
    s = ParcaeStrategy(pipeline_stages=1)
    order: list[str] = []
    monkeypatch.setattr(s, "wait_for_checkpoint", lambda: order.append("waited"))
    trainer = SimpleNamespace(save_checkpoint=lambda path: order.append(f"saved {path}"))
    s.save_before_leaving(trainer, "/run/ckpt/last.ckpt")
    assert order == ["saved /run/ckpt/last.ckpt", "waited"]


def test_the_strategy_is_every_part_of_the_runtimes_host() -> None:
    s = ParcaeStrategy(pipeline_stages=1)
    assert isinstance(s, TrainingHost)
    for name in ("torch_optimizers", "validation_follows", "training_ends", "epoch_ends", "loop_checkpoint",
                 "reset_eval_loaders", "save_before_leaving"):
        assert callable(getattr(s, name))


def test_the_runtime_gets_the_torch_optimizers_unwrapped() -> None:
    import torch

    s = ParcaeStrategy(pipeline_stages=1)
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=0.1)
    s.optimizers = [sgd]
    assert s.torch_optimizers() == [sgd]
    from pytorch_lightning.core.optimizer import LightningOptimizer

    s.optimizers = [LightningOptimizer(sgd)]  # what Lightning's loops hand around
    assert s.torch_optimizers() == [sgd]
