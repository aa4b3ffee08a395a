"""The stage layout: partitioning, (re)building this process's stage and applying a new layout -- with fakes of
the strategy (module, device, optimizers) and of the process groups, no processes."""

from __future__ import annotations

import types
from typing import Any, Optional

import pytest
import torch
from torch import nn

from lightning_parcae.errors import ModelLayoutError
from lightning_parcae.runtime.migration import layer_payload
from lightning_parcae.runtime.pipeline import StageProxy
from lightning_parcae.runtime.stage import is_released
from lightning_parcae.training.layout import StageLayout, named_layers
from lightning_parcae.training.options import StrategyOptions
from lightning_parcae.training.stage_state import StageState


class Net(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)])
        self.head = nn.Linear(2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


class FakeHost:
    """The strategy as the layout sees it."""

    def __init__(self, module: nn.Module) -> None:
        self.lightning_module = module
        self.root_device = torch.device("cpu")
        self.optimizers: list[Any] = []
        self.moved = 0

    def model_to_device(self) -> None:
        self.moved += 1


class FakeGroups:
    def __init__(self, world: int, stages: int, stage: int = 0) -> None:
        self.world, self.pipeline_stages = world, stages
        self.data_parallel = world // stages
        self.coords = types.SimpleNamespace(stage=stage, replica=0)
        self.pipeline_group = None
        self.data_group = None

    def rebuilt(self, data_parallel: int, stages: int) -> "FakeGroups":
        return FakeGroups(data_parallel * stages, stages)


def _options(**given: Any) -> StrategyOptions:
    base: dict[str, Any] = dict(pipeline_stages=None, micro_batches=1, schedule="1f1b", layers_attr=None, balance=None,
                                max_stage_memory_bytes=None, optimizer_state_factor=2.0, profile_repeats=1,
                                start_method="popen", process_group_backend=None, timeout=None, elastic=False,
                                interval_s=1.0, interval_steps=0, look_ahead=1, predictor="persistence",
                                heartbeat_s=0.2, dead_after_s=3.0, stall_after_s=60.0, max_pipeline_stages=None,
                                throughput="measured")
    base.update(given)
    return StrategyOptions(**base)


def _layout(module: nn.Module, groups: FakeGroups, profiler: Optional[Any] = None,
            **options: Any) -> tuple[StageLayout, StageState]:
    state = StageState()
    layout = StageLayout(state, _options(**options), FakeHost(module), profiler)  # type: ignore[arg-type]
    layout.use_groups(groups)  # type: ignore[arg-type]
    return layout, state


def test_partition_by_balance_builds_this_stages_layers_in_place_of_the_stack() -> None:
    module = Net()
    layout, state = _layout(module, FakeGroups(2, 2, stage=1), balance=[1, 3], pipeline_stages=2)
    layout.partition_module(trainer=None)  # type: ignore[arg-type]
    assert state.stack_path == "net" and state.layer_names == ["0", "1", "2", "3"] and state.partition == [1, 3]
    assert [n for n, _ in state.stage.named_children()] == ["1", "2", "3"]  # type: ignore[union-attr]
    assert module.net is state.stage and isinstance(state.proxy, StageProxy)
    assert state.full_stack is not None and len(state.full_stack) == 4
    assert state.p2p is not None and state.p2p.layers == (1, 4)  # the transport knows its stage's layers


def test_a_balance_that_does_not_sum_to_the_layers_is_refused() -> None:
    layout, _ = _layout(Net(), FakeGroups(2, 2), balance=[1, 1], pipeline_stages=2)
    with pytest.raises(ModelLayoutError, match="summing to the 4 layers"):
        layout.partition_module(trainer=None)  # type: ignore[arg-type]


def test_a_partition_of_another_depth_rebuilds_the_groups() -> None:
    layout, state = _layout(Net(), FakeGroups(2, 2), pipeline_stages=1)
    layout.partition_module(trainer=None)  # type: ignore[arg-type]
    assert state.partition == [4] and state.groups.pipeline_stages == 1 and state.groups.data_parallel == 2  # type: ignore[union-attr]


def test_a_model_without_a_stack_trains_whole_and_says_why() -> None:
    class NoStack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.act, self.b = nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)

    module = NoStack()
    layout, state = _layout(module, FakeGroups(1, 1), pipeline_stages=1)
    layout.partition_module(trainer=None)  # type: ignore[arg-type]
    assert state.whole_model and state.layer_names == ["a", "b"] and state.partition == [2]
    assert state.no_cut_reason and state.proxy is None and state.full_stack is module


def test_a_joiner_adopts_the_admitted_layout_and_builds_its_stage_on_place() -> None:
    module = Net()
    host = FakeHost(module)
    state = StageState()
    layout = StageLayout(state, _options(), host, None)  # type: ignore[arg-type]
    layout.adopt_admitted([2, 2], "net", ["0", "1", "2", "3"], [0.5] * 4)
    layout.use_groups(FakeGroups(2, 2, stage=1))  # type: ignore[arg-type]
    layout.place(trainer=None, joining=True)  # type: ignore[arg-type]
    assert state.partition == [2, 2] and state.layer_times == [0.5] * 4
    assert [n for n, _ in module.net.named_children()] == ["2", "3"] and host.moved == 1


def _payloads(sender: nn.Module, layers: list[int]) -> dict[int, Any]:
    """What a migration hands over: each layer's state, packed by its holder (``sender``, the whole net here)."""
    return {i: layer_payload(sender, f"net.{i}", []) for i in layers}


def _storage_bytes(layer: nn.Module) -> int:
    """Bytes of ``layer``'s parameters and buffers that have storage (not ``meta``, not a stand-in)."""
    return sum(t.numel() * t.element_size() for t in [*layer.parameters(), *layer.buffers()] if not is_released(t))


def test_apply_installs_the_new_groups_and_holds_the_new_partitions_layers() -> None:
    module = Net()
    layout, state = _layout(module, FakeGroups(2, 2, stage=0), balance=[2, 2], pipeline_stages=2)
    layout.partition_module(trainer=None)  # type: ignore[arg-type]
    assert [n for n, _ in module.net.named_children()] == ["0", "1"]
    new_groups = FakeGroups(2, 2, stage=1)
    layout.apply([1, 3], new_groups, received=_payloads(Net(), [2, 3]), group_of=[])  # type: ignore[arg-type]
    assert state.groups is new_groups and state.partition == [1, 3]
    assert [n for n, _ in module.net.named_children()] == ["1", "2", "3"]
    assert state.p2p is not None and state.p2p.layers == (1, 4)  # what an emulated cluster's link charges for


def test_a_stage_keeps_no_parameter_storage_for_the_layers_other_stages_hold() -> None:
    """Regression: every stage kept the whole stack's parameters (8 MiB per stage on the peer benchmark at P=2)."""
    module = Net()
    layout, state = _layout(module, FakeGroups(2, 2, stage=1), balance=[1, 3], pipeline_stages=2)
    layout.partition_module(trainer=None)  # type: ignore[arg-type]
    full = state.full_stack
    assert full is not None and len(full) == 4  # the structure stays: the stack can be re-cut in place
    assert _storage_bytes(full[0]) == 0
    assert all(p.is_meta and p.shape == (2, 2) for p in full[0].parameters() if p.ndim == 2)
    assert all(_storage_bytes(full[i]) == 6 * 4 for i in (1, 2, 3))  # held: a 2x2 weight + 2 biases of float32


def test_a_layer_that_arrives_takes_its_state_from_the_payload_and_one_that_leaves_is_released() -> None:
    module, sender = Net(), Net()
    layout, state = _layout(module, FakeGroups(2, 2, stage=0), balance=[2, 2], pipeline_stages=2)
    layout.partition_module(trainer=None)  # type: ignore[arg-type]
    kept = module.net[1].weight.detach().clone()
    new_groups: Any = FakeGroups(2, 2, stage=1)
    layout.apply([1, 3], new_groups, received=_payloads(sender, [2, 3]), group_of=[])
    full = state.full_stack
    assert full is not None
    for i in (2, 3):
        assert torch.equal(full[i].weight, sender.net[i].weight) and torch.equal(full[i].bias, sender.net[i].bias)
    assert torch.equal(full[1].weight, kept)  # held before and after: untouched
    assert _storage_bytes(full[0]) == 0  # left this process
    assert all(not p.is_meta for p in module.parameters())  # what this process trains has storage


def test_a_layer_that_arrives_without_a_payload_is_an_error_not_a_stale_local_copy() -> None:
    module = Net()
    layout, _ = _layout(module, FakeGroups(2, 2, stage=0), balance=[2, 2], pipeline_stages=2)
    layout.partition_module(trainer=None)  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"received no state for 2 of their tensors \(e.g. \['net.3.bias'"):
        layout.apply([1, 3], FakeGroups(2, 2, stage=1), received=_payloads(Net(), [2]),  # type: ignore[arg-type]
                     group_of=[])


def test_a_weight_tied_to_a_part_outside_the_stack_keeps_its_storage_on_every_stage() -> None:
    module = Net()
    module.tied = nn.Linear(2, 2, bias=False)
    module.tied.weight = module.net[0].weight  # tied like an input/output embedding
    layout, state = _layout(module, FakeGroups(2, 2, stage=1), balance=[2, 2], pipeline_stages=2)
    layout.partition_module(trainer=None)  # type: ignore[arg-type]
    full = state.full_stack
    assert full is not None and full[0].weight is module.tied.weight and not full[0].weight.is_meta
    assert full[0].bias.is_meta and full[1].weight.is_meta  # the rest of layer 0 and layer 1 are released


def test_named_layers_lists_a_module_registered_twice_twice() -> None:
    shared = nn.Linear(1, 1)
    seq = nn.Sequential(shared, nn.ReLU(), shared)
    assert [n for n, _ in named_layers(seq)] == ["0", "1", "2"]
    assert [n for n, _ in seq.named_children()] == ["0", "1"]  # why the layout does not use named_children


# ------------------------------------------------------------------------------------ parts outside the stack (issue 22)
class OutsideNet(nn.Module):
    """An embedding-like input layer before the stack, a head after it; ``tied``: the head's weight is the input
    layer's (transposed shapes agree: 2x2)."""

    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(2, 2)
        self.net = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
        self.head = nn.Linear(2, 2)
        if tied:
            self.head.weight = self.inp.weight


class FakeProfiler:
    """Classifies the outside parts as the real profiler does for OutsideNet (no step is run)."""

    block_arity = None

    def __init__(self, tied: bool = False) -> None:
        self.classes = {"inp.weight": "pre", "inp.bias": "pre", "head.weight": "post", "head.bias": "post"}
        if tied:
            self.classes.update({"inp.weight": "both", "head.weight": "both"})

    def classify_outside(self, trainer: Any, stack: nn.Module) -> Any:
        from lightning_parcae.training.profiling import OutsideParts

        return OutsideParts(dict(self.classes), 0.5, 2.0)

    def profile(self, trainer: Any, stack: nn.Module) -> list[float]:
        return [1.0] * len(stack)

    def layer_times(self, trainer: Any, stack: nn.Module, saved: Any = None) -> tuple[list[float], bool]:
        return self.profile(trainer, stack), False


def _outside_layout(stage: int, stages: int = 2, tied: bool = False,
                    balance: Optional[list[int]] = None) -> tuple[OutsideNet, StageLayout, StageState]:
    module = OutsideNet(tied)
    layout, state = _layout(module, FakeGroups(stages, stages, stage=stage), FakeProfiler(tied),
                            balance=balance or [4 // stages] * stages, pipeline_stages=stages)
    layout.partition_module(trainer=None)  # type: ignore[arg-type]
    return module, layout, state


def test_the_first_stage_holds_the_input_layer_and_the_last_the_head_and_nothing_else_of_the_outside() -> None:
    first, _, s0 = _outside_layout(0)
    last, _, s1 = _outside_layout(1)
    assert _storage_bytes(first.inp) == 6 * 4 and _storage_bytes(first.head) == 0
    assert _storage_bytes(last.inp) == 0 and _storage_bytes(last.head) == 6 * 4
    assert s0.stage_key_set() == {"net.0.weight", "net.0.bias", "net.1.weight", "net.1.bias", "inp.weight",
                                  "inp.bias"}
    assert {"head.weight", "head.bias"} <= s1.stage_key_set() and s1.is_stage_key("inp.weight")
    # a released part keeps its shape, dtype and requires_grad, and runs (a stand-in gives zeros of the right shape)
    assert last.inp.weight.shape == (2, 2) and last.inp.weight.requires_grad
    assert torch.equal(last.inp(torch.ones(3, 2)), torch.zeros(3, 2))


def test_a_tied_outside_weight_has_storage_on_both_ends_and_none_in_the_middle() -> None:
    ends = [_outside_layout(s, stages=3, tied=True, balance=[1, 2, 1])[0] for s in (0, 2)]
    middle, _, state = _outside_layout(1, stages=3, tied=True, balance=[1, 2, 1])
    for m in ends:
        assert m.head.weight is m.inp.weight and not is_released(m.inp.weight)
    assert _storage_bytes(middle.inp) == 0 and _storage_bytes(middle.head) == 0 and state.held_outside() == set()
    assert middle.head.weight is middle.inp.weight  # one logical parameter, also as a stand-in


def test_the_partitioner_counts_the_outside_parts_on_the_first_and_the_last_layer() -> None:
    module = OutsideNet()
    layout, state = _layout(module, FakeGroups(2, 2), FakeProfiler(), pipeline_stages=2)
    layout.partition_module(trainer=None)  # type: ignore[arg-type]
    assert state.layer_times == [1.5, 1.0, 1.0, 3.0]  # the profile plus the outside parts' measured seconds
    assert state.partition == [3, 1]  # the head makes the last layer the heaviest: [2, 2] without it
    assert layout.outside_memory(state.post_keys) == 6 * 4 * 4  # params + grads + Adam's two moments


def test_a_migration_that_makes_this_process_the_last_stage_moves_the_head_in_and_the_input_layer_out() -> None:
    module, layout, state = _outside_layout(0)
    sender = OutsideNet()
    received = {i: layer_payload(sender, f"net.{i}", [], state.outside_keys_of(i)) for i in (2, 3)}
    assert set(received[3]["tensors"]) == {"net.3.weight", "net.3.bias", "head.weight", "head.bias"}
    kept = module.net[1].weight.detach().clone()
    layout.apply([1, 3], FakeGroups(2, 2, stage=1), received=received, group_of=[])  # type: ignore[arg-type]
    assert torch.equal(module.head.weight, sender.head.weight) and torch.equal(module.head.bias, sender.head.bias)
    assert _storage_bytes(module.inp) == 0 and torch.equal(state.full_stack[1].weight, kept)  # type: ignore[index]
    assert state.held_outside() == {"head.weight", "head.bias"}


def test_a_migration_without_the_heads_payload_is_an_error_not_a_stale_head() -> None:
    _, layout, state = _outside_layout(0)
    received = {i: layer_payload(OutsideNet(), f"net.{i}", []) for i in (2, 3)}  # the head left out
    with pytest.raises(RuntimeError, match=r"received no state for 2 of their tensors \(e.g. \['head.bias'"):
        layout.apply([1, 3], FakeGroups(2, 2, stage=1), received=received, group_of=[])  # type: ignore[arg-type]


def test_only_a_holder_can_send_an_outside_part_with_its_layer() -> None:
    _, _, state = _outside_layout(0)
    last, _, _ = _outside_layout(1)
    with pytest.raises(ValueError, match=r"cannot send \['inp.bias', 'inp.weight'\] with layer 'net.0'"):
        layer_payload(last, "net.0", [], state.outside_keys_of(0))


def test_a_joiner_adopts_the_outside_classes_and_holds_only_its_stages_parts() -> None:
    module = OutsideNet()
    state = StageState()
    layout = StageLayout(state, _options(), FakeHost(module), None)  # type: ignore[arg-type]
    layout.adopt_admitted([2, 2], "net", ["0", "1", "2", "3"], [0.5] * 4, FakeProfiler().classes)
    layout.use_groups(FakeGroups(2, 2, stage=1))  # type: ignore[arg-type]
    layout.place(trainer=None, joining=True)  # type: ignore[arg-type]
    assert _storage_bytes(module.inp) == 0 and _storage_bytes(module.head) == 6 * 4


class _ReusingProfiler(FakeProfiler):
    """Measures [1, 2, 3, 4] s, or reuses what it is offered."""

    def __init__(self) -> None:
        super().__init__()
        self.offered: list[Any] = []

    def layer_times(self, trainer: Any, stack: nn.Module, saved: Any = None) -> tuple[list[float], bool]:
        self.offered.append(saved)
        return (list(saved[0]), True) if saved is not None else ([1.0, 2.0, 3.0, 4.0], False)


@pytest.mark.parametrize("record,offered", [
    (None, None),
    ({"stack_path": "net", "layer_names": ["0", "1", "2", "3"], "layer_times": [2.0, 2.0, 1.0, 1.0],
      "global_batch": 8}, ([2.0, 2.0, 1.0, 1.0], 8)),
    ({"stack_path": "net", "layer_names": ["0", "1", "2"], "layer_times": [2.0, 2.0, 1.0], "global_batch": 8}, None),
    ({"stack_path": "other", "layer_names": ["0", "1", "2", "3"], "layer_times": [2.0, 2.0, 1.0, 1.0],
      "global_batch": 8}, None),
    ({"stack_path": "net", "layer_names": ["0", "1", "2", "3"], "layer_times": [1.0, 1.0, 1.0, 1.0],
      "global_batch": 8}, None),  # a fixed balance / P = 1 measured nothing: placeholders
    ({"stack_path": "net", "layer_names": ["0", "1", "2", "3"], "layer_times": [2.0, 2.0, 1.0, 1.0]}, None),
])
def test_a_resumed_checkpoints_layer_times_are_offered_only_for_the_same_measured_stack(
        record: Optional[dict], offered: Any) -> None:
    """What the layout offers the profiler from the checkpoint it resumes from (issue 21: a relaunch need not
    profile again): the times of the same stack path and layer names, measured (not the 1.0 placeholders of a fixed
    balance) and with the batch they were measured on; reused times already count the parts outside the stack, so
    the outside seconds (0.5 before, 2.0 after) are added only to measured ones."""
    module = OutsideNet()
    profiler = _ReusingProfiler()
    layout, state = _layout(module, FakeGroups(2, 2, stage=0), profiler, pipeline_stages=2)
    layout.resumed_layout = lambda: record
    layout.partition_module(trainer=None)  # type: ignore[arg-type]
    assert profiler.offered == [offered]
    assert state.layer_times == ([2.0, 2.0, 1.0, 1.0] if offered else [1.5, 2.0, 3.0, 6.0])
