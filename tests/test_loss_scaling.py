"""fp16 mixed precision with a loss scaler under ParcaeStrategy (issue 23), on CPU.

Lightning refuses ``precision="16-mixed"`` on CPU but takes its ``MixedPrecision`` plugin built for the CPU with a
CPU ``torch.amp.GradScaler`` (tests/loss_scaling_worker.py); fp16 autocast and the scaler then run as on a GPU. The
end-to-end CUDA check is step 4 of benchmarks/gpu_check.sh.

Regression (issue 23): ParcaeStrategy refused a GradScaler outright. Supporting it naively -- each process
unscaling its own stage's gradients -- lets one stage skip an overflowing step while the others apply it, and the
skipping stages halve their scale while the others do not. The multi-process tests below force an inf into ONE
rank's gradient after the gradient reduction (so only that rank would see it) and check that every rank skips
that step, keeps the same scale, and ends with one process's parameters.
"""

from __future__ import annotations

import io
import tempfile
import types
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

import pytorch_lightning as pl
from lightning_parcae.errors import ConfigurationError
from lightning_parcae.runtime.migration import layer_payload, pack, unpack
from lightning_parcae.runtime.torch_internals import scaler_found_inf, scaler_unscaled
from lightning_parcae.training.loss_scaling import LossScaling
from lightning_parcae.training.stage_state import StageState

from loss_scaling_worker import OverflowNet, fp16_plugin, launch, run
from runtime_helpers import make_loader

OVERFLOW_AT = 2  # the 3rd optimizer step (global_step 2 while it runs) overflows
STEPS = 6
_RUNS: dict[str, list[dict[str, Any]]] = {}
_OUT: dict[str, str] = {}


def _run(key: str, **cfg: Any) -> list[dict[str, Any]]:
    """One run of tests/loss_scaling_worker.py per pytest session (every rank's observations)."""
    if key not in _RUNS:
        _OUT[key] = tempfile.mkdtemp(prefix=f"parcae-fp16-{key}-")
        _RUNS[key] = launch({"out": _OUT[key], "max_steps": STEPS, "overflow_at": OVERFLOW_AT, **cfg})
    return _RUNS[key]


def _in_process(key: str, **cfg: Any) -> dict[str, Any]:
    """One run of the worker in this process (one plain process, or ParcaeStrategy on one device), cached."""
    if key not in _RUNS:
        _OUT[key] = tempfile.mkdtemp(prefix=f"parcae-fp16-{key}-")
        try:
            _RUNS[key] = [run({"out": _OUT[key], "max_steps": STEPS, "overflow_at": OVERFLOW_AT, **cfg})]
        finally:
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    return _RUNS[key][0]


def _reference() -> dict[str, Any]:
    """One plain Lightning process with the same plugin and the same forced overflow."""
    return _in_process("reference", overflow_rank=0)


def _pipeline() -> list[dict[str, Any]]:
    """D=1 x P=2, M=1: the inf on stage 1 (rank 1) only; a checkpoint after step 5."""
    return _run("pipeline", overflow_rank=1, overflow_param="net.4.weight", save_at=5,
                parcae={"world": 2, "P": 2, "M": 1})


def _replicas() -> list[dict[str, Any]]:
    """D=2 x P=1, M=2: the inf on replica 1 (rank 1) only, after the data-parallel all-reduce."""
    return _run("replicas", overflow_rank=1, overflow_param="net.0.weight", parcae={"world": 2, "P": 1, "M": 2})


def _max_rel_diff(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> float:
    assert set(a) == set(b)
    worst = 0.0
    for k in a:
        x, y = torch.tensor(a[k]), torch.tensor(b[k])
        if x.is_floating_point():
            worst = max(worst, float((x - y).norm() / (y.norm() + 1e-12)))
    return worst


def _assert_skipped_everywhere(ranks: list[dict[str, Any]], ref: dict[str, Any]) -> None:
    for rank in ranks:
        changed = [s["changed"] for s in rank["steps"]]
        assert changed == [s != OVERFLOW_AT for s in range(STEPS)], (rank["rank"], changed)
        assert rank["skipped_steps"] == 1
        # the same scale after every step on every rank, as in one process (halved at the skip, grown 3 steps later)
        assert [s["state"] for s in rank["steps"]] == [s["state"] for s in ref["steps"]]
    assert ranks[0]["finite_at_overflow"] is True  # rank 0's own gradients were finite: it skipped by agreement
    assert ranks[1]["finite_at_overflow"] is False


# ------------------------------------------------------------------------------------------------ multi-process
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_an_overflow_on_one_pipeline_stage_skips_the_step_on_every_stage() -> None:
    ref = _reference()
    assert [s["changed"] for s in ref["steps"]] == [s != OVERFLOW_AT for s in range(STEPS)]  # the reference skips
    assert [s["scale"] for s in ref["steps"]] == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0, 65536.0]
    _assert_skipped_everywhere(_pipeline(), ref)


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_fp16_pipeline_ends_with_one_processs_parameters() -> None:
    # M = 1: the same fp16 operations as one process, split over two processes -- equal to the bit here
    assert _max_rel_diff(_pipeline()[0]["state_dict"], _reference()["state_dict"]) < 1e-6


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_an_overflow_on_one_replica_skips_the_step_on_every_replica() -> None:
    ranks, ref = _replicas(), _reference()
    _assert_skipped_everywhere(ranks, ref)
    # two half-batches of two micro-batches each: fp16 rounds differently than one batch, 1e-5..1e-4 after 6 steps
    assert _max_rel_diff(ranks[0]["state_dict"], ref["state_dict"]) < 1e-3


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_scaler_state_is_in_the_checkpoint_and_resumes_at_another_shape() -> None:
    stages, ref = _pipeline(), _reference()
    mid = f"{_OUT['pipeline']}/mid.ckpt"
    saved = torch.load(mid, weights_only=True)["MixedPrecision"]
    assert saved == stages[0]["steps"][4]["state"]  # after step 5: scale halved at the skip, 2 good steps since
    assert (saved["scale"], saved["_growth_tracker"]) == (32768.0, 2)
    assert stages[0]["checkpoint_scaler"] == stages[0]["steps"][-1]["state"]  # the final checkpoint too
    # resumed in one process (P = 1) with a fresh scaler: it starts from the saved state and, one good step later,
    # grows like the uninterrupted run (a fresh scaler would end at tracker 1, not 0)
    resumed = _in_process("resumed", resume=mid, parcae={"world": 1, "P": 1, "M": 1})
    assert resumed["start_scale"] == saved
    assert resumed["steps"][-1]["state"] == ref["steps"][-1]["state"]
    assert _max_rel_diff(resumed["state_dict"], ref["state_dict"]) < 1e-6


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_without_the_agreement_the_stages_would_disagree() -> None:
    """The negative control: with each rank's own verdict (the naive support) stage 0 applies the step stage 1
    skips, and the two stages' scales part -- what the agreement prevents."""
    ranks = _run("local", overflow_rank=1, overflow_param="net.4.weight", local_verdicts=True,
                 parcae={"world": 2, "P": 2, "M": 1})
    assert ranks[0]["steps"][OVERFLOW_AT]["changed"] and not ranks[1]["steps"][OVERFLOW_AT]["changed"]
    assert ranks[0]["steps"][OVERFLOW_AT]["scale"] != ranks[1]["steps"][OVERFLOW_AT]["scale"]
    assert _max_rel_diff(ranks[0]["state_dict"], _reference()["state_dict"]) > 1e-3


# ------------------------------------------------------------------------------------------------ live migration
@pytest.fixture
def _no_leftover_process_group() -> Any:
    yield
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _fit_in_process(max_steps: int, plugin: Any, ckpt_path: Any = None) -> pl.Trainer:
    from lightning_parcae.training.strategy import ParcaeStrategy

    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ParcaeStrategy(pipeline_stages=1), logger=False,
                         max_steps=max_steps, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, plugins=[plugin])
    trainer.fit(OverflowNet(overflow_at=1, scheduler=False), make_loader(), ckpt_path=ckpt_path)
    return trainer


@pytest.mark.timeout(120)
def test_a_joiner_receives_the_scaler_state_in_the_live_loop_state(_no_leftover_process_group: Any,
                                                                   tmp_path: Any) -> None:
    """The leader's loop state (``Admission.loop_state``: Lightning's checkpoint dump of its own state) carries the
    precision plugin's scaler state over the wire format of a migration, and the joiner's checkpoint
    (``Admission.joiner_checkpoint``) restores it through Lightning's restore path."""
    from lightning_parcae.runtime.joining import Admission

    leader_plugin = fp16_plugin()
    leader = _fit_in_process(3, leader_plugin)
    expected = leader_plugin.scaler.state_dict()
    assert (expected["scale"], expected["_growth_tracker"]) == (32768.0, 1)  # skipped step 1, one good step since
    sent = Admission(None, None, leader.strategy, timedelta(seconds=1)).loop_state(leader)  # type: ignore[arg-type]
    joiner = Admission(None, None, None, timedelta(seconds=1))  # type: ignore[arg-type]
    s = leader.strategy
    layers = {i: layer_payload(leader.lightning_module, s.layer_key(name), s.torch_optimizers())
              for i, name in enumerate(s.layer_names)}  # what the layers' holders send it
    # torch.save / torch.load(weights_only=True), as on the wire
    joiner.inbox = {0: {"loop": unpack(pack(sent)), "layers": unpack(pack(layers))}}
    ckpt = joiner.joiner_checkpoint()
    assert ckpt["MixedPrecision"] == expected
    torch.distributed.destroy_process_group()
    path = tmp_path / "live.ckpt"
    torch.save(ckpt, path)
    joiner_plugin = fp16_plugin()
    _fit_in_process(3, joiner_plugin, ckpt_path=str(path))  # the loop is done: restore only, no step
    assert joiner_plugin.scaler.state_dict() == expected


# ------------------------------------------------------------------------------------------------ units
def _scaler_with_grads(grad: float) -> tuple[torch.amp.GradScaler, torch.optim.Optimizer, nn.Linear]:
    layer = nn.Linear(2, 1, bias=False)
    opt = torch.optim.SGD(layer.parameters(), lr=1.0)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(torch.ones(()))  # the scale tensor exists from the first scaled loss on
    layer.weight.grad = torch.full_like(layer.weight, grad)
    return scaler, opt, layer


def _scaling(scaler: torch.amp.GradScaler) -> LossScaling:
    scaling = LossScaling(scaler, StageState(), torch.device("cpu"))
    scaling.install()
    return scaling


def test_the_verdict_is_made_the_scalers_and_a_skipped_step_backs_off() -> None:
    scaler, opt, layer = _scaler_with_grads(float("inf"))
    scaling = _scaling(scaler)
    before = layer.weight.detach().clone()
    scaler.unscale_(opt)  # the installed unscale_: local unscale, then the (one-process) verdict
    assert [float(f) for f in scaler_found_inf(scaler, opt)] == [1.0]
    assert scaling.skipped_steps == 1
    scaler.step(opt)
    scaler.update()
    assert torch.equal(layer.weight, before) and scaler.get_scale() == 2.0


def test_a_finite_step_is_applied_with_unscaled_gradients() -> None:
    scaler, opt, layer = _scaler_with_grads(8.0)
    scaling = _scaling(scaler)
    before = layer.weight.detach().clone()
    assert scaling.scale([opt]) == 4.0
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    assert torch.allclose(layer.weight, before - 2.0) and scaling.skipped_steps == 0


def test_a_discarded_step_can_be_unscaled_again_with_its_scale_kept() -> None:
    """Under live reconfiguration a step a lost peer interrupts after ``unscale_`` is discarded and re-run: without
    :meth:`LossScaling.forget_step` the re-run's ``unscale_`` raised "unscale_() has already been called"."""
    scaler, opt, layer = _scaler_with_grads(float("inf"))
    scaling = _scaling(scaler)
    scaler.unscale_(opt)
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)
    scaling.forget_step()
    assert not scaler_unscaled(scaler) and scaler.get_scale() == 4.0
    layer.weight.grad = torch.full_like(layer.weight, 8.0)
    scaler.unscale_(opt)
    assert [float(f) for f in scaler_found_inf(scaler, opt)] == [0.0]


def test_a_committed_interrupted_step_goes_through_the_scaler() -> None:
    """A step every rank committed to but this rank's commit was interrupted: skipped by the agreed verdict and the
    scale updated, as on the ranks whose commit returned (a bare ``optimizer.step()`` would apply the inf)."""
    scaler, opt, layer = _scaler_with_grads(float("inf"))
    scaling = _scaling(scaler)
    before = layer.weight.detach().clone()
    scaler.unscale_(opt)
    scaling.apply_committed(opt)
    assert torch.equal(layer.weight, before) and scaler.get_scale() == 2.0 and not scaler_unscaled(scaler)


def test_a_plugin_without_an_enabled_grad_scaler_needs_no_loss_scaling() -> None:
    state, cpu = StageState(), torch.device("cpu")
    assert LossScaling.for_plugin(types.SimpleNamespace(scaler=None), state, cpu) is None
    assert LossScaling.for_plugin(object(), state, cpu) is None  # 32-true, bf16-mixed: no scaler attribute
    disabled = torch.amp.GradScaler("cpu", enabled=False)
    assert LossScaling.for_plugin(types.SimpleNamespace(scaler=disabled), state, cpu) is None
    with pytest.raises(ConfigurationError, match="torch.amp.GradScaler .got object"):
        LossScaling.for_plugin(types.SimpleNamespace(scaler=object()), state, cpu)


def test_a_fused_optimizer_is_refused_with_the_fix() -> None:
    scaler, _, layer = _scaler_with_grads(1.0)
    fused = torch.optim.Adam(layer.parameters(), fused=True)
    with pytest.raises(ConfigurationError, match=r"Adam\(fused=True\).*without fused=True"):
        _scaling(scaler).scale([fused])


def test_the_scaler_state_survives_the_checkpoint_format() -> None:
    """What Lightning writes under ``MixedPrecision`` is plain floats and ints: it loads with weights_only=True."""
    scaler, opt, _ = _scaler_with_grads(float("inf"))
    _scaling(scaler)
    scaler.unscale_(opt)
    scaler.step(opt)
    scaler.update()
    buf = io.BytesIO()
    torch.save({"MixedPrecision": scaler.state_dict()}, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=True)["MixedPrecision"]
    fresh = torch.amp.GradScaler("cpu")
    fresh.load_state_dict(loaded)
    assert fresh.state_dict() == scaler.state_dict() and fresh.get_scale() == 2.0
