"""A LightningCLI project (pytorch_lightning): model, data and trainer come from a YAML file.

    python cli_project.py fit --config cli_project.yaml
"""

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import pytorch_lightning as pl
from pytorch_lightning.cli import LightningCLI


class Classifier(pl.LightningModule):
    def __init__(self, hidden: int = 32, depth: int = 2, lr: float = 0.1) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.stem = nn.Linear(8, hidden)
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(depth)])
        self.head = nn.Linear(hidden, 3)

    def forward(self, x):
        x = torch.tanh(self.stem(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)


class Blobs(pl.LightningDataModule):
    def __init__(self, batch_size: int = 32, samples: int = 2048) -> None:
        super().__init__()
        self.batch_size = batch_size
        self.samples = samples

    def train_dataloader(self):
        g = torch.Generator().manual_seed(0)
        y = torch.randint(0, 3, (self.samples,), generator=g)
        x = torch.randn(self.samples, 8, generator=g) + 2.0 * F.one_hot(y, 8).float()
        return DataLoader(TensorDataset(x, y), batch_size=self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(0))


class CLI(LightningCLI):
    def after_fit(self) -> None:
        self.trainer.save_checkpoint("final.ckpt")


if __name__ == "__main__":
    CLI(Classifier, Blobs, seed_everything_default=0, save_config_callback=None)
