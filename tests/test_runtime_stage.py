"""Finding the layer stack and cutting it to one stage (lightning_parcae.runtime.stage)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_parcae.errors import ModelLayoutError
from lightning_parcae.runtime.stage import (
    cut_stage,
    is_block_list,
    locate_layer_stack,
    materialize_storage,
    release_storage,
    replace_submodule,
    resident_bytes,
    swapped,
)


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


class _Masked(nn.Module):
    """A block with a persistent buffer (in its state dict) and a non-persistent one (a mask no payload carries)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("scale", torch.full((3,), 2.0))
        self.register_buffer("mask", torch.tril(torch.ones(3, 3)), persistent=False)


def test_released_layers_keep_shapes_and_non_persistent_buffers_but_no_parameter_storage() -> None:
    block = _Masked()
    block.lin.weight.marker = "kept"  # type: ignore[attr-defined]
    before = resident_bytes(block)
    released = release_storage([block])
    assert released == (9 + 3 + 3) * 4 and resident_bytes(block) == before - released == 9 * 4  # the mask stays
    assert block.lin.weight.is_meta and block.lin.weight.shape == (3, 3) and block.lin.weight.requires_grad
    assert block.lin.weight.marker == "kept"  # type: ignore[attr-defined]
    assert block.scale.is_meta and torch.equal(block.mask, torch.tril(torch.ones(3, 3)))
    assert release_storage([block]) == 0  # released twice: nothing more


def test_a_tensor_to_keep_is_not_released_and_shared_tensors_stay_shared_through_release_and_materialize() -> None:
    a, b = nn.Linear(2, 2), nn.Linear(2, 2)
    b.weight = a.weight  # one parameter in two layers
    release_storage([a, b], keep={id(a.bias)})
    assert a.weight.is_meta and a.weight is b.weight and not a.bias.is_meta and b.bias.is_meta
    names = materialize_storage([("net.0", a), ("net.1", b)], torch.device("cpu"))
    assert names == {"net.0.weight", "net.1.weight", "net.1.bias"}  # every name the payloads must fill
    assert not a.weight.is_meta and a.weight is b.weight and isinstance(a.weight, nn.Parameter)
