"""lightning_parcae: proactive, liveput-optimized training on preemptible instances.

The problem: spot instances are cheap but disappear (with a short notice, or none) and reappear in bursts. A job
that reacts only after a loss restarts from a checkpoint every time; Parcae (NSDI '24) instead *predicts* the
instance count of the next intervals and picks the data-parallel x pipeline-parallel shape (D, P) that maximizes
*liveput* -- the throughput the job can expect once possible preemptions are counted -- and migrates stages
between live processes before the change happens.

Data flows one way, and the folders are that flow (a module imports only from folders to its left)::

    signals/   ->  planning/                                   ->  runtime/  ->  training/  ->  launch/
    traces,        forecast -> costmodel -> liveput ->             groups,       strategy,      run, agent,
    notices        shape_optimizer -> migration_plan; sim          pipeline,     callbacks      cli
                                                                   migration,
                                                                   elastic ...

``signals`` and ``planning`` are plain Python/numpy (``parcae simulate`` never imports torch); ``runtime`` is the
torch.distributed machinery; ``training`` is the Lightning strategy over it; ``launch`` starts and keeps the
processes. ``errors`` sits below everything; ``testing`` holds helpers for tests only. See ``docs/design.md``.

The public API is re-exported here, lazily, so that user imports stay short and planner-only users do not pay for
importing torch: ``from lightning_parcae import ParcaeStrategy, load_trace, simulate``.

Failure contract (``ParcaeStrategy(elastic=True)``, the default under ``parcae run``; details in
``docs/failure_contract.md``). In every case training ends with the parameters an uninterrupted run would reach:

* **Notice** (cloud metadata, SIGTERM, trace replay): at the next step boundary every member learns it, the leader
  plans the next shape and the member under notice hands over what it holds, then exits. No step is lost.
* **Sudden loss** (SIGKILL, a hung or vanished VM): heartbeats declare the member dead within seconds; the step in
  flight is applied everywhere or discarded everywhere (two-phase commit), survivors rebuild in place and re-run
  a discarded step with the same global batch.
* **Scale-up**: the new process waits as a warm standby and joins at a planning interval with its layers from live
  peers and the loop state from the leader -- no disk, no restart of the others.
* **A whole stage lost** (no live replica of some layer): every member says so loudly and exits with status 75;
  ``parcae run`` restarts the job from the last periodic checkpoint, losing only the steps since it.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "ParcaeStrategy": "lightning_parcae.training.strategy",
    "ParcaeRunCallback": "lightning_parcae.training.callbacks",
    "resume_path": "lightning_parcae.training.callbacks",
    "load_trace": "lightning_parcae.signals.traces",
    "make_predictor": "lightning_parcae.planning.forecast",
    "Shape": "lightning_parcae.planning.costmodel",
    "LiveputOptimizer": "lightning_parcae.planning.shape_optimizer",
    "plan_migration": "lightning_parcae.planning.migration_plan",
    "simulate": "lightning_parcae.planning.sim",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    # Lazy: the strategy pulls in torch and Lightning; keep planner-only users (``parcae simulate``) free of that.
    if name in ("ParcaeStrategy", "ParcaeRunCallback"):
        # the class of the Lightning namespace in use: lightning.pytorch when only it is imported, else
        # pytorch_lightning (explicit: lightning_parcae.training.strategy / lightning_parcae.lightning)
        from lightning_parcae.training.namespaces import likely_namespace  # noqa: PLC0415

        if name == "ParcaeStrategy":
            from lightning_parcae.training.strategy import strategy_class  # noqa: PLC0415

            return strategy_class(likely_namespace())
        from lightning_parcae.training.callbacks import callback_class  # noqa: PLC0415

        return callback_class("run", likely_namespace())
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'lightning_parcae' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


# ``strategy="parcae"`` resolves in pytorch_lightning and lightning.pytorch once either is imported
from lightning_parcae.training.autoregister import install as _install_autoregister  # noqa: E402

_install_autoregister()
