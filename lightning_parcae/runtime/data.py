"""Global-order batches with a sample cursor: every replica gets its share of the batch a single process would see.

Problem: the result of a D x P run must equal a single-process run with the same DataLoader, and a later change of
D must re-shard the data without repeating or skipping samples. Lightning's ``DistributedSampler`` gives rank ``r``
every D-th sample of its own permutation, which matches neither the single-process order (it ignores the user's
sampler and its generator) nor survives a change of D mid-epoch. Instead, the user's DataLoader is read as
defining the *global* order and the *global* batch: step ``s`` of an epoch consumes global samples
``[cursor + s*B, cursor + (s+1)*B)`` of the order the user's sampler yields for that epoch, and replica ``r`` of D
gets the slice ``[r*B/D, (r+1)*B/D)`` of it. The cursor (samples consumed in the current epoch) is all the state
needed to resume, at any D.

Randomness: the user's sampler is iterated once per epoch on every rank, exactly as the single-process DataLoader
would; orders agree across ranks when the sampler is deterministic (``shuffle=False``) or draws from a seeded
``generator``. A checkpoint keeps the generator's state from just before the current epoch's order was drawn, so
a resumed run draws the same order; without it the sampler is advanced through the ``e`` earlier epochs.

Streams (an ``IterableDataset``: a generator, LitData's ``StreamingDataset``, webdataset, Hugging Face streaming):
there is no index to slice by, so *every pipeline reads the whole global stream* and keeps its rows of each global
batch (:class:`GlobalStream`). The contract, documented in docs/strategy.md: the stream yields the same samples in
the same order on every process (as it would in one process), and the DataLoader's ``batch_size`` is the global
batch. Each global batch is handed out whole and cut per pipeline when a step uses it (:func:`rows_of`), so a
change of D between loading and use needs no re-read; the position (samples of the epoch's stream consumed) is the
cursor, and a resumed run, a joiner or a relaunch re-reads the epoch's stream and skips what was consumed -- exact
for any deterministic stream, at the cost of reading the skipped part again.
"""

from __future__ import annotations

import itertools
import warnings
from collections import deque
from collections.abc import Iterator
from typing import Any, Optional, Union

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from lightning_parcae.errors import BatchSplitError, ConfigurationError
from lightning_parcae.planning.costmodel import batch_splits
from lightning_parcae.runtime.pipeline import batch_size_of, split_micro_batches

__all__ = ["GlobalBatchSampler", "GlobalStream", "global_batch_size", "reshard_dataloader", "rows_of"]



class _GlobalSlices:
    """What :class:`GlobalBatchSampler` and :class:`GlobalStream` share: D, this pipeline's index, the split unit,
    the epoch Lightning selects and how a global batch is cut per pipeline."""

    replicas: int
    replica: int
    unit: int
    epoch: int

    def reshard(self, replicas: int, replica: int, unit: int) -> None:
        """Change D and this pipeline's index (live reconfiguration); batches from now on use the new slice.

        Batches already drawn (prefetched by Lightning or DataLoader workers) keep the slice of the D they were
        drawn for; their records let the strategy re-slice them (:meth:`slice_of`).
        """
        self.replicas, self.replica, self.unit = replicas, replica, unit

    def slice_of(self, chunk: list[int], replicas: int, replica: int) -> list[int]:
        """Pipeline ``replica``'s part of a training global batch ``chunk`` split over ``replicas``."""
        per = len(chunk) // replicas
        return chunk[replica * per : (replica + 1) * per]

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch the next iteration reads (called by Lightning)."""
        self.epoch = epoch


class GlobalBatchSampler(_GlobalSlices, Sampler[list[int]]):
    """Yields replica ``replica``'s slice of each global batch of the base sampler's order.

    Args:
        base: the user's sampler (defines the global order of one epoch).
        global_batch: B, samples per global batch (the user's ``batch_size``).
        replicas: D.
        replica: this pipeline's index.
        unit: training batches must split into multiples of this (``D * M``); a trailing partial global batch that
            does not is dropped (with a warning) when ``train`` is set.
        drop_last: drop a trailing partial global batch (as the user's DataLoader would).
        train: training (partial batches must split exactly) or evaluation (near-equal split, may be empty).
        fixed_epoch: training under live reconfiguration: a trailing partial global batch is always dropped, so
            that an epoch has the same number of steps at every D. (Whether ``n`` samples split into ``D x M``
            depends on D; members that sized or drew the epoch at different D -- a joiner admitted into D = 3 while
            the others started the epoch at D = 2 -- would otherwise disagree on where the epoch ends and issue
            mismatched collectives.)
    """

    def __init__(
        self,
        base: Sampler[Any],
        global_batch: int,
        replicas: int,
        replica: int,
        unit: int,
        drop_last: bool,
        train: bool,
        fixed_epoch: bool = False,
    ) -> None:
        self.base = base
        self.global_batch = global_batch
        self.replicas = replicas
        self.replica = replica
        self.unit = unit
        self.drop_last = drop_last
        self.train = train
        self.fixed_epoch = fixed_epoch and train
        self.epoch = 0
        self.cursor = 0
        self._drawn = 0
        self._warned = False
        self._resume: Optional[tuple[int, Optional[torch.Tensor]]] = None
        self._rng_state: Optional[torch.Tensor] = None
        self.loader_generator: Optional[torch.Generator] = None
        """The DataLoader's generator (it draws one seed from it per iterator); set by :func:`reshard_dataloader`."""
        self.records: deque[tuple[int, int, list[int]]] = deque()
        self.sampler = self  # so that Lightning's _set_sampler_epoch finds set_epoch

    def start_at(self, epoch: int, cursor: int, rng_state: Optional[torch.Tensor] = None,
                 rng_now: Optional[torch.Tensor] = None) -> None:
        """Resume: the next iteration of ``epoch`` starts at global sample ``cursor``.

        Args:
            epoch: the epoch to resume in.
            cursor: global samples of that epoch already consumed.
            rng_state: the base sampler generator's state right before it drew ``epoch``'s order (from
                :attr:`rng_state`); restores the exact order of a shuffled loader.
            rng_now: the generator's state when the checkpoint was taken (:attr:`rng_now`). The generator is put
                back to it after ``epoch``'s order is redrawn, so the next epochs draw what the saving process
                draws -- also the DataLoader's per-iteration seed, which comes from the same generator. When
                Lightning resumes straight into the next epoch (a checkpoint taken at an epoch's last step), the
                generator is set to it plus that epoch's one seed draw (a joiner admitted at an epoch's end once
                trained on an order of its own: samples repeated, others skipped).
        """
        self.epoch, self.cursor = epoch, cursor
        self._resume = (epoch, rng_state, rng_now)

    def _generator(self) -> Optional[torch.Generator]:
        gen = getattr(self.base, "generator", None)
        return gen if isinstance(gen, torch.Generator) else None

    @property
    def rng_now(self) -> Optional[torch.Tensor]:
        """The base sampler generator's current state (``None`` without a generator)."""
        gen = self._generator()
        return gen.get_state() if gen is not None else None

    @property
    def rng_state(self) -> Optional[torch.Tensor]:
        """State of the base sampler's generator before the current epoch's order was drawn (``None`` if none)."""
        return self._rng_state

    def _draw(self) -> list[int]:
        # Take exactly len(base) indices without exhausting the iterator: Lightning stops a sized loader after its
        # last batch, so a single-process run never triggers the sampler's end-of-iteration work (RandomSampler
        # draws one more permutation from its generator there).
        self._drawn += 1
        return list(itertools.islice(iter(self.base), len(self.base)))  # type: ignore[arg-type]

    def _order(self) -> list[int]:
        gen = self._generator()
        resume, self._resume = self._resume, None
        if resume is not None and resume[0] < self.epoch:
            self.cursor = 0  # the resumed epoch was complete: the next one starts at its first sample
        if resume is not None and resume[0] == self.epoch and resume[1] is not None and gen is not None:
            gen.set_state(resume[1])
            self._drawn = self.epoch
            if resume[2] is not None:
                self._rng_state = gen.get_state()
                order = self._draw()
                gen.set_state(resume[2])  # where the saving process's generator was: the next epochs agree
                return order
        elif resume is not None and resume[0] < self.epoch and resume[2] is not None and gen is not None:
            gen.set_state(resume[2])  # the saved epoch was complete: continue from the saving process's state ...
            if self.loader_generator is gen:  # ... plus this epoch's DataLoader-iterator seed, as it will draw
                torch.empty((), dtype=torch.int64).random_(generator=gen)
            self._drawn = resume[0] + 1
        while self._drawn < self.epoch:  # fast-forward a resumed run through the epochs it did not see
            self._draw()
        self._rng_state = gen.get_state() if gen is not None else None
        return self._draw()

    def _slice(self, chunk: list[int]) -> Optional[list[int]]:
        n = len(chunk)
        if n == self.global_batch or (self.train and not self.fixed_epoch and n % self.unit == 0):
            per = n // self.replicas
            return chunk[self.replica * per : (self.replica + 1) * per]
        if self.train:
            if not self._warned:
                why = ("under live reconfiguration an epoch has the same number of steps at every D; make the "
                       "dataset a multiple of the global batch to use every sample" if self.fixed_epoch else
                       f"it does not split into {self.replicas} pipelines x micro-batches (multiple of {self.unit} "
                       "needed)")
                warnings.warn(f"dropping the last partial global batch of {n} samples: {why}", stacklevel=2)
                self._warned = True
            return None
        base, extra = divmod(n, self.replicas)
        start = self.replica * base + min(self.replica, extra)
        part = chunk[start : start + base + (1 if self.replica < extra else 0)]
        return part or None

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        start, self.cursor = self.cursor, 0
        self.records.clear()
        for a in range(start, len(order), self.global_batch):
            chunk = order[a : a + self.global_batch]
            if len(chunk) < self.global_batch and self.drop_last:
                return
            part = self._slice(chunk)
            if part is not None:
                # (D, replica, global batch) of every batch handed out, consumed in order by the strategy
                self.records.append((self.replicas, self.replica, chunk))
                yield part

    def __len__(self) -> int:
        n = len(self.base)  # type: ignore[arg-type]
        full, rest = divmod(n, self.global_batch)
        if rest and not self.drop_last:
            if self.train:
                full += 1 if rest % self.unit == 0 and not self.fixed_epoch else 0
            else:
                full += 1 if self.replica < rest else 0 if rest < self.replicas else 1
        return full


class GlobalStream(_GlobalSlices):
    """The training loader over a stream: yields every global batch whole, records it for the strategy.

    Every pipeline iterates the user's DataLoader (an ``IterableDataset``) completely; :attr:`records` holds, for
    each batch handed out, ``(D, replica, positions)`` -- the positions being the batch's sample numbers in the
    epoch's stream -- which the strategy consumes in order and cuts this pipeline's rows from (:func:`rows_of`).
    It offers :class:`GlobalBatchSampler`'s interface (``records``, :meth:`slice_of`, :meth:`reshard`,
    :meth:`set_epoch`, :meth:`start_at`, ``rng_state``/``rng_now``), so the data path treats both alike; a stream's
    batches are cut when a step uses them, so a reshard leaves nothing loaded stale.

    Args:
        loader: the user's DataLoader over an IterableDataset; its ``batch_size`` is B.
        global_batch: B.
        replicas: D.
        replica: this pipeline's index.
        unit: a trailing partial batch must split into multiples of this (``D * M``), else it is dropped.
        fixed_epoch: live reconfiguration: a trailing partial batch is always dropped (see
            :class:`GlobalBatchSampler`).
    """

    rng_state: Optional[torch.Tensor] = None
    rng_now: Optional[torch.Tensor] = None

    def __init__(self, loader: DataLoader, global_batch: int, replicas: int, replica: int, unit: int,
                 fixed_epoch: bool) -> None:
        self.loader = loader
        self.dataset = loader.dataset
        self.collate_fn = loader.collate_fn
        self.global_batch = global_batch
        self.replicas, self.replica, self.unit = replicas, replica, unit
        self.fixed_epoch = fixed_epoch
        self.epoch = 0
        self.cursor = 0
        self.records: deque[tuple[int, int, list[int]]] = deque()
        self.sampler = self  # so that Lightning's _set_sampler_epoch finds set_epoch
        self._resume: Optional[int] = None
        self._warned = False

    def start_at(self, epoch: int, cursor: int, rng_state: Optional[torch.Tensor] = None,
                 rng_now: Optional[torch.Tensor] = None) -> None:
        """Resume: the next iteration of ``epoch`` skips the first ``cursor`` samples of the stream."""
        self.epoch, self.cursor = epoch, cursor
        self._resume = epoch

    def __iter__(self) -> Iterator[Any]:
        resume, self._resume = self._resume, None
        skip = self.cursor if resume is not None and resume == self.epoch else 0
        self.cursor = 0
        self.records.clear()
        pos = 0
        # a sized stream stops after its last batch without being exhausted, as Lightning stops it in one process
        # (LitData's StreamingDataset draws the next epoch's shuffle when exhausted)
        batches = itertools.islice(self.loader, len(self)) if self.sized else iter(self.loader)
        for batch in batches:
            n = batch_size_of(batch) or 1
            if pos < skip:  # consumed before the checkpoint / the join: read again, not trained again
                pos += n
                continue
            if n != self.global_batch and (self.fixed_epoch or n % self.unit):
                if not self._warned:
                    warnings.warn(f"dropping a partial global batch of {n} samples from the stream (the global batch "
                                  f"is {self.global_batch}); give the DataLoader drop_last=True", stacklevel=2)
                    self._warned = True
                return
            self.records.append((self.replicas, self.replica, list(range(pos, pos + n))))
            pos += n
            yield batch

    @property
    def sized(self) -> bool:
        """Whether the user's loader has a length (a stream that knows its size, e.g. LitData's)."""
        try:
            len(self.loader)
        except (TypeError, NotImplementedError):
            return False
        return True

    def __len__(self) -> int:
        """Batches of an epoch, if the stream is sized (else TypeError: Lightning counts until it ends)."""
        n = len(self.loader)
        if self.loader.drop_last:
            return n
        try:
            full, rest = divmod(len(self.dataset), self.global_batch)  # type: ignore[arg-type]
        except (TypeError, NotImplementedError):
            return n
        return full + (1 if rest and not self.fixed_epoch and rest % self.unit == 0 else 0)


def rows_of(batch: Any, replicas: int, replica: int) -> Any:
    """Pipeline ``replica``'s rows of a whole global ``batch`` split into ``replicas`` equal parts (dim 0)."""
    return batch if replicas == 1 else split_micro_batches(batch, replicas)[replica]


def global_batch_size(loader: DataLoader) -> int:
    """The global batch B a DataLoader defines (its ``batch_size``).

    Raises:
        ConfigurationError: for loaders without a plain batch size (custom batch samplers, a stream that yields
            its own batches).
    """
    if isinstance(loader.dataset, IterableDataset) and loader.batch_size is None:
        raise ConfigurationError(
            "ParcaeStrategy needs the DataLoader's batch_size to know the global batch of a stream (got an "
            "IterableDataset with batch_size=None, i.e. one that yields its own batches); let the DataLoader batch "
            "the stream: DataLoader(dataset, batch_size=B)"
        )
    if loader.batch_size is not None:
        return int(loader.batch_size)
    bs = loader.batch_sampler
    if isinstance(bs, BatchSampler):
        return int(bs.batch_size)
    raise ConfigurationError(
        f"cannot tell the global batch size of a DataLoader with batch_sampler {type(bs).__name__}; "
        "give the DataLoader a batch_size"
    )


def reshard_dataloader(
    loader: DataLoader, replicas: int, replica: int, micro_batches: int, train: bool, fixed_epoch: bool = False
) -> tuple[Any, Optional[Union[GlobalBatchSampler, "GlobalStream"]]]:
    """Rebuild ``loader`` so that it yields this replica's share of each global batch.

    Args:
        loader: the user's DataLoader; its ``batch_size`` is the global batch B.
        replicas: D.
        replica: this pipeline's index.
        micro_batches: M (training batches of B / D samples must split into M).
        train: whether this is the training loader.
        fixed_epoch: live reconfiguration: drop a trailing partial global batch at any D (see
            :class:`GlobalBatchSampler`).

    Returns:
        The new loader and its :class:`GlobalBatchSampler` (keep it to set the cursor on resume). A stream (an
        ``IterableDataset``): for training a :class:`GlobalStream` as both; for evaluation the loader itself and
        ``None`` (every pipeline evaluates the whole stream).

    Raises:
        BatchSplitError: (training) if B is not divisible by D, or B / D not by M. An evaluation loader whose B
            does not split over D is given whole to every pipeline (with a warning).
    """
    b = global_batch_size(loader)
    stream = isinstance(loader.dataset, IterableDataset)
    if stream and not train:
        return loader, None  # every pipeline evaluates the whole stream (the same result, D x the work)
    if not train and not batch_splits(b, replicas):
        # Regression (chaos seed 1005): a job with a training batch of 120 moved to D = 5 and died at the next
        # validation, whose batch of 12 does not split over 5 pipelines. The shape is chosen for training; an
        # evaluation batch that does not split is evaluated whole by every pipeline (identical results, D x the work).
        warnings.warn(
            f"evaluation batch size {b} does not split over D={replicas} pipelines: every pipeline evaluates the whole "
            f"batch (the same result, {replicas}x the work); give evaluation loaders a batch_size divisible by the D "
            "values your job can take",
            stacklevel=2,
        )
        replicas, replica = 1, 0
    if not batch_splits(b, replicas):
        raise BatchSplitError(
            f"global batch size {b} cannot be split evenly over D={replicas} pipelines; use a batch_size divisible "
            f"by {replicas}"
        )
    if train and not batch_splits(b, replicas, micro_batches):
        raise BatchSplitError(
            f"global batch size {b} over D={replicas} pipelines gives {b // replicas} samples per pipeline, which "
            f"cannot be split into micro_batches={micro_batches}; the global batch must be a multiple of "
            f"D x M = {replicas * micro_batches}"
        )
    if stream:
        global_stream = GlobalStream(loader, b, replicas, replica, replicas * micro_batches, fixed_epoch)
        return global_stream, global_stream
    drop_last = bool(getattr(loader, "drop_last", False))
    sampler = GlobalBatchSampler(
        loader.sampler, b, replicas, replica, replicas * micro_batches, drop_last, train, fixed_epoch
    )
    sampler.loader_generator = loader.generator
    kwargs: dict[str, Any] = dict(
        batch_sampler=sampler,
        num_workers=loader.num_workers,
        collate_fn=loader.collate_fn,
        pin_memory=loader.pin_memory,
        timeout=loader.timeout,
        worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context,
        generator=loader.generator,
        persistent_workers=loader.persistent_workers,
    )
    if loader.num_workers > 0:
        kwargs["prefetch_factor"] = loader.prefetch_factor
    return DataLoader(loader.dataset, **kwargs), sampler
