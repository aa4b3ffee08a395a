"""Training: the Lightning side -- :class:`~lightning_parcae.training.strategy.ParcaeStrategy` and its callbacks.

Problem: a user's LightningModule must train on D x P processes whose number and shape change while it runs, with
exactly the parameters a single process would reach. The strategy composes the runtime (process groups, pipeline
schedule, live migration) behind Lightning's ``Strategy`` interface; the callbacks report progress to the launcher.
The pieces shared by both Lightning namespaces live beside it: ``namespaces`` (pytorch_lightning or
lightning.pytorch), ``environment`` (the launcher's cluster environment), ``autoregister`` (``strategy="parcae"``)
and ``boot`` (imported by workers at start-up). Nothing here is imported by :mod:`lightning_parcae.planning` or
:mod:`lightning_parcae.runtime`.
"""
