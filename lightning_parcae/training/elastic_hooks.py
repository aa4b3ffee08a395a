"""The elastic hooks: where live reconfiguration enters Lightning's fit loop.

Problem: Lightning's fit loop knows nothing of members coming and going. Under live reconfiguration the strategy
must attach the interval callback (planning and migration happen at step boundaries), keep Lightning from
blocking on a lost rank 0 outside any guarded wait, let a joiner "resume" from the state live peers send it
through Lightning's own restore path, and make an optimizer step that a lost peer interrupts either applied on
every rank or discarded on every rank (two-phase commit) and then re-run on the recovered shape with the same
global batch. At the end of the job the runtime is closed. This part installs and runs those hooks; the runtime
itself (:class:`~lightning_parcae.runtime.elastic.ElasticRuntime`) decides what happens.

The strategy owns one :class:`ElasticHooks` and calls it from ``setup``, ``optimizer_step`` and ``teardown`` when
the job is elastic.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

from lightning_parcae.errors import ConfigurationError, PeerLostError
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
        if trainer.accumulate_grad_batches != 1:
            raise ConfigurationError(
                f"live reconfiguration needs accumulate_grad_batches=1 (got {trainer.accumulate_grad_batches}): a "
                "membership change between the micro-steps of one accumulated step cannot be replayed; raise the "
                "DataLoader's batch_size instead"
            )
        if not any(isinstance(cb, ParcaeElasticCallbackMixin) for cb in trainer.callbacks):
            trainer.callbacks.append(callback_class("elastic", self.ns_name)())
        # Lightning broadcasts a SIGTERM flag from rank 0 before every batch, outside any guarded wait: a lost or
        # hung rank 0 would block the others there for the group timeout. SIGTERM is a notice here (agreed at
        # the step boundary), so the broadcast has nothing to carry.
        silence_sigterm_broadcast(trainer)
        if joining:
            return  # er.joined() runs once the loop state is restored (on_train_start)
        er.boot_publish(trainer)
        activate(er.live)
        # start-up is over: from now on an operation that makes no progress fails within the watchdog's bound
        self.process.use_timeout(er.stall_timeout)

    def optimizer_step(self, optimizer: Any, step: Callable[[], Any]) -> Any:
        """Run ``step`` (Lightning's optimizer step) two-phase: see :meth:`ParcaeStrategy.optimizer_step`."""
        er = self.host.elastic_runtime
        module = self.host.lightning_module
        trainer = module.trainer
        global_step = int(trainer.global_step)
        cursor = self.data.cursor_mark()
        inner = inner_optimizer(optimizer)
        while True:
            self.committing = global_step
            try:
                return step()
            except PeerLostError as exc:
                log.warning("step %d interrupted: %s", global_step, exc)
                if er.decide_commit(global_step):
                    inner.step()  # everyone reduced its gradients: apply the step as the others did
                    er.recover(trainer)
                    return None
                module = self.host.lightning_module
                for p in (module.parameters() if module is not None else []):
                    p.grad = None
                self.steps.discard_pending()
                self.data.rewind(cursor)
                er.recover(trainer)
                self.data.rerun_next_step()
            finally:
                self.committing = None

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
