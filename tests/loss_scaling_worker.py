"""A worker for tests/test_loss_scaling.py: fp16 mixed precision with a GradScaler, on CPU, under ParcaeStrategy.

Problem: Lightning refuses ``precision="16-mixed"`` on CPU (it falls back to bf16), but takes a ``MixedPrecision``
plugin built for the CPU with a CPU ``torch.amp.GradScaler``; fp16 autocast and the scaler then run as on a GPU.
:func:`run` trains :class:`OverflowNet` -- ``runtime_helpers.TinyNet`` whose ``on_after_backward`` can write an
inf into one parameter's gradient on ONE chosen rank at one chosen step, after the gradient reduction, so that only
that process would find it -- and writes what every rank saw to ``rank<r>.json``: per step, the loss scale after
the step and whether any of its parameters changed; the skipped steps its loss scaling counted; the final state
dict (gathered) and the scaler state of the final checkpoint. Without ``parcae`` it is one plain Lightning process
with the same plugin (the reference). ``save_at``: also save ``mid.ckpt`` after that step; ``resume``: start from a
checkpoint; ``local_verdicts``: the negative control, each rank keeping its own inf/nan verdict (the agreement not
installed). :func:`launch` starts the processes the way an external launcher would.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import torch

import pytorch_lightning as pl
from pytorch_lightning.plugins.precision import MixedPrecision

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from runtime_helpers import TinyNet, make_loader  # noqa: E402

__all__ = ["OverflowNet", "fp16_plugin", "run", "launch"]


def fp16_plugin(growth_interval: int = 3) -> MixedPrecision:
    """Lightning's 16-mixed plugin on the CPU, its scaler growing after ``growth_interval`` good steps."""
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", growth_interval=growth_interval))


class OverflowNet(TinyNet):
    """TinyNet whose gradient of ``overflow_param`` becomes inf at ``overflow_at`` on the rank ``overflow_rank``."""

    def __init__(self, overflow_at: int = -1, overflow_rank: int = 0, overflow_param: str = "net.4.weight",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.overflow_at, self.overflow_rank, self.overflow_param = overflow_at, overflow_rank, overflow_param
        self.finite_at_overflow: Optional[bool] = None  # this rank's own gradients at ``overflow_at``, all finite?

    def on_after_backward(self) -> None:
        trainer = self.trainer
        if trainer.global_step != self.overflow_at:
            return
        if trainer.global_rank == self.overflow_rank:
            p = dict(self.named_parameters())[self.overflow_param]
            assert p.grad is not None, f"{self.overflow_param} has no gradient on rank {trainer.global_rank}"
            p.grad.view(-1)[0] = float("inf")
        self.finite_at_overflow = all(bool(torch.isfinite(p.grad).all()) for p in self.parameters()
                                      if p.grad is not None)


class Seen(pl.Callback):
    """Per step: the loss scale after it and whether this rank's parameters changed in it."""

    def __init__(self) -> None:
        self.steps: list[dict[str, Any]] = []
        self.before: list[torch.Tensor] = []
        self.start_scale: dict[str, Any] = {}

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.start_scale = dict(trainer.precision_plugin.state_dict())

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.before = [p.detach().clone() for p in module.parameters()]

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        changed = any(not torch.equal(a, p.detach()) for a, p in zip(self.before, module.parameters()))
        self.steps.append({"step": trainer.global_step, "changed": changed,
                           "scale": trainer.precision_plugin.scaler.get_scale(),
                           "state": dict(trainer.precision_plugin.state_dict())})


class SaveAt(pl.Callback):
    """Save a checkpoint after optimizer step ``step`` (mid-training, as ``ParcaeRunCallback`` does)."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, path

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            trainer.save_checkpoint(self.path)


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    """Train per ``cfg`` and write this rank's observations to ``<out>/rank<r>.json`` (also returned)."""
    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    module = OverflowNet(cfg.get("overflow_at", -1), cfg.get("overflow_rank", 0),
                         cfg.get("overflow_param", "net.4.weight"), optimizer=cfg.get("optimizer", "sgd"),
                         lr=cfg.get("lr", 0.1), scheduler=False)
    out = cfg["out"]
    os.makedirs(out, exist_ok=True)
    extra: dict[str, Any] = {}
    devices = 1
    if cfg.get("parcae"):
        from lightning_parcae.training.strategy import ParcaeStrategy

        p = cfg["parcae"]
        extra["strategy"] = ParcaeStrategy(pipeline_stages=p["P"], micro_batches=p.get("M", 1))
        devices = p["world"]
    if cfg.get("local_verdicts"):  # the negative control: each rank keeps its own inf/nan verdict (no agreement)
        from lightning_parcae.training.loss_scaling import LossScaling

        LossScaling.install = lambda self: None  # type: ignore[method-assign]
    seen = Seen()
    callbacks: list[pl.Callback] = [seen]
    if cfg.get("save_at"):
        callbacks.append(SaveAt(cfg["save_at"], os.path.join(out, "mid.ckpt")))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, max_steps=cfg.get("max_steps", 6), logger=False,
                         enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
                         num_sanity_val_steps=0, callbacks=callbacks, default_root_dir=out,
                         plugins=[fp16_plugin(cfg.get("growth_interval", 3))], **extra)
    trainer.fit(module, make_loader(cfg.get("n", 64), cfg.get("batch", 16)), ckpt_path=cfg.get("resume"))
    final = os.path.join(out, "final.ckpt")
    trainer.save_checkpoint(final)
    steps = getattr(trainer.strategy, "steps", None)
    scaling = getattr(steps, "loss_scaling", None)
    result: dict[str, Any] = {"rank": trainer.global_rank, "steps": seen.steps, "start_scale": seen.start_scale,
                              "global_step": trainer.global_step, "finite_at_overflow": module.finite_at_overflow,
                              "skipped_steps": scaling.skipped_steps if scaling is not None else None}
    if trainer.global_rank == 0:
        ckpt = torch.load(final, weights_only=True)
        result["state_dict"] = {k: v.tolist() for k, v in ckpt["state_dict"].items()}
        result["checkpoint_scaler"] = ckpt.get("MixedPrecision")
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(cfg: dict[str, Any], timeout: float = 150.0) -> list[dict[str, Any]]:
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
