"""The launcher's worker processes: the record of one, the pool that signals and stops them, their environment,
free ports, the modes, the first generation's size.

Problem: the parts of ``parcae run`` (:mod:`.run`, :mod:`.fleet`, :mod:`.relaunch`, :mod:`.console`) and
``parcae agent`` all start or handle worker processes and need the same few facts about them; they live here,
below those parts. In particular the worker's environment is built by one function (:func:`worker_environment`,
its ``PARCAE_*`` part by :func:`lightning_parcae.contract.worker_contract`): it was built in three places with three
rules (the restart fallback kept any stray ``PARCAE_*`` variable of the launcher's own environment, such as a
``PARCAE_MEMBER`` or ``PARCAE_RUN_DIR`` left in the user's shell). The parts signal, stop and fail workers through
the small :class:`WorkerControl` protocol, which :class:`WorkerPool` implements (tests give them a fake).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Protocol, Sequence

from lightning_parcae.contract import ENV_PREFIX
from lightning_parcae.errors import ParcaeError

__all__ = ["ELASTIC", "RESTART_FALLBACK", "POLL_S", "initial_members", "free_port", "worker_environment", "Worker",
           "start_worker_process", "RunFailed", "WorkerControl", "WorkerPool"]

ELASTIC = "elastic"
"""Mode: membership changes are live reconfigurations in place (the default)."""
RESTART_FALLBACK = "restart-fallback"
"""Mode: every membership change stops the whole group and relaunches it from the checkpoint."""
POLL_S = 0.2
"""How often the launcher looks at its processes and the event log (seconds)."""


def initial_members(n: int, pipeline_stages: str, fewest: int = 0) -> tuple[int, int]:
    """How many of ``n`` instances start a (re)launch as initial members under ``--elastic``, and their P.

    The first generation's D must split the script's global batch; the launcher does not know the batch, so it
    takes the largest count whose D is a power of two (any usual batch size splits). The other instances start as
    warm standbys, and the liveput optimizer admits them when a shape that uses them is better.

    With ``auto`` and a model that needs ``fewest`` instances (what a fallback said: ``min_instances``), a power of
    two below it would be a first generation that cannot hold the model; then all ``n`` are members (D = 1 and
    P = n is always a split the strategy may pick).

    Args:
        n: Instances available (>= 1).
        pipeline_stages: ``--pipeline-stages`` (a number or ``auto``).
        fewest: The fewest instances the model fits on (0: not known).

    Returns:
        (members, P): ``members`` is ``D * P`` with D a power of two (for ``auto``, P is 0: the strategy picks a
        divisor of ``members``).
    """
    p = 0 if pipeline_stages == "auto" else min(int(pipeline_stages), n)
    d = 1
    while (2 * d) * max(p, 1) <= n:
        d *= 2
    if not p and d < fewest <= n:
        return n, p
    return d * max(p, 1), p


def worker_environment(base: Mapping[str, str], *, rank: int, world: int, local_rank: int, local_world: int,
                       master_port: int | str, parcae: Mapping[str, str], node_rank: int = 0,
                       master_addr: str = "127.0.0.1", keep: tuple[str, ...] = (),
                       shared_machine: bool = True) -> dict[str, str]:
    """The environment of one worker process: the torchrun-compatible variables plus Parcae's own.

    Args:
        base: The launcher's (or agent's) environment. Every ``PARCAE_*`` variable in it is dropped except those
            named in ``keep``: the worker contract comes from ``parcae`` only.
        rank, world: ``RANK`` / ``WORLD_SIZE`` (a joiner: 0 / 1; ranks change in place later).
        local_rank, local_world: ``LOCAL_RANK`` (this process's device slot) / ``LOCAL_WORLD_SIZE``.
        master_port: ``MASTER_PORT``.
        parcae: The ``PARCAE_*`` variables of this worker (see :mod:`lightning_parcae.contract`).
        node_rank: ``NODE_RANK`` / ``GROUP_RANK``.
        master_addr: ``MASTER_ADDR``.
        keep: ``PARCAE_*`` names of ``base`` to pass through (the agent's ``PARCAE_RESUME_CKPT``).
        shared_machine: The workers share one machine's cores (``parcae run``): ``OMP_NUM_THREADS=1`` unless set.
    """
    from lightning_parcae.training.environment import with_boot_path  # noqa: PLC0415

    env = {k: v for k, v in base.items() if not k.startswith(ENV_PREFIX) or k in keep}
    env.update({
        "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world), "GROUP_RANK": str(node_rank), "NODE_RANK": str(node_rank),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
    })
    env.update(parcae)
    if shared_machine:
        env.setdefault("OMP_NUM_THREADS", "1")
    return with_boot_path(env)  # strategy="parcae" resolves without an import of lightning_parcae


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
    candidate: bool = False
    """A start-up candidate of its launch whose roster is not written yet (``--elastic``): neither a member nor a
    standby so far; the roster makes it one or the other (``rank`` / ``joiner``)."""
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


def start_worker_process(command: Sequence[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``command`` in a session of its own (so its whole process group can be signalled), output to
    ``log_path``."""
    with open(log_path, "wb") as log:
        return subprocess.Popen(list(command), env=dict(env), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


class RunFailed(ParcaeError, RuntimeError):
    """A worker failed (crashed, rejected the token, or never started training); the message holds its log tail."""


class WorkerControl(Protocol):
    """What the launcher's parts may do to the run's worker processes (:class:`WorkerPool`, or a test's fake)."""

    workers: list[Worker]
    """The processes of the run, oldest first (the restart fallback: those of the current generation only)."""

    def signal(self, w: Worker, sig: int) -> None:
        """Send ``sig`` to ``w``'s process group (nothing if it is gone)."""

    def kill_all(self) -> None:
        """Stop every worker (SIGTERM, then SIGKILL)."""

    def failure(self, why: str, workers: Sequence[Worker]) -> RunFailed:
        """The error that fails the run: ``why`` and the tail of each of ``workers``' logs."""


class WorkerPool:
    """The run's worker processes: signals to their process groups, the stop of them all, a failure's log tails.

    Owned by the :class:`~.run.Launcher`; ``workers`` is appended to by ``Fleet.spawn`` (``--elastic``) and replaced
    by ``Relaunch`` (one generation at a time in the restart fallback).
    """

    def __init__(self) -> None:
        self.workers: list[Worker] = []

    def signal(self, w: Worker, sig: int) -> None:
        """Send ``sig`` to ``w``'s process group (nothing if it is gone)."""
        try:
            os.killpg(w.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def failure(self, why: str, workers: Sequence[Worker]) -> RunFailed:
        """The error that fails the run: ``why`` and the last 25 lines of each of ``workers``' logs."""
        tails = []
        for w in workers:
            try:
                text = w.log_path.read_text(errors="replace")
            except OSError:
                text = ""
            tail = "\n".join(text.splitlines()[-25:])
            tails.append(f"--- {w.log_path} (exit {w.proc.returncode}) ---\n{tail}")
        return RunFailed(f"{why}\n" + "\n".join(tails))

    def kill_all(self) -> None:
        """SIGTERM, then SIGKILL every worker's process group (idempotent; also run at exit)."""
        for w in self.workers:
            if w.alive():
                self.signal(w, signal.SIGTERM)
        t_end = time.time() + 2.0
        while time.time() < t_end and any(w.alive() for w in self.workers):
            time.sleep(0.05)
        for w in self.workers:
            if w.handled and not w.alive():
                continue  # exited and accounted for long ago: its pid may belong to someone else by now
            self.signal(w, signal.SIGKILL)  # also reaps grandchildren left in the group
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
