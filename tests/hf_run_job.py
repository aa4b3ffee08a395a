"""A ``transformers`` causal LM (tests/hf_models_worker.py) under ``parcae run``: for a trace that repartitions it.

    parcae run --instances 2 --trace T -- python tests/hf_run_job.py FAMILY OUT --max-steps N

Trains with :class:`~lightning_parcae.training.callbacks.ParcaeRunCallback` (resumable) and, on global rank 0 at the
end, writes the full state dict to ``OUT`` (``trainer.save_checkpoint``) and ``D``/``P`` to ``OUT.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytorch_lightning as pl  # noqa: E402
from hf_models_worker import LAYERS, HFCausalLM, tokens  # noqa: E402
from lightning_parcae.training.callbacks import ParcaeRunCallback, resume_path  # noqa: E402


class _Delay(pl.Callback):
    """Sleeps after every step so that the trace replay has time to change the job."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        time.sleep(self.seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("family")
    parser.add_argument("out")
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    parser.add_argument("--pipeline-stages", default=os.environ.get("PARCAE_PIPELINE_STAGES", "1"))
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=8,
                        help="global batch B (with M = 2: B = 2 leaves D = 1 the only split, so every shape is 1 x P)")
    parser.add_argument("--even-split", action="store_true",
                        help="split the blocks evenly over this process's P (ParcaeStrategy(balance=...)) instead of "
                             "by a layer profile: every block is priced alike, so the shapes the leader picks do not "
                             "follow a profile taken while the workers start on shared cores")
    parser.add_argument("--step-delay", type=float, default=0.1)
    parser.add_argument("--interval-s", type=float, default=float(os.environ.get("PARCAE_INTERVAL_S", "60")))
    parser.add_argument("--plain", action="store_true", help="one plain process (the reference)")
    args = parser.parse_args()
    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    train = DataLoader(tokens(512, 0), batch_size=args.batch_size)
    callbacks: list[pl.Callback] = [_Delay(args.step_delay)] if args.step_delay > 0 else []
    if args.plain:
        strategy: object = "auto"
        devices = 1
    else:
        from lightning_parcae.training.strategy import ParcaeStrategy

        p = None if args.pipeline_stages == "auto" else int(args.pipeline_stages)
        # P is the launch's (a joiner gets 1 and adopts the job's shape): balance must have P entries
        balance = [LAYERS // p + (k < LAYERS % p) for k in range(p)] if args.even_split and p else None
        strategy = ParcaeStrategy(pipeline_stages=p, micro_batches=2, interval_s=args.interval_s,
                                  throughput="profile", balance=balance)
        callbacks.append(ParcaeRunCallback(every_n_steps=20))
        devices = args.devices
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=args.max_steps,
                         max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    module = HFCausalLM(args.family)
    trainer.fit(module, train, ckpt_path=None if args.plain else resume_path())
    if trainer.global_step >= args.max_steps:
        trainer.save_checkpoint(args.out)
        if trainer.is_global_zero:
            s = trainer.strategy
            with open(args.out + ".json", "w") as f:
                json.dump({"step": trainer.global_step, "D": getattr(s, "data_parallel", 1),
                           "P": getattr(s, "pipeline_stages", 1)}, f)


if __name__ == "__main__":
    main()
