"""Train the GPT example with LightningCLI, directly or under ``parcae run`` (live reconfiguration).

    python examples/gpt/train.py --config examples/gpt/config.yaml --trainer.devices 2
    parcae run --instances 4 --trace hh_55_65 --time-scale 30 --pipeline-stages 2 --run-dir out -- \\
        python examples/gpt/train.py --config examples/gpt/config.yaml

Under ``parcae run`` the launcher's environment fills in what the YAML cannot know: ``devices`` (the local world
size it started this worker with), the first generation's pipeline depth (``PARCAE_PIPELINE_STAGES``) and the
planning interval (``PARCAE_INTERVAL_S``, the scaled trace interval); a relaunched worker resumes from
``run_dir/ckpt/last.ckpt`` (:func:`~lightning_parcae.training.callbacks.resume_path`). Options given on the command line
win over these.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import yaml  # noqa: E402
from pytorch_lightning.cli import LightningCLI  # noqa: E402

from gpt import GPT, StdlibText  # noqa: E402
from lightning_parcae.contract import JOIN_ENV  # noqa: E402
from lightning_parcae.testing.emulated_cluster import EmulatedWorkload  # noqa: E402
from lightning_parcae.training.callbacks import resume_path  # noqa: E402


def _env_defaults(argv: list[str]) -> list[str]:
    """Options from the launcher's environment, placed before the user's so that the user's win."""
    extra: list[str] = []
    if "LOCAL_WORLD_SIZE" in os.environ:
        extra += ["--trainer.devices", os.environ["LOCAL_WORLD_SIZE"]]
    p = os.environ.get("PARCAE_PIPELINE_STAGES")
    if p and p != "auto":
        extra += ["--trainer.strategy.init_args.pipeline_stages", p]
    if os.environ.get("PARCAE_INTERVAL_S"):
        extra += ["--trainer.strategy.init_args.interval_s", os.environ["PARCAE_INTERVAL_S"]]
    # --config must come first so that these and the user's options override it
    if "--config" in argv:
        i = argv.index("--config")
        return argv[: i + 2] + extra + argv[i + 2:]
    return extra + argv


def _boot_emulated_instance(args: list[str]) -> None:
    """Under ``model.emulate``, a joining instance (``PARCAE_JOIN=1``) first sleeps the workload's modelled boot
    time (scaled), as a fresh instance would boot before its process can register as a standby. A member fenced
    and restarted as a standby also pays it (the emulation cannot tell a new instance from a restarted process)."""
    if os.environ.get(JOIN_ENV) != "1":
        return
    cfg = _config_model(args)
    emulate = cfg.get("emulate")
    if emulate:
        workload = EmulatedWorkload.named(str(emulate), time_scale=float(cfg.get("time_scale", 30.0)))
        time.sleep(workload.boot_scaled_s())


def _config_model(args: list[str]) -> dict:
    """``model:`` options of the ``--config`` file, with ``--model.emulate`` / ``--model.time_scale`` overrides."""
    out: dict = {}
    if "--config" in args:
        with open(args[args.index("--config") + 1]) as f:
            out.update((yaml.safe_load(f) or {}).get("model") or {})
    for key in ("emulate", "time_scale"):
        flag = f"--model.{key}"
        if flag in args and args.index(flag) + 1 < len(args):
            out[key] = args[args.index(flag) + 1]
    return out


def main() -> None:
    argv = list(sys.argv)
    args = _env_defaults(argv[1:])
    _boot_emulated_instance(args)
    sys.argv = argv[:1]  # the options are passed as ``args`` (LightningCLI warns if both are given)
    cli = LightningCLI(GPT, StdlibText, run=False, save_config_callback=None, args=args)
    # Regression: without a launcher, ParcaeStrategy starts the other ranks by re-running ``sys.argv`` (like
    # Lightning's DDP); with the truncated argv rank 1 ran without --config -- default Trainer, no max_steps -- and
    # the two-process test trained past its 30 steps until its timeout. The children re-apply the defaults above.
    sys.argv = argv
    trainer = cli.trainer
    cli.model.install_link()  # before fit: a joiner receives its stage before LightningModule.setup runs
    trainer.fit(cli.model, cli.datamodule, ckpt_path=resume_path())
    if trainer.is_global_zero:
        s = trainer.strategy
        print(f"finished at step {trainer.global_step}: D={getattr(s, 'data_parallel', 1)} "
              f"P={getattr(s, 'pipeline_stages', 1)} val_loss={trainer.callback_metrics.get('val_loss')}", flush=True)


if __name__ == "__main__":
    main()
