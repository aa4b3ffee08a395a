"""Heartbeats and abortable waits: a silent member is declared dead in seconds, and waits stop at once."""

from __future__ import annotations

import threading
import time
from typing import Iterator

import pytest

from lightning_parcae.errors import PeerLostError
from lightning_parcae.runtime.liveness import Liveness, abort_key, activate, guarded_wait, notice_key
from lightning_parcae.runtime.store import connect_store, host_store


@pytest.fixture
def url() -> Iterator[str]:
    server = host_store("tcp://127.0.0.1:0")
    yield f"tcp://127.0.0.1:{server.port}"


def _live(url: str, member: str, **kw: float) -> Liveness:
    return Liveness(lambda: connect_store(url, token=None), member, interval_s=0.05, dead_after_s=0.5, **kw)


class _BlockingWork:
    """A stand-in for a collective stuck on a dead peer (``wait`` never returns unless released)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.error: Exception | None = None

    def wait(self) -> bool:
        self.release.wait()
        if self.error is not None:
            raise self.error
        return True


def test_liveness_declares_a_member_dead_if_its_heartbeat_stops(url: str) -> None:
    a, b = _live(url, "a").start(), _live(url, "b").start()
    try:
        a.set_generation(7, ["b"])
        b.set_generation(7, ["a"])
        time.sleep(0.3)
        assert not a.aborted.is_set()
        t0 = time.monotonic()
        b.stop()
        assert a.aborted.wait(5.0), "a never noticed that b went silent"
        assert time.monotonic() - t0 < 2.0
        assert "b missed heartbeats" in a.reason
        store = connect_store(url, token=None)
        assert bytes(store.get(abort_key(7))).decode() == a.reason
    finally:
        a.stop()
        b.stop()


def test_guarded_wait_raises_peer_lost_if_the_generation_is_aborted_while_waiting(url: str) -> None:
    a = _live(url, "a").start()
    activate(a)
    try:
        a.set_generation(1, [])
        work = _BlockingWork()
        threading.Timer(0.2, lambda: a.abort("test: peer gone")).start()
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match="peer gone"):
            guarded_wait(work, "pipeline receive")
        assert time.monotonic() - t0 < 1.5
        with pytest.raises(PeerLostError):  # the next wait of the aborted generation fails at once
            guarded_wait(_BlockingWork(), "next")
    finally:
        activate(None)
        a.stop()


def test_guarded_wait_aborts_the_generation_if_the_operation_itself_fails(url: str) -> None:
    a = _live(url, "a").start()
    activate(a)
    try:
        a.set_generation(2, [])
        work = _BlockingWork()
        work.error = RuntimeError("Connection closed by peer [127.0.0.1]:1234")
        work.release.set()
        with pytest.raises(PeerLostError, match="Connection closed"):
            guarded_wait(work, "gradient all-reduce")
        assert a.aborted.is_set()
        store = connect_store(url, token=None)
        assert store.check([abort_key(2)])
    finally:
        activate(None)
        a.stop()


def test_guarded_wait_returns_if_no_liveness_is_active() -> None:
    work = _BlockingWork()
    work.release.set()
    guarded_wait(work)


def test_liveness_sets_noticed_if_a_launcher_writes_a_notice_for_this_member(url: str) -> None:
    a = _live(url, "a").start()
    try:
        connect_store(url, token=None).set(notice_key("a"), '{"kind": "preempt"}')
        assert a.noticed.wait(2.0)
    finally:
        a.stop()
