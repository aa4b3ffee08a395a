"""The tiny MLP of ``train_tiny.py``, ready for ``parcae run`` (live reconfiguration, or the restart fallback).

Problem it shows: under ``parcae run`` the set of worker processes changes whenever the (replayed) spot
availability changes. With ``--elastic`` (the default) the strategy reconfigures in place (``ParcaeStrategy`` reads
``PARCAE_ELASTIC=1`` from the launcher); with ``--restart-fallback`` workers are stopped and relaunched. One script
survives both with two lines: add :class:`~lightning_parcae.training.callbacks.ParcaeRunCallback` (periodic checkpoints,
progress events) and pass :func:`~lightning_parcae.training.callbacks.resume_path` to ``trainer.fit``. The launcher gives
each worker torchrun-style environment variables, so ``devices`` is the local world size it was started with.

    python -m lightning_parcae.launch.run --instances 2 -- python examples/train_run.py --max-steps 200
    python -m lightning_parcae.launch.run --instances 4 --trace hh_55_65 -- python examples/train_run.py --max-steps 3000

``PARCAE_PIPELINE_STAGES`` (set by the launcher from ``--pipeline-stages``) chooses P of the first generation;
``auto`` lets the strategy pick P from a short profile. ``PARCAE_INTERVAL_S`` (the launcher's scaled trace
interval) is the planning interval of live reconfiguration.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import pytorch_lightning as pl  # noqa: E402
from lightning_parcae.training.callbacks import ParcaeRunCallback, resume_path  # noqa: E402
from lightning_parcae.training.strategy import ParcaeStrategy  # noqa: E402
from train_tiny import TinyClassifier, synthetic  # noqa: E402


class _Delay(pl.Callback):
    """Sleeps after every step, so that a demo on a fast machine lasts long enough to see the trace replay.

    The sleep stands in for compute, so it shrinks as the global batch is spread over more pipelines: ``seconds / D``.
    (A fixed sleep made every shape equally fast; the runtime, which prices shapes by their measured step times,
    then rightly saw no reason to admit a new instance, and the demo never grew.)
    """

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def on_train_batch_end(self, trainer: pl.Trainer, *args: object) -> None:
        time.sleep(self.seconds / max(1, int(getattr(trainer.strategy, "data_parallel", 1) or 1)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    parser.add_argument("--pipeline-stages", default=os.environ.get("PARCAE_PIPELINE_STAGES", "1"),
                        help="P, or 'auto' (strategy profiles and picks)")
    parser.add_argument("--micro-batches", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--ckpt-every", type=int, default=50, help="periodic checkpoint every N steps")
    parser.add_argument("--step-delay", type=float, default=0.0, help="sleep per step at D = 1, divided by D (stands in for compute; slows the demo down)")
    parser.add_argument("--interval-s", type=float, default=float(os.environ.get("PARCAE_INTERVAL_S", "60")),
                        help="live reconfiguration: planning interval in seconds (default $PARCAE_INTERVAL_S, or 60)")
    parser.add_argument("--throughput", choices=["measured", "profile"], default="measured",
                        help="how the runtime prices shapes: by measured step times (default) or by the per-layer "
                        "profile formula only (the step delay is invisible to it: D = 2 always looks 2x faster)")
    parser.add_argument("--crash", action="store_true", help="fail at start (used by the tests)")
    args = parser.parse_args()
    if args.crash:
        raise RuntimeError("crashing on purpose (--crash)")

    pl.seed_everything(0)
    gen = torch.Generator().manual_seed(0)
    train = DataLoader(synthetic(2048, 1), batch_size=args.batch_size, shuffle=True, generator=gen)
    p = None if args.pipeline_stages == "auto" else int(args.pipeline_stages)
    # elastic: on when the launcher sets PARCAE_ELASTIC=1; the leader plans D x P once per (scaled) trace interval
    strategy = ParcaeStrategy(pipeline_stages=p, micro_batches=args.micro_batches, interval_s=args.interval_s,
                              throughput=args.throughput)
    run_cb = ParcaeRunCallback(every_n_steps=args.ckpt_every)
    callbacks: list[pl.Callback] = [run_cb]
    if args.step_delay > 0:
        callbacks.append(_Delay(args.step_delay))
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_steps=args.max_steps,
                         max_epochs=-1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=callbacks)
    trainer.fit(TinyClassifier(), train, ckpt_path=resume_path())
    if trainer.is_global_zero:
        s = trainer.strategy
        state = "stopped for restart" if run_cb.stopped_for_restart else "finished"
        print(f"{state} at step {trainer.global_step}: D={s.data_parallel} P={s.pipeline_stages}", flush=True)


if __name__ == "__main__":
    main()
