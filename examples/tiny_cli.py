"""LightningCLI entry point for the tiny example: the strategy comes from YAML.

    python examples/tiny_cli.py fit --config examples/tiny_cli.yaml
    python examples/tiny_cli.py fit --config examples/tiny_cli.yaml --trainer.strategy parcae   # by name
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI

import lightning_parcae.training.strategy  # noqa: F401  (registers the "parcae" strategy name)
from train_tiny import TinyClassifier, synthetic


class TinyData(pl.LightningDataModule):
    """Synthetic train/val data; ``batch_size`` is the global batch."""

    def __init__(self, batch_size: int = 64, seed: int = 0) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.seed = seed

    def train_dataloader(self) -> DataLoader:
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(synthetic(2048, 1), batch_size=self.batch_size, shuffle=True, generator=gen)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(synthetic(512, 2), batch_size=self.batch_size)


if __name__ == "__main__":
    LightningCLI(TinyClassifier, TinyData, save_config_callback=None, seed_everything_default=0)
