"""Throughput of ParcaeStrategy against Lightning's DDPStrategy, and pipeline efficiency against the bubble bound.

Problem: the strategy adds a pipeline runtime, a global-order data path and mirrored steps on top of plain data
parallelism; at P = 1 that must cost (almost) nothing next to DDP, and at P > 1 the measured efficiency should be
close to what the schedule allows, ``M / (M + P - 1)`` for GPipe. This script trains a small transformer language
model on CPU under each configuration (every configuration in its own set of processes, started the way torchrun
would) and prints the numbers side by side:

    python benchmarks/bench_strategy.py                 # ~1-2 minutes on 2 cores
    python benchmarks/bench_strategy.py --steps 40 --micro-batches 8

Columns: samples/s over the timed steps (after warm-up). Ratio lines: Parcae(D=2,P=1) / DDP(2) (goal >= 0.95);
pipeline efficiency = samples/s(D=1,P=2) / (2 x samples/s(D=1,P=1)) next to the GPipe bound.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl


class TinyLM(pl.LightningModule):
    """Embedding, ``blocks`` transformer encoder layers and an output head in one ``nn.Sequential``."""

    def __init__(self, vocab: int = 256, dim: int = 128, blocks: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.vocab = vocab
        layers: list[nn.Module] = [nn.Embedding(vocab, dim)]
        layers += [nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
                   for _ in range(blocks)]
        layers.append(nn.Linear(dim, vocab))
        self.net = nn.Sequential(*layers)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.net(tokens)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x).reshape(-1, self.vocab), y.reshape(-1))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Timer(pl.Callback):
    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.t0 = 0.0
        self.t1 = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.t1 = time.perf_counter()


def _worker(cfg: dict[str, Any]) -> None:
    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    n = cfg["batch"] * (cfg["steps"] + cfg["warmup"])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (n, cfg["seq"] + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    if cfg["kind"] == "ddp":
        from pytorch_lightning.strategies import DDPStrategy

        strategy: Any = DDPStrategy()
        per_loader = cfg["batch"] // cfg["world"]  # DDP: the loader batch is per process
    else:
        from lightning_parcae.training.strategy import ParcaeStrategy

        strategy = ParcaeStrategy(pipeline_stages=cfg["P"], micro_batches=cfg["M"], schedule=cfg["schedule"])
        per_loader = cfg["batch"]  # Parcae: the loader batch is the global batch
    timer = _Timer(cfg["warmup"])
    trainer = pl.Trainer(accelerator="cpu", devices=cfg["world"], strategy=strategy,
                         max_steps=cfg["steps"] + cfg["warmup"], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[timer])
    trainer.fit(TinyLM(), DataLoader(data, batch_size=per_loader))
    if trainer.global_rank == 0:
        rate = cfg["batch"] * cfg["steps"] / (timer.t1 - timer.t0)
        with open(cfg["out"], "w") as f:
            json.dump({"samples_per_s": rate}, f)


def _run(cfg: dict[str, Any]) -> float:
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cfg = {**cfg, "out": out}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(cfg["world"]):
        env = {**os.environ, "LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(cfg["world"]),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    errors = [p.communicate(timeout=600)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(b"\n".join(e[-2000:] for e in errors).decode(errors="replace"))
    with open(out) as f:
        rate = float(json.load(f)["samples_per_s"])
    os.unlink(out)
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description="ParcaeStrategy throughput vs DDP and the pipeline bubble bound")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=20, help="timed optimizer steps per configuration")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--batch", type=int, default=32, help="global batch")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration; the best is reported")
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    base = {"steps": args.steps, "warmup": args.warmup, "batch": args.batch, "seq": args.seq}
    configs = {
        "DDP (2 processes)": {**base, "kind": "ddp", "world": 2},
        "Parcae D=2 P=1": {**base, "kind": "parcae", "world": 2, "P": 1, "M": 1, "schedule": "1f1b"},
        "Parcae D=1 P=1": {**base, "kind": "parcae", "world": 1, "P": 1, "M": 1, "schedule": "gpipe"},
        f"Parcae D=1 P=2 GPipe M={args.micro_batches}": {**base, "kind": "parcae", "world": 2, "P": 2,
                                                          "M": args.micro_batches, "schedule": "gpipe"},
    }
    rates: dict[str, float] = {}
    for _ in range(args.repeats):  # interleave repeats so that background load hits every configuration alike
        for name, cfg in configs.items():
            rates[name] = max(rates.get(name, 0.0), _run(cfg))
    print(f"small transformer LM (4 blocks, d=128, seq={args.seq}), global batch {args.batch}, CPU, 1 thread/process")
    for name, rate in rates.items():
        print(f"  {name:<32s} {rate:8.1f} samples/s")
    names = list(rates)
    ratio = rates[names[1]] / rates[names[0]]
    m = args.micro_batches
    eff = rates[names[3]] / (2 * rates[names[2]])
    print(f"  Parcae(D=2,P=1) / DDP(2)         {ratio:8.3f}   (goal >= 0.95)")
    print(f"  pipeline efficiency (D=1,P=2)    {eff:8.3f}   (GPipe bound M/(M+P-1) = {m / (m + 1):.3f})")


if __name__ == "__main__":
    main()
