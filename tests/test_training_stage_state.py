"""The stage state: the one record of this process's stage; its derived reads (keys, bounds, whole model)."""

from __future__ import annotations

import types

import pytest
from torch import nn

from lightning_parcae.training.stage_state import StageState


def _groups(stage: int) -> types.SimpleNamespace:
    return types.SimpleNamespace(coords=types.SimpleNamespace(stage=stage))


def test_layer_key_prefixes_the_stack_path_only_when_there_is_one() -> None:
    assert StageState(stack_path="net").layer_key("3") == "net.3"
    assert StageState(stack_path="").layer_key("head") == "head"


def test_is_stage_key_by_stack_path_or_by_top_level_layer_names() -> None:
    cut = StageState(stack_path="net")
    assert cut.is_stage_key("net.0.weight") and not cut.is_stage_key("network.0.weight")
    whole = StageState(stack_path="", layer_names=["a", "b"])
    assert whole.is_stage_key("a.weight") and not whole.is_stage_key("c.weight")


def test_stage_key_set_is_the_global_names_of_the_held_layers() -> None:
    stage = nn.Sequential()
    stage.add_module("2", nn.Linear(1, 1))
    state = StageState(stack_path="net", stage=stage)
    assert state.stage_key_set() == {"net.2.weight", "net.2.bias"}


@pytest.mark.parametrize("stage,bounds", [(0, (0, 2)), (1, (2, 5))])
def test_held_bounds_follow_the_partition_and_this_process_stage(stage: int, bounds: tuple[int, int]) -> None:
    state = StageState(partition=[2, 3], groups=_groups(stage))  # type: ignore[arg-type]
    assert state.held_bounds() == bounds


def test_whole_model_only_for_the_empty_stack_path() -> None:
    assert StageState(stack_path="").whole_model
    assert not StageState(stack_path="net").whole_model and not StageState().whole_model


def test_each_state_has_its_own_lists() -> None:
    a, b = StageState(), StageState()
    a.partition.append(1)
    assert b.partition == []
