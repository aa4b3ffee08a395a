"""The modelled network of an emulated cluster: what the real model's bytes would cost on the wire.

Problem: an emulated cluster (:mod:`lightning_parcae.testing.emulated_cluster`) trains a tiny model that stands for
a big one -- GPT-1.5B's stages hold gigabytes, its stage boundary carries 3.3 MB per sample, its gradients are
hundreds of MB per stage -- while the real tensors that move are a few KB. Without a charge for the bytes the
real model would move, every transfer of the emulation is free: a migration moves a stage in milliseconds, a
pipeline's sends cost nothing, and a data-parallel all-reduce costs nothing, so a wide D looks as cheap as a deep
P and the decisions the runtime makes on an emulated cluster are made against a network nobody has.

A :class:`LinkModel` says how long one process's link needs for each of the three kinds of traffic:

* ``charge(layers)`` -- a migration moving those layers' state (parameters and optimizer state);
* ``boundary_s(layer, samples)`` -- one pipeline message across the stage boundary after ``layer`` (an activation
  forward, or its gradient back: the same bytes) for ``samples`` samples;
* ``allreduce_s(layers, replicas)`` -- a ring all-reduce of those layers' gradients over ``replicas`` pipelines.

:func:`set_modelled_link` installs one per process (the emulated example does so in its ``setup``); the runtime
then sleeps the charge *on top of* the real transfer: a migration's :func:`~lightning_parcae.runtime.migration.
exchange` after it, a pipeline send before it is posted (a blocking send at the link's speed: the sender is busy
and the receiver gets the data when the modelled bytes would have arrived, as
:meth:`~lightning_parcae.testing.emulated_cluster.EmulatedWorkload.step_s` models it), the data-parallel gradient
all-reduce before it starts. The default is no link: nothing is added, and a real cluster never installs one.

A link that only has ``charge`` (written before the per-step traffic was modelled) still works: its per-step
traffic is free, as it was.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Optional, Protocol

__all__ = ["LinkModel", "set_modelled_link", "modelled_link", "charge_boundary", "charge_allreduce"]


class LinkModel(Protocol):
    """A modelled network link: the seconds one process's link needs for the traffic of the real model.

    ``boundary_s`` and ``allreduce_s`` are optional (see the module docstring); ``charge`` is required.
    """

    def charge(self, layers: Sequence[int]) -> float:
        """Seconds to move the state of ``layers`` (indices into the model's layer list) over one link."""
        ...


_modelled_link: Optional[LinkModel] = None


def set_modelled_link(link: Optional[LinkModel]) -> Optional[LinkModel]:
    """Install (or, with None, remove) this process's modelled link.

    Returns:
        The link installed before.
    """
    global _modelled_link
    previous, _modelled_link = _modelled_link, link
    return previous


def modelled_link() -> Optional[LinkModel]:
    """The installed link, or None."""
    return _modelled_link


def _sleep(seconds: float) -> float:
    seconds = float(seconds)
    if seconds > 0:
        time.sleep(seconds)
        return seconds
    return 0.0


def charge_boundary(layer: int, samples: int) -> float:
    """Sleep the modelled time of one pipeline message across the boundary after ``layer`` for ``samples`` samples.

    Returns:
        The seconds slept (0 without a link, or with one that does not model per-step traffic).
    """
    fn = getattr(_modelled_link, "boundary_s", None)
    return 0.0 if fn is None else _sleep(fn(int(layer), int(samples)))


def charge_allreduce(layers: Sequence[int], replicas: int) -> float:
    """Sleep the modelled time of a ring all-reduce of ``layers``' gradients over ``replicas`` pipelines.

    Returns:
        The seconds slept (0 without a link, with one that does not model per-step traffic, or for one replica).
    """
    fn = getattr(_modelled_link, "allreduce_s", None)
    if fn is None or replicas <= 1 or not layers:
        return 0.0
    return _sleep(fn([int(i) for i in layers], int(replicas)))
