"""Does the size of the model's output still matter to the pipeline? P=2 / P=1 samples/s at two vocabularies.

Problem (issue 22): ParcaeStrategy used to broadcast the last stage's whole output -- for a language model the
logits, B/D x seq x vocab -- to every stage at every step so that they could re-run the user's step, so a pipeline
got slower relative to one process as the vocabulary grew (P=2 / P=1 samples/s: 0.545 at vocab 256, 0.41 at vocab
16,384). Now only the logged values and the loss cross stages, so the ratio should not depend on the vocabulary.
This script trains the same small transformer LM (embedding, 4 encoder blocks, d 64, output head, in one
``nn.Sequential``; seq 128, batch 16, GPipe M=4) on CPU at D=1 x P=1 (one process) and D=1 x P=2 (two processes,
started the way torchrun would), at vocab 256 and 16,384, and prints the two ratios and their quotient:

    python benchmarks/bench_pipeline_vocab.py              # about 2 minutes on 2 cores
    python benchmarks/bench_pipeline_vocab.py --steps 20 --repeats 3

Goal: ratio(16,384) / ratio(256) >= 0.95. At P=2 the head (d x vocab) is one layer that cannot be split, so a
large vocabulary also unbalances the two stages; the partition is printed so that this part of any gap can be told
from transfer costs, and so are the bytes rank 0 passed to ``dist.broadcast`` per timed step (the old mirror:
B x seq x vocab x 4, 128 MiB at vocab 16,384; now a few KiB whatever the vocabulary). On a loaded machine the
ratios move by tens of percent between runs; take the best of several repeats (``--repeats``).
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

    def __init__(self, vocab: int, dim: int = 64, blocks: int = 4, heads: int = 4) -> None:
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
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class _Timer(pl.Callback):
    """Times the steps after the warm-up and counts the bytes this rank passed to ``dist.broadcast`` in them."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.t0 = 0.0
        self.t1 = 0.0
        self.timing = False
        self.broadcast_bytes = 0
        original = torch.distributed.broadcast

        def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if self.timing:
                self.broadcast_bytes += tensor.numel() * tensor.element_size()
            return original(tensor, *args, **kwargs)

        torch.distributed.broadcast = spy  # type: ignore[assignment]

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.warmup:
            self.t0 = time.perf_counter()
            self.timing = True

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.t1 = time.perf_counter()


def _worker(cfg: dict[str, Any]) -> None:
    from lightning_parcae.training.strategy import ParcaeStrategy

    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    n = cfg["batch"] * (cfg["steps"] + cfg["warmup"])
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg["vocab"], (n, cfg["seq"] + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    strategy = ParcaeStrategy(pipeline_stages=cfg["P"], micro_batches=cfg["M"], schedule="gpipe")
    timer = _Timer(cfg["warmup"])
    trainer = pl.Trainer(accelerator="cpu", devices=cfg["P"], strategy=strategy,
                         max_steps=cfg["steps"] + cfg["warmup"], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=[timer])
    trainer.fit(TinyLM(cfg["vocab"]), DataLoader(data, batch_size=cfg["batch"]))
    if trainer.global_rank == 0:
        rate = cfg["batch"] * cfg["steps"] / (timer.t1 - timer.t0)
        with open(cfg["out"], "w") as f:
            json.dump({"samples_per_s": rate, "partition": list(strategy.partition),
                       "broadcast_per_step": timer.broadcast_bytes / cfg["steps"]}, f)


def _run(cfg: dict[str, Any]) -> dict[str, Any]:
    fd, out = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cfg = {**cfg, "out": out}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(cfg["P"]):
        env = {**os.environ, "LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(cfg["P"]),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    errors = [p.communicate(timeout=600)[1] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(b"\n".join(e[-2000:] for e in errors).decode(errors="replace"))
    with open(out) as f:
        result = json.load(f)
    os.unlink(out)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description="P=2 / P=1 samples/s at a small and a large vocabulary")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per configuration")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16, help="global batch")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--vocabs", type=int, nargs=2, default=[256, 16384])
    parser.add_argument("--repeats", type=int, default=2, help="runs per configuration; the best is reported")
    args = parser.parse_args()
    if args.worker:
        _worker(json.loads(args.worker))
        return
    base = {"steps": args.steps, "warmup": args.warmup, "batch": args.batch, "seq": args.seq,
            "M": args.micro_batches}
    rates: dict[tuple[int, int], float] = {}
    partitions: dict[int, list[int]] = {}
    sent: dict[int, float] = {}
    started = time.perf_counter()
    for _ in range(args.repeats):  # interleaved, so that background load hits every configuration alike
        for vocab in args.vocabs:
            for p in (1, 2):
                res = _run({**base, "vocab": vocab, "P": p})
                rates[(vocab, p)] = max(rates.get((vocab, p), 0.0), res["samples_per_s"])
                if p == 2:
                    partitions[vocab] = res["partition"]
                    sent[vocab] = res["broadcast_per_step"]
    print(f"transformer LM (4 blocks, d=64, seq={args.seq}), batch {args.batch}, GPipe M={args.micro_batches}, "
          f"CPU, 1 thread/process ({time.perf_counter() - started:.0f} s)")
    ratios = {}
    for vocab in args.vocabs:
        ratios[vocab] = rates[(vocab, 2)] / rates[(vocab, 1)]
        print(f"  vocab {vocab:>6d}: P=1 {rates[(vocab, 1)]:7.1f} samples/s   P=2 {rates[(vocab, 2)]:7.1f} samples/s"
              f"   P=2/P=1 {ratios[vocab]:.3f}   (P=2: partition {partitions[vocab]}, "
              f"{sent[vocab] / 1024:.1f} KiB broadcast per step)")
    small, large = args.vocabs
    print(f"  ratio({large}) / ratio({small}) = {ratios[large] / ratios[small]:.3f}   (goal >= 0.95)")


if __name__ == "__main__":
    main()
