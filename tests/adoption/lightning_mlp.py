"""A plain ``lightning`` (``import lightning as L``) script: an MLP regressor on synthetic data with a
LightningDataModule. Nothing here was written for Parcae except ``strategy="parcae"``.

    python lightning_mlp.py --max-steps 300
    python lightning_mlp.py --accumulate 2 --data stream     # gradient accumulation, an IterableDataset
    python lightning_mlp.py --manual                         # manual optimization
    python lightning_mlp.py --optimize-litdata --litdata-dir /tmp/ld  # generate and optimize a LitData dataset
    python lightning_mlp.py --data litdata --litdata-dir /tmp/ld     # train on it (LitData's StreamingDataset)
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset


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
        if not self.automatic_optimization:  # --manual: the loop a GAN or RL fine-tuning script writes itself
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
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


class Stream(IterableDataset):
    """A stream of (x, y) samples in a fixed shuffled order, as a generator reading shards would yield them."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y
        self.order = torch.randperm(len(x), generator=torch.Generator().manual_seed(1)).tolist()

    def __iter__(self):
        for i in self.order:
            yield self.x[i], self.y[i]


def _sample(i: int):
    """One sample of the LitData dataset (optimize() calls it for every index)."""
    g = torch.Generator().manual_seed(10_000 + i)
    x = torch.randn(16, generator=g)
    return x, torch.sin(x[:4].sum()) + 0.1 * x[4:].sum() + 1.0


class Data(L.LightningDataModule):
    def __init__(self, batch_size: int = 32, kind: str = "map", litdata_dir: str = "litdata_train",
                 train_samples: int = 3584) -> None:
        super().__init__()
        self.train_samples = train_samples
        self.batch_size = batch_size
        self.kind = kind
        self.litdata_dir = litdata_dir

    def setup(self, stage: str) -> None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(4096, 16, generator=g)
        y = torch.sin(x[:, :4].sum(1)) + 0.1 * x[:, 4:].sum(1) + 1.0
        if self.kind == "stream":
            self.train_set = Stream(x[:self.train_samples], y[:self.train_samples])
        elif self.kind == "litdata":
            import litdata

            self.train_set = litdata.StreamingDataset(self.litdata_dir, shuffle=True, seed=3)
        else:
            self.train_set = TensorDataset(x[:self.train_samples], y[:self.train_samples])
        self.val_set = TensorDataset(x[3584:], y[3584:])

    def train_dataloader(self):
        if self.kind != "map":
            return DataLoader(self.train_set, batch_size=self.batch_size, drop_last=True)
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True,
                          generator=torch.Generator().manual_seed(0))

    def val_dataloader(self):
        return DataLoader(self.val_set, batch_size=128)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-steps", type=int, default=300)
    parser.add_argument("--out", default="final.ckpt")
    parser.add_argument("--precision", default="32-true", help="Lightning's precision, e.g. 64-true")
    parser.add_argument("--accumulate", type=int, default=1, help="Lightning's accumulate_grad_batches")
    parser.add_argument("--data", choices=["map", "stream", "litdata"], default="map",
                        help="training data: a TensorDataset, an IterableDataset, or LitData's StreamingDataset")
    parser.add_argument("--litdata-dir", default="litdata_train", help="the optimized LitData dataset")
    parser.add_argument("--manual", action="store_true", help="manual optimization (automatic_optimization=False)")
    parser.add_argument("--train-samples", type=int, default=3584, help="training set size (at most 3584)")
    parser.add_argument("--val-every", type=int, default=100, help="val_check_interval (batches)")
    parser.add_argument("--optimize-litdata", action="store_true", help="write --litdata-dir with litdata.optimize")
    args = parser.parse_args()
    if args.optimize_litdata:
        import litdata

        litdata.optimize(fn=_sample, inputs=list(range(3584)), output_dir=args.litdata_dir, chunk_bytes="64KB",
                         num_workers=1)
        return
    L.seed_everything(0)
    trainer = L.Trainer(
        strategy="parcae",
        accelerator="cpu",
        precision=args.precision,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        val_check_interval=min(args.val_every, args.train_samples // 32),
        logger=CSVLogger("logs"),
        callbacks=[ModelCheckpoint(dirpath="checkpoints", monitor="val_loss"),
                   EarlyStopping(monitor="val_loss", patience=100)],
    )
    model, data = Regressor(), Data(kind=args.data, litdata_dir=args.litdata_dir, train_samples=args.train_samples)
    model.automatic_optimization = not args.manual
    trainer.fit(model, datamodule=data)
    trainer.validate(model, datamodule=data)
    trainer.test(model, dataloaders=data.val_dataloader())
    predictions = trainer.predict(model, dataloaders=data.val_dataloader())
    assert sum(len(p) for p in predictions) > 0
    trainer.save_checkpoint(args.out)


if __name__ == "__main__":
    main()
