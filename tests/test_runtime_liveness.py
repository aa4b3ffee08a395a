"""Heartbeats and abortable waits: a silent member is declared dead in seconds, and waits stop at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from typing import Iterator

import pytest

from lightning_parcae.errors import PeerLostError
from lightning_parcae.runtime.liveness import Liveness, SilenceClock, abort_key, dead_key, hb_key, left_key, activate, guarded_wait, notice_key
from lightning_parcae.runtime.store import connect_store, host_store

from conftest import record_client_calls


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
        assert bytes(store.get(dead_key(7, "b"))).decode() == a.reason  # who, for recovery (a lost joiner)
    finally:
        a.stop()
        b.stop()


def test_a_member_that_left_as_planned_is_not_declared_dead_when_its_heartbeat_stops(url: str) -> None:
    """Regression (``tests/netns_harness.py --machines 32 --seed 8``): a leaver by notice exits after its hand-over;
    the members that stay watched it until the new generation's groups were built, declared it dead when that took
    longer than the silence bound, and abandoned a switch none of whose ranks was missing. A leaver now writes its
    ``left_key`` first: its silence aborts nothing, while a silent member without one is still declared dead."""
    a, b, c = _live(url, "a").start(), _live(url, "b").start(), _live(url, "c").start()
    store = connect_store(url, token=None)
    try:
        a.set_generation(8, ["b", "c"])
        b.set_generation(8, ["a", "c"])
        c.set_generation(8, ["a", "b"])
        time.sleep(0.2)
        store.set(left_key(8, "b"), "notice")
        b.stop()  # b leaves as planned
        time.sleep(1.5)  # three times the silence bound
        assert not a.aborted.is_set() and not c.aborted.is_set(), (a.reason, c.reason)
        assert "b" not in a._watch and "b" not in c._watch
        c.stop()  # c, with no left key, goes silent
        assert a.aborted.wait(5.0) and "c missed heartbeats" in a.reason
    finally:
        for x in (a, b, c):
            x.stop()


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


class _DoneWork:
    """A finished operation: ``is_completed()`` is true; ``wait`` records the thread it ran on (or fails)."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.waited_on: list[str] = []

    def is_completed(self) -> bool:
        return True

    def wait(self) -> bool:
        self.waited_on.append(threading.current_thread().name)
        if self.error is not None:
            raise self.error
        return True


@pytest.mark.parametrize("n", [1, 5])
def test_guarded_wait_finishes_a_completed_operation_on_the_calling_thread(url: str, n: int) -> None:
    """Regression (issue 13, elastic step overhead): every guarded wait was handed to the helper thread, and each
    hand-off cost a thread switch (~0.3 ms under load) even for operations that had already finished."""
    a = _live(url, "a").start()
    activate(a)
    try:
        a.set_generation(3, [])
        works = [_DoneWork() for _ in range(n)]
        for w in works:
            guarded_wait(w, "pipeline send")
        assert all(w.waited_on == [threading.current_thread().name] for w in works)
        assert a._waiter_thread is None  # the helper was never needed
        pending = _BlockingWork()  # one that has not finished still goes through the abortable helper
        threading.Timer(0.1, pending.release.set).start()
        guarded_wait(pending, "pipeline receive")
        assert a._waiter_thread is not None
    finally:
        activate(None)
        a.stop()


@pytest.mark.parametrize("message", ["Connection closed by peer [127.0.0.1]:1234", ""])
def test_guarded_wait_aborts_the_generation_if_a_completed_operation_failed(url: str, message: str) -> None:
    a = _live(url, "a").start()
    activate(a)
    try:
        a.set_generation(4, [])
        with pytest.raises(PeerLostError, match="gradient all-reduce failed"):
            guarded_wait(_DoneWork(RuntimeError(message)), "gradient all-reduce")
        assert a.aborted.is_set()
        assert connect_store(url, token=None).check([abort_key(4)])
        with pytest.raises(PeerLostError, match="aborted"):  # and nothing runs in the aborted generation after it
            guarded_wait(_DoneWork(), "pipeline send")
    finally:
        activate(None)
        a.stop()


class _SlicedWork:
    """A gloo-like collective: ``wait(timeout)`` raises "Operation timed out!" until it is released."""

    def __init__(self, slices_before_done: int, error: Exception | None = None) -> None:
        self.left = slices_before_done
        self.error = error
        self.timeouts: list[object] = []
        self.threads: set[str] = set()

    def is_completed(self) -> bool:
        return self.left <= 0

    def wait(self, timeout: object = None) -> bool:
        self.threads.add(threading.current_thread().name)
        if self.left > 0:
            if timeout is None:
                raise AssertionError("a plain wait() on a pending collective would block")
            self.left -= 1
            self.timeouts.append(timeout)
            raise RuntimeError("Operation timed out!")
        if self.error is not None:
            raise self.error
        return True


@pytest.mark.parametrize("slices", [1, 3, 10])
def test_liveness_waits_a_collective_in_slices_on_the_calling_thread(url: str, slices: int) -> None:
    a = _live(url, "a").start()
    try:
        a.set_generation(5, [])
        work = _SlicedWork(slices)
        a.wait(work, "step agreement", sliced=True)
        assert len(work.timeouts) == slices and work.threads == {threading.current_thread().name}
        assert a._waiter_thread is None and not a.aborted.is_set()
    finally:
        a.stop()


@pytest.mark.parametrize("slices", [0, 2])
def test_liveness_aborts_if_a_sliced_collective_failed(url: str, slices: int) -> None:
    a = _live(url, "a").start()
    try:
        a.set_generation(6, [])
        with pytest.raises(PeerLostError, match="gradient all-reduce failed: Connection closed"):
            a.wait(_SlicedWork(slices, RuntimeError("Connection closed by peer")), "gradient all-reduce", sliced=True)
        assert a.aborted.is_set() and connect_store(url, token=None).check([abort_key(6)])
    finally:
        a.stop()


def test_liveness_abandons_a_sliced_collective_if_the_generation_is_aborted(url: str) -> None:
    a = _live(url, "a").start()
    try:
        a.set_generation(7, [])
        work = _SlicedWork(10**9)  # a peer that never comes
        threading.Timer(0.2, lambda: a.abort("peer x lost")).start()
        t0 = time.monotonic()
        with pytest.raises(PeerLostError, match="peer x lost"):
            a.wait(work, "step agreement", sliced=True)
        assert time.monotonic() - t0 < 5.0 and work in a._parked
    finally:
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


# ------------------------------------------------------------------------------------------------ store outages
def test_silence_clock_counts_a_blind_round_only_up_to_its_bound() -> None:
    clock = SilenceClock(blind_after_s=1.0)
    clock.reset(["a"], now=0.0)
    assert clock.silent_for("a", b"1", now=0.0) == 0.0
    clock.tick(0.2)
    assert clock.silent_for("a", b"1", now=0.2) == pytest.approx(0.2)
    clock.tick(5.2)  # the reads of this round blocked for 5 s (the store did not answer)
    assert clock.silent_for("a", b"1", now=5.2) == pytest.approx(1.2)
    assert clock.silent_for("a", b"2", now=5.2) == 0.0  # a changed heartbeat: not silent at all


def test_silence_clock_still_finds_a_dead_member_if_every_round_is_slow() -> None:
    """A watcher whose every round is slow (a loaded machine) must still declare a dead member dead."""
    clock = SilenceClock(blind_after_s=1.0)
    clock.reset(["a"], now=0.0)
    now, silent = 0.0, 0.0
    for _ in range(4):
        now += 4.0
        clock.tick(now)
        silent = clock.silent_for("a", None, now)
    assert silent >= 3.0


class _OutageStore:
    """A store client that stops answering (every call blocks) while ``answering`` is clear -- the view of a member
    whose store is unreachable."""

    def __init__(self, inner: object, answering: threading.Event) -> None:
        self._inner, self._answering = inner, answering

    def __getattr__(self, name: str) -> object:
        op = getattr(self._inner, name)

        def call(*args: object, **kwargs: object) -> object:
            self._answering.wait()
            return op(*args, **kwargs)

        return call


def test_liveness_does_not_count_a_store_outage_as_a_peers_silence(url: str) -> None:
    """Regression: the store unreachable for a few seconds made every heartbeat look old when it answered again
    (the peers could not write either, and their next beat comes a round later), so members that were all alive
    declared each other dead and a store hiccup became a recovery. Here the watcher's store blocks for 4 s and the
    peer's heartbeat resumes 0.3 s after it answers again: nobody may be declared dead (bound 1.5 s)."""
    answering = threading.Event()
    answering.set()
    a = Liveness(lambda: _OutageStore(connect_store(url, token=None), answering), "a", interval_s=0.05,
                 dead_after_s=1.5).start()
    peer = connect_store(url, token=None)
    beating = threading.Event()
    beating.set()
    stop = threading.Event()

    def beat() -> None:
        c = 0
        while not stop.wait(0.05):
            if beating.is_set():
                c += 1
                peer.set(hb_key("b"), str(c))

    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        a.set_generation(5, ["b"])
        time.sleep(0.5)
        beating.clear()
        answering.clear()
        time.sleep(4.0)
        answering.set()
        time.sleep(0.3)
        beating.set()
        time.sleep(1.0)
        assert not a.aborted.is_set(), a.reason
        beating.clear()  # b really goes silent now: still found
        assert a.aborted.wait(5.0), "a member silent after the outage was never declared dead"
    finally:
        answering.set()
        stop.set()
        a.stop()


@pytest.fixture
def paused_store_url() -> Iterator[tuple[str, subprocess.Popen]]:
    """A store hosted by its own process, so that the test can make it stop answering (SIGSTOP) and come back."""
    code = ("import sys, time\nfrom lightning_parcae.runtime.store import host_store\n"
            "s = host_store('tcp://127.0.0.1:0')\nprint(s.port, flush=True)\ntime.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(proc.stdout.readline())
        yield f"tcp://127.0.0.1:{port}", proc
    finally:
        proc.kill()
        proc.wait()


def test_liveness_declares_nobody_dead_if_the_store_stops_answering_for_a_while(
        paused_store_url: tuple[str, subprocess.Popen]) -> None:
    """Regression: the store unreachable for a few seconds (here: its process stopped for 4 s, so every read
    blocks in silence) made every heartbeat look old when it answered again, and the members -- all alive --
    declared each other dead, turning a store hiccup into a recovery. Time during which the watcher could not
    read the store is not counted as anyone's silence."""
    url, proc = paused_store_url
    live = [Liveness(lambda: connect_store(url, token=None), m, interval_s=0.05, dead_after_s=1.5).start()
            for m in ("a", "b", "c")]
    try:
        for lv in live:
            lv.set_generation(3, ["a", "b", "c"])
        time.sleep(0.5)
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(4.0)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(2.0)
        assert not any(lv.aborted.is_set() for lv in live), [lv.reason for lv in live]
        # and a member that really goes silent after the outage is still found
        live[2].stop()
        assert live[0].aborted.wait(6.0), "a member that stopped after the outage was never declared dead"
        assert "c missed heartbeats" in live[0].reason
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        for lv in live:
            lv.stop()


def test_wait_key_sees_a_key_soon_after_it_is_set_with_many_waiters(url: str) -> None:
    """Regression (issue 21): ``wait_key`` looped over ``TCPStore.wait([key], 50 ms)``. With c10d's default C++
    log level every timed-out wait logs two warnings, and after ~5 s of them torch 2.13's client stalls ~5 s in one
    wait: at N=16 four members entered the next generation 5 s late, the leaver's grace ran out and the job fell
    back to a restart. 16 waiters here (one connection each, as members have) waited 4.3-4.7 s for a key set after
    1 s with the old loop; polling with ``check`` sees it within tens of ms."""
    from lightning_parcae.runtime.store import connect_store as connect

    lives = [Liveness(lambda: connect(url, token=None), f"w{i}", interval_s=0.05, dead_after_s=30.0)
             for i in range(16)]
    stores = [connect(url, token=None) for _ in lives]
    seen: list[float] = []
    set_at = [0.0]

    def wait(i: int) -> None:
        lives[i].wait_key(stores[i], "parcae/genrec/1", "waiting for the next generation")
        seen.append(time.monotonic() - set_at[0])

    threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    time.sleep(1.0)  # long enough for the old loop's ~20 timed-out waits per waiter
    set_at[0] = time.monotonic()
    connect(url, token=None).set("parcae/genrec/1", "{}")
    for t in threads:
        t.join(15)
    assert len(seen) == 16, "a waiter never saw the key"
    assert max(seen) < 1.0, f"waiters saw the key {max(seen):.2f} s after it was set"


class _CountingStore:
    """A real TCPStore behind a counter of the requests a caller makes."""

    def __init__(self, store: object) -> None:
        self.store = store
        self.requests: list[str] = []

    def check(self, keys: list[str]) -> bool:
        self.requests.append("check")
        return self.store.check(keys)  # type: ignore[attr-defined]

    def get(self, key: str) -> bytes:
        self.requests.append("get")
        return self.store.get(key)  # type: ignore[attr-defined]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self.requests.append("multi_get")
        return self.store.multi_get(keys)  # type: ignore[attr-defined]


def test_reading_every_members_heartbeat_takes_two_requests_whatever_the_members() -> None:
    """Regression (issue 21): the leader's heartbeat thread read each watched member with its own check and get,
    in series -- 2N requests a beat (64 at N = 32), 2N network round trips across machines. Once every member has
    beaten it is one check of all keys and one multi_get; while one has not, one check + get each (a multi_get
    would wait for the missing key), with the same result."""
    from lightning_parcae.runtime.liveness import read_beats

    store = host_store("tcp://127.0.0.1:0", token=None)
    members = [f"i{k}" for k in range(32)]
    for k, m in enumerate(members):
        store.set(hb_key(m), f'{{"c": {k}}}')
    counted = _CountingStore(store)
    beats = read_beats(counted, members)  # type: ignore[arg-type]
    assert beats == {m: f'{{"c": {k}}}'.encode() for k, m in enumerate(members)}
    assert counted.requests == ["check", "multi_get"]
    counted.requests.clear()
    beats = read_beats(counted, [*members[:3], "late"])  # type: ignore[arg-type]
    assert beats == {"i0": b'{"c": 0}', "i1": b'{"c": 1}', "i2": b'{"c": 2}', "late": None}
    assert "multi_get" not in counted.requests


def _etcd_job_store(etcd_server: object, prefix: str) -> object:
    url = etcd_server.store_url(prefix)  # type: ignore[attr-defined]
    host_store(url, token=None)
    return connect_store(url, token=None)


def test_wait_key_on_etcd_watches_the_key_instead_of_polling(etcd_server: object) -> None:
    """Regression (issue 21): ``wait_key`` polled with ``check`` every 20 ms whatever the store, so on etcd every
    member waiting for its step's commit decision sent up to 50 requests a second. On a store that can watch one
    key it now waits in watch slices: a 1 s wait costs a handful of requests, not ~50, and ends when the key is
    written."""
    store = _etcd_job_store(etcd_server, "/parcae/t-waitkey")
    calls = record_client_calls(store)
    live = Liveness(lambda: _etcd_job_store(etcd_server, "/parcae/t-waitkey"), "m0", interval_s=0.05,
                    dead_after_s=3.0)
    writer = _etcd_job_store(etcd_server, "/parcae/t-waitkey")
    threading.Timer(1.0, lambda: writer.set(  # type: ignore[attr-defined]
        "parcae/commit/1/5/decision", "apply")).start()
    t0 = time.monotonic()
    live.wait_key(store, "parcae/commit/1/5/decision", "commit of step 5")  # type: ignore[arg-type]
    took = time.monotonic() - t0
    assert 0.95 <= took < 1.3, took
    assert len(calls) <= 2 * (1.0 / live.watch_s + 1) + 1, calls  # a read and a watch per 0.2 s slice at most
    assert calls.count("watch") >= 1


def test_wait_key_on_etcd_still_ends_on_an_abort_within_a_slice(etcd_server: object) -> None:
    """The watch cannot see the abort flag: the wait must still end within one slice of the abort."""
    store = _etcd_job_store(etcd_server, "/parcae/t-waitabort")
    live = Liveness(lambda: _etcd_job_store(etcd_server, "/parcae/t-waitabort"), "m0", interval_s=0.05,
                    dead_after_s=3.0)
    aborted_at = [0.0]

    def abort() -> None:
        aborted_at[0] = time.monotonic()
        live.reason = "m1 missed heartbeats"
        live.aborted.set()

    threading.Timer(0.5, abort).start()
    with pytest.raises(PeerLostError, match="m1 missed heartbeats"):
        live.wait_key(store, "parcae/commit/1/6/decision", "commit of step 6")  # type: ignore[arg-type]
    assert time.monotonic() - aborted_at[0] < live.watch_s + 0.25


def _counted_etcd_factory(etcd_server: object, prefix: str) -> tuple[list[list[str]], "object"]:
    """A store factory for a Liveness on etcd that records each opened client's requests (python-etcd's
    ``read``/``write``/``delete``: every request goes through one of them), one list per client, in order."""
    opened: list[list[str]] = []

    def factory() -> object:
        store = _etcd_job_store(etcd_server, prefix)
        opened.append(record_client_calls(store, ("read", "write", "delete")))
        return store

    return opened, factory


def test_a_heartbeat_on_etcd_is_two_requests_and_the_abort_and_notice_keys_are_watched(etcd_server: object) -> None:
    """Regression (issue 21): every beat of every member also read its generation's abort key and its own notice
    key -- two of its four requests (five on the leader), five beats a second, for keys written a few times in a
    job's life. Now a beat is its own write and the watched beat's read; a second thread holds one watch of the
    abort and notice keys' directory, which a write ends at once."""
    prefix = "/parcae/t-hbreq"
    writer = _etcd_job_store(etcd_server, prefix)
    writer.set(hb_key("m1"), "leader beat")  # type: ignore[attr-defined]
    opened, factory = _counted_etcd_factory(etcd_server, prefix)
    live = Liveness(factory, "m0", interval_s=0.05, dead_after_s=30.0)  # type: ignore[arg-type]
    live.start()
    live.set_generation(2, ["m1"])
    try:
        time.sleep(0.5)  # the signal thread's first listing and watch are in place
        beats, signals = opened
        beats.clear(), signals.clear()
        time.sleep(1.0)
        assert 10 <= len(beats) <= 2 * (1.0 / live.interval_s + 2), beats  # old code: ~4 a beat
        assert signals == [], signals  # nothing was written there: the watch stands
        t0 = time.monotonic()
        writer.set(abort_key(2), "m1 missed heartbeats")  # type: ignore[attr-defined]
        assert live.aborted.wait(1.0) and live.reason == "m1 missed heartbeats"
        aborted_after = time.monotonic() - t0
        writer.set(notice_key("m0"), '{"kind": "preempt", "member": "m0", "source": "test"}')  # type: ignore
        assert live.noticed.wait(1.0)
        assert aborted_after < 0.5, aborted_after
    finally:
        live.stop()


def test_the_watch_reaches_an_abort_before_the_next_beat_and_a_generation_entered_late(etcd_server: object) -> None:
    """An abort written between two beats (1 s apart here) is seen when it is written; a process that enters a
    generation whose abort was written before it got there sees it at once (the watch's listing has it)."""
    prefix = "/parcae/t-hbwatch"
    writer = _etcd_job_store(etcd_server, prefix)
    live = Liveness(lambda: _etcd_job_store(etcd_server, prefix), "m0", interval_s=1.0, dead_after_s=30.0)
    live.start()
    live.set_generation(1, [])
    try:
        time.sleep(0.3)
        t0 = time.monotonic()
        writer.set(abort_key(1), "m3 lost")  # type: ignore[attr-defined]
        assert live.aborted.wait(2.0)
        assert time.monotonic() - t0 < 0.3  # not at the next beat
        writer.set(abort_key(2), "m4 lost")  # type: ignore[attr-defined]
        time.sleep(0.3)
        live.set_generation(2, [])
        assert live.aborted.is_set() and live.reason == "m4 lost"
        live.set_generation(3, [])
        assert not live.aborted.is_set()
    finally:
        live.stop()


def test_when_the_watch_fails_the_heartbeat_polls_the_abort_key_again(etcd_server: object,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    prefix = "/parcae/t-hbfallback"
    writer = _etcd_job_store(etcd_server, prefix)
    opened: list[object] = []

    def factory() -> object:
        store = _etcd_job_store(etcd_server, prefix)
        if opened:  # the signal thread's client: its listing fails
            monkeypatch.setattr(store, "snapshot", lambda name: (_ for _ in ()).throw(ConnectionError("down")))
        opened.append(store)
        return store

    live = Liveness(factory, "m0", interval_s=0.05, dead_after_s=30.0)  # type: ignore[arg-type]
    live.start()
    live.set_generation(5, [])
    try:
        time.sleep(0.2)
        assert len(opened) == 2 and not live._signals_live.is_set()
        writer.set(abort_key(5), "m2 lost")  # type: ignore[attr-defined]
        assert live.aborted.wait(1.0) and live.reason == "m2 lost"
    finally:
        live.stop()
