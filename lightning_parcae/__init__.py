"""lightning_parcae: proactive, liveput-optimized training on preemptible instances.

The problem: spot instances are cheap but disappear (with a short notice, or none) and reappear in bursts. A job
that reacts only after a loss restarts from a checkpoint every time; Parcae (NSDI '24) instead *predicts* the
instance count of the next intervals and picks the data-parallel x pipeline-parallel shape (D, P) that maximizes
*liveput* -- the throughput the job can expect once possible preemptions are counted -- and migrates stages
between live processes before the change happens.

Data flows one way::

    availability signals -> predictor -> liveput optimizer -> migration plan -> runtime

The planner side (:mod:`~lightning_parcae.signals.traces`, :mod:`~lightning_parcae.planning.forecast`,
:mod:`~lightning_parcae.planning.costmodel`, :mod:`~lightning_parcae.planning.liveput`, :mod:`~lightning_parcae.planning.shape_optimizer`,
:mod:`~lightning_parcae.planning.migration_plan`, :mod:`~lightning_parcae.planning.sim`) is plain Python/numpy. The runtime
(:mod:`~lightning_parcae.training.strategy`, :mod:`~lightning_parcae.runtime`) imports it, never the reverse.

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

from typing import Any

__version__ = "0.1.0"

__all__ = ["__version__", "ParcaeStrategy"]


def __getattr__(name: str) -> Any:
    # The runtime pulls in torch; keep planner-only users (``parcae simulate``) free of that import cost.
    if name == "ParcaeStrategy":
        # the class of the Lightning namespace in use: lightning.pytorch when only it is imported, else
        # pytorch_lightning (explicit: lightning_parcae.training.strategy / lightning_parcae.lightning)
        from lightning_parcae.training.strategy import strategy_class
        from lightning_parcae.training.namespaces import likely_namespace

        return strategy_class(likely_namespace())
    raise AttributeError(f"module 'lightning_parcae' has no attribute {name!r}")


# ``strategy="parcae"`` resolves in pytorch_lightning and lightning.pytorch once either is imported
from lightning_parcae.training.autoregister import install as _install_autoregister  # noqa: E402

_install_autoregister()
