"""The launcher's worker processes: the record of one, free ports, the modes, the first generation's size.

Problem: the parts of ``parcae run`` (:mod:`.run`, :mod:`.fleet`, :mod:`.relaunch`, :mod:`.console`) all handle
worker processes and need the same few facts about them; they live here, below those parts.
"""

from __future__ import annotations

import socket
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

__all__ = ["ELASTIC", "RESTART_FALLBACK", "POLL_S", "initial_members", "free_port", "Worker"]

ELASTIC = "elastic"
"""Mode: membership changes are live reconfigurations in place (the default)."""
RESTART_FALLBACK = "restart-fallback"
"""Mode: every membership change stops the whole group and relaunches it from the checkpoint."""
POLL_S = 0.2
"""How often the launcher looks at its processes and the event log (seconds)."""


def initial_members(n: int, pipeline_stages: str) -> tuple[int, int]:
    """How many of ``n`` instances start a (re)launch as initial members under ``--elastic``, and their P.

    The first generation's D must split the script's global batch; the launcher does not know the batch, so it
    takes the largest count whose D is a power of two (any usual batch size splits). The other instances start as
    warm standbys, and the liveput optimizer admits them when a shape that uses them is better.

    Args:
        n: Instances available (>= 1).
        pipeline_stages: ``--pipeline-stages`` (a number or ``auto``).

    Returns:
        (members, P): ``members`` is ``D * P`` with D a power of two (for ``auto``, P is 0: the strategy picks a
        divisor of ``members``).
    """
    p = 0 if pipeline_stages == "auto" else min(int(pipeline_stages), n)
    d = 1
    while (2 * d) * max(p, 1) <= n:
        d *= 2
    return d * max(p, 1), p


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@dataclass
class Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    # --elastic only
    member: str = ""
    instance: int = -1
    joiner: bool = False
    launch: int = 0
    started: float = 0.0
    noticed_at: Optional[float] = None
    """When the trace removed this worker's instance (its notice); None if it was not removed."""
    deadline: Optional[float] = None
    sigterm_sent: bool = False
    killed: bool = False
    """The launcher sent SIGKILL (grace period over, a removed standby, a fallback's stragglers, the end)."""
    handled: bool = False

    def alive(self) -> bool:
        return self.proc.poll() is None
