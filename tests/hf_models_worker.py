"""Train a Hugging Face ``transformers`` causal LM, built from a tiny config, at a given P and write its parameters.

    python hf_models_worker.py FAMILY P OUT      (P == 1: plain Lightning, strategy="auto")

Problem: the models people train come from ``transformers``, whose forwards use patterns a hand-written block list
does not (the stack is looped as a slice ``self.layers[:n]``, blocks get keyword arguments, rotary tables and masks
are computed before the loop, a KV cache is created when ``use_cache`` is on, ``enumerate`` indices pick a layer's
mask type). This worker wraps one in an ordinary LightningModule -- random initialisation, nothing downloaded --
trains a few optimizer steps (Adam, M = 2, validation once) and writes the final state dict (``OUT.ckpt``) and the
last validation loss (``OUT``) so that tests/test_hf_models.py can compare a P-stage run with one process.

Families: ``gpt2`` (``transformer.h``, the cache passed positionally), ``llama`` (``model.layers[:n]``, rotary
tables, grouped-query attention), ``qwen2`` (``enumerate(self.layers[:n])`` with ``layer_types[i]`` choosing full or
sliding-window attention per layer: the index must be the global one).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import torch
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl

VOCAB, SEQ, HIDDEN, LAYERS = 128, 16, 32, 4

__all__ = ["build_model", "HFCausalLM", "tokens", "main"]


def build_model(family: str) -> torch.nn.Module:
    """A randomly initialised ``<family>ForCausalLM`` from a tiny config (4 layers, hidden 32, vocab 128), dropout 0."""
    import transformers as tf

    if family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=HIDDEN, n_layer=LAYERS, n_head=4,
                            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return tf.GPT2LMHeadModel(cfg)
    if family == "llama":
        cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
        return tf.LlamaForCausalLM(cfg)
    if family == "qwen2":
        cfg = tf.Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                             use_sliding_window=True, sliding_window=4, max_window_layers=2)
        return tf.Qwen2ForCausalLM(cfg)
    raise SystemExit(f"unknown family {family!r}")


class HFCausalLM(pl.LightningModule):
    """An ordinary LightningModule around a ``transformers`` causal LM: the loss is the model's own (``labels=``).

    Args:
        family: ``gpt2``, ``llama`` or ``qwen2``.
    """

    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = build_model(family)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (ids,) = batch
        loss = self.model(input_ids=ids, labels=ids).loss
        self.log("val_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def tokens(n: int, seed: int) -> TensorDataset:
    """``n`` sequences of ``SEQ`` tokens with structure (each token is the previous plus a small step)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    steps = torch.randint(1, 4, (n, SEQ), generator=g).cumsum(1)
    return TensorDataset((start + steps) % VOCAB)


def main() -> None:
    family, p, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    pl.seed_everything(0, verbose=False)
    torch.set_num_threads(1)
    module = HFCausalLM(family)
    train = DataLoader(tokens(64, 0), batch_size=8)
    val = DataLoader(tokens(16, 1), batch_size=8)
    if p > 1:
        from lightning_parcae.training.strategy import ParcaeStrategy

        strategy: Any = ParcaeStrategy(pipeline_stages=p, micro_batches=2)
    else:
        strategy = "auto"
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=p, max_steps=4, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=2, val_check_interval=4)
    try:
        trainer.fit(module, train, val)
        res = trainer.validate(module, val, verbose=False)
    except Exception as exc:  # noqa: BLE001
        if trainer.is_global_zero:
            with open(out, "w") as f:
                json.dump({"error": f"{type(exc).__name__}: {exc}"}, f)
        raise
    trainer.save_checkpoint(out + ".ckpt")
    if trainer.is_global_zero:
        with open(out, "w") as f:
            json.dump({"val_loss": res[0]["val_loss"], "P": p,
                       "stack": getattr(trainer.strategy, "stack_path", None) if p > 1 else None}, f)


if __name__ == "__main__":
    main()
