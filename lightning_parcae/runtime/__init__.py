"""The runtime: process groups, the pipeline engine, liveness and in-place migration over ``torch.distributed``.

Problem: :mod:`lightning_parcae.planning` decides *what* shape the job should have; something has to host the coordination store,
rebuild process groups per generation, run the pipeline schedule and move layers between live processes. Each of
those concerns lives in its own module here; this package file deliberately imports none of them, so importing one
piece does not drag in the others. The runtime imports :mod:`lightning_parcae.planning` and
:mod:`lightning_parcae.signals`, never :mod:`lightning_parcae.training` or :mod:`lightning_parcae.launch`.
"""
