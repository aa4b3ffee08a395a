"""A worker for tests/test_strategy.py's checks that only small things cross pipeline stages.

Problem: the last pipeline stage holds the outputs and the loss; the other stages -- rank 0 among them -- must log,
monitor and stop exactly like one process, from what the last stage sends them, without the outputs (here a wide
"vocabulary" of 2048 logits per sample) ever being broadcast. :func:`run` trains :class:`WideNet` (a torchmetrics
metric logged on step and epoch, ``sync_dist``, a progress-bar value, validation every 2 steps) with
``ModelCheckpoint(monitor=...)`` and ``EarlyStopping``, then predicts; every rank writes what it saw (the metrics
after each step, the monitors' choices, the predictions, the largest tensor it broadcast) to ``rank<r>.json``.
:func:`launch` starts the processes the way an external launcher would; without ``parcae`` it is one plain process.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 2048
BATCH = 16

__all__ = ["WideNet", "run", "launch"]


class WideNet(pl.LightningModule):
    """A 4-layer MLP with a wide output layer (``VOCAB`` classes) in one ``nn.Sequential``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, VOCAB))
        import torchmetrics

        self.train_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=VOCAB, average="micro")
        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=VOCAB, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.train_acc(logits, y)
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_loss_sync", loss, sync_dist=True, on_step=True, on_epoch=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("train_max", loss, reduce_fx="max", on_step=True)
        return {"loss": loss, "mean_target": y.float().mean()}

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("val_loss", loss, sync_dist=True, prog_bar=True)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc)
        return loss

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0]).argmax(dim=1)

    def configure_optimizers(self) -> Any:
        return torch.optim.Adam(self.parameters(), lr=0.02)


def _loader(n: int, seed: int) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = x[:, :4].argmax(dim=1).long()  # 4 of the VOCAB classes
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


class _Seen(pl.Callback):
    """What this rank's callbacks see after each training batch."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.validations: list[dict[str, Any]] = []

    def on_validation_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.validations.append({"step": trainer.global_step,
                                     "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()}})

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.steps.append({
            "step": trainer.global_step,
            "loss": float(outputs["loss"]),
            "mean_target": float(outputs["mean_target"]),
            "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
            "progress_bar": {k: float(v) for k, v in trainer.progress_bar_metrics.items()},
        })


def _spy_broadcasts() -> list[int]:
    """Record the size in bytes of every tensor this process passes to ``torch.distributed.broadcast``."""
    sizes: list[int] = []
    original = torch.distributed.broadcast

    def spy(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        sizes.append(tensor.numel() * tensor.element_size())
        return original(tensor, *args, **kwargs)

    torch.distributed.broadcast = spy  # type: ignore[assignment]
    return sizes


def run(cfg: dict[str, Any]) -> None:
    """Train, validate and predict per ``cfg``; write this rank's observations to ``<out>/rank<r>.json``."""
    from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint

    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    sizes = _spy_broadcasts()
    module = WideNet()
    out = cfg["out"]
    if cfg.get("parcae"):
        from lightning_parcae.training.strategy import ParcaeStrategy

        p = cfg["parcae"]
        extra: dict[str, Any] = {"strategy": ParcaeStrategy(pipeline_stages=p["P"], micro_batches=p["M"],
                                                            schedule=p.get("schedule", "1f1b"))}
        devices = p["world"]
    else:
        extra, devices = {}, 1
    seen = _Seen()
    best = ModelCheckpoint(dirpath=os.path.join(out, "ckpt"), filename="{step}", monitor="val_acc", mode="max",
                           save_top_k=1)
    stop = EarlyStopping(monitor="val_acc", mode="max", patience=1)
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_steps=16, val_check_interval=2, logger=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=1,
                         callbacks=[seen, best, stop], default_root_dir=out, **extra)
    trainer.fit(module, _loader(128, 1), _loader(32, 2))
    fit_sizes = list(sizes)
    final = {k: float(v) for k, v in trainer.callback_metrics.items()}
    predictions = trainer.predict(module, _loader(32, 2))
    rank = trainer.global_rank
    result = {
        "rank": rank,
        "steps": seen.steps,
        "final": final,
        "validations": seen.validations,
        "global_step": trainer.global_step,
        "best": os.path.basename(best.best_model_path),
        "best_score": float(best.best_model_score) if best.best_model_score is not None else None,
        "stopped_epoch": stop.stopped_epoch,
        "early_best": float(stop.best_score),
        "predictions": [p.tolist() for p in predictions] if predictions is not None else None,
        "max_broadcast_bytes": max(fit_sizes, default=0),
        "output_bytes": BATCH * VOCAB * 4,
        "state_dict": {k: v.tolist() for k, v in module.state_dict().items()} if not cfg.get("parcae") else None,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cfg: dict[str, Any], timeout: float = 400.0) -> list[dict[str, Any]]:
    """Run ``cfg`` in ``cfg["parcae"]["world"]`` processes (one without ``parcae``); every rank's observations."""
    world = cfg["parcae"]["world"] if cfg.get("parcae") else 1
    os.makedirs(cfg["out"], exist_ok=True)
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        if cfg.get("parcae"):
            env.update({"LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world),
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        log = open(os.path.join(cfg["out"], f"rank{rank}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, __file__, json.dumps(cfg)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    failed = []
    try:
        for rank, (proc, log) in enumerate(procs):
            rc = proc.wait(timeout=timeout)
            log.close()
            if rc != 0:
                failed.append(rank)
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
    if failed:
        tails = [f"--- rank {r} ---\n" + Path(cfg["out"], f"rank{r}.log").read_text()[-3000:] for r in failed]
        raise RuntimeError("worker(s) failed:\n" + "\n".join(tails))
    return [json.loads(Path(cfg["out"], f"rank{r}.json").read_text()) for r in range(world)]


if __name__ == "__main__":
    run(json.loads(sys.argv[1]))
