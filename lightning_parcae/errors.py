"""Errors named by their cause.

Problem: a user who passes a malformed trace, an impossible pipeline shape or a foreign ``Trainer`` must be told
what was given, what was expected and how to fix it -- not see a traceback from deep inside numpy or torch. Every
error the package raises on purpose is a subclass of :class:`ParcaeError` so callers can catch the family, and each
subclass names one cause.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, TypeVar

__all__ = [
    "ParcaeError",
    "TraceFormatError",
    "ConfigurationError",
    "InfeasibleShapeError",
    "ModelLayoutError",
    "BatchSplitError",
    "StageMemoryError",
    "ForeignTrainerError",
    "CheckpointStorageError",
    "CoordinationError",
    "NoticeSourceError",
    "PeerLostError",
    "RendezvousError",
    "build_by_name",
]

_T = TypeVar("_T")


class ParcaeError(Exception):
    """Base class of every error raised on purpose by lightning_parcae."""


class TraceFormatError(ParcaeError, ValueError):
    """A trace file could not be read: names the file, the line and what was expected there."""


class ConfigurationError(ParcaeError, ValueError):
    """An option or a combination of options is invalid (says what was given and what is accepted)."""


class InfeasibleShapeError(ConfigurationError):
    """No (D, P) shape satisfies the constraints (instances, pipeline-depth limits, memory)."""


class ModelLayoutError(ConfigurationError):
    """The LightningModule cannot be split into pipeline stages as given (no layer stack, too few layers)."""


class BatchSplitError(ConfigurationError):
    """The global batch cannot be split evenly into D pipelines x micro-batches."""


class StageMemoryError(ConfigurationError):
    """A pipeline stage does not fit the per-stage memory limit."""


class ForeignTrainerError(ParcaeError, TypeError):
    """A ``lightning.pytorch`` Trainer (or other foreign object) was given where ``pytorch_lightning`` is needed."""


class CheckpointStorageError(ConfigurationError):
    """The checkpoint location cannot be used: no fsspec backend for its scheme, no credentials, a bucket that does
    not exist or cannot be written, an endpoint that cannot be reached. Found at start, before any training."""


class CoordinationError(ParcaeError, RuntimeError):
    """The coordination store is unreachable, refused our token, or disagrees with this process's generation."""


class NoticeSourceError(ParcaeError, RuntimeError):
    """A preemption-notice source (cloud metadata, signal, replay) could not be read or is misconfigured."""


class PeerLostError(ParcaeError, RuntimeError):
    """A member of the current generation died or stopped answering; the collective in flight was abandoned.

    Raised out of a guarded wait (see :mod:`lightning_parcae.runtime.liveness`) so that the step in flight is
    discarded on every survivor and the job recovers under a new generation.
    """


class RendezvousError(ParcaeError, RuntimeError):
    """The process groups of a generation could not be formed within the bound: a member never arrived at the
    rendezvous, or one arrived and vanished before every connection to it was made."""


def build_by_name(registry: Mapping[str, Callable[..., _T]], name: Any, kwargs: Mapping[str, Any], *,
                  unknown: str, bad: str) -> _T:
    """``registry[name](**kwargs)``, with a user's two mistakes named: a name not in the registry, and keywords
    the constructor does not take.

    Args:
        registry: The known constructors by name.
        name: The name the user gave.
        kwargs: The keywords the user gave.
        unknown: The message for a name not in ``registry`` (it should list the known ones).
        bad: What was being built, for the message ``"<bad>: <the TypeError>"`` on refused keywords.

    Raises:
        ConfigurationError: for either mistake.
    """
    if name not in registry:
        raise ConfigurationError(unknown)
    try:
        return registry[name](**kwargs)
    except TypeError as exc:
        raise ConfigurationError(f"{bad}: {exc}") from None
