"""Train a tiny MLP with ParcaeStrategy on synthetic, deterministic data (CPU, well under a minute).

Problem it shows: an ordinary LightningModule -- ``forward`` runs ``self.net``, an ``nn.Sequential`` -- trains
data- and pipeline-parallel without any change to its code; only the Trainer's ``strategy`` differs.

    python examples/train_tiny.py --devices 2 --pipeline-stages 2 --micro-batches 4
    python examples/train_tiny.py --devices 2            # strategy="parcae": P chosen from a short profile

With ``--devices N`` the script re-launches itself N times (like Lightning's DDP); under torchrun it uses the
processes torchrun started.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl
from lightning_parcae.training.strategy import ParcaeStrategy


class TinyClassifier(pl.LightningModule):
    """4-class classifier; the pipeline is cut between the children of ``self.net``."""

    def __init__(self, hidden: int = 64, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(
            nn.Linear(16, hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.GELU(),
            nn.Linear(hidden, hidden), nn.GELU(),
            nn.Linear(hidden, 4),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", nn.functional.cross_entropy(logits, y), sync_dist=True, prog_bar=True)
        self.log("val_acc", (logits.argmax(-1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def synthetic(n: int, seed: int) -> TensorDataset:
    """Deterministic data: the label is the argmax of the first four features."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return TensorDataset(x, x[:, :4].argmax(dim=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--pipeline-stages", type=int, default=None)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--schedule", choices=["1f1b", "gpipe"], default="1f1b")
    parser.add_argument("--batch-size", type=int, default=64, help="global batch size")
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    pl.seed_everything(0)
    gen = torch.Generator().manual_seed(0)  # seeded shuffle: every process sees the same global order
    train = DataLoader(synthetic(2048, 1), batch_size=args.batch_size, shuffle=True, generator=gen)
    val = DataLoader(synthetic(512, 2), batch_size=args.batch_size)
    if args.pipeline_stages is None:
        strategy: object = "parcae"
    else:
        strategy = ParcaeStrategy(pipeline_stages=args.pipeline_stages, micro_batches=args.micro_batches,
                                  schedule=args.schedule)
    trainer = pl.Trainer(accelerator="cpu", devices=args.devices, strategy=strategy, max_epochs=args.epochs,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(TinyClassifier(), train, val)
    if trainer.is_global_zero:
        s = trainer.strategy
        print(f"D={s.data_parallel} P={s.pipeline_stages} partition={s.partition} "
              f"val_loss={float(trainer.callback_metrics['val_loss']):.4f} "
              f"val_acc={float(trainer.callback_metrics['val_acc']):.3f}")


if __name__ == "__main__":
    main()
