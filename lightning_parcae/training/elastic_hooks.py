"""The elastic hooks: where live reconfiguration enters Lightning's fit loop.

Problem: Lightning's fit loop knows nothing of members coming and going. Under live reconfiguration the strategy
must attach the interval callback (planning and migration happen at step boundaries), keep Lightning from
blocking on a lost rank 0 outside any guarded wait, let a joiner "resume" from the state live peers send it
through Lightning's own restore path, and make an optimizer step that a lost peer interrupts either applied on
every rank or discarded on every rank (two-phase commit) and then re-run on the recovered shape with the same
global batch. At the end of the job the runtime is closed. This part installs and runs those hooks; the runtime
itself (:class:`~lightning_parcae.runtime.elastic.ElasticRuntime`) decides what happens.

Gradient accumulation (``accumulate_grad_batches = k``): membership changes only at optimizer-step boundaries (the
interval callback agrees after a step, not after each of its k micro-steps), so a notice in the middle of a window
is taken at its end. A lost peer in the middle of a window -- in a micro-step's pipeline exchange, or in the
gradient all-reduce of the window's last micro-step -- discards the whole window on every survivor: the survivors
recover, rewind the data cursor to the window's start and replay its micro-steps in order on the recovered shape
(re-cut for the new D), then the optimizer step runs once. Every survivor replays the same micro-steps in the same
order whichever micro-step it noticed the loss in, so the pipeline exchanges of the replay pair up. The replayed
micro-steps' ``self.log`` calls are made again (an ``on_epoch`` mean counts them twice); the parameters equal one
process's.

Manual optimization (P = 1): the user's ``training_step`` makes its own backward and optimizer calls, so a lost
peer is handled per batch. Before any optimizer step of the batch is applied (in a ``manual_backward``'s
gradient all-reduce, or an optimizer step discarded everywhere) the survivors recover and run the whole
``training_step`` again on the recovered shape with the same global batch -- exact. Once an optimizer step of the
batch has been applied, the batch cannot be run again (that step would be applied twice): a loss in the rest of
the batch, or a ``manual_backward`` after a step that was applied while recovering (its rows were cut for the old
shape), falls back to the last checkpoint -- exact too, at the cost of a restart. A loop with one optimizer step
at the end of ``training_step`` (the usual case) never needs the fallback.

The strategy owns one :class:`ElasticHooks` and calls it from ``setup``, ``training_step``, ``optimizer_step``,
``backward`` (manual optimization) and ``teardown`` when the job is elastic.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from lightning_parcae.errors import PeerLostError
from lightning_parcae.planning.costmodel import batch_splits
from lightning_parcae.training.lightning_internals import inner_optimizer, silence_sigterm_broadcast, wrap_after_closure
from lightning_parcae.training.process_setup import resume_once

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from lightning_parcae.training.data_path import DataPath
    from lightning_parcae.training.process_setup import ProcessSetup
    from lightning_parcae.training.step_runner import StepRunner

__all__ = ["ElasticHooks", "HooksHost"]


class HooksHost(Protocol):
    """What the elastic hooks need from the strategy: its runtime, module and precision plugin."""

    @property
    def elastic_runtime(self) -> Any: ...

    @property
    def lightning_module(self) -> Any: ...

    @property
    def precision_plugin(self) -> Any: ...

log = logging.getLogger(__name__)


class ElasticHooks:
    """Live reconfiguration's hooks into one strategy's Trainer (see the module docstring).

    Args:
        host: The strategy, for its elastic runtime, module and precision plugin.
        data: The data path (the sample cursor a discarded step rewinds).
        steps: The step runner (the gradients a discarded step drops).
        process: The process setup (the collective timeout once start-up is over).
        ns_name: The Lightning namespace of the strategy (for the callback class).

    Attributes:
        committing: The global step whose optimizer step is running (``None`` outside one).
    """

    def __init__(self, host: HooksHost, data: "DataPath", steps: "StepRunner", process: "ProcessSetup",
                 ns_name: str) -> None:
        self.host = host
        self.data = data
        self.steps = steps
        self.process = process
        self.ns_name = ns_name
        self.committing: Optional[int] = None
        self.window_calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []  # this window's micro-steps' arguments
        self.replaying = False
        self.batch_steps = 0  # manual optimization: optimizer steps applied in the running training_step
        self.reshaped = False  # manual optimization: the shape changed after a step of this batch was applied

    def split_global_batch(self, trainer: "pl.Trainer", global_batch: int) -> None:
        """Before a training loader is sliced: a generation whose D cannot split the global batch (the launcher
        seated it before the batch was known: D a power of two) moves in place to the same P with the largest D
        that can (:meth:`~lightning_parcae.runtime.elastic.ElasticRuntime.split_global_batch`). Regression (chaos
        seed 700 at 8 instances): B = 60 on a first generation of D = 8 stopped every worker with "global batch
        size 60 cannot be split evenly over D=8 pipelines" and ``parcae run`` exited 1. A batch that no D splits
        into the micro-batches (B not a multiple of M) is left to the data path's error, which names the fix."""
        groups = self.data.stage.groups
        m = self.data.micro_batches
        if groups is None or global_batch % m or batch_splits(global_batch, groups.data_parallel, m):
            return
        self.data.global_batch = global_batch  # the throughput model the leader builds needs B
        self.host.elastic_runtime.split_global_batch(trainer)

    def install_live_restore(self, trainer: "pl.Trainer") -> None:
        """A joiner 'resumes' from the state received from live peers, through Lightning's own restore path."""
        from lightning_parcae.runtime.elastic import LIVE_CHECKPOINT  # noqa: PLC0415

        resume_once(trainer, lambda _given: LIVE_CHECKPOINT)

    def setup(self, trainer: "pl.Trainer", joining: bool) -> None:
        """Commit after every closure, attach the interval callback; initial members agree on generation 0, a
        joiner starts heartbeating once its loop state is restored."""
        from lightning_parcae.training.callbacks import ParcaeElasticCallbackMixin, callback_class  # noqa: PLC0415
        from lightning_parcae.runtime.liveness import activate  # noqa: PLC0415

        er = self.host.elastic_runtime
        assert er is not None
        wrap_after_closure(self.host.precision_plugin, self._commit_after)
        if not any(isinstance(cb, ParcaeElasticCallbackMixin) for cb in trainer.callbacks):
            trainer.callbacks.append(callback_class("elastic", self.ns_name)())
        # Lightning broadcasts a SIGTERM flag from rank 0 before every batch, outside any guarded wait: a lost or
        # hung rank 0 would block the others there for the group timeout. SIGTERM is a notice here (agreed at
        # the step boundary), so the broadcast has nothing to carry.
        silence_sigterm_broadcast(trainer)
        self.data.before_split = self.split_global_batch
        if joining:
            return  # er.joined() runs once the loop state is restored (on_train_start)
        er.boot_publish(trainer)
        activate(er.live)
        # start-up is over: from now on an operation that makes no progress fails within the watchdog's bound
        self.process.use_timeout(er.stall_timeout)

    def training_step(self, args: tuple[Any, ...], kwargs: dict[str, Any], run: Callable[[], Any]) -> Any:
        """Run one micro-step (Lightning's ``training_step``, ``run``) of the window being accumulated.

        Inside the optimizer step (the window's last micro-step, or every step without accumulation) a lost peer
        is the optimizer step's to handle (:meth:`optimizer_step`). Before it -- an earlier micro-step of an
        accumulation window, whose pipeline exchange failed -- no one has stepped: the window is discarded and
        replayed on the recovered shape here, then this micro-step runs again.
        """
        if self.replaying:
            return run()
        self.window_calls.append((tuple(args[1:]), dict(kwargs)))
        manual = not self.host.lightning_module.automatic_optimization
        while True:
            self.batch_steps, self.reshaped = 0, False
            try:
                return run()
            except PeerLostError as exc:
                if self.committing is not None:
                    raise
                trainer = self.host.lightning_module.trainer
                log.warning("micro-step of step %d interrupted: %s", int(trainer.global_step), exc)
                if manual and self.batch_steps:
                    self._manual_fallback(trainer, "a peer was lost after an optimizer step of this batch was applied")
                self.window_calls = self._restart_window(trainer)

    def before_manual_backward(self) -> None:
        """Manual optimization: a backward after a step of this batch was applied while recovering would use rows
        cut for the old shape -- fall back to the checkpoint instead (see the module docstring)."""
        if self.reshaped:
            self._manual_fallback(self.host.lightning_module.trainer,
                                  "the shape changed inside a manual-optimization batch after one of its optimizer "
                                  "steps was applied")

    def _manual_fallback(self, trainer: "pl.Trainer", reason: str) -> None:
        self.host.elastic_runtime.fallback(trainer, {"reason": f"{reason} (manual optimization: the batch cannot be "
                                                               "run again without applying that step twice)"})

    def optimizer_step(self, optimizer: Any, step: Callable[[], Any]) -> Any:
        """Run ``step`` (Lightning's optimizer step) two-phase: see :meth:`ParcaeStrategy.optimizer_step`."""
        er = self.host.elastic_runtime
        module = self.host.lightning_module
        trainer = module.trainer
        global_step = int(trainer.global_step)
        inner = inner_optimizer(optimizer)
        while True:
            self.committing = global_step
            try:
                out = step()
                self.close_window()
                self.batch_steps += 1
                return out
            except PeerLostError as exc:
                self.committing = None
                log.warning("step %d interrupted: %s", global_step, exc)
                if er.decide_commit(global_step):
                    # everyone reduced its gradients: apply the step as the others did (fp16: by the agreed verdict)
                    self.steps.apply_committed_step(inner)
                    er.recover(trainer)
                    self.close_window()
                    self.batch_steps += 1
                    self.reshaped = True
                    return None
                if not module.automatic_optimization:
                    raise  # manual optimization: the whole training_step runs again (training_step above)
                # the re-run of the last micro-step (through ``step``) counts itself in again
                self.window_calls = self._restart_window(trainer)[:-1]
            finally:
                self.committing = None

    def close_window(self) -> None:
        """The optimizer step was applied: the next micro-step opens a new accumulation window."""
        self.window_calls = []
        self.data.close_window()

    def _restart_window(self, trainer: "pl.Trainer") -> list[tuple[tuple[Any, ...], dict[str, Any]]]:
        """Discard the window's gradients, recover, and replay every micro-step of the window but the last on the
        recovered shape; the caller re-runs the last (Lightning's batch for it is the one it is running). Returns
        the window's micro-step arguments. A loss during the replay starts the recovery and the replay over."""
        er = self.host.elastic_runtime
        calls = list(self.window_calls)
        records = self.data.restart_window()
        while True:
            self._drop_gradients()
            er.recover(trainer)
            try:
                self._replay(records[:-1], calls[:len(records) - 1])
                break
            except PeerLostError as exc:
                log.warning("replay of step %d interrupted: %s", int(trainer.global_step), exc)
                self.data.restart_window()  # back to the window's start; the replay begins again
        if records:
            self.data.replay_next(records[-1], given=True)
        return calls

    def _drop_gradients(self) -> None:
        module = self.host.lightning_module
        for p in (module.parameters() if module is not None else []):
            p.grad = None
        self.steps.discard_pending()

    def _replay(self, records: list[Any], calls: list[tuple[tuple[Any, ...], dict[str, Any]]]) -> None:
        """Forward and backward of the window's earlier micro-steps, their batches rebuilt from the dataset for the
        current shape; gradients accumulate without the data-parallel reduction (the window's last micro-step
        reduces them all)."""
        if not records:
            return
        self.replaying = True
        try:
            for record, (rest, kwargs) in zip(records, calls):
                self.data.replay_next(record, given=False)
                with self.steps.no_sync():
                    out = self.steps.training_step(None, *rest, **kwargs)
                    self.steps.backward(out["loss"] if isinstance(out, dict) else out)
        finally:
            self.replaying = False

    def _commit_after(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def after_closure(model: Any, optimizer: Any) -> Any:
            out = original(model, optimizer)
            er = self.host.elastic_runtime
            if er is not None and self.committing is not None:
                er.commit(int(self.committing))
            return out

        return after_closure

    def close(self) -> None:
        """At teardown: a job that finished training is stopped; the runtime is closed either way."""
        from lightning_parcae.runtime.lifecycle import Phase  # noqa: PLC0415

        er = self.host.elastic_runtime
        finished = er.life.phase == Phase.TRAINING
        if finished:
            er.life.to(Phase.STOPPED)
        er.close(finished=finished)
