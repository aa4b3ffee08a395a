"""Liveness: heartbeats and abortable waits, so that a lost peer is noticed in seconds, not at a collective timeout.

Problem: when an instance disappears without notice, gloo tells only the ranks that shared a TCP connection with it
("Connection closed by peer"); every other rank stays blocked in its collective until the process-group timeout
(30 minutes by default). A *hung* peer (SIGSTOP, or a VM that vanishes without a TCP reset) is not noticed by
anyone. ``abort()`` does not unblock a pending gloo operation either. So failure detection cannot rely on the
collectives themselves.

Solution:

* Every process runs a heartbeat thread with **its own store client**: it bumps ``parcae/hb/<member>`` every
  ``interval_s``, watches the heartbeats of the members it is told to watch (the leader watches everyone, everyone
  watches the leader), and declares a member dead when its counter has not moved for ``dead_after_s`` (measured on
  the local clock, so clock skew between machines does not matter; time during which the store itself did not
  answer is not counted as anyone's silence, see :class:`SilenceClock`). A death is published as
  ``parcae/abort/<generation>`` (first writer wins, the value is the reason); every process reads that key at each
  beat -- on etcd a second thread watches it (and the notice key) instead: one long watch of the directory those
  rare keys share, woken by their writes alone (:meth:`Liveness._watch_signals`).
* Every collective of the runtime is issued asynchronously and waited through :func:`guarded_wait`, which waits in
  short slices (``Work.wait(timeout)`` can be repeated) and raises :class:`~lightning_parcae.errors.PeerLostError`
  as soon as the generation is aborted, or when the operation itself fails (a closed connection), after publishing
  the abort so the others stop too. An abandoned operation may still complete later and write into its buffers:
  the caller must not reuse them, and the work object is parked (:meth:`Liveness.park`) so that dropping it never
  blocks.
* The same thread reads ``parcae/notice/<member>`` (a preemption notice written by a launcher or agent) and sets
  :attr:`Liveness.noticed`; SIGTERM does the same through the strategy's signal handler. A notice is a record of
  this module's one format (:func:`notice_record`, :func:`write_notice`), signed with the job token like every
  other record of the job; one that fails verification (written without the token -- e.g. the raw JSON that
  ``parcae agent`` once wrote -- altered, or copied from another member's key) is refused: logged once as a
  warning that names the key, and ignored. Without a job token (an open store) notices are plain JSON, as every
  record of such a job is.

Without an active :class:`Liveness` (static jobs), :func:`guarded_wait` is a plain ``work.wait()``.
"""

from __future__ import annotations

import ctypes
import json
import logging
import queue
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch.distributed as dist

from lightning_parcae.errors import PeerLostError
from lightning_parcae.runtime import steptime
from lightning_parcae.runtime.store import (KEY_DIRECTORIES, TamperedRecordError, decode_record, encode_record,
                                            read_if_present)

__all__ = ["Liveness", "SilenceClock", "guarded_wait", "guarded_post", "guarded", "active", "activate", "hb_key", "abort_key", "left_key", "notice_key",
           "read_beats", "notice_record", "encode_notice", "decode_notice", "write_notice", "read_notice", "NoticeCheck"]

log = logging.getLogger(__name__)

WATCH_SLICE_S = 0.2
"""Longest single watch of :meth:`Liveness.wait_key` (one heartbeat period): the abort flag is read between."""

SIGNAL_WATCH_S = 10.0
"""Longest single watch of the abort and notice keys on etcd (:meth:`Liveness._watch_signals`): a write ends it at
once; the timeout only renews it (two requests)."""


SIGNALS = KEY_DIRECTORIES["parcae/abort/"]
"""The etcd directory of the abort and notice keys (the same for both: one watch sees either)."""


def hb_key(member: str) -> str:
    """Store key of ``member``'s heartbeat."""
    return f"parcae/hb/{member}"


def read_beats(store: dist.Store, members: Sequence[str]) -> dict[str, Optional[bytes]]:
    """Each member's current heartbeat record (``None``: it has written none).

    Two store requests whatever the number of members once every one has beaten (one ``check`` of all the keys,
    one ``multi_get``); a ``check`` and a ``get`` per member only while some have not (start-up, a joiner), since
    ``multi_get`` would wait for a missing key. Heartbeat keys are never deleted, so a key seen by the ``check``
    is still there for the ``multi_get``. One member (what a non-leader watches: the leader) is one read on etcd
    (:func:`~lightning_parcae.runtime.store.read_if_present`), not a ``check`` and a ``get``. On etcd, heartbeats
    live in a directory of their own (:data:`~lightning_parcae.runtime.store.KEY_DIRECTORIES`): several members are
    one listing of it, present or not.

    Regression (issue 21): always one ``check`` + ``get`` per member, in series, on the heartbeat thread of every
    process that watches the others -- 2N requests a beat on the leader and in recovery (64 at N = 32: 3.4 ms a
    beat on loopback, 2N network round trips across machines), against 2 now (0.14 ms at N = 32 on loopback).
    """
    keys = [hb_key(m) for m in members]
    read_present = getattr(store, "read_present", None)
    if read_present is not None and len(keys) > 1:  # etcd: one listing of the heartbeats' own directory
        got = read_present(keys)
        return {m: got.get(k) for m, k in zip(members, keys)}
    if len(keys) > 1 and store.check(keys):
        return {m: bytes(v) for m, v in zip(members, store.multi_get(keys))}
    return {m: read_if_present(store, k) for m, k in zip(members, keys)}


def abort_key(generation: int) -> str:
    """Store key whose presence aborts ``generation`` (value: the reason)."""
    return f"parcae/abort/{generation}"


def dead_key(generation: int, member: str) -> str:
    """Store key whose presence says ``member`` was declared dead while ``generation`` formed or ran (value: the
    reason). Recovery reads it for processes that are not old members -- a joiner lost while it was admitted."""
    return f"parcae/dead/{generation}/{member}"


def left_key(generation: int, member: str) -> str:
    """Store key whose presence says ``member`` left as planned (a notice, a release) in the switch to
    ``generation``, after its transfers: its heartbeat stops next, and that silence is not a death."""
    return f"parcae/left/{generation}/{member}"


def notice_key(member: str) -> str:
    """Store key of a preemption notice for ``member`` (written by a launcher/agent: :func:`write_notice`)."""
    return f"parcae/notice/{member}"


NOTICE_KINDS = ("preempt", "rebalance", "terminate")
"""The kinds a notice record may have (those of :class:`lightning_parcae.signals.notices.Notice`)."""


def notice_record(member: str, *, source: str, kind: str = "preempt", deadline: Optional[float] = None,
                  why: str = "") -> dict[str, Any]:
    """The one notice record every writer (``parcae run``'s fleet, ``parcae agent``) builds.

    Args:
        member: The member the notice is about (the worker's member id).
        source: Who noticed: ``replay`` (the launcher's trace), ``agent``, ...
        kind: One of :data:`NOTICE_KINDS`.
        deadline: When the instance is expected gone (``time.time()`` base), if known.
        why: Free text for logs.

    Raises:
        ValueError: An unknown ``kind``.
    """
    if kind not in NOTICE_KINDS:
        raise ValueError(f"notice kind {kind!r}: expected one of {', '.join(NOTICE_KINDS)}")
    rec: dict[str, Any] = {"member": member, "kind": kind, "source": source, "time": time.time()}
    if deadline is not None:
        rec["deadline"] = float(deadline)
    if why:
        rec["why"] = why
    return rec


def encode_notice(member: str, record: dict[str, Any], token: Optional[str]) -> bytes:
    """The bytes of ``member``'s notice: signed with the job token for :func:`notice_key` (the store's
    :func:`~lightning_parcae.runtime.store.encode_record`), or plain JSON in an open store (no token)."""
    if token:
        return encode_record(notice_key(member), record, token)
    return json.dumps(record, sort_keys=True).encode()


def decode_notice(member: str, raw: bytes, token: Optional[str]) -> dict[str, Any]:
    """The record of ``member``'s notice read as ``raw``, verified with the job token.

    Raises:
        TamperedRecordError: With a token: not signed with it for ``member``'s key (unsigned, forged, altered, or
            copied from another member's key). Always: not a notice record (no JSON object, unknown kind, another
            member's id).
    """
    key = notice_key(member)
    if token:
        rec = decode_record(key, raw, token)
    else:
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise TamperedRecordError(f"notice {key!r} is not a JSON record") from None
    if not isinstance(rec, dict) or rec.get("kind") not in NOTICE_KINDS or rec.get("member", member) != member:
        raise TamperedRecordError(f"notice {key!r} is not a notice record for {member!r}: {str(rec)[:200]}")
    return rec


def write_notice(store: dist.Store, member: str, record: dict[str, Any], token: Optional[str]) -> None:
    """Write ``member``'s notice (:func:`encode_notice`); the member's heartbeat thread picks it up."""
    store.set(notice_key(member), encode_notice(member, record, token))


def read_notice(store: dist.Store, member: str, token: Optional[str]) -> Optional[dict[str, Any]]:
    """``member``'s notice, or None when there is none.

    Raises:
        TamperedRecordError: A notice is there but fails :func:`decode_notice`.
    """
    key = notice_key(member)
    if not store.check([key]):
        return None
    return decode_notice(member, bytes(store.get(key)), token)


class NoticeCheck:
    """Whether members have a valid preemption notice, as a planner counts them (the leader's standby filter, the
    agents' start-up roster): :func:`read_notice` with the job token.

    A notice that fails verification (not signed with the job token, altered, or copied from another member's key)
    never leaves a member out: it is ignored with a warning and a ``notice_refused`` event, once per notice.

    Regression: a bare existence check of the notice key let anyone who can write to the store (but does not hold
    the job token) keep standbys or start-up candidates out, while the worker's own heartbeat thread ignored the
    same forged notice.

    Args:
        token: The job token (None: records are unsigned).
        event: The event log (``notice_refused``).
        who: What the members are, for the warning (``standby``, ``start-up candidate``).
    """

    def __init__(self, token: Optional[str], event: Callable[..., None], who: str) -> None:
        self.token, self.event, self.who = token, event, who
        self._refused: dict[str, bytes] = {}  # member -> the notice bytes refused (warned about once)

    def __call__(self, store: dist.Store, member: str) -> bool:
        """Whether ``member`` has a valid notice in ``store``."""
        try:
            return read_notice(store, member, self.token) is not None
        except TamperedRecordError as exc:
            raw: bytes = b""
            try:
                raw = bytes(store.get(notice_key(member)))
            except Exception:  # noqa: BLE001 -- only for warning once per notice
                pass
            if self._refused.get(member) != raw:
                self._refused[member] = raw
                log.warning("ignoring the notice under %s for %s %s: %s", notice_key(member), self.who, member, exc)
                self.event("notice_refused", about=member, key=notice_key(member), error=str(exc))
            return False


class Liveness:
    """Heartbeat thread + abort flag of one process.

    Args:
        store_factory: Opens a *new* client of the coordination store (the thread must not share the main
            thread's connection).
        member: This process's member id.
        interval_s: Heartbeat period.
        dead_after_s: A watched member whose heartbeat has not changed for this long is declared dead.
        poll_s: Slice length of :meth:`wait`.
        token: The job token: a notice is accepted only when signed with it (None: an open store, plain JSON).
    """

    def __init__(
        self,
        store_factory: Callable[[], dist.Store],
        member: str,
        *,
        interval_s: float = 0.2,
        dead_after_s: float = 3.0,
        poll_s: float = 0.02,
        token: Optional[str] = None,
    ) -> None:
        self.store_factory = store_factory
        self.member = member
        self._token = token or None
        self._refused_notice: Optional[bytes] = None
        """The notice bytes last refused (warned about once, not at every beat)."""
        self.interval_s = interval_s
        self.dead_after_s = dead_after_s
        self.poll_s = poll_s
        self.watch_s = max(poll_s, min(WATCH_SLICE_S, dead_after_s / 10))
        """Slice of :meth:`wait_key` on a store that watches keys: the longest the abort flag goes unread there."""
        self.generation = -1
        self.step = 0
        self.phase = "starting"
        self.aborted = threading.Event()
        self.noticed = threading.Event()
        self.reason = ""
        self._watch: list[str] = []
        self._clock = SilenceClock(blind_after_s=dead_after_s / 3)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store: Optional[dist.Store] = None
        self._parked: list[Any] = []
        self._waiter_thread: Optional[_Waiter] = None
        self._signal_store: Optional[Any] = None
        self._signal_thread: Optional[threading.Thread] = None
        self._signals: dict[str, bytes] = {}
        """The last listing of the abort and notice keys (etcd; key -> value)."""
        self._signals_live = threading.Event()
        """Set while the signal thread's watch stands in for the heartbeat thread's polls of those keys."""

    # ------------------------------------------------------------------------------------------------ control
    def start(self) -> "Liveness":
        """Open the thread's store client, write the first heartbeat and start the thread."""
        self._store = self.store_factory()
        self._beat(0)
        self._thread = threading.Thread(target=self._run, name=f"parcae-heartbeat-{self.member}", daemon=True)
        self._thread.start()
        if hasattr(self._store, "snapshot"):  # etcd: watch the abort and notice keys instead of polling them
            self._signal_store = self.store_factory()
            self._signal_thread = threading.Thread(target=self._watch_signals, name=f"parcae-signals-{self.member}",
                                                   daemon=True)
            self._signal_thread.start()
        return self

    @property
    def running(self) -> bool:
        """Whether the heartbeat thread runs (started and not stopped): only then can :attr:`aborted` be set."""
        return self._thread is not None and not self._stop.is_set()

    def abort_reason(self) -> Optional[str]:
        """Why the current generation was aborted (a peer declared dead), or None while it runs (or the heartbeat
        thread does not)."""
        if not self.running or not self.aborted.is_set():
            return None
        return self.reason or f"generation {self.generation} aborted"

    def stop(self) -> None:
        """Stop the thread (the last heartbeat stays in the store and goes stale)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval_s + 1.0)

    def set_generation(self, generation: int, watch: Sequence[str]) -> None:
        """Enter ``generation``: clear the abort flag and watch ``watch`` (member ids, this one excluded)."""
        with self._lock:
            self.generation = generation
            self._watch = [m for m in watch if m != self.member]
            self._clock.reset(self._watch, time.monotonic())
            self.aborted.clear()
            self.reason = ""
            # not only while the watch is live: its first listing may hold this abort and have been acted on for the
            # generation before, just as the watch takes over from the polls
            known = self._signals.get(abort_key(generation))
        if known is not None:  # aborted before this process entered it: the watch saw that write already
            self._aborted_by(generation, known)

    def unwatch(self, members: Sequence[str]) -> None:
        """Stop watching ``members`` in the current generation (their silence no longer aborts it); the abort flag,
        if raised already, stays raised.

        For members that left *as planned* (their :func:`left_key` is written): once a switch's transfers are done,
        a leaver by notice or release exits and its heartbeat stops. Regression (``tests/netns_harness.py
        --machines 32 --seed 8``): the members that stayed watched it until the new generation's groups were built;
        at 32 machines on 2 cores that took over 3 s, so they declared the leaver dead and abandoned a switch none
        of whose ranks was missing, and the job split in two (31 s and half the members lost). Now a silent member
        is checked for that key before it is declared dead, and unwatched if it is there.
        """
        with self._lock:
            gone = set(members)
            self._watch = [m for m in self._watch if m not in gone]

    def abort(self, reason: str, generation: Optional[int] = None) -> None:
        """Publish the abort of ``generation`` (default: the current one) and raise the local flag."""
        g = self.generation if generation is None else generation
        store = self._store
        if store is not None:
            try:
                store.compare_set(abort_key(g), "", reason)
            except Exception as exc:  # noqa: BLE001 -- the local flag still stops this process
                log.warning("could not publish the abort of generation %d: %s", g, exc)
        if g == self.generation:
            self.reason = self.reason or reason
            self.aborted.set()

    def park(self, obj: Any) -> None:
        """Keep an abandoned work/group alive for the life of the process.

        Dropping it could block until its timeout, and destroying a gloo group whose threads are stuck on a dead
        peer at interpreter exit aborts the process ("terminate called without an active exception"). So its
        reference count is raised once more than any owner will ever release: it is never destroyed (a bounded
        leak of one generation's groups per failure).
        """
        if obj is None:
            return
        self._parked.append(obj)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))

    # ------------------------------------------------------------------------------------------------ waiting
    def wait(self, work: Any, what: str = "collective", sliced: bool = False) -> None:
        """Wait for ``work``; raise :class:`PeerLostError` if the generation is aborted or the op fails.

        gloo offers no abortable wait for point-to-point operations (a timed-out ``recv`` closes the connection,
        and ``is_completed()`` never turns true for it), so the blocking ``work.wait()`` runs on a helper thread
        while this thread watches the abort flag. On abort the helper (possibly stuck forever on a dead peer) is
        abandoned with the work and a fresh one serves the next generation.

        ``sliced``: ``work`` is a gloo *collective*, whose ``wait(timeout)`` can time out and be repeated without
        harm (measured: an all-reduce waited in 20 ms slices while a peer came 0.3 s late gave the right result),
        so it is waited on this thread in ``poll_s`` slices -- no hand-off to the helper, which cost a thread
        switch per operation (~0.3-1 ms under load, issue 13). Never for point-to-point operations.
        """
        if steptime.ON:
            with steptime.span("wait: " + what):
                return self._wait(work, what, sliced)
        return self._wait(work, what, sliced)

    def _wait_sliced(self, work: Any, what: str) -> None:
        slice_ = timedelta(seconds=self.poll_s)
        while True:
            if self.aborted.is_set():
                self.park(work)
                raise PeerLostError(f"{what} abandoned: generation {self.generation} aborted ({self.reason})")
            try:
                work.wait(slice_)
                return
            except Exception:  # noqa: BLE001 -- a slice that timed out, or the operation failed: told apart below
                if not _completed(work):
                    continue  # still pending: the slice ran out
            try:  # finished (a failure -- or a success right after the slice ran out): the plain wait tells
                work.wait()
                return
            except BaseException as exc:  # noqa: BLE001
                self._failed(work, what, exc)

    def _wait(self, work: Any, what: str, sliced: bool = False) -> None:
        if self.aborted.is_set():
            self.park(work)
            raise PeerLostError(f"{what} abandoned: generation {self.generation} aborted ({self.reason})")
        if sliced:
            return self._wait_sliced(work, what)
        if _completed(work):
            # finished already (a send whose bytes left, a collective the peers were early for): no hand-off to the
            # helper thread -- its wake-up cost a thread switch per operation (measured ~0.3 ms each under load)
            if steptime.ON:
                steptime.add("wait fast path (already complete)", 0.0)
            try:
                work.wait()
            except BaseException as exc:  # noqa: BLE001 -- the same handling as the helper's error
                self._failed(work, what, exc)
            return
        box = self._waiter().submit(work)
        while not box.done.wait(self.poll_s):
            if self.aborted.is_set():
                self.park(work)
                self._retire_waiter()
                raise PeerLostError(f"{what} abandoned: generation {self.generation} aborted ({self.reason})")
        if steptime.ON and box.t_done:
            steptime.add("wait handoff (waiter done -> caller awake)", time.perf_counter() - box.t_done)
        if box.error is not None:
            self._failed(work, what, box.error)

    def _failed(self, work: Any, what: str, error: BaseException) -> None:
        self.park(work)
        reason = f"{self.member}: {what} failed: {(str(error).splitlines() or [''])[0][:200]}"
        self.abort(reason)
        raise PeerLostError(reason)

    def _waiter(self) -> "_Waiter":
        if self._waiter_thread is None:
            self._waiter_thread = _Waiter(self.member)
        return self._waiter_thread

    def _retire_waiter(self) -> None:
        if self._waiter_thread is not None:
            self.park(self._waiter_thread)
            self._waiter_thread = None

    def wait_key(self, store: dist.Store, key: str, what: str) -> None:
        """Wait until ``key`` exists in ``store``, aborting like :meth:`wait`.

        It polls with ``check`` (every ``poll_s``), never with a short ``store.wait``. Regression (issue 21, the
        N=16 notice that fell back to a restart): ``TCPStore.wait([key], 50 ms)`` in a loop -- as this method did --
        makes torch 2.13's client stall ~5 s in one of the timed-out waits (``benchmarks/tcpstore_wait_stall.py``:
        4 and 16 waiters, every one saw the key 4.3-4.7 s after it was set, against 6-14 ms by ``check``). Four of sixteen members entered
        generation 1 five seconds late, the leaver's grace ran out meanwhile, and the transition world could not
        form.

        A store that can watch one key (etcd: ``wait_for``) is waited on in slices of :attr:`watch_s` instead of
        polled: a read and a watch per wait instead of a read every ``poll_s``, woken by the write itself. The
        abort flag is checked between slices; the keys waited for (a step's commit decision, the next generation's
        record) are also what a failure's handling writes, so a recovery wakes the waiters at once.
        """
        wait_for = getattr(store, "wait_for", None)
        while True:
            if self.aborted.is_set():
                raise PeerLostError(f"{what} abandoned: generation {self.generation} aborted ({self.reason})")
            try:
                if wait_for is not None:
                    if wait_for(key, self.watch_s):
                        return
                    continue
                if store.check([key]):
                    return
            except Exception as exc:  # noqa: BLE001
                # a store hiccup (etcd's client wraps a read timeout as EtcdConnectionFailed on a loaded machine):
                # keep waiting; a lost peer still ends the wait through the abort flag
                if not (type(exc).__name__ in ("EtcdConnectionFailed", "EtcdWatchTimedOut")
                        or isinstance(exc, (ConnectionError, TimeoutError))):
                    raise
            time.sleep(self.poll_s)

    # ------------------------------------------------------------------------------------------------ thread
    def _beat(self, counter: int) -> None:
        assert self._store is not None
        payload = {"c": counter, "g": self.generation, "step": self.step, "phase": self.phase}
        self._store.set(hb_key(self.member), json.dumps(payload))

    def _run(self) -> None:
        counter = 0
        store = self._store
        assert store is not None
        while not self._stop.wait(self.interval_s):
            counter += 1
            try:
                self._beat(counter)
                with self._lock:
                    g, watch = self.generation, list(self._watch)
                if not self._signals_live.is_set():  # no watch of the signals (not etcd, or it failed): poll
                    if g >= 0 and not self.aborted.is_set() and store.check([abort_key(g)]):
                        self._aborted_by(g, bytes(store.get(abort_key(g))))
                    if not self.noticed.is_set() and store.check([notice_key(self.member)]):
                        if self._notice_valid(bytes(store.get(notice_key(self.member)))):
                            self.noticed.set()
                raws = {m: b or b"" for m, b in read_beats(store, watch).items()}
                now = time.monotonic()  # after the reads: a store that stalled them is blind time, not silence
                dead: list[tuple[str, float]] = []
                with self._lock:
                    if g != self.generation:
                        continue
                    self._clock.tick(now)
                    for m, raw in raws.items():
                        silent = self._clock.silent_for(m, raw, now)
                        if silent > self.dead_after_s:
                            dead.append((m, silent))
                for m, silent in dead:
                    if store.check([left_key(g, m)]):  # left as planned: stop watching it, nothing is lost
                        self.unwatch([m])
                        continue
                    if not self.aborted.is_set():
                        why = f"{m} missed heartbeats for {silent:.1f} s (declared dead by {self.member})"
                        store.set(dead_key(g, m), why)
                        self.abort(why, g)
                    break  # one death aborts the generation; recovery finds the others
            except Exception as exc:  # noqa: BLE001 -- a store hiccup must not kill the heartbeat
                log.warning("heartbeat of %s: %s", self.member, exc)

    def _aborted_by(self, g: int, raw: bytes) -> None:
        """Generation ``g``'s abort key reads ``raw``: raise the flag if ``g`` is still the current generation."""
        with self._lock:
            if g == self.generation and not self.aborted.is_set():
                self.reason = raw.decode(errors="replace")
                self.aborted.set()

    def _watch_signals(self) -> None:
        """The signal thread (etcd only): read the abort and notice keys' directory, act on it, then watch it.

        Regression (issue 21): the heartbeat thread read this generation's abort key and this member's notice key at
        every beat -- two of its four or five requests, five beats a second on every member (the largest share of a
        job's store traffic while it trains, paced by time) -- for keys written a few times in a job's life. Here one
        listing and one long watch of their directory (:data:`~lightning_parcae.runtime.store.KEY_DIRECTORIES`)
        replace them: no request until a key there is written (or :data:`SIGNAL_WATCH_S` renews the watch), and an
        abort reaches every member when it is written, not at its next beat. Until the first listing succeeds, and
        whenever the store fails, :attr:`_signals_live` is clear and the heartbeat thread polls as before.
        """
        store = self._signal_store
        assert store is not None
        while not self._stop.is_set():
            try:
                values, index = store.snapshot(SIGNALS)
                with self._lock:
                    self._signals = values
                    g = self.generation
                self._act_on_signals(g, values)
                self._signals_live.set()
                store.await_change(SIGNALS, index, SIGNAL_WATCH_S)
            except Exception as exc:  # noqa: BLE001 -- the heartbeat thread polls meanwhile
                if self._signals_live.is_set():
                    log.warning("watch of the abort and notice keys of %s failed (polling meanwhile): %s",
                                self.member, exc)
                self._signals_live.clear()
                self._stop.wait(self.interval_s)

    def _act_on_signals(self, g: int, values: dict[str, bytes]) -> None:
        """Raise the abort flag (generation ``g``'s abort key is there) or the notice flag (this member's notice is
        there and valid) from a listing of the signals' directory."""
        raw = values.get(abort_key(g)) if g >= 0 else None
        if raw is not None:
            self._aborted_by(g, raw)
        notice = values.get(notice_key(self.member))
        if notice is not None and not self.noticed.is_set() and self._notice_valid(notice):
            self.noticed.set()

    def _notice_valid(self, raw: bytes) -> bool:
        """Whether ``raw`` (this member's notice key) is a valid notice; a refused one is logged once."""
        if raw == self._refused_notice:
            return False
        try:
            decode_notice(self.member, raw, self._token)
            return True
        except TamperedRecordError as exc:
            self._refused_notice = raw
            log.warning("ignoring the notice under %s for %s: %s", notice_key(self.member), self.member, exc)
            return False


class SilenceClock:
    """How long each watched heartbeat has stayed unchanged, counting only the time the watcher could see it.

    Problem: silence is measured on the watcher's clock between two reads of the store. When the *store* stops
    answering for a few seconds (a network partition of the store host, a paused VM, a long GC), every read blocks,
    and when it answers again every peer's heartbeat looks several seconds old -- although no peer was silent, the
    watcher was blind. Counting that time declared live members dead, so a short store outage became a spurious
    recovery with every member alive.

    Solution: the caller ticks the clock once per round of reads (with the time taken *after* the reads). A round
    that took longer than ``blind_after_s`` since the previous one counts only ``blind_after_s`` of its length
    towards every member's silence. A really dead member is still declared dead: each round adds at least
    ``min(round, blind_after_s)``, so detection takes at most ``dead_after_s / blind_after_s`` slow rounds.

    Args:
        blind_after_s: The longest round counted in full.
    """

    def __init__(self, blind_after_s: float) -> None:
        self.blind_after_s = blind_after_s
        self._seen: dict[str, tuple[Any, float]] = {}
        self._last: Optional[float] = None

    def reset(self, members: Sequence[str], now: float) -> None:
        """Start watching ``members`` afresh: each is silent for 0 s as of ``now``."""
        self._seen = {m: (None, now) for m in members}
        self._last = now

    def tick(self, now: float) -> None:
        """One round of reads ended at ``now``: discount the part of the round beyond ``blind_after_s``."""
        if self._last is not None and now - self._last > self.blind_after_s:
            blind = now - self._last - self.blind_after_s
            self._seen = {m: (raw, since + blind) for m, (raw, since) in self._seen.items()}
        self._last = now

    def silent_for(self, member: str, raw: Any, now: float) -> float:
        """Seconds ``member``'s heartbeat has read ``raw`` (0 when it changed since the last read)."""
        last = self._seen.get(member)
        if last is None or last[0] != raw:
            self._seen[member] = (raw, now)
            return 0.0
        return now - last[1]


def _completed(work: Any) -> bool:
    """Whether ``work`` has finished (``is_completed()``; False when it cannot tell)."""
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 -- a work object without it (or a broken one) goes the helper's way
        return False


class _Box:
    def __init__(self, work: Any) -> None:
        self.work = work
        self.done = threading.Event()
        self.error: Optional[BaseException] = None
        self.t_done = 0.0


class _Waiter:
    """A daemon thread that runs blocking ``work.wait()`` calls in submission order."""

    def __init__(self, member: str) -> None:
        self._queue: "queue.SimpleQueue[_Box]" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"parcae-wait-{member}", daemon=True)
        self._thread.start()

    def submit(self, work: Any) -> _Box:
        box = _Box(work)
        self._queue.put(box)
        return box

    def _run(self) -> None:
        while True:
            box = self._queue.get()
            try:
                box.work.wait()
            except BaseException as exc:  # noqa: BLE001 -- handed to the waiting thread
                box.error = exc
            if steptime.ON:
                box.t_done = time.perf_counter()
            box.done.set()


_ACTIVE: list[Optional[Liveness]] = [None]


def activate(liveness: Optional[Liveness]) -> None:
    """Make ``liveness`` the one :func:`guarded_wait` uses (None: plain waits)."""
    _ACTIVE[0] = liveness


def active() -> Optional[Liveness]:
    """The active :class:`Liveness`, if any."""
    return _ACTIVE[0]


def guarded_post(post: Callable[[], Any], what: str = "collective") -> Any:
    """Issue an async operation; with an active :class:`Liveness`, a failure to post (a peer's connection is
    already closed) becomes :class:`PeerLostError` and aborts the generation."""
    live = _ACTIVE[0]
    if live is None:
        return post()
    if live.aborted.is_set():
        raise PeerLostError(f"{what} not started: generation {live.generation} aborted ({live.reason})")
    try:
        return post()
    except RuntimeError as exc:
        reason = f"{live.member}: posting {what} failed: {str(exc).splitlines()[0][:200]}"
        live.abort(reason)
        raise PeerLostError(reason) from None


def guarded(post: Callable[[], Any], what: str = "collective", collective: bool = False) -> None:
    """Post and wait (:func:`guarded_post` + :func:`guarded_wait`)."""
    guarded_wait(guarded_post(post, what), what, collective)


def guarded_wait(work: Any, what: str = "collective", collective: bool = False) -> None:
    """Wait for an async operation: abortable when a :class:`Liveness` is active, else ``work.wait()``.

    ``collective``: ``work`` is a collective (all-reduce, broadcast, gather), not a point-to-point send or receive;
    on gloo it is then waited on the calling thread in slices (see :meth:`Liveness.wait`).
    """
    live = _ACTIVE[0]
    if live is None:
        if steptime.ON:
            with steptime.span("wait: " + what):
                work.wait()
            return
        work.wait()
    else:
        live.wait(work, what, sliced=collective and _gloo())


def _gloo() -> bool:
    """Whether the default process group is gloo (whose collectives' ``wait(timeout)`` is repeatable)."""
    try:
        return dist.is_initialized() and dist.get_backend() == "gloo"
    except Exception:  # noqa: BLE001
        return False
