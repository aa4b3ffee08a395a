"""The layer profiler: whether a block list can be cut (forward must chain the blocks), and per-layer times --
with a fake strategy (rank 0 of one process) and plain modules."""

from __future__ import annotations

import types
import warnings
from typing import Optional

import pytest
import torch
from torch import nn

from lightning_parcae.training.profiling import BLOCK_VERDICTS, LayerProfiler
from lightning_parcae.training.stage_state import StageState


class Blocks(nn.Module):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how
        self.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
        self.example_input_array = torch.ones(1, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "indexed":
            return self.blocks[1](self.blocks[0](x))
        for block in self.blocks:
            x = x + block(x) if self.how == "residual" else block(x)
        return x


def _profiler(module: nn.Module, stack_path: str, layer_names: list[str], micro_batches: int = 1) -> LayerProfiler:
    state = StageState(groups=types.SimpleNamespace(world=1), stack_path=stack_path,  # type: ignore[arg-type]
                       layer_names=layer_names)
    host = types.SimpleNamespace(lightning_module=module, global_rank=0, batch_to_device=lambda b: b)
    return LayerProfiler(state, 1, host, micro_batches)  # type: ignore[arg-type]


def test_a_chained_block_list_can_be_cut_and_its_first_input_is_kept() -> None:
    module = Blocks("chain")
    profiler = _profiler(module, "blocks", ["0", "1", "2"])
    assert profiler.check_block_list(trainer=None, stack=module.blocks) is None
    assert profiler.block_sample is not None and profiler.block_sample[0].shape == (1, 2)
    assert isinstance(module.blocks, nn.ModuleList)  # the stand-in is gone again


@pytest.mark.parametrize("how,code", [("residual", 3), ("indexed", 2)])
def test_a_block_list_forward_does_not_chain_cannot_be_cut(how: str, code: int) -> None:
    module = Blocks(how)
    assert _profiler(module, "blocks", ["0", "1", "2"]).check_block_list(None, module.blocks) == BLOCK_VERDICTS[code]


def test_profile_times_every_layer_of_a_sequential() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
            self.example_input_array = torch.ones(4, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.net(x)

    module = Net()
    times = _profiler(module, "net", ["0", "1", "2"]).profile(trainer=None, stack=module.net)  # type: ignore[arg-type]
    assert len(times) == 3 and all(t > 0 for t in times)


class _Seq(nn.Module):
    def __init__(self, batch: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2))
        self.example_input_array = torch.ones(batch, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def test_a_relaunch_reuses_the_checkpoints_layer_times_for_a_sample_of_their_batch_instead_of_profiling(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 21): every relaunch profiled the whole stack again on rank 0 while the others waited -- 41
    of the 45 s from the roster to the first step of the emulated GPT-1.5B at 1 x 6 -- though the checkpoint it
    resumed from came from the same layers. Saved times for the same layers and a sample of the batch they were
    measured on are used as they are; for another batch size or another layer count the layers are measured."""
    import lightning_parcae.training.profiling as profiling

    calls: list[int] = []
    real = profiling.profile_layer_times

    def counted(*args: object, **kwargs: object) -> list[float]:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(profiling, "profile_layer_times", counted)
    module = _Seq(batch=4)
    profiler = _profiler(module, "net", ["0", "1", "2"])
    saved = [0.3, 0.1, 0.2]
    assert profiler.layer_times(None, module.net, (saved, 4)) == (saved, True)  # type: ignore[arg-type]
    assert calls == []
    times, reused = profiler.layer_times(None, module.net, (saved, 8))  # type: ignore[arg-type]
    assert not reused and calls == [1] and times != saved
    times, reused = profiler.layer_times(None, module.net, (saved[:2], 4))  # type: ignore[arg-type]
    assert not reused and calls == [1, 1]
    assert profiler.profile(None, module.net) != saved and calls == [1, 1, 1]  # type: ignore[arg-type]


class _Sleepy(nn.Module):
    """A layer whose forward + backward take ``ms`` per row (the emulated accelerator), and that records the rows
    it was run on."""

    def __init__(self, ms: float, seen: list[int]) -> None:
        super().__init__()
        self.ms, self.seen, self.lin = ms, seen, nn.Linear(2, 2)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        from lightning_parcae.testing.emulated_device import emulated_compute

        self.seen.append(int(x.shape[0]))
        if mask is not None:
            x = x * mask  # a batched extra argument must have the rows of the hidden state
        return emulated_compute(self.lin(x), self.ms / 3.0)  # backward: twice the forward


class _SleepyBlocks(nn.Module):
    def __init__(self, seen: list[int], batch: int, mask_rows: Optional[int]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Sleepy(ms, seen) for ms in (2.0, 6.0, 4.0)])
        self.example_input_array = torch.ones(batch, 2)
        self.mask_rows = mask_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = None if self.mask_rows is None else torch.ones(self.mask_rows, 2)
        for block in self.blocks:
            x = block(x, mask)
        return x


@pytest.mark.parametrize("mask_rows", [None, 32])
def test_the_layers_are_timed_on_one_micro_batch_and_scaled_to_the_whole_batch(mask_rows: Optional[int]) -> None:
    """Regression (issue 21): rank 0 timed every layer on the whole global batch (41 s of each first launch of the
    emulated GPT-1.5B at 1 x 6; on a GPU a whole batch through one layer need not fit where a micro-batch does).
    With M = 8 the layers run on 32 / 8 = 4 rows -- a batched extra argument (a mask) cut alike -- and the times
    are those of the whole batch (the emulated layers take 2, 6 and 4 ms a row: 64, 192, 128 ms for 32 rows)."""
    seen: list[int] = []
    module = _SleepyBlocks(seen, batch=32, mask_rows=mask_rows)
    profiler = _profiler(module, "blocks", ["0", "1", "2"], micro_batches=8)
    assert profiler.check_block_list(trainer=None, stack=module.blocks) is None
    seen.clear()
    times, reused = profiler.layer_times(None, module.blocks)  # type: ignore[arg-type]
    assert not reused and set(seen) == {4}
    for t, want in zip(times, (0.064, 0.192, 0.128)):
        assert want <= t < want * 1.6, times


def test_a_micro_batch_that_does_not_run_falls_back_to_timing_the_whole_batch() -> None:
    """An extra argument whose first dimension is the batch size by chance (a 32-row table the blocks index whole)
    cannot be cut: the cut sample fails, and the whole batch is timed instead -- not a parameter-count balance."""
    seen: list[int] = []
    tried: list[int] = []

    class Indexing(_Sleepy):
        def forward(self, x: torch.Tensor, table: Optional[torch.Tensor] = None) -> torch.Tensor:
            assert table is not None
            tried.append(int(x.shape[0]))
            return super().forward(x + table[31])  # row 31 of the table, whatever the batch

    class Table(_SleepyBlocks):
        def __init__(self) -> None:
            super().__init__(seen, batch=32, mask_rows=None)
            self.blocks = nn.ModuleList([Indexing(ms, seen) for ms in (2.0, 6.0, 4.0)])
            self.table = torch.ones(32, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x, self.table)
            return x

    module = Table()
    profiler = _profiler(module, "blocks", ["0", "1", "2"], micro_batches=8)
    assert profiler.check_block_list(trainer=None, stack=module.blocks) is None
    seen.clear()
    tried.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "balancing by parameter count"
        times, _ = profiler.layer_times(None, module.blocks)  # type: ignore[arg-type]
    assert tried[0] == 4 and set(seen) == {32}  # the cut sample failed in the first layer; the whole one ran
    for t, want in zip(times, (0.064, 0.192, 0.128)):
        assert want <= t < want * 1.6, times


# ------------------------------------------------------------------------------------ parts outside the stack (issue 22)
class LM(nn.Module):
    """A tiny block-list LM whose ``training_step`` the classification runs (no Lightning needed).

    ``how``: ``plain`` (embedding -> blocks -> norm + head), ``tied`` (the head is the embedding), ``value_mask``
    (the blocks' mask is computed from the embedding's *values*: no gradient path, only the value check sees it),
    ``grad_arg`` (a learned bias outside the stack is a block argument), ``frozen`` (the embedding does not train),
    ``eval_only`` (a parameter only validation uses).
    """

    def __init__(self, how: str = "plain") -> None:
        super().__init__()
        self.how = how
        self.tok = nn.Embedding(8, 4)
        self.bias = nn.Parameter(torch.zeros(4))
        self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 8, bias=False)
        self.eval_head = nn.Linear(4, 8)
        self.register_buffer("scale", torch.ones(4))  # a buffer of the root (no parameters of its own there)
        if how == "tied":
            self.head.weight = self.tok.weight
        if how == "frozen":
            self.tok.weight.requires_grad_(False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids)
        mask = (x.abs().sum(-1, keepdim=True) > 1.0).float() if self.how == "value_mask" else None
        for block in self.blocks:
            if mask is not None:
                x = block(x, mask)
            elif self.how == "grad_arg":
                x = block(x, self.bias)
            else:
                x = block(x)
        return self.head(self.norm(x) * self.scale)

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        return nn.functional.cross_entropy(self(ids).flatten(0, 1), ids.flatten())


class ArgBlock(nn.Linear):
    def forward(self, x: torch.Tensor, extra: object = None) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(x)
        return out * extra if isinstance(extra, torch.Tensor) and extra.shape[-1] == 1 else \
            out + (extra if isinstance(extra, torch.Tensor) else 0)


def _classify(how: str) -> tuple[LM, dict[str, str]]:
    torch.manual_seed(0)
    module = LM(how)
    module.blocks = nn.ModuleList([ArgBlock(4, 4) for _ in range(3)])
    profiler = _profiler(module, "blocks", ["0", "1", "2"])
    batch = (torch.randint(0, 8, (2, 5)),)
    profiler._sample_batch = lambda trainer: batch  # type: ignore[method-assign]
    before = {k: v.clone() for k, v in module.state_dict().items()}
    flags = {n: p.requires_grad for n, p in module.named_parameters()}
    parts = profiler.classify_outside(None, module.blocks)
    assert all(torch.equal(before[k], v) for k, v in module.state_dict().items())  # the trace changes nothing
    assert flags == {n: p.requires_grad for n, p in module.named_parameters()}
    assert all(p.grad is None for p in module.parameters())
    return module, parts.classes


def test_the_embedding_belongs_to_the_first_stage_and_the_norm_and_head_to_the_last() -> None:
    _, classes = _classify("plain")
    assert classes == {"tok.weight": "pre", "norm.weight": "post", "norm.bias": "post", "head.weight": "post"}
    # not placed, so kept on every stage: an unused parameter (bias), one only validation uses (eval_head), and a
    # buffer of a module without parameters of its own (scale)


def test_a_tied_input_and_output_embedding_belongs_to_both_ends() -> None:
    _, classes = _classify("tied")
    assert classes["tok.weight"] == classes["head.weight"] == "both" and classes["norm.weight"] == "post"


def test_a_frozen_embedding_is_classified_like_a_trained_one() -> None:
    _, classes = _classify("frozen")
    assert classes["tok.weight"] == "pre"


def test_a_part_the_blocks_arguments_depend_on_is_replicated() -> None:
    _, classes = _classify("grad_arg")
    assert "bias" not in classes and classes["tok.weight"] == "pre"


def test_a_part_the_blocks_arguments_depend_on_by_value_only_is_replicated() -> None:
    """The mask comes from the embedding's values (no gradient path): a stage with a stand-in embedding would
    compute another mask, which the replay as a middle / last stage sees."""
    _, classes = _classify("value_mask")
    assert "tok.weight" not in classes and classes["head.weight"] == "post"


def test_nothing_is_placed_without_a_sample_step() -> None:
    module = LM()
    profiler = _profiler(module, "blocks", ["0", "1", "2"])
    profiler._sample_batch = lambda trainer: None  # type: ignore[method-assign]
    assert profiler.classify_outside(None, module.blocks).classes == {}
