"""On one CUDA GPU: ParcaeStrategy against Lightning's own single-device strategy, and a resume from a checkpoint.

Problem: the project is developed and tested on CPU (gloo); "code runs on CPU and uses CUDA when present" is a
claim until it runs on a GPU. This script is the short, prepared check for a machine that has one: it trains the
small transformer LM of ``bench_strategy.py`` (larger here: d=512, 8 blocks) on ``cuda:0`` three ways, each in its
own process, with deterministic kernels:

* ``lightning``: ``Trainer(accelerator="gpu", devices=1)`` -- Lightning's ``SingleDeviceStrategy``, the baseline;
* ``parcae``: the same with ``strategy=ParcaeStrategy(pipeline_stages=1)``;
* ``parcae-resume``: ParcaeStrategy saving a checkpoint mid-training (after half the steps, from a callback, as
  ``ParcaeRunCallback`` does), then a fresh process that resumes from it (``fit(ckpt_path=...)``, loaded with ``weights_only=True``) and finishes.

It prints, side by side, samples/s of each (after warm-up) and the largest relative parameter difference of
``parcae`` and ``parcae-resume`` against ``lightning`` (goal: 0 up to floating-point reassociation, <= 1e-5), and
the ratio parcae / lightning samples/s (goal >= 0.95)::

    python benchmarks/gpu_check.py --out gpu_check.json     # ~1 minute on one H200

``--precision 16-mixed`` runs the same three under fp16 mixed precision with Lightning's loss scaler
(``MixedPrecision`` + ``torch.amp.GradScaler("cuda")``; ParcaeStrategy makes the scaler's inf/nan verdict the
job's, see ``lightning_parcae/training/loss_scaling.py``), and ``--overflow-at K`` writes an inf into one gradient
at optimizer step K (a callback's ``on_after_backward``, in every run), so that step must be skipped and the scale
halved. It then also reports each run's loss scale after every step (``scales_match``: parcae's and the resumed
run's equal Lightning's; ``skipped``: the steps where the scale backed off) and the scaler state in the
checkpoint, which the resumed run must start from (``resume_started_from_saved_scaler``)::

    python benchmarks/gpu_check.py --precision 16-mixed --overflow-at 15 --steps 40 --out gpu_check_fp16.json

``--model peer-lm`` trains issue 22's model instead -- ``bench_pipeline_peer.py``'s GPT-style LM with a
``--vocab``-way head (16,384 by default) -- and ``--model hf-gpt2`` / ``hf-llama`` ``transformers`` causal LMs built
from configs (random init, nothing downloaded), all at P = 1 on the GPU, the same three runs::

    python benchmarks/gpu_check.py --model peer-lm --dim 512 --blocks 8 --out gpu_check_peer_lm.json

Without a GPU it says so and exits 2 (``--accelerator cpu`` tries the script itself; 16-mixed then uses a CPU
scaler, as ``tests/test_loss_scaling.py`` does). Multi-GPU (NCCL between devices) is not covered: one GPU only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _save_at_class() -> Any:
    import pytorch_lightning as pl

    class SaveAt(pl.Callback):
        """Save a checkpoint mid-training (as ParcaeRunCallback does), after optimizer step ``step``."""

        def __init__(self, step: int, path: str) -> None:
            self.step, self.path = step, path

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            if trainer.global_step == self.step:
                trainer.save_checkpoint(self.path)

    return SaveAt


def _SaveAt(step: int, path: str) -> Any:  # noqa: N802 -- a class built on first use (imports Lightning late)
    return _save_at_class()(step, path)


def _fp16_callbacks(overflow_at: int) -> tuple[Any, Any]:
    """``(overflow, scales)``: a callback writing an inf into the first gradient at step ``overflow_at`` (after the
    backward, before the optimizer step; -1: never), and one recording the loss scale after every step and the
    scaler state the run started from."""
    import pytorch_lightning as pl

    class Overflow(pl.Callback):
        def on_after_backward(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            if trainer.global_step == overflow_at:
                p = next(p for p in module.parameters() if p.grad is not None)
                p.grad.view(-1)[0] = float("inf")

    class Scales(pl.Callback):
        def __init__(self) -> None:
            self.scales: list[float] = []
            self.start: dict[str, Any] = {}

        def on_train_start(self, trainer: pl.Trainer, *args: Any) -> None:
            self.start = dict(trainer.precision_plugin.state_dict())

        def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            if scaler is not None:
                self.scales.append(float(scaler.get_scale()))

    return Overflow(), Scales()


MODELS = ("tiny-lm", "peer-lm", "hf-gpt2", "hf-llama")
"""``--model``: ``tiny-lm`` (bench_strategy's TinyLM, vocabulary 256), ``peer-lm`` (bench_pipeline_peer's GPT-style LM:
embedding, pre-LayerNorm blocks, final norm, a ``--vocab``-way head -- issue 22's model), ``hf-gpt2`` / ``hf-llama``
(``transformers`` causal LMs from configs of width ``--dim``, ``--blocks`` layers and ``--vocab`` tokens, random
init, nothing downloaded; the loss is the model's own)."""


def _module(cfg: dict[str, Any]) -> Any:
    """The LightningModule of ``cfg["model"]`` (see :data:`MODELS`), initialised from seed 0."""
    import pytorch_lightning as pl
    from torch import nn

    model = cfg.get("model", "tiny-lm")
    if model == "tiny-lm":
        from bench_strategy import TinyLM

        return TinyLM(dim=cfg["dim"], blocks=cfg["blocks"], heads=8)

    class LM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            if model == "peer-lm":
                from bench_pipeline_peer import build_layers

                self.layers = build_layers({"vocab": cfg["vocab"], "dim": cfg["dim"], "heads": 8,
                                            "blocks": cfg["blocks"], "seq": cfg["seq"]})
                return
            import transformers as tf

            if model == "hf-gpt2":
                conf: Any = tf.GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=cfg["dim"],
                                          n_layer=cfg["blocks"], n_head=8, resid_pdrop=0.0, embd_pdrop=0.0,
                                          attn_pdrop=0.0)
                self.hf = tf.GPT2LMHeadModel(conf)
            elif model == "hf-llama":
                conf = tf.LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["dim"], intermediate_size=4 * cfg["dim"],
                                      num_hidden_layers=cfg["blocks"], num_attention_heads=8, num_key_value_heads=4,
                                      max_position_embeddings=cfg["seq"])
                self.hf = tf.LlamaForCausalLM(conf)
            else:
                raise SystemExit(f"unknown --model {model!r}; choose from {', '.join(MODELS)}")

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            if model == "peer-lm":
                loss = nn.functional.cross_entropy(self.layers(x).reshape(-1, cfg["vocab"]), y.reshape(-1))
            else:
                loss = self.hf(input_ids=x, labels=x).loss
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    return LM()


def _worker(cfg: dict[str, Any]) -> None:
    sys.path.insert(0, HERE)
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from bench_strategy import _Timer

    pl.seed_everything(0, verbose=False)
    torch.use_deterministic_algorithms(True)
    total = cfg["steps"] + cfg["warmup"]
    g = torch.Generator().manual_seed(0)
    vocab = 256 if cfg.get("model", "tiny-lm") == "tiny-lm" else cfg["vocab"]
    tokens = torch.randint(0, vocab, (cfg["batch"] * total, cfg["seq"] + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    if cfg["kind"] == "lightning":
        strategy: Any = "auto"
    else:
        from lightning_parcae.training.strategy import ParcaeStrategy

        strategy = ParcaeStrategy(pipeline_stages=1)
    timer = _Timer(cfg["warmup"])
    callbacks: list[Any] = [timer]
    if cfg.get("save"):
        callbacks.append(_SaveAt(cfg["save_at"], cfg["save"]))
    overflow, scales = _fp16_callbacks(cfg.get("overflow_at", -1))
    callbacks += [overflow, scales]
    precision: dict[str, Any] = {"precision": cfg.get("precision", "32-true")}
    if precision["precision"] == "16-mixed" and cfg["accelerator"] == "cpu":  # Lightning would fall back to bf16
        from pytorch_lightning.plugins.precision import MixedPrecision

        precision = {"plugins": [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))]}
    trainer = pl.Trainer(accelerator=cfg["accelerator"], devices=1, strategy=strategy, max_steps=cfg["stop"], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, callbacks=callbacks, deterministic=True, **precision)
    model = _module(cfg)
    trainer.fit(model, DataLoader(data, batch_size=cfg["batch"]), ckpt_path=cfg.get("resume"))
    params = {k: v.detach().float().cpu() for k, v in trainer.lightning_module.state_dict().items()}
    torch.save(params, cfg["params"])
    rate = cfg["batch"] * (cfg["stop"] - cfg["warmup"]) / max(timer.t1 - timer.t0, 1e-9) if timer.t0 else None
    with open(cfg["out"], "w") as f:
        json.dump({"samples_per_s": rate, "device": str(trainer.strategy.root_device),
                   "strategy": type(trainer.strategy).__name__, "precision": type(trainer.precision_plugin).__name__,
                   "scales": scales.scales, "start_scaler": scales.start,
                   "final_scaler": dict(trainer.precision_plugin.state_dict())}, f)


def _run(cfg: dict[str, Any], tmp: str, name: str) -> dict[str, Any]:
    cfg = {**cfg, "out": os.path.join(tmp, f"{name}.json"), "params": os.path.join(tmp, f"{name}.pt")}
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(cfg)], env=env, capture_output=True,
                          text=True, timeout=600)
    if proc.returncode:
        raise RuntimeError(f"{name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(cfg["out"]) as f:
        res = json.load(f)
    res["params"] = cfg["params"]
    return res


def _backoffs(start: float, scales: list[float]) -> list[int]:
    """The optimizer steps after which the loss scale went down (skipped: an inf or nan gradient)."""
    before = [start, *scales[:-1]]
    return [i for i, (b, after) in enumerate(zip(before, scales)) if after < b]


def _max_rel_diff(a_path: str, b_path: str) -> float:
    a = torch.load(a_path, weights_only=True)
    b = torch.load(b_path, weights_only=True)
    return max(float((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=60, help="timed optimizer steps")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8)
    ap.add_argument("--model", default="tiny-lm", choices=MODELS,
                    help="what to train (tiny-lm: the default small LM; peer-lm: bench_pipeline_peer's GPT-style LM; "
                         "hf-gpt2 / hf-llama: transformers models from configs)")
    ap.add_argument("--vocab", type=int, default=16384, help="vocabulary of peer-lm / hf-* (tiny-lm: 256)")
    ap.add_argument("--out", default=None, help="also write the results as JSON here")
    ap.add_argument("--accelerator", default="gpu", help="'cpu' only to try the script itself without a GPU")
    ap.add_argument("--precision", default="32-true", help="Lightning precision of every run, e.g. 16-mixed")
    ap.add_argument("--overflow-at", type=int, default=-1,
                    help="write an inf into one gradient at this optimizer step (its step must be skipped)")
    a = ap.parse_args()
    if a.worker:
        _worker(json.loads(a.worker))
        return
    if a.accelerator == "gpu" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device here (torch.cuda.is_available() is False); run it on a GPU machine")
        sys.exit(2)
    total = a.steps + a.warmup
    base = {"steps": a.steps, "warmup": a.warmup, "batch": a.batch, "seq": a.seq, "dim": a.dim, "blocks": a.blocks,
            "stop": total, "accelerator": a.accelerator, "precision": a.precision, "overflow_at": a.overflow_at,
            "model": a.model, "vocab": a.vocab}
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if a.accelerator == "gpu" else "cpu",
                               "torch": torch.__version__, "model": a.model,
                               "vocab": 256 if a.model == "tiny-lm" else a.vocab}
    with tempfile.TemporaryDirectory() as tmp:
        t = time.time()
        light = _run({**base, "kind": "lightning"}, tmp, "lightning")
        parcae = _run({**base, "kind": "parcae"}, tmp, "parcae")
        ckpt = os.path.join(tmp, "half.ckpt")
        _run({**base, "kind": "parcae", "save": ckpt, "save_at": total // 2}, tmp, "parcae-saving")
        resumed = _run({**base, "kind": "parcae", "resume": ckpt}, tmp, "parcae-resume")
        results.update({
            "lightning": {k: light[k] for k in ("samples_per_s", "device", "strategy")},
            "parcae": {k: parcae[k] for k in ("samples_per_s", "device", "strategy")},
            "parcae_vs_lightning_max_rel_param_diff": _max_rel_diff(light["params"], parcae["params"]),
            "resume_vs_lightning_max_rel_param_diff": _max_rel_diff(light["params"], resumed["params"]),
            "parcae_over_lightning_samples_per_s": parcae["samples_per_s"] / light["samples_per_s"],
            "wall_s": time.time() - t,
        })
        if a.precision == "16-mixed":
            half = total // 2
            saved = torch.load(ckpt, weights_only=True).get("MixedPrecision")
            results["fp16"] = {
                "precision_plugin": parcae["precision"],
                "final_scale": light["scales"][-1] if light["scales"] else None,
                "scales_match": parcae["scales"] == light["scales"] and resumed["scales"] == light["scales"][half:],
                "skipped": _backoffs(light["start_scaler"].get("scale", 0.0), light["scales"]),
                "checkpoint_scaler": saved,
                "resume_started_from_saved_scaler": resumed["start_scaler"] == saved,
                "final_scaler_match": parcae["final_scaler"] == light["final_scaler"] == resumed["final_scaler"],
            }
    print(json.dumps(results, indent=2))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
