"""Fakes of the launcher parts' typed collaborators: processes, the worker pool, the store, the event log.

The parts of ``parcae run`` (:mod:`lightning_parcae.launch.fleet`, ``relaunch``, ``console``) receive a
``RunState``, ``WorkerReports``, a ``WorkerControl``, a ``JobStore``, an event sink and a line printer; with these
fakes their decisions are tested without starting a process.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_parcae.launch.config import RunConfig
from lightning_parcae.launch.processes import RunFailed, Worker
from lightning_parcae.launch.state import RunState, WorkerReports


class FakeProc:
    """A process that is alive until ``returncode`` is set (a SIGKILL sets it to -9 when ``dies_on_kill``)."""

    _next_pid = 10_000

    def __init__(self, returncode: Optional[int] = None) -> None:
        FakeProc._next_pid += 1
        self.pid = FakeProc._next_pid
        self.returncode = returncode

    def poll(self) -> Optional[int]:
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            import subprocess  # noqa: PLC0415

            raise subprocess.TimeoutExpired("fake", timeout or 0)
        return self.returncode


class FakePool:
    """A ``WorkerControl``: records signals; SIGKILL ends a fake process with -9."""

    def __init__(self, workers: Sequence[Worker] = ()) -> None:
        self.workers: list[Worker] = list(workers)
        self.signals: list[tuple[str, int]] = []
        self.killed_all = 0

    def signal(self, w: Worker, sig: int) -> None:
        self.signals.append((w.member or f"rank{w.rank}", int(sig)))
        if sig == 9 and w.proc.returncode is None:
            w.proc.returncode = -9

    def kill_all(self) -> None:
        self.killed_all += 1
        for w in self.workers:
            if w.proc.returncode is None:
                w.proc.returncode = -9

    def failure(self, why: str, workers: Sequence[Worker]) -> RunFailed:
        return RunFailed(why)


class FakeStore:
    """A ``JobStore`` that keeps what was published."""

    def __init__(self, fail: bool = False) -> None:
        self.url, self.token = "tcp://127.0.0.1:1", "secret"
        self.published: list[tuple[str, dict[str, Any]]] = []
        self.fail = fail
        self.layout: Optional[dict[str, Any]] = None  # what current_layout returns (a test sets it)

    def publish(self, key: str, record: dict[str, Any]) -> None:
        if self.fail:
            raise OSError("store down")
        self.published.append((key, dict(record)))

    def current_layout(self) -> Optional[dict[str, Any]]:
        return self.layout


class EventLog:
    """An event sink: ``(kind, fields)`` per call."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def __call__(self, kind: str, /, **fields: Any) -> None:
        self.events.append((kind, fields))

    def kinds(self) -> list[str]:
        return [k for k, _ in self.events]

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [f for k, f in self.events if k == kind]


class Lines:
    """A line printer (``say``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, msg: str) -> None:
        self.lines.append(msg)


def worker(member: str, *, instance: int = 0, joiner: bool = False, launch: int = 0, rank: int = 0,
           returncode: Optional[int] = None, log_dir: Optional[Path] = None) -> Worker:
    """A ``Worker`` record over a :class:`FakeProc`."""
    log = (log_dir or Path("/nonexistent")) / f"{member}.log"
    return Worker(rank, FakeProc(returncode), log, member=member, instance=instance, joiner=joiner,  # type: ignore[arg-type]
                  launch=launch)


def config(tmp_path: Path, **kw: Any) -> RunConfig:
    """A ``RunConfig`` for ``tmp_path`` (no trace, a dummy command)."""
    base: dict[str, Any] = dict(instances=2, command=["python", "x.py"], run_dir=tmp_path, max_instances=4,
                                time_scale=10.0, grace_s=20.0, plot=False)
    base.update(kw)
    return RunConfig(**base)


def parts(tmp_path: Path, **cfg: Any) -> dict[str, Any]:
    """The collaborators every part takes, as fakes, in a dict."""
    return dict(cfg=config(tmp_path, **cfg), state=RunState(), reports=WorkerReports(), pool=FakePool(),
                store=FakeStore(), events=EventLog(), say=Lines())


def text_out() -> io.StringIO:
    return io.StringIO()
