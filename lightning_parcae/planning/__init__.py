"""Planning: what shape should the job have in the next intervals, and how does it get there?

Problem: given the instance counts seen so far, choose the data-parallel x pipeline-parallel shape (D, P) for the
coming intervals that maximizes *liveput* (throughput expected once possible preemptions are counted), and, when
the shape or membership changes, which process takes which stage and which layers move from whom.

The flow inside this package is one way::

    forecast -> costmodel -> liveput -> shape_optimizer -> policy -> migration_plan
                                                              \\-> sim (the same decision, replayed on a trace)

Everything here is plain Python / numpy / scipy / statsmodels: no torch, no torch.distributed. The runtime and the
simulator decide through the same :class:`~lightning_parcae.planning.policy.ShapeDecider` (one predictor factory,
one optimizer), so what ``parcae simulate`` predicts is what ``parcae run`` decides.
"""
