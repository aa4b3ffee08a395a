"""The job's shared records in the coordination store: generations, standbys, commits, history.

Problem: processes that come and go must agree on one sequence of configurations without a central server of our
own. The store (TCPStore hosted by the launcher, or etcd) is the only shared memory, and it has no transactions
beyond ``add`` and ``compare_set``. This module fixes the key layout and the few atomic operations the runtime
protocol needs:

``parcae/genrec/<g>``
    The generation record (JSON): members in rank order, partition, shape, the migration plan from ``g-1``, the
    step it starts at, why. Written once with ``compare_set`` -- when several survivors propose generation ``g``
    after a failure, the first proposal wins and everyone reads the winner.
``parcae/current``
    The newest generation that has been *started* (a hint for joiners and for fencing; records are the truth).
``parcae/standby/<i>``, ``parcae/standby/count``
    Members waiting to join, in arrival order (``add`` gives each its slot).
``parcae/commit/<g>/<step>``
    Two-phase step: every member adds 1 once its gradients are reduced; the step may be applied once the count
    equals the generation's world size (the last one sets ``.../decision``). After a failure the count decides,
    for everyone alike, whether the interrupted step was complete (apply it) or not (discard it).
``parcae/recover/<g>/<member>``
    Survivors of an aborted generation ``g`` announce themselves here.
``parcae/history``
    Instance counts observed at each planning interval (the predictor's input), appended by the leader.
``parcae/booting/<member>``
    A joiner that ``parcae run`` started together with others for one trace event (:func:`booting_key`): its
    launch batch (``{"batch", "members", "t"}``, written by the launcher, ``"gone": true`` once its process
    exited). The leader holds a batch's first ready standbys back for a short grace while a batch-mate still
    boots, so that the batch is admitted in one generation (:data:`~.shape_choice.BATCH_GRACE_S`).

Records are signed with the job token when there is one (:mod:`lightning_parcae.runtime.store`), else plain JSON.
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from lightning_parcae.runtime.store import count_in, decode_record, encode_record, read_if_present, scoped

__all__ = ["Coordinator", "genrec_key", "booting_key"]


def genrec_key(generation: int) -> str:
    """Store key of generation ``generation``'s record."""
    return f"parcae/genrec/{generation}"


def booting_key(member: str) -> str:
    """Store key of ``member``'s launch-batch record (a joiner started with others for one trace event)."""
    return f"parcae/booting/{member}"


class Coordinator:
    """Typed access to the job's records.

    Args:
        store: A client of the coordination store (the caller's thread owns it).
        token: The job token (records are signed and verified) or None (plain JSON).
    """

    def __init__(self, store: dist.Store, token: Optional[str] = None) -> None:
        self.store = store
        self.token = token or None

    # ------------------------------------------------------------------------------------------------ records
    def _enc(self, key: str, value: dict[str, Any]) -> bytes:
        if self.token:
            return encode_record(key, value, self.token)
        return json.dumps(value, sort_keys=True).encode()

    def _dec(self, key: str, raw: bytes) -> dict[str, Any]:
        if self.token:
            return decode_record(key, raw, self.token)
        return json.loads(raw.decode())

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Write a record."""
        self.store.set(key, self._enc(key, value))

    def get(self, key: str, timeout_s: Optional[float] = 0.0) -> Optional[dict[str, Any]]:
        """Read a record; None if it is not there (after waiting up to ``timeout_s``; None waits forever)."""
        if timeout_s is None:
            self.store.wait([key])
        elif timeout_s > 0:
            try:
                self.store.wait([key], timedelta(seconds=timeout_s))
            except (RuntimeError, LookupError):
                return None
        elif not self.store.check([key]):
            return None
        return self._dec(key, bytes(self.store.get(key)))

    def claim(self, key: str, value: dict[str, Any]) -> dict[str, Any]:
        """Write ``value`` under ``key`` unless a record is there (``compare_set``: the first writer wins); returns
        the record that is there now, to every caller alike."""
        return self._dec(key, bytes(self.store.compare_set(key, "", self._enc(key, value))))

    # ------------------------------------------------------------------------------------------------ generations
    def propose(self, record: dict[str, Any]) -> dict[str, Any]:
        """Propose ``record`` as generation ``record["generation"]``; returns the record that won.

        The first proposal for a generation wins (``compare_set``); later ones get the winner back.
        """
        return self.claim(genrec_key(int(record["generation"])), record)

    def generation(self, g: int, timeout_s: Optional[float] = 0.0) -> Optional[dict[str, Any]]:
        """Generation ``g``'s record (None if absent)."""
        return self.get(genrec_key(g), timeout_s)

    def set_current(self, g: int) -> None:
        """Advance ``parcae/current`` to ``g`` (never moves it back)."""
        cur = self.current()
        if g > cur:
            self.store.set("parcae/current", str(g))

    def current(self) -> int:
        """The newest started generation (-1 before the first)."""
        if not self.store.check(["parcae/current"]):
            return -1
        return int(bytes(self.store.get("parcae/current")).decode())

    # ------------------------------------------------------------------------------------------------ standbys
    def register_standby(self, member: str) -> int:
        """Announce ``member`` as waiting to join; returns its arrival slot."""
        slot = int(self.store.add("parcae/standby/count", 1)) - 1
        self.store.set(f"parcae/standby/{slot}", member)
        return slot

    def standbys(self) -> list[str]:
        """Members that ever registered as standby, in arrival order."""
        count = read_if_present(self.store, "parcae/standby/count")  # one read on etcd; add(0) was three
        out = []
        for i in range(int(count) if count else 0):
            value = read_if_present(self.store, f"parcae/standby/{i}")
            if value is not None:
                out.append(value.decode())
        return out

    # ------------------------------------------------------------------------------------------------ two-phase step
    @staticmethod
    def verdict_key(g: int) -> str:
        """Survivors' one verdict on a planned generation ``g`` that a loss overtook: "abandon" or "keep"."""
        return f"parcae/verdict/{g}"

    @staticmethod
    def commit_key(g: int, step: int) -> str:
        """Counter of members that finished reducing the gradients of ``step`` in generation ``g``."""
        return f"parcae/commit/{g}/{step}"

    @staticmethod
    def commit_scope(g: int, step: int) -> str:
        """Scope of the members' own arrival keys for ``step`` of generation ``g`` on etcd (:func:`count_in`)."""
        return f"commit/{g}/{step}"

    def commit_arrive(self, g: int, step: int, world: int, member: Optional[str] = None) -> bool:
        """Count ``member`` in; True if all ``world`` have (it then fixes the decision, see :mod:`.recovery`).

        On etcd each member writes its own key and counts them (two requests; torch's ``add`` there is a
        compare-and-swap loop with random sleeps); elsewhere an atomic ``add``. More than one member may see the
        full count on etcd: fixing the decision is a ``compare_set`` that every one of them wins alike.
        """
        if member is not None:
            counted = count_in(self.store, self.commit_scope(g, step), member)
            if counted is not None:
                return counted >= world
        return int(self.store.add(self.commit_key(g, step), 1)) >= world

    def commit_count(self, g: int, step: int) -> int:
        """Members counted in for ``step`` of generation ``g`` (either way of counting)."""
        tally = scoped(self.store, self.commit_scope(g, step))
        counted = tally.count_keys() if hasattr(tally, "count_keys") else 0
        return max(counted, int(self.store.add(self.commit_key(g, step), 0)))

    def forget_commit(self, g: int, step: int) -> None:
        """Delete ``step``'s commit records (everyone has passed it), so the store does not grow per step."""
        base = self.commit_key(g, step)
        drop_scope = getattr(self.store, "drop_scope", None)  # etcd: the members' arrival keys, one request
        if drop_scope is not None:
            drop_scope(self.commit_scope(g, step))
        for key in (base, base + "/decision"):
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 -- a store without delete (older etcd v2 API) just keeps them
                return

    # ------------------------------------------------------------------------------------------------ recovery
    def announce_survivor(self, g: int, member: str, info: dict[str, Any]) -> None:
        """Tell the other survivors of aborted generation ``g`` that ``member`` is alive."""
        self.put(f"parcae/recover/{g}/{member}", {**info, "t": time.time()})

    def survivor(self, g: int, member: str) -> Optional[dict[str, Any]]:
        """``member``'s survivor announcement for generation ``g`` (None if absent)."""
        return self.get(f"parcae/recover/{g}/{member}")

    # ------------------------------------------------------------------------------------------------ history
    def history(self) -> list[int]:
        """Instance counts of past planning intervals."""
        rec = self.get("parcae/history")
        return list(rec["counts"]) if rec else []

    def append_history(self, n: int, keep: int = 1000) -> None:
        """Append one interval's count (the leader is the only writer)."""
        counts = (self.history() + [int(n)])[-keep:]
        self.put("parcae/history", {"counts": counts})
