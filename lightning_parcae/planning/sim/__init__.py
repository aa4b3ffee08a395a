"""Trace-driven simulation of training policies (plain Python; the same optimizer and cost model as the runtime).

Problem: "on a trace like mine, what would each policy train, what would it cost, and why?" must be answerable
before any instance is rented. :func:`simulate` runs the chosen policies on a trace and returns a
:class:`Comparison` that prints as a table, saves as JSON and plots availability, the chosen D x P and the
cumulative samples of every policy.
"""

from lightning_parcae.planning.sim.policies import POLICIES, PolicyResult, run_policy
from lightning_parcae.planning.sim.report import Comparison, simulate

__all__ = ["POLICIES", "PolicyResult", "run_policy", "Comparison", "simulate"]
