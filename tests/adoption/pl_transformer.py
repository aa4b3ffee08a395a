"""A plain pytorch_lightning script: a small causal transformer LM whose blocks are an nn.ModuleList looped in
forward, trained on synthetic tokens. Nothing here was written for Parcae except ``strategy="parcae"``.

    python pl_transformer.py --max-steps 300
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl
from pytorch_lightning.callbacks import LearningRateMonitor, ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, bias=False, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask):
        h = self.ln1(x)
        a, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        x = x + a
        return x + self.mlp(self.ln2(x))


class TinyGPT(pl.LightningModule):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, layers: int = 4, seq: int = 16,
                 lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, seq, dim))
        self.blocks = nn.ModuleList([Block(dim, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=idx.device), diagonal=1)
        x = self.tok(idx) + self.pos[:, :t]
        for block in self.blocks:
            x = block(x, mask)
        return self.head(self.ln_f(x))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).flatten(0, 1), y.flatten()))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def tokens(n: int, seq: int, vocab: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (n, 1), generator=g)
    step = torch.randint(1, 4, (n, 1), generator=g)
    data = (start + step * torch.arange(seq + 1)) % vocab  # learnable: arithmetic sequences
    return TensorDataset(data[:, :-1], data[:, 1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--out", default="final.ckpt")
    parser.add_argument("--accelerator", default="cpu", help="'gpu' for the GPU check (benchmarks/gpu_check.sh)")
    args = parser.parse_args()
    pl.seed_everything(0)
    train = DataLoader(tokens(4096, 16, 64, 0), batch_size=32, shuffle=True,
                       generator=torch.Generator().manual_seed(0))
    val = DataLoader(tokens(256, 16, 64, 1), batch_size=64)
    trainer = pl.Trainer(
        strategy="parcae",
        accelerator=args.accelerator,
        max_steps=args.max_steps,
        val_check_interval=100,
        logger=CSVLogger("logs"),
        callbacks=[ModelCheckpoint(dirpath="checkpoints", every_n_train_steps=100), LearningRateMonitor()],
    )
    model = TinyGPT()
    trainer.fit(model, train, val)
    trainer.validate(model, val)
    trainer.save_checkpoint(args.out)


if __name__ == "__main__":
    main()
