"""A worker for tests/test_runtime_link.py: a real ParcaeStrategy pipeline charges its sends to the installed link.

Problem it guards: the link hooks are only worth something if the strategy wires them -- the layout must tell each
stage's transport which layers it holds, or the sends charge nothing (or the wrong boundary). :func:`run` trains a
4-layer ``nn.Sequential`` at D=1 x P=2 (balance [2, 2], M=2, 3 steps, batch 8) with a recording link installed in
``setup`` (as the emulated example installs the workload's); each rank writes the calls it saw to ``rank<r>.json``.
:func:`launch` starts the processes as an external launcher would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["run", "launch"]


class Recorder:
    """A modelled link that records every per-step charge and charges nothing."""

    def __init__(self) -> None:
        self.calls: list[list[Any]] = []

    def charge(self, layers: Sequence[int]) -> float:
        self.calls.append(["charge", sorted(int(i) for i in layers)])
        return 0.0

    def boundary_s(self, layer: int, samples: int) -> float:
        self.calls.append(["boundary", int(layer), int(samples)])
        return 0.0

    def allreduce_s(self, layers: Sequence[int], replicas: int) -> float:
        self.calls.append(["allreduce", [int(i) for i in layers], int(replicas)])
        return 0.0


class Net(pl.LightningModule):
    """Four layers in one ``nn.Sequential``; installs :class:`Recorder` as this process's link."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 2))
        self.link = Recorder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def setup(self, stage: str) -> None:
        from lightning_parcae.runtime.link import set_modelled_link

        set_modelled_link(self.link)


def run(out: str) -> None:
    """Train 3 steps at 1 x 2 and write this rank's recorded calls."""
    from lightning_parcae.training.strategy import ParcaeStrategy

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(24, 4), torch.randint(0, 2, (24,)))
    module = Net()
    trainer = pl.Trainer(accelerator="cpu", devices=2, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         strategy=ParcaeStrategy(pipeline_stages=2, micro_batches=2, balance=[2, 2]))
    trainer.fit(module, DataLoader(data, batch_size=8))
    rank = trainer.global_rank
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"calls": module.link.calls}, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(out: str, timeout: float = 240.0) -> list[dict[str, Any]]:
    """Run :func:`run` in 2 processes; every rank's recorded calls."""
    os.makedirs(out, exist_ok=True)
    port = _free_port()
    procs = []
    for rank in range(2):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log = open(os.path.join(out, f"rank{rank}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, __file__, out], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    try:
        for rank, (proc, log) in enumerate(procs):
            rc = proc.wait(timeout=timeout)
            log.close()
            if rc != 0:
                raise AssertionError(f"rank {rank} exited {rc}: {Path(out, f'rank{rank}.log').read_text()[-3000:]}")
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
    return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(2)]


if __name__ == "__main__":
    run(sys.argv[1])
