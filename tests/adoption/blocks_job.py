"""Train a block-list model (nn.ModuleList looped in forward) at a given D x P and write the final parameters.

    python blocks_job.py VARIANT P D OUT       (P * D == 1: plain Lightning, strategy="auto")

Environment: ``BLOCKS_PARCAE=1`` uses ParcaeStrategy also for one process; ``BLOCKS_RESUME=PATH`` resumes ``fit``
from that checkpoint; ``BLOCKS_STEPS=N`` trains to ``max_steps=N`` (default 12).

Variants: ``mask`` (blocks take a causal mask), ``tuple`` (blocks return ``(hidden, attention weights)``),
``residual`` (code between the blocks: ``x = x + block(x)``, refused for P > 1), ``tied`` (the head's weight is the
token embedding's, GPT-2 style). Each rank also writes ``OUT.rank<r>.json``: the keys outside the block list that
have storage on it, and those with optimizer state.
"""

import json
import os
import sys

import torch
from torch import nn
from torch.utils.data import DataLoader

import pytorch_lightning as pl
from lightning_parcae.training.strategy import ParcaeStrategy

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from pl_transformer import Block, TinyGPT, tokens  # noqa: E402


class TupleBlock(Block):
    def forward(self, x, mask):
        h = self.ln1(x)
        a, w = self.attn(h, h, h, attn_mask=mask, need_weights=True)
        x = x + a
        return x + self.mlp(self.ln2(x)), w


class TupleGPT(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TupleBlock(32, 4) for _ in range(4)])

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos[:, :t]
        for block in self.blocks:
            x, _ = block(x, mask)
        return self.head(self.ln_f(x))


class TiedGPT(TinyGPT):
    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(32, 64, bias=False)
        self.head.weight = self.tok.weight


class ResidualGPT(TinyGPT):
    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos[:, :t]
        for block in self.blocks:
            x = x + 0.5 * block(x, mask)
        return self.head(self.ln_f(x))


def main() -> None:
    variant, p, d, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    pl.seed_everything(0)
    model = {"mask": TinyGPT, "tuple": TupleGPT, "residual": ResidualGPT, "tied": TiedGPT}[variant]()
    train = DataLoader(tokens(512, 16, 64, 0), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(0))
    val = DataLoader(tokens(64, 16, 64, 1), batch_size=32)
    parcae = p * d > 1 or os.environ.get("BLOCKS_PARCAE") == "1"
    strategy = ParcaeStrategy(pipeline_stages=p, micro_batches=2) if parcae else "auto"
    steps = int(os.environ.get("BLOCKS_STEPS", "12"))
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=p * d, max_steps=steps, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         val_check_interval=6)
    try:
        trainer.fit(model, train, val, ckpt_path=os.environ.get("BLOCKS_RESUME") or None)
    except Exception as exc:  # noqa: BLE001
        if trainer.is_global_zero:
            json.dump({"error": f"{type(exc).__name__}: {exc}"}, open(out, "w"))
        raise SystemExit(1)
    state = model.state_dict(keep_vars=True)
    optimized = {id(p) for opt in trainer.optimizers for p, st in opt.state.items() if st}
    stored = {k: not (v.is_meta or getattr(v, "_parcae_stand_in", False)) for k, v in state.items()
              if not k.startswith("blocks.")}
    with open(f"{out}.rank{trainer.global_rank}.json", "w") as f:
        json.dump({"stored": sorted(k for k, v in stored.items() if v),
                   "optimized": sorted(k for k in stored if id(state[k]) in optimized),
                   "grads": sorted(k for k in stored if getattr(state[k], "grad", None) is not None)}, f)
    res = trainer.validate(model, val, verbose=False)
    trainer.save_checkpoint(out + ".ckpt")
    if trainer.is_global_zero:
        json.dump({"val_loss": res[0]["val_loss"], "P": trainer.strategy.pipeline_stages if parcae else 1},
                  open(out, "w"))


if __name__ == "__main__":
    main()
