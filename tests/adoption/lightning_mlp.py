"""A plain ``lightning`` (``import lightning as L``) script: an MLP regressor on synthetic data with a
LightningDataModule. Nothing here was written for Parcae except ``strategy="parcae"``.

    python lightning_mlp.py --max-steps 300
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Regressor(L.LightningModule):
    def __init__(self, width: int = 64, lr: float = 0.05) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.encoder = nn.Linear(16, width)
        self.hidden = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.out = nn.Linear(width, 1)

    def forward(self, x):
        x = torch.tanh(self.encoder(x))
        for layer in self.hidden:
            x = x + torch.tanh(layer(x))
        return self.out(x).squeeze(-1)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y), prog_bar=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 32) -> None:
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 16, generator=g)
        y = torch.sin(x[:, :4].sum(1)) + 0.1 * x[:, 4:].sum(1) + 1.0
        self.train_set = TensorDataset(x[:3584], y[:3584])
        self.val_set = TensorDataset(x[3584:], y[3584:])

    def train_dataloader(self):
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(0))

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=128)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--out", default="final.ckpt")
    parser.add_argument("--precision", default="32-true", help="Lightning's precision, e.g. 64-true")
    args = parser.parse_args()
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy="parcae",
        accelerator="cpu",
        precision=args.precision,
        max_steps=args.max_steps,
        val_check_interval=100,
        logger=CSVLogger("logs"),
        callbacks=[ModelCheckpoint(dirpath="checkpoints", monitor="val_loss"),
                   EarlyStopping(monitor="val_loss", patience=100)],
    )
    model, data = Regressor(), Data()
    trainer.fit(model, datamodule=data)
    trainer.validate(model, datamodule=data)
    trainer.test(model, dataloaders=data.val_dataloader())
    predictions = trainer.predict(model, dataloaders=data.val_dataloader())
    assert sum(len(p) for p in predictions) > 0
    trainer.save_checkpoint(args.out)


if __name__ == "__main__":
    main()
