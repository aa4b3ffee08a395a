"""Layout-independent checkpoints: name-keyed optimizer state, atomic writes, resume at another D x P."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_parcae.runtime.checkpoint import (
    atomic_save,
    layer_state,
    load_named_optimizer_state,
    merge_named_optimizer_states,
    named_optimizer_state,
    plain_containers,
)

from runtime_helpers import TinyNet, cached_run, max_rel_diff, reference
from test_strategy import HARD, HARD_SHAPE


def _two_stage_optimizers() -> tuple[nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    opt_full = torch.optim.Adam(full.parameters(), lr=0.1)
    full(torch.randn(5, 3)).sum().backward()
    opt_full.step()
    opt_a = torch.optim.Adam(full[0].parameters(), lr=0.1)
    opt_b = torch.optim.Adam(full[1].parameters(), lr=0.1)
    return full, opt_full, opt_a, opt_b


def test_checkpoint_keys_optimizer_state_by_name_if_saved() -> None:
    full, opt_full, _, _ = _two_stage_optimizers()
    named = named_optimizer_state(opt_full, full)
    assert set(named["state"]) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert named["param_groups"][0]["params"] == ["0.weight", "0.bias", "1.weight", "1.bias"]
    assert named["param_groups"][0]["lr"] == 0.1


def test_checkpoint_loads_named_state_into_a_stage_if_layout_differs() -> None:
    full, opt_full, opt_a, opt_b = _two_stage_optimizers()
    named = named_optimizer_state(opt_full, full)
    load_named_optimizer_state(opt_b, full, named)
    exp = opt_full.state[full[1].weight]["exp_avg"]
    assert torch.equal(opt_b.state[full[1].weight]["exp_avg"], exp)
    assert full[0].weight not in opt_b.state
    # and back: two stages merge into the full name-keyed state
    load_named_optimizer_state(opt_a, full, named)
    merged = merge_named_optimizer_states([named_optimizer_state(opt_a, full), named_optimizer_state(opt_b, full)])
    assert merged["param_groups"][0]["params"] == named["param_groups"][0]["params"]
    assert torch.equal(merged["state"]["1.weight"]["exp_avg"], exp)


def test_checkpoint_layer_state_holds_params_and_optimizer_state_if_asked() -> None:
    full, opt_full, _, _ = _two_stage_optimizers()
    st = layer_state(full, "1", [opt_full])
    assert {"1.weight", "1.bias", "optim0/1.weight/exp_avg", "optim0/1.weight/step"} <= set(st)
    assert not any(k.startswith("0.") for k in st)


def test_checkpoint_writes_atomically_if_saved(tmp_path: Path) -> None:
    target = tmp_path / "x.ckpt"
    atomic_save({"a": torch.ones(2), "h": plain_containers({"n": 1})}, target)
    assert torch.load(target, weights_only=True)["a"].sum() == 2
    assert [p.name for p in tmp_path.iterdir()] == ["x.ckpt"]


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "shape",
    [pytest.param({"world": 2, "P": 2, "M": 2, "schedule": "gpipe"}, id="resume-1x2"),
     pytest.param({"world": 4, "P": 1, "M": 2, "schedule": "1f1b"}, id="resume-4x1", marks=pytest.mark.slow)],
)
def test_checkpoint_resumes_at_other_shape_if_written_at_2x2(shape: dict) -> None:
    first = cached_run("hard", {**HARD, "parcae": HARD_SHAPE})
    ckpt = os.path.join(first["out"], "ckpt-step=3.ckpt")
    loaded = torch.load(ckpt, weights_only=True)
    assert loaded["parcae"]["data"]["cursor"] > 0  # written mid-epoch: the sample cursor matters
    plain = TinyNet()
    plain.load_state_dict(loaded["state_dict"])  # loads into the unpartitioned module
    assert isinstance(next(iter(loaded["optimizer_states"][0]["state"])), str)
    resumed = cached_run(f"resume-{shape['world']}-{shape['P']}", {**HARD, "ckpt_every": None, "resume": ckpt,
                                                                   "parcae": shape})
    ref = reference("hard", HARD)
    assert resumed["global_step"] == ref["global_step"] == 6
    assert max_rel_diff(resumed["state_dict"], ref["state_dict"]) < 1e-5
    assert resumed["metrics"]["val_loss"] == pytest.approx(ref["metrics"]["val_loss"], rel=1e-5)
