"""A small GPT trained byte-level on the Python standard library's own source: a real model on real text that
needs no download.

Problem it shows: Parcae matters when a model does not fit one instance -- GPT-1.5B and 6.7B with Adam need a
pipeline (P >= 2) on 16 GB GPUs. This model reproduces that regime at CPU scale: an embedding, ``n_blocks``
pre-LayerNorm transformer blocks and a head, as one top-level ``nn.Sequential`` (``self.layers``) that
:class:`~lightning_parcae.training.strategy.ParcaeStrategy` cuts into stages. With ``max_stage_memory_bytes`` below the
whole model's training memory (parameters + gradients + Adam state), every shape needs P >= 2.

Data: the ``*.py`` files directly in the standard library directory (``os.path.dirname(os.__file__)``), sorted by
name and concatenated up to ``max_bytes`` bytes: deterministic on a given Python version, nothing to download.
The last ``val_fraction`` of the bytes is the validation set. Validation reports loss and perplexity
(torchmetrics).
"""

from __future__ import annotations

import glob
import math
import os
import time
from typing import Optional

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchmetrics.text import Perplexity

from lightning_parcae.runtime.elastic import LIVE_CHECKPOINT
from lightning_parcae.testing.emulated_cluster import EmulatedWorkload, install_modelled_link
from lightning_parcae.testing.emulated_device import emulated_compute

__all__ = ["GPT", "StdlibText", "stdlib_bytes"]

VOCAB = 256  # bytes


def stdlib_bytes(max_bytes: int) -> bytes:
    """The first ``max_bytes`` bytes of the standard library's top-level ``*.py`` files, sorted by name."""
    root = os.path.dirname(os.__file__)
    files = sorted(glob.glob(os.path.join(root, "*.py")))
    if not files:
        raise FileNotFoundError(f"no *.py files in the standard library directory {root}")
    out = bytearray()
    for path in files:
        with open(path, "rb") as f:
            out += f.read()
        if len(out) >= max_bytes:
            break
    return bytes(out[:max_bytes])


class _Windows(Dataset):
    """Non-overlapping windows of ``seq_len + 1`` bytes (input and next-byte target)."""

    def __init__(self, data: torch.Tensor, seq_len: int) -> None:
        self.data = data
        self.seq_len = seq_len

    def __len__(self) -> int:
        return (len(self.data) - 1) // self.seq_len

    def __getitem__(self, i: int) -> torch.Tensor:
        a = i * self.seq_len
        return self.data[a: a + self.seq_len + 1]


class StdlibText(pl.LightningDataModule):
    """Byte-level text of the standard library's source (see the module docstring).

    Args:
        seq_len: Bytes per training sequence.
        batch_size: Global batch size (sequences per optimizer step).
        max_bytes: Bytes of source used in all.
        val_fraction: Tail fraction held out for validation.
        val_batches: Validation batches per validation run (keeps validation short).
        seed: Shuffling seed.
    """

    def __init__(self, seq_len: int = 64, batch_size: int = 16, max_bytes: int = 1_000_000,
                 val_fraction: float = 0.05, val_batches: int = 4, seed: int = 0) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction}: must be strictly between 0 and 1")
        self.seq_len, self.batch_size, self.max_bytes = seq_len, batch_size, max_bytes
        self.val_fraction, self.val_batches, self.seed = val_fraction, val_batches, seed
        self.train: Optional[_Windows] = None
        self.val: Optional[_Windows] = None

    def setup(self, stage: Optional[str] = None) -> None:
        data = torch.frombuffer(bytearray(stdlib_bytes(self.max_bytes)), dtype=torch.uint8).long()
        cut = int(len(data) * (1.0 - self.val_fraction))
        self.train = _Windows(data[:cut], self.seq_len)
        val = _Windows(data[cut:], self.seq_len)
        n = min(len(val), self.val_batches * self.batch_size)
        self.val = torch.utils.data.Subset(val, range(n))  # type: ignore[assignment]

    def train_dataloader(self) -> DataLoader:
        assert self.train is not None
        gen = torch.Generator().manual_seed(self.seed)
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True, generator=gen, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        assert self.val is not None
        return DataLoader(self.val, batch_size=self.batch_size, drop_last=True)


class Embed(nn.Module):
    """Token + learned position embedding."""

    def __init__(self, d_model: int, seq_len: int, device_ms: float = 0.0,
                 device_backward_ms: Optional[float] = None) -> None:
        super().__init__()
        self.device_ms, self.device_backward_ms = device_ms, device_backward_ms
        self.tok = nn.Embedding(VOCAB, d_model)
        self.pos = nn.Embedding(seq_len, d_model)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        return emulated_compute(self.tok(idx) + self.pos(torch.arange(t, device=idx.device))[None], self.device_ms,
                                backward_ms_per_sample=self.device_backward_ms)


class Block(nn.Module):
    """Pre-LayerNorm transformer block: causal self-attention and an MLP, each with a residual."""

    def __init__(self, d_model: int, n_heads: int, device_ms: float = 0.0,
                 device_backward_ms: Optional[float] = None) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.device_ms, self.device_backward_ms = device_ms, device_backward_ms
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return emulated_compute(x + self.mlp(self.ln2(x)), self.device_ms,
                                backward_ms_per_sample=self.device_backward_ms)


class Head(nn.Module):
    """Final LayerNorm and the projection to byte logits."""

    def __init__(self, d_model: int, device_ms: float = 0.0, device_backward_ms: Optional[float] = None) -> None:
        super().__init__()
        self.device_ms, self.device_backward_ms = device_ms, device_backward_ms
        self.ln = nn.LayerNorm(d_model)
        self.out = nn.Linear(d_model, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return emulated_compute(self.out(self.ln(x)), self.device_ms, backward_ms_per_sample=self.device_backward_ms)


class GPT(pl.LightningModule):
    """GPT-style byte-level language model whose layers are one ``nn.Sequential`` (embedding, blocks, head).

    Args:
        n_blocks: Transformer blocks (>= 1).
        d_model: Width.
        n_heads: Attention heads (must divide ``d_model``).
        seq_len: Longest sequence (position embeddings).
        lr: AdamW learning rate.
        weight_decay: AdamW weight decay.
        device_ms_per_sample: Emulated accelerator (:mod:`lightning_parcae.testing.emulated_device`): each block's
            forward also takes this many modelled milliseconds per sample (backward twice as long; the embedding a
            quarter, the head half of a block's). 0 (default): the real CPU compute only. Used with
            ``parcae run --emulated-devices`` so that one small machine behaves like instances with an
            accelerator each.
        emulate: An emulated cluster faithful to a profiled workload (:mod:`lightning_parcae.testing.emulated_cluster`):
            ``"gpt-1.5b"`` (the Parcae artifact's GPT-1.5B on p3.2xlarge) or a workload JSON file. The embedding,
            the ``n_blocks`` blocks and the head model the profile's embedding, its middle layers (grouped
            contiguously when ``n_blocks`` is smaller than the profile's, one to one when equal) and its head:
            each sleeps its layers' profiled forward and backward milliseconds per sample divided by
            ``time_scale``, and every state transfer of a migration, pipeline message and data-parallel all-reduce
            also sleeps the modelled 10 Gbps time of the real model's bytes (installed in :meth:`setup`). Excludes
            ``device_ms_per_sample``. None (default): no profile.
        time_scale: Divides every modelled duration of ``emulate`` (30: a 3 s modelled step runs in 0.1 s).
        state_gbps: With ``emulate``: the modelled bandwidth, in Gbit/s, of a migration's state transfers only
            (pipeline messages and all-reduces keep the workload's 10 Gbps). None (default): the same 10 Gbps. A
            lower value emulates stages that are costly to move (``benchmarks/bench_replay.py --state-gbps``).
    """

    def __init__(self, n_blocks: int = 8, d_model: int = 64, n_heads: int = 4, seq_len: int = 64,
                 lr: float = 3e-3, weight_decay: float = 0.01, device_ms_per_sample: float = 0.0,
                 emulate: Optional[str] = None, time_scale: float = 30.0,
                 state_gbps: Optional[float] = None) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model={d_model} must be a multiple of n_heads={n_heads}")
        if device_ms_per_sample < 0:
            raise ValueError(f"device_ms_per_sample={device_ms_per_sample} must be >= 0 (0 turns the emulated "
                             "accelerator off)")
        if emulate is not None and device_ms_per_sample > 0:
            raise ValueError(f"emulate={emulate!r} and device_ms_per_sample={device_ms_per_sample} both set the "
                             "emulated compute time: give one of them (emulate takes per-layer times from a profile)")
        if state_gbps is not None and (emulate is None or not state_gbps > 0):
            raise ValueError(f"state_gbps={state_gbps} needs emulate (a profiled workload whose migrations it "
                             "slows) and a value > 0 in Gbit/s, e.g. 0.25")
        self.save_hyperparameters()
        ms = float(device_ms_per_sample)
        fwd: list[float] = [0.25 * ms] + [ms] * n_blocks + [0.5 * ms]
        bwd: list[Optional[float]] = [None] * (n_blocks + 2)  # backward_factor (2x) of emulated_compute
        self.workload: Optional[EmulatedWorkload] = None
        if emulate is not None:
            link = {} if state_gbps is None else {"state_bandwidth_bytes_per_s": state_gbps * 1.25e8}
            self.workload = EmulatedWorkload.named(emulate, time_scale=time_scale, **link).coarsened(n_blocks)
            fwd = [self.workload.forward_ms_per_sample(i) for i in range(n_blocks + 2)]
            bwd = [self.workload.backward_ms_per_sample(i) for i in range(n_blocks + 2)]
        self.layers = nn.Sequential(Embed(d_model, seq_len, fwd[0], bwd[0]),
                                    *[Block(d_model, n_heads, fwd[1 + i], bwd[1 + i]) for i in range(n_blocks)],
                                    Head(d_model, fwd[-1], bwd[-1]))
        self.val_ppl = Perplexity()

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.layers(idx)

    def install_link(self) -> None:
        """With ``emulate``: every state transfer, pipeline message and gradient all-reduce of this process also
        takes the workload's modelled network time from now on (without: nothing). Idempotent.

        Called by :meth:`setup` and, earlier, by ``train.py`` before ``fit``. Regression (issue 21, stop 50): a
        standby is admitted -- and receives its stage -- while the strategy sets up its environment, before
        Lightning calls ``setup``, so a joiner received whole stages over no modelled link: in the 0.25 Gbps
        GPT-1.5B replays its three layers arrived in 0.43 s where the link takes 23.6 s, while its senders paid for
        theirs, and the leader's fit of the migration constants came out flat (a 15.5 s latency, 659 kB/s)."""
        if self.workload is not None:
            install_modelled_link(self.workload)

    def setup(self, stage: str) -> None:
        """Install the modelled link (:meth:`install_link`; a no-op when ``train.py`` already did)."""
        self.install_link()

    def teardown(self, stage: str) -> None:
        """Remove the modelled link installed by :meth:`setup`."""
        if self.workload is not None:
            install_modelled_link(None)

    def held_layers(self) -> list[int]:
        """Indices of the layers this process holds under the current layout (all of them before one exists)."""
        try:
            strategy = self.trainer.strategy
        except RuntimeError:  # not attached to a Trainer
            strategy = None
        partition = list(getattr(strategy, "partition", None) or [])
        groups = getattr(strategy, "groups", None)
        if not partition or groups is None or sum(partition) != len(self.layers):
            return list(range(len(self.layers)))
        stage = groups.coords.stage
        start = sum(partition[:stage])
        return list(range(start, start + partition[stage]))

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        """With ``emulate``: a restore also takes the modelled time to read this process's layers' state.

        Every process reads its own stage in parallel, so each sleeps for its layers at the workload's checkpoint
        read bandwidth. Writes are not charged: the runtime writes checkpoints in the background, off the critical
        path of a step (what a restart pays is the read). A joiner's restore from live peers
        (:data:`~lightning_parcae.runtime.elastic.LIVE_CHECKPOINT`) reads no checkpoint: its state came over the
        modelled link, already charged.
        """
        if self.workload is None:
            return
        try:
            path = self.trainer.ckpt_path
        except RuntimeError:  # not attached to a Trainer
            path = None
        if str(path) != LIVE_CHECKPOINT:
            time.sleep(self.workload.checkpoint_read_s(self.held_layers()))

    def _logits_targets(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self(batch[:, :-1]), batch[:, 1:]

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        logits, y = self._logits_targets(batch)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int) -> None:
        logits, y = self._logits_targets(batch)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.val_ppl(logits, y)
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_ppl", self.val_ppl)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)

    def training_memory_bytes(self, optimizer_state_factor: float = 2.0) -> int:
        """Parameters + gradients + optimizer state of the whole model (what one instance would hold at P = 1)."""
        n = sum(p.numel() * p.element_size() for p in self.parameters())
        return int(n * (2 + optimizer_state_factor))


def count_params(model: nn.Module) -> int:
    """Number of parameters."""
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":  # pragma: no cover -- a quick size check
    m = GPT()
    print(f"{count_params(m):,} parameters, {m.training_memory_bytes() / 2**20:.1f} MiB with Adam state; "
          f"{len(m.layers)} layers; loss at init ~{math.log(VOCAB):.2f}")
