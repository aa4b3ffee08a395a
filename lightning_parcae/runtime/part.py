"""What every part of one process's live-reconfiguration protocol acts through: its connection to the job.

Problem: the protocol's halves -- the generation switch, failure recovery, admission of a joiner -- live in modules
of their own, and each needs the same handful of collaborators: this process's member id, the coordination store
and its records, the heartbeats, the lifecycle and the event log. Handing each part its owner (the
:class:`~lightning_parcae.runtime.elastic.ElasticRuntime`) to read them from let every part read and change
everything there. :class:`PartContext` names exactly that handful, typed; the runtime builds it once it is connected
and gives it to each part, and a test gives fakes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch.distributed as dist

from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.lifecycle import Lifecycle
from lightning_parcae.runtime.liveness import Liveness

__all__ = ["EventSink", "PartContext"]


class EventSink(Protocol):
    """Appends one event to the run's event log (``run_dir/events.jsonl``)."""

    def __call__(self, event_name: str, /, **fields: Any) -> None: ...


@dataclass(frozen=True)
class PartContext:
    """One process's connection to the job, as the runtime's parts use it.

    Owner: the :class:`~lightning_parcae.runtime.elastic.ElasticRuntime`, which builds it when it connects; frozen
    (a part uses these collaborators, it never replaces them).

    Attributes:
        member: This process's member id.
        store: The main thread's client of the coordination store.
        coord: The job's records in that store.
        live: The heartbeats, guarded waits and the abort flag of the current generation.
        life: This process's lifecycle (phase changes are logged as events).
        event: The event log.
    """

    member: str
    store: dist.Store
    coord: Coordinator
    live: Liveness
    life: Lifecycle
    event: EventSink
