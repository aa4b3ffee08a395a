"""The step runner: one Lightning step as P pipeline stages over M micro-batches, with one process's result.

Problem: Lightning calls ``training_step`` once per batch and expects a loss, logs and gradients equal to those of
one process. Under ParcaeStrategy each process holds one stage of the layer stack, so the step must run the user's
code around a stage proxy (head / middle / tail), follow a pipeline schedule (GPipe or 1F1B), scale the
micro-batch losses, give every rank the same logs and step result, keep the step's gradients aside across
Lightning's ``zero_grad`` and then reduce them: replicated parameters summed over the pipeline, a tied outside part
(an input embedding that is also the LM head) summed between its two holders -- the first and the last stage --
only, everything this process holds averaged over the D replicas, clipping by the norm over all stages (each
logical parameter once).

Only what is small crosses stages: the last stage runs the user's step (on its micro-batches in training; once on
the concatenated stack outputs in evaluation) and is the only one that does. What the other stages need from it --
the ``self.log`` calls (values, and the state of logged torchmetrics objects; see ``log_replay``), the loss
returned to Lightning and the rest of the step's returned dict, the evaluation step's return value -- is pickled
into one :class:`StepOutcome` and broadcast over the pipeline group, and every stage replays the same calls. The
stack outputs themselves (for a language model the logits, B/D x seq x vocab) never leave the last stage. A side
effect of the user's step other than ``self.log`` (a counter it bumps, a metric it updates but does not log) happens
on the last stage only.

Predict: ``predict_step`` runs on the last stage; its return value (the predictions) is the step's outcome, so
every stage of the pipeline returns the same predictions, as before (each pipeline reads its own shard).
"""

from __future__ import annotations

import pickle
from collections.abc import Generator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parcae.errors import ConfigurationError, ModelLayoutError
from lightning_parcae.runtime import steptime
from lightning_parcae.runtime.link import charge_allreduce
from lightning_parcae.runtime.liveness import guarded, guarded_post, guarded_wait
from lightning_parcae.runtime.pipeline import (
    BlockListProxy,
    StageBoundary,
    chunk_batch,
    run_forward_only,
    run_train_schedule,
    schedule_ops,
    split_micro_batches,
)
from lightning_parcae.runtime.stage import is_released, swapped
from lightning_parcae.training.lightning_internals import inner_optimizer
from lightning_parcae.training.log_replay import LogCall, LogRecorder, local_calls, portable_calls, replay_calls
from lightning_parcae.training.loss_scaling import LossScaling
from lightning_parcae.training.stage_state import StageState

if TYPE_CHECKING:
    from lightning_parcae.training.data_path import DataPath

__all__ = ["StepRunner", "StepHost", "StepOutcome"]


@dataclass(frozen=True)
class StepOutcome:
    """What one step's last stage hands the other stages of its pipeline (see the module docstring).

    Attributes:
        calls: The step's ``self.log`` calls (training: one merged call per name; evaluation: as made).
        result: What the step returns to Lightning -- training: ``(loss, extras)``, the mean micro-batch loss and
            the rest of the last micro-batch's returned dict (``None`` when the step returned the loss tensor);
            evaluation: the user's step's return value.
    """

    calls: list[LogCall]
    result: Any


class StepHost(Protocol):
    """What the step runner needs from the strategy: the module, the precision plugin and the device."""

    @property
    def lightning_module(self) -> Any: ...

    @property
    def precision_plugin(self) -> Any: ...

    @property
    def root_device(self) -> torch.device: ...


class StepRunner:
    """Pipeline steps and gradient reduction for one strategy (see the module docstring).

    Args:
        state: The stage state (read only: groups, stack path, stage, proxy, transport).
        micro_batches: M, micro-batches per pipeline batch.
        schedule: ``"1f1b"`` or ``"gpipe"``.
        host: The strategy, for the module, the precision plugin and the device.
        data: The data path (this step's batch, the sample cursor).

    Attributes:
        pending_grads: The last ``training_step``'s gradients, put back in :meth:`backward`.
        sync_grads: False while Lightning accumulates (no data-parallel all-reduce).
        loss_scaling: Under 16-mixed precision the job-wide loss scaling (set by :meth:`check_supported`).
    """

    def __init__(self, state: StageState, micro_batches: int, schedule: str, host: StepHost,
                 data: "DataPath") -> None:
        self.state = state
        self.micro_batches = micro_batches
        self.schedule = schedule
        self.host = host
        self.data = data
        self.pending_grads: Optional[list[Optional[Tensor]]] = None
        self.sync_grads = True
        self.loss_scaling: Optional[LossScaling] = None

    def discard_pending(self) -> None:
        """Forget the gradients kept aside by the last ``training_step`` (its step is being re-run), and under fp16
        the scaler's unscaled state of that step (its scale unchanged)."""
        self.pending_grads = None
        if self.loss_scaling is not None:
            self.loss_scaling.forget_step()

    def apply_committed_step(self, optimizer: Optimizer) -> None:
        """Apply an interrupted step that every rank committed to: through the fp16 loss scaler when there is one
        (skipped by the job's agreed inf/nan verdict, then the scale updated, as on the ranks whose commit
        returned), else ``optimizer.step()``."""
        if self.loss_scaling is not None:
            self.loss_scaling.apply_committed(optimizer)
        else:
            optimizer.step()

    def check_supported(self, module: Any) -> None:
        """Refuse what the pipeline step cannot run (manual optimization at P > 1, or with a loss scaler); under
        16-mixed precision set up the job-wide loss scaling of the plugin's GradScaler
        (:mod:`~lightning_parcae.training.loss_scaling`).

        Raises:
            ConfigurationError: naming what to use instead.
        """
        if not module.automatic_optimization:
            g = self.state.groups
            if g is not None and g.pipeline_stages > 1:
                raise ConfigurationError(
                    f"manual optimization (automatic_optimization=False) runs at pipeline_stages=1 only (got "
                    f"P={g.pipeline_stages}): with P > 1 the pipeline schedule must own each step's forward and "
                    "backward, which manual optimization leaves to training_step; use ParcaeStrategy("
                    "pipeline_stages=1) -- data parallel, still elastic -- or automatic optimization"
                )
            if getattr(self.host.precision_plugin, "scaler", None) is not None:
                raise ConfigurationError(
                    "manual optimization with 16-mixed precision (a GradScaler) is not supported by ParcaeStrategy; "
                    "use precision='bf16-mixed' or '32-true', or automatic optimization"
                )
            return
        self.loss_scaling = LossScaling.for_plugin(self.host.precision_plugin, self.state, self.host.root_device)

    def call_step(self, name: str, mode: str, batch: Any, rest: tuple[Any, ...], kwargs: dict[str, Any],
                   given: Optional[Tensor] = None) -> Any:
        s, host = self.state, self.host
        module = host.lightning_module
        assert module is not None and s.stack_path is not None
        if s.proxy is None or (s.groups is not None and s.groups.pipeline_stages == 1):
            return getattr(module, name)(batch, *rest, **kwargs)  # P = 1: the user's step as written
        s.proxy.mode, s.proxy.given, s.proxy.captured = mode, given, None
        with swapped(module, s.stack_path, s.proxy):
            return getattr(module, name)(batch, *rest, **kwargs)

    def head(self, name: str, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Callable[[Any], Tensor]:
        s = self.state

        def head(mb: Any) -> Tensor:
            try:
                self.call_step(name, "head", mb, rest, kwargs)
            except StageBoundary:
                assert s.proxy is not None
                return s.proxy.captured  # type: ignore[return-value]
            raise ModelLayoutError(f"{name} returned without running the layer stack '{s.stack_path}'")

        return head

    def middle(self, name: str, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Optional[Callable[[Any, Tensor],
                                                                                                 Tensor]]:
        """For a block list: a middle stage runs the user's step with its blocks fed by the received activation,
        so that blocks get the extra arguments (masks, positions) the step computes; None for an nn.Sequential."""
        s = self.state
        if not isinstance(s.proxy, BlockListProxy):
            return None

        def middle(mb: Any, act: Tensor) -> Tensor:
            try:
                self.call_step(name, "middle", mb, rest, kwargs, act)
            except StageBoundary:
                assert s.proxy is not None
                return s.proxy.captured  # type: ignore[return-value]
            raise ModelLayoutError(f"{name} returned without running the blocks of '{s.stack_path}'")

        return middle

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One pipeline step over M micro-batches (forward and backward); returns the mean micro-batch loss.
        Under manual optimization (P = 1) the user's step as written, on this replica's rows: its
        ``manual_backward`` calls reach :meth:`backward`, which averages the gradients over the replicas."""
        s, host = self.state, self.host
        module = host.lightning_module
        g = s.groups
        assert module is not None and g is not None and s.p2p is not None and s.stage is not None
        trainer = module.trainer
        if not module.automatic_optimization:
            out = module.training_step(self.data.effective_batch(args[0]), *args[1:], **kwargs)
            self.data.count_samples(trainer.current_epoch)
            return out
        batch, rest = self.data.effective_batch(args[0]), tuple(args[1:])
        m_total = self.micro_batches
        micro = split_micro_batches(batch, m_total)
        params = [p for p in module.parameters() if p.requires_grad]
        # the gradients before this step are kept aside and put back after it -- unless Lightning is about to zero
        # them anyway (no accumulation, the module's own optimizer_zero_grad): then they are dropped now, so a
        # stage does not hold two gradient sets through its step (issue 22: 1.16-1.30x the peer's peak memory)
        previous = [None] * len(params) if _zeroed_after_step(module, trainer) else [p.grad for p in params]
        for p in params:
            p.grad = None
        results: list[Any] = []
        recorder = LogRecorder(module)

        def tail(mb: Any, act: Optional[Tensor]) -> Tensor:
            result = self.call_step("training_step", "full" if act is None else "tail", mb, rest, kwargs, act)
            results.append(result)
            return _loss_of(result)

        ops = schedule_ops(self.schedule, g.coords.stage, g.pipeline_stages, m_total)
        scale = 1.0 / (m_total * trainer.accumulate_grad_batches)
        if self.loss_scaling is not None:  # fp16: the scaler's S, the same on every rank
            scale *= self.loss_scaling.scale(_inner_optimizers(trainer))
        with recorder.active():
            run_train_schedule(
                ops, micro, s.stage, s.p2p, g.prev_rank(), g.next_rank(),
                self.head("training_step", rest, kwargs), tail, scale, host.precision_plugin.train_step_context,
                middle=self.middle("training_step", rest, kwargs),
            )
        self.pending_grads = [p.grad for p in params]
        for p, prev in zip(params, previous):
            p.grad = prev
        self.data.count_samples(trainer.current_epoch)
        if g.pipeline_stages == 1 or g.is_last_stage:
            losses = torch.stack([_loss_of(r).detach().float() for r in results])
            loss = losses.mean().to(losses.device)
            last = results[-1]
            extras = {k: v for k, v in last.items() if k != "loss"} if isinstance(last, Mapping) else None
            mine = StepOutcome(recorder.merged(), (loss, extras))
        else:
            mine = None
        outcome = self.share_outcome(mine)
        replay_calls(module, outcome.calls)
        loss, extras = outcome.result
        if extras is not None:
            return {**extras, "loss": loss}
        return loss

    def share_outcome(self, mine: Optional["StepOutcome"]) -> "StepOutcome":
        """The last stage's outcome of a step, on every stage of the pipeline (``mine`` on the last stage, ``None``
        elsewhere); at P = 1 ``mine`` itself.

        The outcome is pickled (tensors on the CPU, a logged Metric as its state) and broadcast over the pipeline
        group as one byte tensor; the receiving stages get it back with tensors on their device and their copies of
        the logged metrics holding the last stage's state. A step whose outcome cannot be pickled (a ``self.log``
        option that is not a plain value) fails with the same error on every stage instead of hanging the others.

        Raises:
            ConfigurationError: if the last stage's outcome cannot be sent.
        """
        s, host = self.state, self.host
        g = s.groups
        module = host.lightning_module
        assert g is not None and module is not None
        if g.pipeline_stages == 1:
            assert mine is not None
            return mine
        assert s.p2p is not None
        if g.is_last_stage:
            assert mine is not None
            try:
                payload = pickle.dumps(("ok", portable_calls(module, mine.calls), _to_cpu(mine.result)))
            except (pickle.PicklingError, TypeError, AttributeError, ConfigurationError) as exc:
                payload = pickle.dumps(("error", f"{type(exc).__name__}: {exc}", None))
            data: Optional[Tensor] = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(s.p2p.device)
        else:
            data = None
        data = s.p2p.broadcast(data, g.last_stage_rank())
        kind, calls, result = pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301 -- our own pipeline's stage
        if kind == "error":
            raise ConfigurationError(
                "under ParcaeStrategy (P > 1) what a step logs and returns is sent from the last pipeline stage to "
                f"the others, and this step's could not be sent ({calls}); log plain numbers, tensors or "
                "torchmetrics Metric attributes, with plain options"
            )
        if g.is_last_stage:
            assert mine is not None
            return mine
        return StepOutcome(local_calls(module, calls, host.root_device), _to_device(result, host.root_device))

    def eval_step(self, name: str, context: Callable[[], Any], *args: Any, **kwargs: Any) -> Any:
        """Evaluation at P > 1: the stack forward over the stages, then the user's step once on the last stage with
        the concatenated outputs; its logs and return value are replayed / returned on every stage."""
        s, host = self.state, self.host
        module = host.lightning_module
        g = s.groups
        assert module is not None and g is not None and s.p2p is not None and s.stage is not None
        with context():
            if g.pipeline_stages == 1:
                return getattr(module, name)(*args, **kwargs)
            batch, rest = args[0], tuple(args[1:])
            micro = chunk_batch(batch, self.micro_batches)
            middle = self.middle(name, rest, kwargs)  # block lists: the last stage also stops after its blocks
            outs = run_forward_only(micro, s.stage, s.p2p, g.prev_rank(), g.next_rank(),
                                    self.head(name, rest, kwargs), middle=middle, tail=middle)
            mine = None
            if g.is_last_stage:
                recorder = LogRecorder(module)
                with recorder.active():
                    result = self.call_step(name, "given", batch, rest, kwargs, torch.cat(outs))
                mine = StepOutcome(recorder.in_order(), result)
            outcome = self.share_outcome(mine)
            replay_calls(module, outcome.calls)
            return outcome.result

    # -------------------------------------------------------------------------------------------- gradients
    @contextmanager
    def no_sync(self) -> Generator[None, None, None]:
        """While Lightning accumulates, skip the data-parallel gradient all-reduce."""
        self.sync_grads = False
        try:
            yield None
        finally:
            self.sync_grads = True

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer] = None, *args: Any,
                 **kwargs: Any) -> Tensor:
        """Put back the gradients computed in :meth:`training_step`, then reduce them (unless accumulating).

        Manual optimization: ``manual_backward`` runs the real backward here, then every parameter's gradient is
        averaged over the D replicas -- after each call, so a step that calls it more than once (a GAN's two
        losses) gets what one process accumulates (the average is linear, and averaging gradients that are
        already equal on every replica leaves them unchanged)."""
        host = self.host
        module = host.lightning_module
        assert module is not None
        if not module.automatic_optimization:
            closure_loss = host.precision_plugin.pre_backward(closure_loss, module)
            host.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
            self.reduce_gradients()
            return host.precision_plugin.post_backward(closure_loss, module)
        closure_loss = host.precision_plugin.pre_backward(closure_loss, module)
        params = [p for p in module.parameters() if p.requires_grad]
        pending = self.pending_grads or [None] * len(params)
        for p, g in zip(params, pending):
            if g is not None:
                p.grad = g if p.grad is None else p.grad + g
        self.pending_grads = None
        if self.sync_grads:
            self.reduce_gradients()
        closure_loss = host.precision_plugin.post_backward(closure_loss, module)
        return closure_loss

    def replicated_params(self) -> list[nn.Parameter]:
        """Trainable parameters outside the layer stack that every stage keeps (not classified to a stage)."""
        return self._outside_params()[0]

    def tied_params(self) -> list[nn.Parameter]:
        """Trainable outside parameters held by the first and the last stage (``"both"``: tied input and output
        embeddings) that this process holds."""
        return self._outside_params()[1]

    def _outside_params(self) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
        s, host = self.state, self.host
        module = host.lightning_module
        assert module is not None and s.stage is not None
        local = {id(p) for p in s.stage.parameters()}
        replicated: list[nn.Parameter] = []
        tied: list[nn.Parameter] = []
        for name, p in module.named_parameters():
            if not p.requires_grad or id(p) in local or is_released(p):
                continue
            kind = s.outside.get(name)
            if kind is None:
                replicated.append(p)
            elif kind == "both":
                tied.append(p)
        return replicated, tied

    def reduce_gradients(self) -> None:
        """Sum the gradients of replicated parameters over the pipeline and those of a tied outside part between
        its two holders (the first and the last stage), then average everything this process holds over the D
        replicas (parameters without storage here have no gradient and are left out). On an emulated cluster the
        D-way all-reduce first sleeps the modelled ring all-reduce of the real model's gradients of this stage's
        layers (:func:`~lightning_parcae.runtime.link.charge_allreduce`)."""
        s, host = self.state, self.host
        g = s.groups
        module = host.lightning_module
        assert g is not None and module is not None
        replicated, tied = self._outside_params()
        if g.pipeline_stages > 1 and replicated:
            _all_reduce_grads(replicated, g.pipeline_group, 1.0)
        if g.pipeline_stages > 1 and tied and (g.is_first_stage or g.is_last_stage):
            ranks = g.pipeline_ranks(g.coords.replica)
            _exchange_sum_grads(tied, ranks[-1] if g.is_first_stage else ranks[0])
        if g.data_parallel > 1:
            if s.partition and not s.whole_model:  # an emulated cluster's link: the real model's gradient bytes
                charge_allreduce(range(*s.held_bounds()), g.data_parallel)
            special = {id(p) for p in replicated} | {id(p) for p in tied}
            held = [p for p in module.parameters() if p.requires_grad and not is_released(p)]
            # one flat buffer per kind: a part kept on several stages is reduced in the same order everywhere, so
            # its copies stay bitwise equal
            for part in ([p for p in held if id(p) not in special], replicated, tied):
                if part:
                    _all_reduce_grads(part, g.data_group, 1.0 / g.data_parallel)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        """Clip by the norm of the gradients of ALL parameters of the model (every stage's), like one process: each
        logical parameter counted once (a replicated or tied one on stage 0)."""
        s, host = self.state, self.host
        g = s.groups
        assert g is not None
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None and not is_released(p)]
        replicated, tied = self._outside_params()
        shared = {id(p) for p in replicated} | {id(p) for p in tied}
        sq = torch.zeros((), dtype=torch.float32, device=host.root_device)
        for p in params:
            if id(p) in shared and not g.is_first_stage:
                continue  # counted once, on stage 0
            sq += p.grad.detach().float().pow(2).sum()
        if g.pipeline_stages > 1:
            guarded(lambda: dist.all_reduce(sq, group=g.pipeline_group, async_op=True), "gradient-norm all-reduce",
                    collective=True)
        total = sq.sqrt()
        coef = torch.clamp(clip_val / (total + 1e-6), max=1.0)
        for p in params:
            p.grad.detach().mul_(coef.to(p.grad.dtype))



def _zeroed_after_step(module: Any, trainer: Any) -> bool:
    """Whether Lightning zeroes (sets to None) every gradient between this ``training_step`` and its backward: no
    accumulation, and ``optimizer_zero_grad`` is the LightningModule's own (``optimizer.zero_grad()``, whose
    ``set_to_none`` is torch's default). A module that overrides the hook keeps its gradients as before."""
    if int(getattr(trainer, "accumulate_grad_batches", 1)) != 1:
        return False
    hook = getattr(type(module), "optimizer_zero_grad", None)
    return (getattr(hook, "__qualname__", None) == "LightningModule.optimizer_zero_grad"
            and hook.__module__.split(".")[0] in ("pytorch_lightning", "lightning"))


def _inner_optimizers(trainer: Any) -> list[Optimizer]:
    """The trainer's torch optimizers (inside Lightning's wrappers)."""
    return [inner_optimizer(o) for o in getattr(trainer, "optimizers", [])]


def _loss_of(result: Any) -> Tensor:
    if isinstance(result, Tensor):
        return result
    if isinstance(result, Mapping) and isinstance(result.get("loss"), Tensor):
        return result["loss"]
    raise ConfigurationError(
        "under ParcaeStrategy training_step must return the loss tensor or a dict with a 'loss' tensor "
        f"(got {type(result).__name__})"
    )




def _to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor in it (through dicts, lists and tuples) detached and on the CPU."""
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)  # a copy: a view would pickle its whole storage
    if isinstance(obj, Mapping):
        return type(obj)((k, _to_cpu(v)) for k, v in obj.items())  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_cpu(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _to_device(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor in it on ``device``."""
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, Mapping):
        return type(obj)((k, _to_device(v, device)) for k, v in obj.items())  # type: ignore[call-arg]
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_device(v, device) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_device(v, device) for v in obj)
    return obj


def _flat_grads_by_dtype(params: list[nn.Parameter]) -> list[tuple[list[nn.Parameter], Tensor]]:
    """``params`` grouped by dtype, each group with its gradients in one new flat buffer (missing ones as zeros)."""
    by_dtype: dict[torch.dtype, list[nn.Parameter]] = {}
    for p in params:
        by_dtype.setdefault(p.dtype, []).append(p)
    return [(same, torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in same]))
            for same in by_dtype.values()]


def _set_grads_from_flat(params: list[nn.Parameter], flat: Tensor) -> None:
    """Give each of ``params`` its slice of ``flat`` (in order) as its gradient."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).clone()
        offset += n


_calls: dict[str, int] = {}


def _call_key(group: Any, dtype: torch.dtype) -> str:
    """The same string in every member of ``group`` for its k-th gradient all-reduce of ``dtype`` in this process
    (the group's ranks and the count; only for :func:`steptime.interval`, which matches calls across processes).

    The count is per process since its start, so keys match across members only while a group's members have been
    together from the start (``benchmarks/bench_scale.py`` reads them from runs without changes)."""
    ranks = dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))
    base = f"{','.join(map(str, ranks))}/{dtype}"
    _calls[base] = _calls.get(base, 0) + 1
    return f"{base}/{_calls[base]}"


def _all_reduce_grads(params: list[nn.Parameter], group: Any, scale: float) -> None:
    """Sum gradients over ``group`` in one flat buffer (missing gradients count as zero), times ``scale``."""
    for same, flat in _flat_grads_by_dtype(params):
        with steptime.interval("gradient all-reduce", _call_key(group, flat.dtype) if steptime.ON else ""):
            guarded(lambda: dist.all_reduce(flat, group=group, async_op=True), "gradient all-reduce", collective=True)
        if scale != 1.0:
            flat.mul_(scale)
        _set_grads_from_flat(same, flat)


_TIED_GRAD_TAG = 1 << 20
"""Point-to-point tag of the tied outside parts' gradients (far above the pipeline's ``3m + k`` tags)."""


def _exchange_sum_grads(params: list[nn.Parameter], peer: int) -> None:
    """Sum ``params``' gradients with the same parameters' on global rank ``peer`` (the other holder of a tied
    part): each side sends its flat gradients and adds the other's (missing gradients count as zero; addition is
    commutative, so both sides get bitwise the same sum)."""
    for k, (same, flat) in enumerate(_flat_grads_by_dtype(params)):
        other = torch.empty_like(flat)
        tag = _TIED_GRAD_TAG + k
        send = (lambda: dist.isend(flat, peer, tag=tag), "tied gradient send")
        recv = (lambda: dist.irecv(other, peer, tag=tag), "tied gradient receive")
        # the lower rank sends first, the other receives first (NCCL runs a pair's operations in issue order)
        works = [guarded_post(*op) for op in ((send, recv) if dist.get_rank() < peer else (recv, send))]
        for w in works:
            guarded_wait(w, "tied gradient exchange")
        flat.add_(other)
        _set_grads_from_flat(same, flat)
