"""lightning_parcae: proactive, liveput-optimized training on preemptible instances.

The problem: spot instances are cheap but disappear (with a short notice, or none) and reappear in bursts. A job
that reacts only after a loss restarts from a checkpoint every time; Parcae (NSDI '24) instead *predicts* the
instance count of the next intervals and picks the data-parallel x pipeline-parallel shape (D, P) that maximizes
*liveput* -- the throughput the job can expect once possible preemptions are counted -- and migrates stages
between live processes before the change happens.

Data flows one way::

    availability signals -> predictor -> liveput optimizer -> migration plan -> runtime

The planner side (:mod:`~lightning_parcae.traces`, :mod:`~lightning_parcae.predictor`,
:mod:`~lightning_parcae.costmodel`, :mod:`~lightning_parcae.liveput`, :mod:`~lightning_parcae.optimizer`,
:mod:`~lightning_parcae.planner`, :mod:`~lightning_parcae.sim`) is plain Python/numpy. The runtime
(:mod:`~lightning_parcae.strategy`, :mod:`~lightning_parcae.runtime`) imports it, never the reverse.

See ``docs/failure_contract.md`` for what happens on a notice, a sudden loss, a scale-up and the loss of a whole
stage.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "ParcaeStrategy"]


def __getattr__(name: str) -> Any:
    # The runtime pulls in torch; keep planner-only users (``parcae simulate``) free of that import cost.
    if name == "ParcaeStrategy":
        from lightning_parcae.strategy import ParcaeStrategy

        return ParcaeStrategy
    raise AttributeError(f"module 'lightning_parcae' has no attribute {name!r}")
