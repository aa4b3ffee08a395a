"""The layer profiler: whether a block list can be cut (forward must chain the blocks), and per-layer times --
with a fake strategy (rank 0 of one process) and plain modules."""

from __future__ import annotations

import types

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


def _profiler(module: nn.Module, stack_path: str, layer_names: list[str]) -> LayerProfiler:
    state = StageState(groups=types.SimpleNamespace(world=1), stack_path=stack_path,  # type: ignore[arg-type]
                       layer_names=layer_names)
    host = types.SimpleNamespace(lightning_module=module, global_rank=0, batch_to_device=lambda b: b)
    return LayerProfiler(state, 1, host)  # type: ignore[arg-type]


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
