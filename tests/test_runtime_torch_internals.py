"""The runtime's one adapter for torch's private internals (lightning_parcae.runtime.torch_internals): each
wrapped internal still exists with the shape it is used with (run this first after a torch upgrade)."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torch import nn

from lightning_parcae.runtime.torch_internals import child, children, forget_process_groups, put_child, set_group_timeout


def test_children_are_listed_in_order_with_a_module_held_twice_listed_twice() -> None:
    shared = nn.Linear(1, 1)
    seq = nn.Sequential(shared, nn.ReLU(), shared)
    assert children(seq) == [shared, seq[1], shared]
    assert len(list(seq.children())) == 2  # what the public API would give instead
    assert child(seq, "2") is shared


def test_a_child_can_be_put_at_a_hole_of_a_module_list() -> None:
    held = nn.ModuleList()
    put_child(held, "3", nn.Linear(1, 1))
    assert [n for n, _ in held.named_children()] == ["3"]


def test_the_process_group_registry_is_forgotten_without_a_shutdown() -> None:
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        set_group_timeout(timedelta(seconds=7))
        kept = forget_process_groups()
        assert len(kept) == 1 and not dist.is_initialized()
        dist.init_process_group("gloo", store=dist.PrefixStore("again/", store), rank=0, world_size=1)
        assert dist.is_initialized()  # a new world could be built over the forgotten one
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_own_tensors_lists_a_modules_own_parameters_and_persistent_buffers_and_put_replaces_in_place() -> None:
    """What a stage's storage release reads and swaps: only the module's own tensors (not its children's), only
    persistent buffers (a non-persistent mask is in no payload), replaced without changing the registration."""
    import torch
    from torch import nn

    from lightning_parcae.runtime.torch_internals import own_buffers, own_tensors, put_own_tensor

    m = nn.BatchNorm1d(3)
    m.register_buffer("mask", torch.ones(3), persistent=False)
    m.child = nn.Linear(2, 2)
    kinds = [(k, n) for k, n, _ in own_tensors(m)]
    assert kinds == [("param", "weight"), ("param", "bias"), ("buffer", "running_mean"), ("buffer", "running_var"),
                     ("buffer", "num_batches_tracked")]
    assert [n for n, _ in own_buffers(m)][-1] == "mask"
    put_own_tensor(m, "buffer", "mask", torch.zeros(3))
    assert "mask" not in m.state_dict() and float(m.mask.sum()) == 0.0
    w = nn.Parameter(torch.zeros(3))
    put_own_tensor(m, "param", "weight", w)
    assert m.weight is w and "weight" in dict(m.named_parameters(recurse=False))
