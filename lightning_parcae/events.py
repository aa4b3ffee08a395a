"""The run's event log: one JSON object per line in ``run_dir/events.jsonl``.

Problem: the launcher (``parcae run``), the Lightning callbacks and the elastic runtime all report what happened
(progress, phases, decisions, migrations, exits) to one place the launcher tails and the report reads. Writers live
in different processes and different layers, so the format and the write must be defined once, below all of them:
a single ``write`` on an ``O_APPEND`` file keeps concurrent lines whole without a lock.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

__all__ = ["EVENTS_FILE", "append_event"]

EVENTS_FILE = "events.jsonl"
"""The event log's file name inside the run directory."""


def append_event(run_dir: str | os.PathLike[str], event: dict[str, Any]) -> None:
    """Append one JSON line to ``run_dir/events.jsonl`` (a single ``write`` on an ``O_APPEND`` file).

    Args:
        run_dir: The run directory.
        event: A JSON-safe dict; ``time`` (``time.time()``) is added when missing.
    """
    event = {"time": time.time(), **event}
    line = (json.dumps(event, sort_keys=True) + "\n").encode()
    fd = os.open(os.path.join(os.fspath(run_dir), EVENTS_FILE), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
