"""Finding the layer stack and cutting it to one stage (lightning_parcae.runtime.stage)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parcae.errors import ModelLayoutError
from lightning_parcae.runtime.stage import cut_stage, is_block_list, locate_layer_stack, replace_submodule, swapped


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(2, 4)
        self.body = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.Linear(4, 4))
        self.head = nn.Linear(4, 1)


class _Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.h = nn.ModuleList([nn.Linear(3, 3) for _ in range(4)])


def test_the_stack_holding_most_parameters_is_found_without_a_hint() -> None:
    assert locate_layer_stack(_Model()) == "body"
    assert locate_layer_stack(_Blocks()) == "h"


def test_a_named_stack_that_is_not_a_sequence_is_refused_with_its_type() -> None:
    with pytest.raises(ModelLayoutError, match="is a Linear, not an nn.Sequential"):
        locate_layer_stack(_Model(), "head")
    with pytest.raises(ModelLayoutError, match="names no submodule"):
        locate_layer_stack(_Model(), "nope")


def test_a_cut_sequential_keeps_the_global_names_and_the_same_modules() -> None:
    m = _Model()
    stage = cut_stage(m.body, ["2", "3"])
    assert isinstance(stage, nn.Sequential) and [n for n, _ in stage.named_children()] == ["2", "3"]
    assert stage[0] is m.body[2]
    assert set(stage.state_dict()) == {"2.weight", "2.bias", "3.weight", "3.bias"}


def test_a_cut_block_list_keeps_its_holes_and_runs_its_blocks_in_order() -> None:
    b = _Blocks()
    stage = cut_stage(b.h, ["1", "3"])
    assert isinstance(stage, nn.ModuleList) and is_block_list(stage)
    assert [n for n, _ in stage.named_children()] == ["1", "3"]
    assert [id(x) for x in stage.children()] == [id(b.h[1]), id(b.h[3])]


def test_a_stand_in_is_swapped_in_for_the_step_and_the_stack_put_back() -> None:
    m = _Model()
    body = m.body
    stand_in = nn.Identity()
    with swapped(m, "body", stand_in):
        assert m.body is stand_in
        assert torch.equal(m.body(torch.ones(1, 4)), torch.ones(1, 4))
    assert m.body is body
    old = replace_submodule(m, "body.0", nn.Identity())
    assert isinstance(old, nn.Linear) and isinstance(m.body[0], nn.Identity)
