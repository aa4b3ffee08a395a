"""Merging ``self.log`` over micro-batches: one logged value per step, as a single process would log it.

Problem: the pipeline runs the user's ``training_step`` once per micro-batch (and other stages replay it on the
last stage's outputs), so every ``self.log`` call would be issued M times with micro-batch values. The recorder
stands in for ``LightningModule.log`` during those calls, keeps them, and replays one call per name merged as its
``reduce_fx`` says (mean / sum / max / min) with the summed ``batch_size``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from lightning_parcae.errors import ConfigurationError

__all__ = ["LogRecorder"]


class LogRecorder:
    """Collects ``self.log`` calls of the M micro-steps and replays one merged call per name."""

    def __init__(self, module: Any) -> None:
        self.module = module
        self.calls: dict[str, list[tuple[Any, dict[str, Any]]]] = {}

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if args:
            raise ConfigurationError("pass self.log options by keyword under ParcaeStrategy")
        self.calls.setdefault(name, []).append((value, kwargs))

    @contextmanager
    def active(self) -> Generator[None, None, None]:
        self.module.log = self  # type: ignore[method-assign]
        try:
            yield
        finally:
            del self.module.log

    def replay(self) -> None:
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
            type(self.module).log(self.module, name, value, **kwargs)
        self.calls.clear()
