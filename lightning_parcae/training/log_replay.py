"""``self.log`` under a pipeline: one merged call per step, recorded where the loss is, replayed on every stage.

Problem: the pipeline runs the user's ``training_step`` once per micro-batch, and only on the last stage, where
the outputs and the loss are; every ``self.log`` call would be issued M times with micro-batch values, and the
other stages -- rank 0 among them, which is the rank Lightning logs and checkpoints on -- would log nothing. The
recorder stands in for ``LightningModule.log`` during those calls and keeps them; :meth:`LogRecorder.merged` gives
one call per name merged as its ``reduce_fx`` says (mean / sum / max / min) with the summed ``batch_size``,
:meth:`LogRecorder.in_order` the calls as made (evaluation, one call of the user's step). The calls then cross to
the other stages -- only what was logged, never the outputs: :func:`portable_calls` turns them into plain,
picklable values (tensors detached on the CPU; a logged torchmetrics ``Metric`` by its attribute path and its
state), :func:`local_calls` turns them back on a receiving stage (loading the state into that stage's copy of the
metric, so that its step value and its epoch ``compute()`` are the last stage's) and :func:`replay_calls` issues
them to Lightning -- on every stage the same calls with the same values, so ``sync_dist``, the progress bar and
checkpoint monitors see what one process would.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import Tensor, nn

from lightning_parcae.errors import ConfigurationError

__all__ = ["LogCall", "LogRecorder", "MetricSnapshot", "portable_calls", "local_calls", "replay_calls"]


@dataclass(frozen=True)
class LogCall:
    """One ``self.log(name, value, **kwargs)`` call."""

    name: str
    value: Any
    kwargs: dict[str, Any]


class LogRecorder:
    """Collects the ``self.log`` calls of the user's step(s) while :meth:`active` (see the module docstring)."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: dict[str, list[tuple[Any, dict[str, Any]]]] = {}
        self.order: list[LogCall] = []

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise ConfigurationError("pass self.log options by keyword under ParcaeStrategy")
        self.calls.setdefault(name, []).append((value, kwargs))
        self.order.append(LogCall(name, value, kwargs))

    @contextmanager
    def active(self) -> Generator[None, None, None]:
        """While inside, ``module.log`` records here instead of reaching Lightning."""
        self.module.log = self  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.module.log

    def merged(self) -> list[LogCall]:
        """One call per name (in the order of first use): numbers merged by ``reduce_fx``, ``batch_size`` summed,
        anything else (a ``Metric``, a string) the last value."""
        out = []
        for name, calls in self.calls.items():
            value, kwargs = calls[-1]
            if isinstance(value, (Tensor, int, float)) and not isinstance(value, bool):
                values = torch.stack([torch.as_tensor(v, dtype=torch.float32).detach().float().reshape(())
                                      if not isinstance(v, Tensor) else v.detach().float().reshape(())
                                      for v, _ in calls])
                fx = kwargs.get("reduce_fx", "mean")
                fx_name = fx if isinstance(fx, str) else getattr(fx, "__name__", "mean")
                merged = {"sum": values.sum, "max": values.max, "min": values.min}.get(fx_name, values.mean)()
                if isinstance(value, Tensor):
                    merged = merged.to(value.device)
                value = merged
                sizes = [kw.get("batch_size") for _, kw in calls]
                if all(s is not None for s in sizes):
                    kwargs = {**kwargs, "batch_size": int(sum(sizes))}  # type: ignore[arg-type]
            out.append(LogCall(name, value, kwargs))
        return out

    def in_order(self) -> list[LogCall]:
        """Every recorded call, as made."""
        return list(self.order)

    def replay(self) -> None:
        """Issue :meth:`merged` to Lightning and forget the calls (one process holds the whole step)."""
        replay_calls(self.module, self.merged())
        self.calls.clear()
        self.order.clear()


def replay_calls(module: Any, calls: list[LogCall]) -> None:
    """Issue ``calls`` to Lightning's ``LightningModule.log`` on ``module``."""
    for call in calls:
        type(module).log(module, call.name, call.value, **call.kwargs)


# ---------------------------------------------------------------------------------------- crossing stages
@dataclass(frozen=True)
class MetricSnapshot:
    """A logged torchmetrics ``Metric`` as it crosses stages: where it lives in the module, and its state.

    Attributes:
        path: The metric's dotted attribute path in the LightningModule (as ``named_modules`` names it).
        state: Its metric states (``Metric.metric_state``), on the CPU.
        counters: The bookkeeping that makes its step value and ``compute()`` follow (see :func:`_metric_counters`).
    """

    path: str
    state: dict[str, Any]
    counters: dict[str, Any]


# torchmetrics' own fields behind a Metric's step value (``forward``'s cache, which Lightning logs on step), its
# ``compute()`` cache and its update count (torchmetrics 1.x). They have no public setter; they are read and
# written here only, by name, through the pickling protocol torchmetrics documents (``__getstate__`` /
# ``__setstate__`` ~ the instance dict). If torchmetrics renames them, a non-last stage logs no step value for a
# Metric (the epoch value, from the states, is unaffected).
_METRIC_COUNTERS = ("_forward_cache", "_update_count", "_computed")


def _metric_counters(metric: nn.Module) -> dict[str, Any]:
    state = metric.__getstate__()
    return {k: _to_cpu(state[k]) for k in _METRIC_COUNTERS if k in state}


def _is_metric(value: Any) -> bool:
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency of Lightning
        return False
    return isinstance(value, Metric)


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return obj.detach().to("cpu", copy=True)  # a copy: a view would pickle its whole storage
    if isinstance(obj, list):
        return [_to_cpu(v) for v in obj]
    return obj


def _to_device(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, Tensor):
        return obj.to(device)
    if isinstance(obj, list):
        return [_to_device(v, device) for v in obj]
    return obj


def _metric_path(module: nn.Module, metric: nn.Module) -> str:
    for path, sub in module.named_modules():
        if sub is metric:
            return path
    raise ConfigurationError(
        f"a logged torchmetrics {type(metric).__name__} is not an attribute of the LightningModule; under "
        "ParcaeStrategy (P > 1) a logged Metric must be a submodule (self.acc = Accuracy(...)) so that every "
        "pipeline stage's copy can take the last stage's state"
    )


def portable_calls(module: nn.Module, calls: list[LogCall]) -> list[LogCall]:
    """``calls`` as plain values that can be pickled to another stage: tensors detached on the CPU, a ``Metric``
    as a :class:`MetricSnapshot`.

    Raises:
        ConfigurationError: if a logged ``Metric`` is not a submodule of ``module``.
    """
    out = []
    for call in calls:
        value = call.value
        if _is_metric(value):
            value = MetricSnapshot(_metric_path(module, value), _to_cpu(dict(value.metric_state)),
                                   _metric_counters(value))
        elif isinstance(value, Tensor):
            value = value.detach().to("cpu", copy=True)  # a copy: a view pickles its whole storage
        out.append(LogCall(call.name, value, dict(call.kwargs)))
    return out


def local_calls(module: nn.Module, calls: list[LogCall], device: Optional[torch.device] = None) -> list[LogCall]:
    """The calls of :func:`portable_calls` on a receiving stage: tensors on ``device``, and each
    :class:`MetricSnapshot` loaded into this stage's copy of the metric, which then stands in the call."""
    out = []
    for call in calls:
        value = call.value
        if isinstance(value, MetricSnapshot):
            metric = module.get_submodule(value.path)
            target = metric.device
            restored = {k: _to_device(v, target) for k, v in value.state.items()}
            restored.update({k: _to_device(v, target) for k, v in value.counters.items()})
            metric.__dict__.update(restored)  # metric states are plain attributes (not buffers) in torchmetrics
            value = metric
        elif isinstance(value, Tensor) and device is not None:
            value = value.to(device)
        out.append(LogCall(call.name, value, call.kwargs))
    return out
