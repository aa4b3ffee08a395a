"""The worker side of ``parcae run``: periodic checkpoints, graceful stop on a notice, and progress events.

Problem: ``parcae run`` changes the membership in place (live reconfiguration, :mod:`lightning_parcae.runtime.elastic`),
but when a stage loses every replica -- or under ``--restart-fallback`` -- it stops the whole group and relaunches it
from a checkpoint, the way torchrun does. For that to lose little work, the training script must (1) checkpoint regularly, (2) on a preemption notice (SIGTERM)
stop at one step that *every* rank agrees on and write a checkpoint there, and (3) resume from that checkpoint
when relaunched. The launcher also needs to see progress (step, samples/s, D x P) to show it live and to measure
the time each restart costs. Lightning's own SIGTERM handling is no help here: it broadcasts inside the signal
handler (which can deadlock against a collective in flight) and then raises ``SIGTERMException`` without saving.

Solution: :class:`ParcaeRunCallback` (active only when ``PARCAE_RUN_DIR`` is set, i.e. under ``parcae run``)

* checks the job token against the launcher's store once (a worker with a wrong token exits with a clear message);
* replaces the SIGTERM handler with one that only sets a flag, and at every batch end runs one tiny all-reduce
  ("has any rank been told to stop?") so that all ranks stop after the same step;
* saves ``trainer.save_checkpoint(run_dir/ckpt/last.ckpt)`` (atomic; layout-independent, so it resumes at any
  D x P) every ``every_n_steps`` steps and at the agreed stop step -- or, when the launcher names a checkpoint
  directory (``--checkpoint-dir``: a shared mount or ``s3://``/``gs://``/``az://``), a new complete checkpoint
  there (:mod:`lightning_parcae.runtime.checkpoint_store`), so it outlives the instance that wrote it;
* appends JSON-lines events (``start`` / ``progress`` / ``checkpoint`` / ``stop`` / ``end``) to
  ``run_dir/events.jsonl`` from global rank 0.

:func:`resume_path` returns the checkpoint the launcher wants the script to resume from (``PARCAE_RESUME_CKPT``),
or None. Both are optional overrides: under the launcher ``ParcaeStrategy`` adds a ``ParcaeRunCallback()`` when the
script has none and resumes from ``PARCAE_RESUME_CKPT`` when ``fit`` gets no ``ckpt_path``. Explicitly::

    trainer = pl.Trainer(..., callbacks=[ParcaeRunCallback(every_n_steps=200)])
    trainer.fit(model, data, ckpt_path=resume_path())

The callback classes exist once per Lightning namespace (:func:`callback_class`); ``ParcaeRunCallback`` here is the
``pytorch_lightning`` one, :mod:`lightning_parcae.lightning` exports the ``lightning.pytorch`` ones.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Optional

from lightning_parcae.contract import (
    CHECKPOINT_DIR_ENV,
    RUN_DIR_ENV,
    RESUME_ENV,
    STORE_ENV,
    JOB_TOKEN_ENV,
    GENERATION_ENV,
    WRONG_TOKEN_EXIT,
    FALLBACK_EXIT,
)
from lightning_parcae.events import append_event
from lightning_parcae.runtime import steptime

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["ParcaeRunCallback", "ParcaeElasticCallback", "resume_path", "RUN_DIR_ENV", "RESUME_ENV", "callback_class"]

RATE_WINDOW_S = 5.0
"""The progress events' samples/s is taken over the batches of the last this many seconds (at least the last step)."""



def resume_path() -> Optional[str]:
    """The checkpoint to pass to ``trainer.fit(..., ckpt_path=...)``.

    Returns:
        ``$PARCAE_RESUME_CKPT`` when it is set and the file exists (or it is a checkpoint store's URL, which the
        launcher found complete), else None (a fresh start).
    """
    path = os.environ.get(RESUME_ENV)
    return path if path and ("://" in path or os.path.isfile(path)) else None



class ParcaeRunCallbackMixin:
    """Checkpoints, graceful notice handling and progress events for workers started by ``parcae run``.

    Inactive (a no-op) when ``PARCAE_RUN_DIR`` is not set, so a script can always add it.

    Args:
        every_n_steps: Save ``last.ckpt`` every this many optimizer steps (0: only on a notice and at the end).
        progress_every_s: Minimum seconds between two ``progress`` events.
        check_token: Verify ``PARCAE_JOB_TOKEN`` against the store at ``PARCAE_STORE`` when constructed; on a wrong
            token print the reason and exit with status 3.
    """

    def __init__(self, every_n_steps: int = 50, progress_every_s: float = 1.0, check_token: bool = True) -> None:
        super().__init__()
        self.run_dir: Optional[Path] = Path(os.environ[RUN_DIR_ENV]) if os.environ.get(RUN_DIR_ENV) else None
        self.checkpoint_dir: Optional[str] = os.environ.get(CHECKPOINT_DIR_ENV) or None
        self.every_n_steps = max(0, int(every_n_steps))
        self.progress_every_s = progress_every_s
        self.generation = int(os.environ.get(GENERATION_ENV, "0"))
        self.notified = False
        self.stopped_for_restart = False
        self._agreed_stop = False
        self._t0 = time.time()
        self._last_progress = 0.0
        self._step_t: Optional[float] = None
        self._last_step_t: Optional[float] = None
        self._window: list[tuple[float, int]] = []
        self._samples_per_step = 0
        self._resumed_step = 0
        self._last_step = 0  # the global step at the last batch end
        if self.active:
            if check_token:
                self._check_token()
            self._install_handler()

    # ------------------------------------------------------------------------------------------------ helpers
    @property
    def active(self) -> bool:
        """Whether the process runs under ``parcae run``."""
        return self.run_dir is not None

    @property
    def ckpt_path(self) -> Optional[Path]:
        """``run_dir/ckpt/last.ckpt`` (None when inactive)."""
        return self.run_dir / "ckpt" / "last.ckpt" if self.run_dir is not None else None

    @property
    def save_target(self) -> Optional[str]:
        """Where a save goes: the launcher's checkpoint directory (each save adds a complete checkpoint to it) or,
        without one, ``run_dir/ckpt/last.ckpt`` (None when inactive)."""
        if self.checkpoint_dir:
            return self.checkpoint_dir
        return str(self.ckpt_path) if self.ckpt_path is not None else None

    def _check_token(self) -> None:
        url = os.environ.get(STORE_ENV)
        if not url:
            return
        from lightning_parcae.errors import CoordinationError  # noqa: PLC0415
        from lightning_parcae.runtime.store import connect_store  # noqa: PLC0415

        try:
            connect_store(url, token=os.environ.get(JOB_TOKEN_ENV), timeout_s=10.0, op_timeout_s=10.0)
        except CoordinationError as exc:
            print(f"parcae worker (rank {os.environ.get('RANK', '?')}): {exc}", file=sys.stderr, flush=True)
            sys.exit(WRONG_TOKEN_EXIT)

    def _on_sigterm(self, signum: int, frame: Optional[FrameType]) -> None:
        self.notified = True

    def _install_handler(self) -> None:
        signal.signal(signal.SIGTERM, self._on_sigterm)

    def _emit(self, trainer: pl.Trainer, kind: str, **fields: Any) -> None:
        if self.run_dir is None or not trainer.is_global_zero:
            return
        s = trainer.strategy
        d = int(getattr(s, "data_parallel", trainer.world_size))
        p = int(getattr(s, "pipeline_stages", 1))
        append_event(self.run_dir, {
            "source": "worker", "event": kind, "generation": self.generation, "step": int(trainer.global_step),
            "samples": int(trainer.global_step) * self._samples_per_step, "D": d, "P": p, "N": trainer.world_size,
            "elapsed_s": time.time() - self._t0,
            # the launcher's restart fallback chooses only a D that splits this batch (runtime.data.batch_splits)
            "global_batch": getattr(s, "global_batch", None), "micro_batches": getattr(s, "micro_batches", None),
            **fields,
        })

    def _save(self, trainer: pl.Trainer, reason: str) -> None:
        assert self.ckpt_path is not None and self.save_target is not None
        t = time.time()
        if trainer.is_global_zero and not self.checkpoint_dir:
            self.ckpt_path.parent.mkdir(parents=True, exist_ok=True)
        from lightning_parcae.errors import PeerLostError  # noqa: PLC0415

        try:
            # collective under ParcaeStrategy; atomic write on rank 0. weights_only=False given explicitly: the full
            # training state, and no "weights_only was not set" line in the worker log at every periodic save
            trainer.save_checkpoint(self.save_target, weights_only=False)
        except PeerLostError as exc:
            if _elastic(trainer) is None:
                raise
            # a member was lost while the checkpoint was gathered: skip this one (the previous last.ckpt stays,
            # the write is atomic); the step boundary right after this hook recovers in place
            print(f"checkpoint at step {trainer.global_step} skipped: {exc}", file=sys.stderr, flush=True)
            self._emit(trainer, "checkpoint_skipped", reason=str(exc)[:200])
            return
        self._emit(trainer, "checkpoint", reason=reason, save_s=time.time() - t, path=self.save_target)

    # ------------------------------------------------------------------------------------------------ hooks
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Take SIGTERM back from Lightning (flag only) and report the start of this generation."""
        if not self.active:
            return
        self._resumed_step = int(trainer.global_step)
        self._last_step = self._resumed_step
        if _elastic(trainer) is None:  # live reconfiguration handles SIGTERM itself (migrate, not stop)
            self._install_handler()
            if trainer.strategy.reduce_boolean_decision(self.notified, all=False):
                self._stop_before_training(trainer)
                return
        self._emit(trainer, "start", resumed_from=self._resumed_step, resume_ckpt=resume_path())

    def stop_if_batch_misfits(self, trainer: pl.Trainer, global_batch: int) -> None:
        """Restart fallback, before a training loader is sliced: a generation whose D cannot split the global
        batch reports the batch and stops (every rank exits with ``FALLBACK_EXIT``), so that ``parcae run``
        relaunches it with the largest D that splits it (:meth:`~lightning_parcae.launch.relaunch.Relaunch.shape_for`).

        Regression (8 instances, ``--restart-fallback``, a global batch of 60): the first launch seats D a power of
        two before any worker knows the batch; D = 8 stopped every worker with ``BatchSplitError`` and the run
        failed. A batch that no D splits into the micro-batches is left to the data path's error (it names the
        fix). Live reconfiguration changes the shape in place instead
        (:meth:`~lightning_parcae.training.elastic_hooks.ElasticHooks.split_global_batch`)."""
        from lightning_parcae.planning.costmodel import batch_splits  # noqa: PLC0415

        s = trainer.strategy
        d, m = int(getattr(s, "data_parallel", 1)), int(getattr(s, "micro_batches", 1) or 1)
        if not self.active or global_batch % m or batch_splits(global_batch, d, m):
            return
        self._emit(trainer, "stop", reason=f"the global batch {global_batch} does not split over D={d} pipelines "
                   f"of M={m} micro-batches (restart fallback: relaunch with a D that does)",
                   global_batch=global_batch, micro_batches=m, batch_misfit=True)
        from lightning_parcae.runtime.lifecycle import exit_now  # noqa: PLC0415

        exit_now(FALLBACK_EXIT)

    def _stop_before_training(self, trainer: pl.Trainer) -> None:
        """A notice came while this generation started (it was superseded by the next change): stop before the
        first step, without a checkpoint -- the one it resumed from is the state it holds.

        Regression (issue 21, the restart fallback's replay of lh_80_90): a generation noticed during its set-up
        ran one step and saved a checkpoint before stopping, 12 s of a relaunch that the next one repeated.
        """
        self._agreed_stop = True
        self.stopped_for_restart = True
        self._emit(trainer, "stop", reason="notice before the first step (restart fallback)",
                   resumed_from=self._resumed_step)
        trainer.should_stop = True

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Agree on a stop, checkpoint every K steps, and emit progress."""
        if not self.active:
            return
        if steptime.ON:
            t = time.perf_counter()
            if self._step_t is not None:
                steptime.add("step", t - self._step_t)
            self._step_t = t
            with steptime.span("callback.run"):
                return self._batch_end(trainer, outputs, batch)
        return self._batch_end(trainer, outputs, batch)

    def _batch_end(self, trainer: pl.Trainer, outputs: Any, batch: Any) -> None:
        global_batch = getattr(trainer.strategy, "global_batch", None)
        if global_batch:  # the global batch stays fixed while D changes under live reconfiguration
            self._samples_per_step = int(global_batch)
        elif not self._samples_per_step:
            self._samples_per_step = _batch_len(batch) * int(getattr(trainer.strategy, "data_parallel", 1))
        now = time.time()
        step = int(trainer.global_step)
        self._window.append((now, step))
        # the rate is taken over the last 5 s, but over at least one step (a job whose steps take longer -- a large
        # model: tens of seconds per step -- kept a window of one entry and never reported progress at all), and
        # from the batch that completed a step (under gradient accumulation a window starting at a batch inside a
        # step miscounts it): from the oldest step completed in the last 5 s, else the newest completed before
        completed: dict[int, float] = {}
        for t, s in self._window:
            completed.setdefault(s, t)
        inside = [s for s, t in completed.items() if now - t <= RATE_WINDOW_S and s < step]
        start = min(inside) if inside else max((s for s in completed if s < step), default=step)
        self._window = [w for w in self._window if w[1] >= start]
        if self._agreed_stop:
            return
        # under gradient accumulation only a batch that ended an optimizer step is a place to stop or checkpoint (a
        # checkpoint inside a window would resume without the window's gradients); every rank sees the same steps
        stepped, self._last_step = step != self._last_step, step
        if not stepped:
            return
        stop = False if _elastic(trainer) is not None else trainer.strategy.reduce_boolean_decision(
            self.notified, all=False)
        if stop:
            self._agreed_stop = True
            self.stopped_for_restart = True
            self._save(trainer, "notice")
            self._emit(trainer, "stop", reason="notice (restart fallback)", samples_per_s=self._rate())
            trainer.should_stop = True
            return
        if self.every_n_steps and step % self.every_n_steps == 0 and step > self._resumed_step:
            self._save(trainer, "periodic")
        if self._window[0][1] < step and now - self._last_progress >= self.progress_every_s:
            self._last_progress = now
            self._emit(trainer, "progress", samples_per_s=self._rate(), **_loss_field(outputs))

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Report the validation metrics (``val_*`` in ``callback_metrics``) as a ``validation`` event."""
        if not self.active or trainer.sanity_checking:
            return
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items()
                   if k.startswith("val") and getattr(v, "numel", lambda: 1)() == 1}
        if metrics:
            self._emit(trainer, "validation", metrics=metrics)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Save and report the end of training (a finished run, not a stop for restart)."""
        if steptime.ON and self.run_dir is not None:
            append_event(self.run_dir, {"source": "worker", "event": "step_timing", "rank": trainer.global_rank,
                                        "elastic": _elastic(trainer) is not None, "parts": steptime.summary(),
                                        "intervals": steptime.intervals()})
        if not self.active or self._agreed_stop:
            return
        self._save(trainer, "end")
        self._emit(trainer, "end", samples_per_s=self._rate())

    def _rate(self) -> float:
        (t0, s0), (t1, s1) = self._window[0], self._window[-1]
        return (s1 - s0) * self._samples_per_step / (t1 - t0) if t1 > t0 else 0.0


def _loss_field(outputs: Any) -> dict[str, float]:
    """``{"loss": value}`` from a training step's output (a tensor or a dict with ``loss``), else ``{}``."""
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    try:
        return {"loss": float(loss.detach())} if loss is not None and loss.numel() == 1 else {}
    except (AttributeError, RuntimeError, TypeError):
        return {}


def _batch_len(batch: Any) -> int:
    """Number of samples in a batch (first tensor's leading dimension)."""
    if hasattr(batch, "shape") and len(batch.shape) > 0:
        return int(batch.shape[0])
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_len(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_len(next(iter(batch.values())))
    return 0


_PROGRESS_BAR = ("parcae/N", "parcae/D", "parcae/P", "parcae/generation")


def _elastic(trainer: pl.Trainer) -> Any:
    return getattr(trainer.strategy, "elastic_runtime", None)


class ParcaeElasticCallbackMixin:
    """The interval callback of live reconfiguration (added by ``ParcaeStrategy`` when ``elastic`` is on).

    After every optimizer step it hands control to the strategy's
    :class:`~lightning_parcae.runtime.elastic.ElasticRuntime`, which agrees with every process on notices and
    plans, lets the leader run the predictor and the liveput optimizer when an interval is due, and switches,
    recovers or falls back in place. It then logs the job's configuration to Lightning's loggers and progress bar:
    ``parcae/N``, ``parcae/D``, ``parcae/P``, ``parcae/generation``, ``parcae/samples_per_s``,
    ``parcae/predicted_N`` (next interval), ``parcae/liveput`` and ``parcae/migration_s`` (time of the last
    migration).

    Args:
        log_metrics: Log the metrics above (``self.log`` every ``log_every_n_steps`` steps of the Trainer and at the
            first step of each generation; ``N``, ``D``, ``P`` on the progress bar).
    """

    def __init__(self, log_metrics: bool = True) -> None:
        super().__init__()
        self.log_metrics = log_metrics
        self._logged_generation: Optional[int] = None
        self._t: Optional[float] = None
        self._rate = 0.0
        self._boundary_step: Optional[int] = None  # the global step of the last boundary

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """A joiner becomes a training member once its loop state has been restored."""
        er = _elastic(trainer)
        if er is None:
            return
        er.install_signal_handler()  # after Lightning's own: SIGTERM means "migrate away", not "stop"
        if er.joining and er.life.phase.value != "training":
            er.joined(trainer)
        self._boundary_step = int(trainer.global_step)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """Step boundary: agree, plan, switch or recover; then log the configuration.

        Only after an optimizer step: under gradient accumulation the batches inside a window are not boundaries
        (a membership change there would split the window's gradient between two shapes), so a notice in a window
        is taken at its end."""
        er = _elastic(trainer)
        if er is None:
            return
        if int(trainer.global_step) == self._boundary_step:
            return  # inside an accumulation window (or a skipped step): no optimizer step was taken
        self._boundary_step = int(trainer.global_step)
        if steptime.ON:
            with steptime.span("callback.elastic"):
                return self._batch_end(trainer, pl_module, er)
        return self._batch_end(trainer, pl_module, er)

    def _batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, er: Any) -> None:
        er.boundary(trainer)
        now = time.time()
        b = getattr(trainer.strategy, "global_batch", None) or 0
        if self._t is not None and now > self._t:
            inst = b / (now - self._t)
            self._rate = inst if self._rate == 0.0 else 0.8 * self._rate + 0.2 * inst
        self._t = now
        if not self.log_metrics or er.layout is None:
            return
        # Lightning's self.log costs ~0.5 ms a value (8 values: ~4 ms, a third of a small model's step, issue 13);
        # its loggers write every log_every_n_steps anyway, and the progress bar keeps the last values: log at that
        # cadence and whenever the configuration changed
        every = max(1, int(getattr(trainer, "log_every_n_steps", 1) or 1))
        if int(trainer.global_step) % every and er.generation == self._logged_generation:
            return
        self._logged_generation = er.generation
        lay = er.layout
        pred = er.stats.get("predicted_N")
        values = {
            "parcae/N": float(len(lay.members)), "parcae/D": float(lay.data_parallel),
            "parcae/P": float(lay.pipeline_stages), "parcae/generation": float(er.generation),
            "parcae/samples_per_s": float(self._rate),
            "parcae/migration_s": float(er.migrations[-1]["duration_s"]) if er.migrations else 0.0,
        }
        if pred:
            values["parcae/predicted_N"] = float(pred[0])
        if er.stats.get("liveput") is not None:
            values["parcae/liveput"] = float(er.stats["liveput"])
        for k, v in values.items():
            pl_module.log(k, v, on_step=True, on_epoch=False, prog_bar=k in _PROGRESS_BAR,
                          sync_dist=False, batch_size=1)


@lru_cache(maxsize=None)
def callback_class(kind: str, ns_name: str = "pytorch_lightning") -> type:
    """``ParcaeRunCallback`` (``kind="run"``) or ``ParcaeElasticCallback`` (``kind="elastic"``) built over the
    ``Callback`` of one Lightning namespace (``"pytorch_lightning"`` or ``"lightning.pytorch"``)."""
    from lightning_parcae.training.namespaces import namespace  # noqa: PLC0415

    mixin = {"run": ParcaeRunCallbackMixin, "elastic": ParcaeElasticCallbackMixin}[kind]
    name = {"run": "ParcaeRunCallback", "elastic": "ParcaeElasticCallback"}[kind]
    module = __name__ if ns_name == "pytorch_lightning" else "lightning_parcae.lightning"
    return type(name, (mixin, namespace(ns_name).pl.Callback),
                {"__module__": module, "__qualname__": name, "__doc__": mixin.__doc__})


def __getattr__(name: str) -> Any:
    # the pytorch_lightning classes, built on first use (lightning.pytorch: lightning_parcae.lightning)
    if name == "ParcaeRunCallback":
        return callback_class("run")
    if name == "ParcaeElasticCallback":
        return callback_class("elastic")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
