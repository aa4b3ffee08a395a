"""The runtime: the only part of lightning_parcae that touches ``torch.distributed``.

Problem: the planner decides *what* shape the job should have; something has to host the coordination store,
rebuild process groups per generation, run the pipeline schedule and move layers between live processes. Each of
those concerns lives in its own module here; this package file deliberately imports none of them, so importing one
piece does not drag in the others.
"""
