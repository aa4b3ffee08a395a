"""The data path: every pipeline reads its slice of one global batch order, at any shape, resumable mid-epoch.

Problem: a D x P job must train on exactly the batches a single process would see -- the same global batch B, in
the same order -- while D changes under it, a step (under gradient accumulation: every micro-step of its window)
may be re-run after a lost peer, and a checkpoint must resume mid-epoch. Lightning injects its own distributed sampler and prefetches batches sliced for the shape at load
time. This part replaces Lightning's sampler injection (every loader is read in global order and sliced per
pipeline by :func:`~lightning_parcae.runtime.data.reshard_dataloader`), keeps the sample cursor (epoch, samples
consumed, sampler RNG) for checkpoints, and re-cuts a batch that was sliced for a previous D.

Accumulation windows (live reconfiguration): with ``accumulate_grad_batches = k`` one optimizer step consumes k
global batches, and a lost peer anywhere in them discards the whole window. The data path remembers the window's
batch records (global indices) and the cursor at its start, so the elastic hooks can rewind to the start and
replay every micro-step of the window, re-cut for the recovered D (:meth:`DataPath.restart_window`,
:meth:`DataPath.replay_next`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from lightning_parcae.runtime.data import GlobalBatchSampler, GlobalStream, global_batch_size, reshard_dataloader, rows_of
from lightning_parcae.training.lightning_internals import (
    prepare_dataloader,
    replace_prepare_dataloader,
    restore_prepare_dataloader,
    whole_stream_for_every_process,
)
from lightning_parcae.training.stage_state import StageState

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["DataPath", "BatchRecord"]

BatchRecord = tuple[int, int, list[int]]  # (D, replica) the batch was sliced for, and the global batch's indices

_TRAINING, _PREDICTING = "train", "predict"  # RunningStage values (both namespaces)


class DataPath:
    """Resharded loaders, the sample cursor and stale-batch re-cuts for one strategy (see the module docstring).

    Args:
        state: The stage state (read only: this generation's groups give D and the replica).
        micro_batches: M, micro-batches per pipeline batch.
        elastic: Live reconfiguration on (every member must agree on where an epoch ends).
        to_device: Moves a re-cut batch to this process's device (the strategy's ``batch_to_device``).

    Attributes:
        global_batch: B, once the training loader is known.
        resume: The cursor read from a checkpoint (epoch, cursor, rng, rng_now), applied to the next train loader.
        window: The batch records (D, replica, global indices) of the optimizer step being accumulated (emptied by
            :meth:`close_window` once the step is applied).
        window_indices: Global sample indices this pipeline trained on in that window (kept until the next window
            opens: :attr:`last_step_indices`).
    """

    def __init__(self, state: StageState, micro_batches: int, elastic: bool, to_device: Callable[[Any], Any]) -> None:
        self.stage = state
        self.micro_batches = micro_batches
        self.elastic = elastic
        self.to_device = to_device
        self.prepare_patch: Optional[Callable[..., Any]] = None  # Lightning's own _prepare_dataloader
        self.train_sampler: Optional[Union[GlobalBatchSampler, GlobalStream]] = None
        self.train_loader: Optional[Any] = None
        self.global_batch: Optional[int] = None
        self.cursor_epoch = -1
        self.cursor = 0
        self.resume: Optional[dict[str, Any]] = None
        self.step_batch: Optional[BatchRecord] = None  # (D, replica, global batch) of this step
        self.window: list[BatchRecord] = []
        self.window_indices: list[int] = []
        self.window_batches: dict[int, Any] = {}  # a stream's whole global batches of this window, by position
        self.window_start: tuple[int, int] = (-1, 0)
        self.replay: Optional[tuple[BatchRecord, bool]] = None  # the next batch's record; whether it is the batch given
        # called with (trainer, B) before a training loader is sliced: the strategy changes a shape whose D cannot
        # split B (a first generation seated before B was known) instead of failing
        self.before_split: Optional[Callable[[Any, int], None]] = None

    def sampler_kwargs(self) -> dict[str, Any]:
        """All stages of a pipeline read the same shard: replicas = D, rank = pipeline index (used for predict)."""
        groups = self.stage.groups
        if groups is None:
            return {"num_replicas": 1, "rank": 0}
        return {"num_replicas": groups.data_parallel, "rank": groups.coords.replica}

    def install(self, trainer: "pl.Trainer") -> None:
        """Replace Lightning's sampler injection: every loader is read in global order and sliced per pipeline."""
        if self.prepare_patch is None:
            self.prepare_patch = prepare_dataloader(trainer)
        original = self.prepare_patch
        s = self.stage

        def prepare(dataloader: object, shuffle: bool, mode: Any) -> object:
            from torch.utils.data import DataLoader  # noqa: PLC0415

            if mode == _PREDICTING or not isinstance(dataloader, DataLoader):
                return original(dataloader, shuffle, mode)
            assert s.groups is not None
            train = mode == _TRAINING
            whole_stream_for_every_process(dataloader.dataset)  # a LitData stream: not pre-sharded per rank
            if train and self.before_split is not None:
                self.before_split(trainer, global_batch_size(dataloader))
            loader, sampler = reshard_dataloader(
                dataloader, s.groups.data_parallel, s.groups.coords.replica, self.micro_batches, train,
                fixed_epoch=self.elastic,  # every member, joiner or not, must agree on where an epoch ends
            )
            if train:
                self.train_sampler = sampler
                self.train_loader = loader
                self.global_batch = sampler.global_batch
                if self.resume is not None:
                    sampler.start_at(self.resume["epoch"], self.resume["cursor"],
                                     self.resume.get("rng"), self.resume.get("rng_now"))
            return loader

        replace_prepare_dataloader(trainer, prepare)

    def uninstall(self, trainer: Any) -> None:
        """Give the trainer its own sampler injection back."""
        if trainer is not None and self.prepare_patch is not None:
            restore_prepare_dataloader(trainer)
            self.prepare_patch = None

    def reshard(self, data_parallel: int, replica: int) -> None:
        """Slice the training batches that are still to come for a new D (and this process's replica)."""
        if self.train_sampler is not None:
            self.train_sampler.reshard(data_parallel, replica, data_parallel * self.micro_batches)

    def count_samples(self, epoch: int) -> None:
        """Advance the cursor by one global batch of epoch ``epoch`` (the Trainer's current epoch; a new epoch
        restarts the cursor, or resumes the checkpoint's)."""
        if epoch != self.cursor_epoch:
            self.cursor_epoch = epoch
            resume = self.resume
            self.cursor = resume["cursor"] if resume and resume["epoch"] == epoch else 0
        self.cursor += self.global_batch or 0

    def cursor_mark(self) -> tuple[int, int]:
        """``(epoch, cursor)`` now, to :meth:`rewind` to if the step about to run is discarded."""
        return self.cursor_epoch, self.cursor

    def rewind(self, mark: tuple[int, int]) -> None:
        """Put the cursor back to ``mark`` (a :meth:`cursor_mark`): the step after it was discarded."""
        self.cursor_epoch, self.cursor = mark

    @property
    def last_step_indices(self) -> list[int]:
        """Global sample indices this pipeline trained on in the last optimizer step (its window, as last run)."""
        return self.window_indices

    def rerun_next_step(self) -> None:
        """The next step re-runs the discarded one: :meth:`effective_batch` hands it the batch that step began with."""
        if self.step_batch is not None:
            self.replay = (self.step_batch, True)

    @property
    def rerun_step(self) -> bool:
        """Whether the next step re-runs a discarded one (or replays a micro-step of a discarded window)."""
        return self.replay is not None

    def restart_window(self) -> list["BatchRecord"]:
        """The optimizer step being accumulated was discarded: rewind the cursor to the start of its window and
        return the window's batch records (the caller replays all but the last with :meth:`replay_next` and re-runs
        the last with the batch Lightning gives it)."""
        records, self.window = self.window, []
        self.rewind(self.window_start)
        return records

    def replay_next(self, record: "BatchRecord", given: bool) -> None:
        """The next :meth:`effective_batch` is the batch of ``record``; ``given``: the batch passed to it is that
        record's own (re-cut only if the shape changed), otherwise it is rebuilt from the dataset."""
        self.replay = (record, given)

    def close_window(self) -> None:
        """The accumulated optimizer step was applied: the next batch opens a new window."""
        self.window = []
        self.window_batches = {}

    def resume_from(self, saved: dict[str, Any]) -> None:
        """Resume the sample cursor of a checkpoint (its ``"data"`` record) at the next training loader."""
        self.resume = {"epoch": int(saved["epoch"]), "cursor": int(saved["cursor"]),
                       "rng": saved.get("rng"), "rng_now": saved.get("rng_now")}

    def state(self) -> dict[str, Any]:
        """The sample cursor: epoch, samples of that epoch consumed, global batch size, sampler RNG state."""
        state: dict[str, Any] = {"epoch": max(self.cursor_epoch, 0), "cursor": self.cursor,
                                 "global_batch": self.global_batch or 0}
        rng = self.train_sampler.rng_state if self.train_sampler is not None else None
        if rng is not None:
            state["rng"] = rng
        now = self.train_sampler.rng_now if self.train_sampler is not None else None
        if now is not None:
            state["rng_now"] = now
        return state

    def effective_batch(self, batch: Any) -> Any:
        """This pipeline's slice of the current global batch -- re-cut if the shape changed after it was loaded.

        Lightning prefetches the next batch (and DataLoader workers prefetch more), so a batch may have been sliced
        for the previous D. The sampler recorded each batch's global indices; a stale slice is rebuilt here from the
        dataset with the loader's ``collate_fn``. A step re-run after a failure reuses the batch it started with.
        """
        sampler = self.train_sampler
        g = self.stage.groups
        if sampler is None or g is None:
            return batch
        if self.replay is not None:
            record, given = self.replay  # a re-run after a failure: the same global batch
            self.replay = None
        elif sampler.records:
            record, given = sampler.records.popleft(), True
            self.step_batch = record
        else:
            return batch
        if not self.window:
            self.window_start = self.cursor_mark()
            self.window_indices = []
        self.window.append(record)
        d, replica, chunk = record
        indices = sampler.slice_of(chunk, g.data_parallel, g.coords.replica)
        self.window_indices.extend(indices)
        if isinstance(sampler, GlobalStream):
            # a stream's batches arrive whole: keep the window's (a replay has no dataset to re-read) and cut rows
            if given:
                self.window_batches[chunk[0]] = batch
            return rows_of(self.window_batches[chunk[0]], g.data_parallel, g.coords.replica)
        if given and (d, replica) == (g.data_parallel, g.coords.replica):
            return batch
        loader = self.train_loader
        assert loader is not None
        fresh = loader.collate_fn([loader.dataset[i] for i in indices])
        return self.to_device(fresh)
