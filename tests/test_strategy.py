"""ParcaeStrategy: transparency against single-process Lightning, configuration, and bad inputs."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import pytorch_lightning as pl
from lightning_parcae.errors import (
    BatchSplitError,
    ConfigurationError,
    ForeignTrainerError,
    ModelLayoutError,
    StageMemoryError,
)
from lightning_parcae.training.strategy import ParcaeStrategy, check_trainer

from runtime_helpers import TinyNet, cached_run, make_loader, max_rel_diff, reference

# One 4-process run checks the hardest default combination: D=2 x P=2, Adam, global-norm clipping, gradient
# accumulation, 2 micro-batches (1F1B), validation with sync_dist and a torchmetrics metric, LR scheduler,
# and ModelCheckpoint every 3 steps (reused by tests/test_runtime_checkpoint.py).
HARD = dict(optimizer="adam", lr=0.05, clip=0.3, accumulate=2, max_steps=6, sanity=2, shuffle=True,
            ckpt_every=3)
HARD_SHAPE = {"world": 4, "P": 2, "M": 2, "schedule": "1f1b"}


def _assert_transparent(res: dict, ref: dict) -> None:
    assert res["global_step"] == ref["global_step"]
    assert max_rel_diff(res["state_dict"], ref["state_dict"]) < 1e-5
    for name in ("val_loss", "val_acc"):
        assert res["metrics"][name] == pytest.approx(ref["metrics"][name], rel=1e-5)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_strategy_matches_single_process_if_2x2_adam_clip_accumulate() -> None:
    res = cached_run("hard", {**HARD, "parcae": HARD_SHAPE})
    _assert_transparent(res, reference("hard", HARD))


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    ("world", "p", "m", "schedule", "optimizer"),
    [(1, 1, 1, "1f1b", "sgd"), (2, 1, 2, "1f1b", "sgd"), (2, 2, 2, "gpipe", "sgd"), (2, 2, 4, "1f1b", "adam"),
     (4, 2, 2, "gpipe", "sgd"), (2, 1, 1, "1f1b", "adam")],
)
def test_strategy_matches_single_process_if_shape_varies(world: int, p: int, m: int, schedule: str,
                                                         optimizer: str) -> None:
    cfg = dict(optimizer=optimizer, lr=0.05, max_steps=5, sanity=2, clip=1.0 if optimizer == "adam" else None)
    res = cached_run(f"shape-{world}-{p}-{m}-{schedule}-{optimizer}",
                     {**cfg, "parcae": {"world": world, "P": p, "M": m, "schedule": schedule}})
    _assert_transparent(res, reference(f"shape-{optimizer}", cfg))


# ------------------------------------------------------------------------------------------ what crosses stages
# One 2-process run (D=1 x P=2, M=2, 1F1B) of a model with a wide output (2048 logits per sample), a torchmetrics
# metric logged on step and epoch, sync_dist, a progress-bar value, ModelCheckpoint(monitor=...), EarlyStopping and
# predict, against one plain process (tests/stage_crossing_worker.py).
_CROSSING: dict[str, list[dict]] = {}


def _crossing(key: str) -> list[dict]:
    import tempfile

    from stage_crossing_worker import launch

    if key not in _CROSSING:
        cfg: dict = {"out": tempfile.mkdtemp(prefix=f"parcae-crossing-{key}-")}
        if key == "pipeline":
            cfg["parcae"] = {"world": 2, "P": 2, "M": 2, "schedule": "1f1b"}
        _CROSSING[key] = launch(cfg)
    return _CROSSING[key]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_stages_never_broadcast_a_tensor_the_size_of_the_output() -> None:
    """Regression (issue 22): every step broadcast the last stage's whole output (here 16 x 2048 logits, 128 KiB)
    to the other stages so that they could re-run the user's step; only the logged values and the loss cross now."""
    for rank in _crossing("pipeline"):
        assert 0 < rank["max_broadcast_bytes"] < rank["output_bytes"] / 8, rank["max_broadcast_bytes"]


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_logged_values_are_equal_on_every_stage_and_to_one_process() -> None:
    stages, (ref,) = _crossing("pipeline"), _crossing("reference")
    first, last = stages
    # what Lightning and the callbacks see after each step (metrics, progress bar, the step's output) is the same
    # on both stages -- also what only the last stage computed (the Metric, the max over micro-batches, extras)
    assert first["steps"] == last["steps"] and first["validations"] == last["validations"]
    assert first["final"] == last["final"] and first["predictions"] == last["predictions"]
    assert len(first["steps"]) == len(ref["steps"])
    for mine, theirs in zip(first["steps"], ref["steps"]):
        assert mine["step"] == theirs["step"]
        assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-5)
        for name in ("train_loss", "train_loss_sync_step"):
            assert mine["metrics"][name] == pytest.approx(theirs["metrics"][name], rel=1e-5)
        assert mine["progress_bar"]["train_loss"] == pytest.approx(theirs["progress_bar"]["train_loss"], rel=1e-5)
    assert [v["step"] for v in first["validations"]] == [v["step"] for v in ref["validations"]]
    for mine, theirs in zip(first["validations"], ref["validations"]):
        for name in ("val_loss", "val_acc"):  # sync_dist, and a torchmetrics Metric logged from validation_step
            assert mine["metrics"][name] == pytest.approx(theirs["metrics"][name], rel=1e-5)
    for name in ("train_loss_sync_epoch", "train_acc_epoch"):  # epoch values: sync_dist, a Metric's compute()
        assert first["final"][name] == pytest.approx(ref["final"][name], rel=1e-5)
    assert first["predictions"] == ref["predictions"]  # predict returns the predictions on every stage


@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_checkpoint_monitor_and_early_stopping_choose_like_one_process() -> None:
    stages, (ref,) = _crossing("pipeline"), _crossing("reference")
    for rank in stages:
        assert rank["global_step"] == ref["global_step"] < 16  # EarlyStopping stopped at the same step
        assert rank["stopped_epoch"] == ref["stopped_epoch"]
        assert rank["best"] == ref["best"]  # ModelCheckpoint(monitor="val_acc") kept the same step
        assert rank["best_score"] == pytest.approx(ref["best_score"], rel=1e-5)
        assert rank["early_best"] == pytest.approx(ref["early_best"], rel=1e-5)


# ------------------------------------------------------------------------------------------------ single process
@pytest.fixture(autouse=True)
def _no_leftover_process_group() -> object:
    """In-process runs leave their (size-1) world up, like DDP does; take it down after each test."""
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _fit(module: pl.LightningModule, loader: torch.utils.data.DataLoader, **strategy_kwargs: object) -> pl.Trainer:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ParcaeStrategy(**strategy_kwargs), max_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(module, loader)
    return trainer


@pytest.mark.timeout(60)
def test_strategy_trains_in_process_if_one_device(tmp_path: object) -> None:
    pl.seed_everything(0)
    module = TinyNet(scheduler=False)
    trainer = _fit(module, make_loader(), pipeline_stages=1, micro_batches=4)
    assert trainer.global_step == 1
    assert trainer.strategy.partition == [5]


@pytest.mark.timeout(60)
def test_strategy_raises_model_layout_error_if_more_stages_than_layers() -> None:
    with pytest.raises(ModelLayoutError, match="exceeds the 5 layers"):
        _partition_only(ParcaeStrategy(pipeline_stages=6), TinyNet())


def _partition_only(strategy: ParcaeStrategy, module: pl.LightningModule) -> None:
    """Run the partition step alone, with a stand-in for the process groups (no Trainer, no processes)."""
    p = strategy.pipeline_stages_option or 1
    strategy._lightning_module = module
    strategy.layout.use_groups(types.SimpleNamespace(  # type: ignore[arg-type]
        world=p, pipeline_stages=p, coords=types.SimpleNamespace(stage=0), pipeline_group=None
    ))
    strategy.parallel_devices = [torch.device("cpu")]
    strategy.layout.partition_module(types.SimpleNamespace(fit_loop=None, state=None))  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_strategy_raises_model_layout_error_if_module_has_no_layer_stack() -> None:
    class NoStack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)

    with pytest.raises(ModelLayoutError, match="no nn.Sequential or nn.ModuleList.*pipeline_stages=1 this model"):
        _partition_only(ParcaeStrategy(pipeline_stages=2), NoStack())


@pytest.mark.timeout(60)
def test_strategy_trains_whole_model_at_p1_if_module_has_no_layer_stack() -> None:
    """Regression (issue 12): a model without a cuttable stack was refused even at P = 1, where data
    parallelism needs no cut; its top-level children now stand in for layers and P is pinned to 1."""
    class NoStack(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2)
            self.act = nn.ReLU()
            self.b = nn.Linear(2, 1)

    s = ParcaeStrategy(pipeline_stages=1)
    _partition_only(s, NoStack())
    assert s.whole_model and s.layer_names == ["a", "b"] and s.max_pipeline_stages == 1
    assert s.stage_key_set() == {"a.weight", "a.bias", "b.weight", "b.bias"}
    assert s.is_stage_key("a.weight") and not s.is_stage_key("act.x")


@pytest.mark.timeout(60)
def test_strategy_raises_stage_memory_error_if_stage_exceeds_limit() -> None:
    with pytest.raises(StageMemoryError, match=r"stage \d .*max_stage_memory_bytes=100"):
        _partition_only(ParcaeStrategy(pipeline_stages=1, max_stage_memory_bytes=100), TinyNet())


@pytest.mark.timeout(60)
def test_strategy_raises_batch_split_error_if_batch_not_divisible_by_micro_batches() -> None:
    pl.seed_everything(0)
    with pytest.raises(BatchSplitError, match=r"16 .*micro_batches=3"):
        _fit(TinyNet(), make_loader(batch_size=16), pipeline_stages=1, micro_batches=3)


def test_strategy_raises_foreign_trainer_error_if_lightning_pytorch_trainer() -> None:
    foreign = type("Trainer", (), {"__module__": "lightning.pytorch.trainer.trainer"})()
    with pytest.raises(ForeignTrainerError, match="lightning_parcae.lightning import ParcaeStrategy"):
        check_trainer(foreign)


def test_strategy_raises_configuration_error_if_options_invalid() -> None:
    with pytest.raises(ConfigurationError):
        ParcaeStrategy(micro_batches=0)
    with pytest.raises(ConfigurationError):
        ParcaeStrategy(schedule="zigzag")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        ParcaeStrategy(pipeline_stages=2, balance=[1, 1, 1])


def test_strategy_is_registered_if_imported() -> None:
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="parcae", logger=False)
    assert isinstance(trainer.strategy, ParcaeStrategy)


def test_strategy_finds_named_layer_stack_if_layers_attr_given() -> None:
    from lightning_parcae.runtime.stage import locate_layer_stack

    class Two(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.small = nn.Sequential(nn.Linear(2, 2))
            self.big = nn.Sequential(nn.Linear(20, 20), nn.ReLU())

        def parcae_layers(self) -> nn.Sequential:
            return self.small

    m = Two()
    assert locate_layer_stack(m, "big") == "big"
    assert locate_layer_stack(m) == "small"  # the hook wins over the largest stack
    del Two.parcae_layers
    assert locate_layer_stack(m) == "big"
