"""ParcaeStrategy for the ``lightning`` package (``import lightning as L`` / ``lightning.pytorch``).

The same strategy as :mod:`lightning_parcae.training.strategy`, built over ``lightning.pytorch``'s ``ParallelStrategy`` (a
``lightning.pytorch.Trainer`` accepts only strategies of its own class hierarchy)::

    import lightning as L
    trainer = L.Trainer(strategy="parcae")          # or:
    from lightning_parcae.lightning import ParcaeStrategy
    trainer = L.Trainer(strategy=ParcaeStrategy(pipeline_stages=2))
"""

from __future__ import annotations

from lightning_parcae.training.callbacks import callback_class
from lightning_parcae.training.strategy import strategy_class

__all__ = ["ParcaeStrategy", "ParcaeRunCallback", "ParcaeElasticCallback"]

ParcaeStrategy = strategy_class("lightning.pytorch")
ParcaeRunCallback = callback_class("run", "lightning.pytorch")
ParcaeElasticCallback = callback_class("elastic", "lightning.pytorch")
