"""The step runner: one Lightning step as P pipeline stages over M micro-batches, with one process's result.

Problem: Lightning calls ``training_step`` once per batch and expects a loss, logs and gradients equal to those of
one process. Under ParcaeStrategy each process holds one stage of the layer stack, so the step must run the user's
code around a stage proxy (head / middle / tail), follow a pipeline schedule (GPipe or 1F1B), scale the
micro-batch losses, mirror the last stage's outputs so that every rank logs the same values, keep the step's
gradients aside across Lightning's ``zero_grad`` and then reduce them: replicated parameters summed over the
pipeline, everything averaged over the D replicas, clipping by the norm over all stages.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parcae.errors import ConfigurationError, ModelLayoutError
from lightning_parcae.runtime.liveness import guarded
from lightning_parcae.runtime.pipeline import (
    BlockListProxy,
    StageBoundary,
    chunk_batch,
    run_forward_only,
    run_train_schedule,
    schedule_ops,
    split_micro_batches,
)
from lightning_parcae.runtime.stage import swapped
from lightning_parcae.training.log_replay import LogRecorder

__all__ = ["StepRunner"]


class StepRunner:
    """Pipeline steps and gradient reduction for one strategy (see the module docstring).

    Args:
        strategy: The owning ParcaeStrategy (its module, groups, stage, proxy, transport, precision plugin and
            data path).

    Attributes:
        pending_grads: The last ``training_step``'s gradients, put back in :meth:`backward`.
        sync_grads: False while Lightning accumulates (no data-parallel all-reduce).
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.pending_grads: Optional[list[Optional[Tensor]]] = None
        self.sync_grads = True

    def check_supported(self, module: Any) -> None:
        """Refuse what the pipeline step cannot run: manual optimization, 16-mixed precision with a GradScaler.

        Raises:
            ConfigurationError: naming what to use instead.
        """
        if not module.automatic_optimization:
            raise ConfigurationError("ParcaeStrategy supports automatic optimization only")
        if getattr(self.strategy.precision_plugin, "scaler", None) is not None:
            raise ConfigurationError(
                "16-mixed precision with a GradScaler is not supported by ParcaeStrategy; use precision='bf16-mixed' "
                "or '32-true'"
            )

    def call_step(self, name: str, mode: str, batch: Any, rest: tuple[Any, ...], kwargs: dict[str, Any],
                   given: Optional[Tensor] = None) -> Any:
        s = self.strategy
        module = s.lightning_module
        assert module is not None and s.stack_path is not None
        if s._proxy is None or (s.groups is not None and s.groups.pipeline_stages == 1):
            return getattr(module, name)(batch, *rest, **kwargs)  # P = 1: the user's step as written
        s._proxy.mode, s._proxy.given, s._proxy.captured = mode, given, None
        with swapped(module, s.stack_path, s._proxy):
            return getattr(module, name)(batch, *rest, **kwargs)

    def head(self, name: str, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[Any], Tensor]:
        s = self.strategy
        def head(mb: Any) -> Tensor:
            try:
                self.call_step(name, "head", mb, rest, kwargs)
            except StageBoundary:
                assert s._proxy is not None
                return s._proxy.captured  # type: ignore[return-value]
            raise ModelLayoutError(f"{name} returned without running the layer stack '{s.stack_path}'")

        return head

    def middle(self, name: str, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[Callable[[Any, Tensor],
                                                                                                 Tensor]]:
        """For a block list: a middle stage runs the user's step with its blocks fed by the received activation,
        so that blocks get the extra arguments (masks, positions) the step computes; None for an nn.Sequential."""
        s = self.strategy
        if not isinstance(s._proxy, BlockListProxy):
            return None

        def middle(mb: Any, act: Tensor) -> Tensor:
            try:
                self.call_step(name, "middle", mb, rest, kwargs, act)
            except StageBoundary:
                assert s._proxy is not None
                return s._proxy.captured  # type: ignore[return-value]
            raise ModelLayoutError(f"{name} returned without running the blocks of '{s.stack_path}'")

        return middle

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One pipeline step over M micro-batches (forward and backward); returns the mean micro-batch loss."""
        s = self.strategy
        module = s.lightning_module
        g = s.groups
        assert module is not None and g is not None and s._p2p is not None and s._stage is not None
        trainer = module.trainer
        batch, rest = s.data.effective_batch(args[0]), tuple(args[1:])
        m_total = s.micro_batches
        micro = split_micro_batches(batch, m_total)
        params = [p for p in module.parameters() if p.requires_grad]
        previous = [p.grad for p in params]
        for p in params:
            p.grad = None
        results: list[Any] = []
        outputs: list[Tensor] = []
        recorder = LogRecorder(module)

        def tail(mb: Any, act: Optional[Tensor]) -> Tensor:
            result = self.call_step("training_step", "full" if act is None else "tail", mb, rest, kwargs, act)
            results.append(result)
            if s._proxy is not None and isinstance(s._proxy.captured, Tensor):
                outputs.append(s._proxy.captured.detach())
            return _loss_of(result)

        ops = schedule_ops(s.schedule, g.coords.stage, g.pipeline_stages, m_total)
        scale = 1.0 / (m_total * trainer.accumulate_grad_batches)
        with recorder.active():
            run_train_schedule(
                ops, micro, s._stage, s._p2p, g.prev_rank(), g.next_rank(),
                self.head("training_step", rest, kwargs), tail, scale, s.precision_plugin.train_step_context,
                middle=self.middle("training_step", rest, kwargs),
            )
            if g.pipeline_stages > 1:
                results = self.mirror_train(micro, rest, kwargs, outputs, results)
        recorder.replay()
        self.pending_grads = [p.grad for p in params]
        for p, prev in zip(params, previous):
            p.grad = prev
        s.data.count_samples()
        losses = torch.stack([_loss_of(r).detach().float() for r in results])
        loss = losses.mean().to(losses.device)
        last = results[-1]
        if isinstance(last, Mapping):
            return {**last, "loss": loss}
        return loss

    def mirror_train(self, micro: list[Any], rest: tuple[Any, ...], kwargs: dict[str, Any],
                      outputs: list[Tensor], results: list[Any]) -> list[Any]:
        """Give every stage the last stage's outputs and re-run the user's step there (no grad)."""
        s = self.strategy
        g = s.groups
        assert g is not None and s._p2p is not None
        full = torch.cat(outputs) if g.is_last_stage else None
        full = s._p2p.broadcast(full, g.last_stage_rank())
        if g.is_last_stage:
            return results
        chunks = torch.chunk(full, len(micro))
        mirrored = []
        with torch.no_grad(), s.precision_plugin.train_step_context():
            for mb, out in zip(micro, chunks):
                mirrored.append(self.call_step("training_step", "given", mb, rest, kwargs, out))
        return mirrored

    def eval_step(self, name: str, context: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        s = self.strategy
        module = s.lightning_module
        g = s.groups
        assert module is not None and g is not None and s._p2p is not None and s._stage is not None
        with context():
            if g.pipeline_stages == 1:
                return getattr(module, name)(*args, **kwargs)
            batch, rest = args[0], tuple(args[1:])
            micro = chunk_batch(batch, s.micro_batches)
            middle = self.middle(name, rest, kwargs)  # block lists: the last stage also stops after its blocks
            outs = run_forward_only(micro, s._stage, s._p2p, g.prev_rank(), g.next_rank(),
                                    self.head(name, rest, kwargs), middle=middle, tail=middle)
            full = s._p2p.broadcast(torch.cat(outs) if g.is_last_stage else None, g.last_stage_rank())
            return self.call_step(name, "given", batch, rest, kwargs, full)

    # -------------------------------------------------------------------------------------------- gradients
    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """While Lightning accumulates, skip the data-parallel gradient all-reduce."""
        self.sync_grads = False
        try:
            yield None
        finally:
            self.sync_grads = True

    def backward(self, closure_loss: Tensor) -> Tensor:
        """Put back the gradients computed in :meth:`training_step`, then reduce them (unless accumulating)."""
        s = self.strategy
        module = s.lightning_module
        assert module is not None
        closure_loss = s.precision_plugin.pre_backward(closure_loss, module)
        params = [p for p in module.parameters() if p.requires_grad]
        pending = self.pending_grads or [None] * len(params)
        for p, g in zip(params, pending):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self.pending_grads = None
        if self.sync_grads:
            self.reduce_gradients()
        closure_loss = s.precision_plugin.post_backward(closure_loss, module)
        return closure_loss

    def replicated_params(self) -> list[nn.Parameter]:
        """Trainable parameters outside the layer stack (present on every stage)."""
        s = self.strategy
        assert s.lightning_module is not None and s._stage is not None
        local = {id(p) for p in s._stage.parameters()}
        return [p for p in s.lightning_module.parameters() if p.requires_grad and id(p) not in local]

    def reduce_gradients(self) -> None:
        """Sum replicated parameters' gradients over the pipeline, then average everything over the D replicas."""
        s = self.strategy
        g = s.groups
        module = s.lightning_module
        assert g is not None and module is not None
        replicated = self.replicated_params()
        if g.pipeline_stages > 1 and replicated:
            _all_reduce_grads(replicated, g.pipeline_group, 1.0)
        if g.data_parallel > 1:
            _all_reduce_grads([p for p in module.parameters() if p.requires_grad], g.data_group,
                              1.0 / g.data_parallel)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Clip by the norm of the gradients of ALL parameters of the model (every stage's), like one process."""
        s = self.strategy
        g = s.groups
        assert g is not None
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        replicated = {id(p) for p in self.replicated_params()}
        sq = torch.zeros((), dtype=torch.float32, device=s.root_device)
        for p in params:
            if id(p) in replicated and not g.is_first_stage:
                continue  # counted once, on stage 0
            sq += p.grad.detach().float().pow(2).sum()
        if g.pipeline_stages > 1:
            guarded(lambda: dist.all_reduce(sq, group=g.pipeline_group, async_op=True), "gradient-norm all-reduce",
                    collective=True)
        total = sq.sqrt()
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.dtype))



def _loss_of(result: Any) -> Tensor:
    if isinstance(result, Tensor):
        return result
    if isinstance(result, Mapping) and isinstance(result.get("loss"), Tensor):
        return result["loss"]
    raise ConfigurationError(
        "under ParcaeStrategy training_step must return the loss tensor or a dict with a 'loss' tensor "
        f"(got {type(result).__name__})"
    )




def _all_reduce_grads(params: list[nn.Parameter], group: Any, scale: float) -> None:
    """Sum gradients over ``group`` in one flat buffer (missing gradients count as zero), times ``scale``."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    for same in by_dtype.values():
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in same]
        flat = torch.cat([g.reshape(-1) for g in grads])
        guarded(lambda: dist.all_reduce(flat, group=group, async_op=True), "gradient all-reduce", collective=True)
        if scale != 1.0:
            flat.mul_(scale)
        offset = 0
        for p in same:
            n = p.numel()
            p.grad = flat[offset : offset + n].view_as(p).clone()
            offset += n
