"""Shared pieces of the runtime tests: a tiny module, deterministic data, and a multi-process launcher.

Problem: the strategy's promise is "same result as one process", which can only be checked by running several
real processes (gloo over loopback) and comparing with a plain single-process Lightning run. Processes are started
the way an external launcher (torchrun, or Lightning's own script launcher) would: with ``LOCAL_RANK``,
``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, each running :func:`run` from this file.
Rank 0 leaves a result file (final checkpoint + metrics); the test compares it with the reference.

Runs are cached per pytest session (:func:`cached_run`) so one multi-process run can serve several tests.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl

ROOT = Path(__file__).resolve().parent.parent

__all__ = ["TinyNet", "make_loader", "run", "launch", "cached_run", "reference", "max_rel_diff"]


class TinyNet(pl.LightningModule):
    """A 5-layer MLP classifier whose forward runs ``self.net`` (plus an optional replicated input scale)."""

    def __init__(self, optimizer: str = "sgd", lr: float = 0.1, scheduler: bool = True) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)
        )
        self.optimizer_name = optimizer
        self.lr = lr
        self.use_scheduler = scheduler
        import torchmetrics

        self.val_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x * 1.0)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True)
        self.val_acc.update(logits, y)
        self.log("val_acc", self.val_acc)

    def configure_optimizers(self) -> Any:
        if self.optimizer_name == "adam":
            opt: torch.optim.Optimizer = torch.optim.Adam(self.parameters(), lr=self.lr)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.use_scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def make_loader(n: int = 64, batch_size: int = 16, shuffle: bool = False, seed: int = 0) -> DataLoader:
    """Deterministic synthetic 4-class data; with ``shuffle`` a seeded generator fixes the order on every rank."""
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].argmax(dim=1)).long()
    gen = torch.Generator().manual_seed(seed) if shuffle else None
    return DataLoader(TensorDataset(x, y), batch_size=batch_size, shuffle=shuffle, generator=gen)


def _trainer(cfg: dict[str, Any], strategy: Any, devices: int, out_dir: str) -> pl.Trainer:
    from pytorch_lightning.callbacks import ModelCheckpoint

    callbacks: list[pl.Callback] = []
    if cfg.get("ckpt_every"):
        callbacks.append(ModelCheckpoint(dirpath=out_dir, filename="ckpt-{step}", every_n_train_steps=cfg["ckpt_every"],
                                         save_top_k=-1, save_last=False))
    kwargs: dict[str, Any] = {}
    if strategy is not None:
        kwargs["strategy"] = strategy
    return pl.Trainer(
        accelerator="cpu", devices=devices, max_steps=cfg.get("max_steps", 6), logger=False,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=bool(callbacks),
        callbacks=callbacks, gradient_clip_val=cfg.get("clip"), accumulate_grad_batches=cfg.get("accumulate", 1),
        num_sanity_val_steps=cfg.get("sanity", 0), limit_val_batches=cfg.get("limit_val", 1.0),
        precision=cfg.get("precision", "32-true"), default_root_dir=out_dir, **kwargs,
    )


def run(cfg: dict[str, Any]) -> Optional[dict[str, Any]]:
    """Train per ``cfg``; with ``cfg["parcae"]`` under ParcaeStrategy, else plain single-process Lightning.

    Returns (on rank 0) ``{"state_dict": ..., "metrics": {...}}``; the Parcae run also writes ``final.ckpt``.
    """
    pl.seed_everything(cfg.get("seed", 0), verbose=False)
    module = TinyNet(cfg.get("optimizer", "sgd"), cfg.get("lr", 0.1), cfg.get("scheduler", True))
    loader = make_loader(cfg.get("n", 64), cfg.get("batch", 16), cfg.get("shuffle", False))
    val = make_loader(cfg.get("n_val", 32), cfg.get("val_batch", 8)) if cfg.get("val", True) else None
    out_dir = cfg["out"]
    if cfg.get("parcae"):
        from lightning_parcae.training.strategy import ParcaeStrategy

        p = cfg["parcae"]
        strategy: Any = ParcaeStrategy(pipeline_stages=p.get("P"), micro_batches=p.get("M", 1),
                                       schedule=p.get("schedule", "1f1b"), balance=p.get("balance"))
        devices = p["world"]
    else:
        strategy, devices = None, 1
    trainer = _trainer(cfg, strategy, devices, out_dir)
    trainer.fit(module, loader, val, ckpt_path=cfg.get("resume"))
    final = os.path.join(out_dir, "final.ckpt")
    trainer.save_checkpoint(final)
    if trainer.global_rank != 0:
        return None
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    state = torch.load(final, weights_only=True)["state_dict"]
    result = {"state_dict": state, "metrics": metrics, "global_step": trainer.global_step}
    torch.save(result, os.path.join(out_dir, "result.pt"))
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cfg: dict[str, Any], timeout: float = 150.0) -> dict[str, Any]:
    """Run ``cfg`` in ``cfg["parcae"]["world"]`` processes (external-launcher style) and return rank 0's result."""
    world = cfg["parcae"]["world"]
    os.makedirs(cfg["out"], exist_ok=True)
    cfg_path = os.path.join(cfg["out"], "cfg.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "LOCAL_RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(world),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        log = open(os.path.join(cfg["out"], f"rank{rank}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, __file__, cfg_path], env=env, stdout=log,
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
        tails = []
        for rank in failed:
            text = Path(cfg["out"], f"rank{rank}.log").read_text()
            tails.append(f"--- rank {rank} ---\n{text[-3000:]}")
        raise RuntimeError("worker(s) failed:\n" + "\n".join(tails))
    return torch.load(os.path.join(cfg["out"], "result.pt"), weights_only=True)


_CACHE: dict[str, dict[str, Any]] = {}


def cached_run(key: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """Run ``cfg`` once per pytest session (multi-process if it has ``parcae``), keyed by ``key``."""
    if key not in _CACHE:
        cfg = {**cfg, "out": cfg.get("out") or tempfile.mkdtemp(prefix=f"parcae-{key}-")}
        _CACHE[key] = launch(cfg) if cfg.get("parcae") else run(cfg)  # type: ignore[assignment]
        _CACHE[key]["out"] = cfg["out"]
    return _CACHE[key]


def reference(key: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The single-process Lightning run of ``cfg`` (without ``parcae``), cached."""
    ref = {k: v for k, v in cfg.items() if k not in ("parcae", "out", "ckpt_every", "resume")}
    return cached_run("ref-" + key, ref)


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest relative difference over the common float tensors (keys must match)."""
    assert set(a) == set(b), (sorted(set(a) ^ set(b)))
    worst = 0.0
    for k in a:
        if not a[k].is_floating_point():
            continue
        d = (a[k].float() - b[k].float()).norm() / (b[k].float().norm() + 1e-12)
        worst = max(worst, float(d))
    return worst


if __name__ == "__main__":
    with open(sys.argv[1]) as fh:
        run(json.load(fh))
