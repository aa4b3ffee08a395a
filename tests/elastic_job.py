"""A tiny deterministic training job for the live-reconfiguration tests (run as a worker process).

Every sample carries its index, so the test can check that each one is consumed exactly once. After every step,
stage-0 ranks append the sample ids of their slice, and every rank appends a digest of its stage's parameters
(replicas of a stage must agree). At the end every process writes its parameters (global names) to
``<out>/final_<member>.pt``. ``--reference`` trains the same job in one plain process (no strategy) and writes
``<out>/reference.pt``.

Options the chaos harness draws from (``tests/chaos``): ``--optimizer adam|sgd``, ``--schedule 1f1b|gpipe``,
``--val-every N`` (a validation loop every N steps, metrics synced over the job), ``--drop-last`` (the reference
drops a trailing partial batch too) and ``--after-fit`` (what a script does after ``fit``: ``save_checkpoint``,
``validate``, ``test`` and ``predict``; their results go to ``<out>/after_<member>.json``).
``--max-stage-memory-bytes`` gives the strategy a per-stage memory limit (the reference ignores it).
``--outside`` puts an input layer before the stack and a head after it (outside ``net``): under a pipeline they
belong to the first and the last stage and move with layer 0 and the last layer; each process's final parameters
leave out what it does not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

import pytorch_lightning as pl


class Indexed(Dataset):
    """Synthetic regression data: (x, y, index)."""

    def __init__(self, n: int = 512) -> None:
        g = torch.Generator().manual_seed(7)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, 2, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[i], self.y[i], i


class Net(pl.LightningModule):
    def __init__(self, hidden: int = 16, optimizer: str = "adam", blocks: bool = False,
                 outside: bool = False) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        torch.manual_seed(3)
        h = hidden
        self.inp: nn.Module = nn.Identity()
        self.head: nn.Module = nn.Identity()
        if outside:  # the stack holds the hidden layers only; the input layer and the head are outside it
            self.inp = nn.Linear(8, h)
            self.net = nn.Sequential(*[nn.Sequential(nn.Linear(h, h), nn.Tanh()) for _ in range(4)])
            self.head = nn.Linear(h, 2)
        elif blocks:  # 4 layers, each with parameters: any P <= 3 gives every stage something to optimize
            self.net = nn.Sequential(nn.Sequential(nn.Linear(8, h), nn.Tanh()), nn.Sequential(nn.Linear(h, h),
                                     nn.Tanh()), nn.Sequential(nn.Linear(h, h), nn.Tanh()), nn.Linear(h, 2))
        else:
            self.net = nn.Sequential(nn.Linear(8, h), nn.Tanh(), nn.Linear(h, h), nn.Tanh(), nn.Linear(h, h),
                                     nn.Tanh(), nn.Linear(h, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(self.inp(x)))

    def training_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        x, y, _ = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch: tuple, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("val_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def test_step(self, batch: tuple, batch_idx: int) -> None:
        x, y, _ = batch
        self.log("test_loss", nn.functional.mse_loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: tuple, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> dict:
        if self.optimizer_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(self.parameters(), lr=5e-2, momentum=0.9)
        else:
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
        # a scheduler whose state must survive migrations and reach joiners (the LR changes every 5 steps)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.7)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Recorder(pl.Callback):
    def __init__(self, out: str, delay: float) -> None:
        self.out = out
        self.delay = delay
        self.last_step = -1

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.last_step = int(trainer.global_step)  # a resumed or joining process: that step is someone else's record

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: object) -> None:
        if int(trainer.global_step) != self.last_step:  # inside an accumulation window: written at its end
            self.last_step = int(trainer.global_step)
            self.record(trainer, pl_module)
        if self.delay:
            time.sleep(self.delay)

    def record(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        s = trainer.strategy
        er = getattr(s, "elastic_runtime", None)
        member = er.member if er else "single"
        g = s.groups
        stage = g.coords.stage if g else 0
        prefix = f"{s.stack_path}." if getattr(s, "stack_path", None) else "net."
        digest = {k: float(v.double().sum()) + float(v.double().abs().sum()) * 1e-3
                  for k, v in pl_module.state_dict().items() if k.startswith(prefix)}
        rec = {"step": int(trainer.global_step), "gen": er.generation if er else 0, "member": member,
               "stage": stage, "replica": g.coords.replica if g else 0, "digest": digest, "t": time.time()}
        if stage == 0:
            rec["ids"] = list(map(int, s.last_step_indices)) if hasattr(s, "last_step_indices") else []
        with open(os.path.join(self.out, f"steps_{member}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--max-steps", type=int, default=24)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--pipeline-stages", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--interval-steps", type=int, default=0)
    ap.add_argument("--delay", type=float, default=0.0)
    ap.add_argument("--ckpt-every", type=int, default=0)
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--samples", type=int, default=512, help="dataset size (a multiple of the batch size)")
    ap.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    ap.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    ap.add_argument("--val-every", type=int, default=0, help="validation every N steps (0: none)")
    ap.add_argument("--drop-last", action="store_true")
    ap.add_argument("--after-fit", action="store_true", help="save_checkpoint/validate/test/predict after fit")
    ap.add_argument("--stall-s", type=float, default=120.0, help="progress watchdog bound (seconds)")
    ap.add_argument("--blocks", action="store_true", help="Linear+Tanh blocks as layers (no parameter-free stage)")
    ap.add_argument("--outside", action="store_true", help="an input layer and a head outside the layer stack")
    ap.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    ap.add_argument("--max-stage-memory-bytes", type=int, default=None,
                    help="the strategy's per-stage memory limit: below the whole model's it rules out P=1 (a model "
                    "that needs a pipeline), so a shape change keeps P >= 2")
    ap.add_argument("--reference", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    loader = DataLoader(Indexed(args.samples), batch_size=args.batch_size, shuffle=True,
                        generator=torch.Generator().manual_seed(11), drop_last=args.drop_last)
    val = DataLoader(Indexed(48), batch_size=12) if args.val_every else None
    model = Net(args.hidden, args.optimizer, args.blocks, args.outside)
    common = dict(accelerator="cpu", max_steps=args.max_steps, max_epochs=-1, logger=False,
                  enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                  accumulate_grad_batches=args.accumulate)
    if args.val_every:
        common.update(val_check_interval=args.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0)
    if args.reference:
        trainer = pl.Trainer(devices=1, **common)
        trainer.fit(model, loader, val)
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, os.path.join(args.out, "reference.pt"))
        return
    from lightning_parcae.training.callbacks import ParcaeRunCallback, resume_path
    from lightning_parcae.training.strategy import ParcaeStrategy

    strategy = ParcaeStrategy(pipeline_stages=args.pipeline_stages, micro_batches=args.micro_batches, elastic=True,
                              schedule=args.schedule, interval_s=0, interval_steps=args.interval_steps,
                              heartbeat_s=0.1, dead_after_s=3.0, stall_after_s=args.stall_s,
                              # its steps are mostly a sleep (--delay): measured throughput barely changes with D, so
                              # shape choices would be coin flips; these tests are about the membership protocol
                              throughput="profile", max_stage_memory_bytes=args.max_stage_memory_bytes)
    callbacks: list[pl.Callback] = [Recorder(args.out, args.delay)]
    if args.ckpt_every:
        callbacks.append(ParcaeRunCallback(every_n_steps=args.ckpt_every, check_token=False))
    devices = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(devices=devices, strategy=strategy, callbacks=callbacks, **common)
    trainer.fit(model, loader, val, ckpt_path=resume_path())
    er = strategy.elastic_runtime
    from lightning_parcae.runtime.stage import is_released

    state = {k: v.detach().cpu().clone() for k, v in model.state_dict(keep_vars=True).items() if not is_released(v)}
    torch.save(state, os.path.join(args.out, f"final_{er.member}.pt"))
    if args.after_fit:  # what a Lightning script does next; must work after any number of reconfigurations
        after: dict = {}
        path = os.path.join(args.out, "after_fit.ckpt")
        trainer.save_checkpoint(path)
        strategy.wait_for_checkpoint()
        after["checkpoint_step"] = int(torch.load(path, weights_only=True)["global_step"]) \
            if trainer.is_global_zero else None
        check = DataLoader(Indexed(48), batch_size=12)
        after["validate"] = trainer.validate(model, check, verbose=False)
        after["test"] = trainer.test(model, check, verbose=False)
        preds = trainer.predict(model, check)
        after["predict_rows"] = int(sum(p.shape[0] for p in preds)) if preds else 0
        with open(os.path.join(args.out, f"after_{er.member}.json"), "w") as f:
            json.dump(after, f)


if __name__ == "__main__":
    main()
