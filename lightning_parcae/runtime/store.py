"""Coordination stores: where the launcher, the agents and the workers of one job meet.

Problem: every Parcae process needs one shared key-value store (membership, generations, plans, heartbeats,
``init_process_group`` rendezvous). Three things go wrong easily with the ``torch.distributed`` stores as they come:

* **Exposure.** ``TCPStore(host_name="127.0.0.1", is_master=True)`` listens on *all* interfaces (measured on
  torch 2.13: the socket binds ``*:port``), so anyone on the network can write plans into a job. :func:`host_store`
  binds the listening socket itself -- loopback unless ``allow_remote=True`` -- and hands it to ``TCPStore``.
* **Hangs.** A client of a store that is not there retries for the store timeout (default 300 s; the process-group
  default is 30 min). :func:`connect_store` gives up after ``timeout_s`` with a :class:`CoordinationError` that
  says what to check.
* **Forgery.** The store has no access control. The job token is a shared secret: records written with
  :func:`publish` carry an HMAC-SHA256 over (key, JSON payload), :func:`read` verifies it, so a plan or membership
  record written by someone without the token is rejected (:class:`TamperedRecordError`). The launcher also
  installs a salted proof of the token (:func:`install_token`) so that a client started with the wrong token fails
  at once (:class:`WrongTokenError`) instead of publishing records nobody accepts. Only JSON crosses the store,
  never pickle.

Store URLs (:func:`parse_store_url`)::

    tcp://127.0.0.1:29500            TCPStore hosted by the launcher (port 0: pick a free one when hosting)
    etcd://127.0.0.1:2379/parcae/job1  etcd v2 API (etcd 3.4 with --enable-v2=true), keys under the job prefix
    file:///tmp/parcae-job1.store      FileStore (one machine only)

What the HMAC does not prevent: someone who can reach the store can still delete or overwrite keys (denial of
service) or replay an older *validly signed* value of the same key. Keep the store on loopback or behind a
firewall/security group, and put a generation number in records whose freshness matters.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import os
import secrets
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from base64 import urlsafe_b64decode, urlsafe_b64encode
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_parcae.contract import JOB_TOKEN_ENV
from lightning_parcae.errors import ConfigurationError, CoordinationError

__all__ = [
    "StoreSpec",
    "parse_store_url",
    "host_store",
    "connect_store",
    "new_token",
    "install_token",
    "check_token",
    "publish",
    "read",
    "encode_record",
    "decode_record",
    "is_loopback",
    "scoped",
    "drop_scopes",
    "read_if_present",
    "count_in",
    "TokenStore",
    "WrongTokenError",
    "TamperedRecordError",
    "JOB_TOKEN_ENV",
]


AUTH_KEY = "parcae/auth/v1"
MAX_RECORD_BYTES = 16 * 1024 * 1024
_DEFAULT_ETCD_PORT = 2379
_DEFAULT_ETCD_PREFIX = "/parcae"
_EXAMPLES = "tcp://127.0.0.1:29500, etcd://127.0.0.1:2379/parcae/job1 or file:///tmp/parcae-job1.store"
_PROOF_CONTEXT = b"parcae-job-token-proof/v1:"
_RECORD_CONTEXT = b"parcae-record/v1\0"

KEY_DIRECTORIES: Mapping[str, str] = {"parcae/hb/": "beats", "parcae/abort/": "signals", "parcae/notice/": "signals"}
"""On etcd, the keys under each prefix live in a directory of their own (below the job's), not among the job's other
keys: a leader reads every heartbeat with one listing of ``beats`` (N entries, not the job's whole directory), and
every process watches ``signals`` -- abort and notice keys, rare writes -- with one long watch instead of reading
two keys at every heartbeat (:meth:`_EtcdStore.snapshot`, :meth:`_EtcdStore.await_change`). The keys keep their
names: only their place in etcd changes, so every reader and writer is unchanged. Other stores ignore this."""


class WrongTokenError(CoordinationError):
    """This process's job token does not match the one the launcher installed in the store (or none was given)."""


class TamperedRecordError(CoordinationError):
    """A store record failed HMAC verification: written without the job token, altered, or moved to another key."""


# ---------------------------------------------------------------------------------------------------------------
# URLs
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class StoreSpec:
    """A parsed store URL.

    Attributes:
        scheme: ``"tcp"``, ``"etcd"`` or ``"file"``.
        host: Host name or IP (tcp, etcd); None for file.
        port: Port (tcp, etcd); None for file. 0 means "pick a free one" and is only valid for hosting.
        path: The etcd key prefix (normalized, e.g. ``"/parcae/job1"``) or the absolute file path.
    """

    scheme: str
    host: str | None = None
    port: int | None = None
    path: str | None = None

    @property
    def url(self) -> str:
        """The URL this spec was parsed from, in normal form."""
        if self.scheme == "file":
            return f"file://{self.path}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        tail = (self.path or "") if self.scheme == "etcd" else ""
        return f"{self.scheme}://{host}:{self.port}{tail}"

    def with_port(self, port: int) -> StoreSpec:
        """A copy with another port (e.g. the port a hosted store actually got)."""
        return StoreSpec(self.scheme, self.host, port, self.path)


def _bad_url(url: str, why: str) -> ConfigurationError:
    return ConfigurationError(f"bad coordination store URL {url!r}: {why}; expected e.g. {_EXAMPLES}")


def parse_store_url(url: str) -> StoreSpec:
    """Parse a store URL into a :class:`StoreSpec`.

    Args:
        url: ``tcp://HOST:PORT``, ``etcd://HOST[:PORT]/PREFIX`` (port 2379 and prefix ``/parcae`` by default) or
            ``file:///ABSOLUTE/PATH``.

    Returns:
        The parsed spec.

    Raises:
        ConfigurationError: For anything else, with an example of each accepted form.
    """
    if not isinstance(url, str) or "://" not in url:
        raise _bad_url(str(url), "no scheme")
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    if parts.query or parts.fragment or parts.username or parts.password:
        raise _bad_url(url, "query strings, fragments and user:password are not supported")
    if scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise _bad_url(url, "a file store is local: use file:///absolute/path")
        path = urllib.parse.unquote(parts.path)
        if not path.startswith("/") or path.endswith("/"):
            raise _bad_url(url, "the file path must be absolute and name a file")
        return StoreSpec("file", path=os.path.normpath(path))
    if scheme not in ("tcp", "etcd"):
        raise _bad_url(url, f"unknown scheme {scheme!r} (known: tcp, etcd, file)")
    try:
        host, port = parts.hostname, parts.port
    except ValueError as exc:  # port out of range or not a number
        raise _bad_url(url, str(exc)) from None
    if not host:
        raise _bad_url(url, "no host")
    if scheme == "tcp":
        if port is None:
            raise _bad_url(url, "a tcp store needs a port")
        if parts.path not in ("", "/"):
            raise _bad_url(url, "a tcp store URL has no path")
        return StoreSpec("tcp", host=host, port=port)
    prefix = "/" + "/".join(p for p in parts.path.split("/") if p) if parts.path.strip("/") else _DEFAULT_ETCD_PREFIX
    if not all(c.isalnum() or c in "/._-" for c in prefix):
        raise _bad_url(url, "the etcd prefix may contain only letters, digits and / . _ -")
    if port == 0:
        raise _bad_url(url, "an etcd store needs a real port")
    return StoreSpec("etcd", host=host, port=port or _DEFAULT_ETCD_PORT, path=prefix)


def _as_spec(spec: StoreSpec | str) -> StoreSpec:
    return spec if isinstance(spec, StoreSpec) else parse_store_url(spec)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address) is this machine's loopback."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------------------------
# Hosting (launcher side)
# ---------------------------------------------------------------------------------------------------------------
def host_store(
    spec: StoreSpec | str,
    *,
    world_size: int | None = None,
    timeout_s: float = 60.0,
    allow_remote: bool = False,
    token: str | None = None,
) -> dist.Store:
    """Host the job's coordination store (the launcher calls this once; workers never do).

    ``tcp``: starts a ``TCPStore`` server on a socket bound to ``spec.host`` only (the returned store's ``.port``
    is the real port when ``spec.port`` is 0). ``file``: deletes a stale store file and opens a fresh one.
    ``etcd``: etcd hosts itself (see :class:`~lightning_parcae.testing.etcd_server.EtcdServer`); this connects to
    it. With ``token``, the token proof is installed (:func:`install_token`).

    Args:
        spec: A :class:`StoreSpec` or store URL.
        world_size: Expected number of clients (informational; the server never waits for them).
        timeout_s: Timeout of the returned store's blocking operations (and of connecting, for etcd).
        allow_remote: Allow a non-loopback bind address such as ``0.0.0.0``. Required on purpose: every host that
            can reach the port can read and disturb the job.
        token: The job token to install, or None for an open store.

    Returns:
        The hosted store (the launcher's own client of it).

    Raises:
        ConfigurationError: A non-loopback host without ``allow_remote=True``.
        CoordinationError: The port is taken, or the etcd server is unreachable.
        WrongTokenError: An etcd prefix already holds another job's token.
    """
    spec = _as_spec(spec)
    if spec.scheme == "tcp":
        assert spec.host is not None and spec.port is not None
        if not is_loopback(spec.host) and not allow_remote:
            raise ConfigurationError(
                f"refusing to host the coordination store on {spec.host}: only loopback is allowed by default, "
                "because anyone who can reach the port can read and disturb the job. Pass allow_remote=True "
                "(CLI: --store-host) and restrict the port to the job's instances with a firewall/security group."
            )
        store = _host_tcp(spec, world_size=world_size, timeout_s=timeout_s)
    elif spec.scheme == "file":
        assert spec.path is not None
        try:
            os.unlink(spec.path)  # a FileStore file only grows; a stale one would replay an old job
        except FileNotFoundError:
            pass
        store = _open_file_store(spec.path, timeout_s)
    else:
        store = _open_client(spec, timeout_s=timeout_s, op_timeout_s=timeout_s)
    if token is not None:
        install_token(store, token)
    return store


def _host_tcp(spec: StoreSpec, *, world_size: int | None, timeout_s: float) -> dist.Store:
    assert spec.host is not None and spec.port is not None
    try:
        infos = socket.getaddrinfo(spec.host, spec.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CoordinationError(f"cannot host the coordination store on {spec.host!r}: {exc}") from None
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise CoordinationError(f"cannot host the coordination store on {spec.url}: {exc}") from None
    port = int(sock.getsockname()[1])
    wildcard = ipaddress.ip_address(addr[0]).is_unspecified
    self_host = ("::1" if family == socket.AF_INET6 else "127.0.0.1") if wildcard else addr[0]
    try:
        store = dist.TCPStore(
            self_host,
            port,
            world_size,
            True,
            timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except Exception as exc:
        sock.close()
        raise CoordinationError(f"cannot host the coordination store on {spec.url}: {exc}") from exc
    sock.detach()  # the store's server owns the listening descriptor now
    return store


def _open_file_store(path: str, timeout_s: float) -> dist.Store:
    try:
        store = dist.FileStore(path, -1)
    except Exception as exc:
        raise CoordinationError(f"cannot open the file store {path}: {exc}") from exc
    store.set_timeout(timedelta(seconds=timeout_s))
    return store


# ---------------------------------------------------------------------------------------------------------------
# Connecting (agent / worker side)
# ---------------------------------------------------------------------------------------------------------------
def _unreachable(spec: StoreSpec, timeout_s: float, why: str) -> CoordinationError:
    return CoordinationError(
        f"could not reach the coordination store at {spec.url} within {timeout_s:g} s: is the launcher running? "
        f"Check the address and port, and that a firewall/security group lets this host reach it ({why})"
    )


def connect_store(
    spec: StoreSpec | str,
    *,
    token: str | None,
    timeout_s: float = 10.0,
    op_timeout_s: float = 300.0,
) -> dist.Store:
    """Connect to the job's coordination store as a client, failing fast when it is not there.

    Args:
        spec: A :class:`StoreSpec` or store URL.
        token: This job's token. Given: the store must hold the matching proof (waited for up to ``timeout_s``).
            None: accepted only when the store holds no proof (an open store).
        timeout_s: How long to keep trying to reach the store before giving up.
        op_timeout_s: Timeout of the returned store's blocking operations (``get``, ``wait``).

    Returns:
        A ``torch.distributed.Store`` (``TCPStore``, ``FileStore`` or an ``EtcdStore`` rooted at the job prefix).

    Raises:
        CoordinationError: The store is unreachable within ``timeout_s`` (the message says what to check).
        WrongTokenError: The token is wrong or missing.
        ConfigurationError: A malformed URL, ``tcp`` port 0, or python-etcd missing for ``etcd://``.
    """
    spec = _as_spec(spec)
    deadline = time.monotonic() + timeout_s
    store = _open_client(spec, timeout_s=timeout_s, op_timeout_s=op_timeout_s)
    check_token(store, token, wait_s=max(0.0, deadline - time.monotonic()) if token is not None else 0.0)
    return store


def _open_client(spec: StoreSpec, *, timeout_s: float, op_timeout_s: float) -> dist.Store:
    deadline = time.monotonic() + timeout_s
    if spec.scheme == "tcp":
        if not spec.port:
            raise ConfigurationError(f"cannot connect to {spec.url}: port 0 is only meaningful when hosting")
        assert spec.host is not None
        try:
            store: dist.Store = dist.TCPStore(spec.host, spec.port, None, False, timedelta(seconds=timeout_s))
        except Exception as exc:
            raise _unreachable(spec, timeout_s, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from exc
        store.set_timeout(timedelta(seconds=op_timeout_s))
    elif spec.scheme == "file":
        assert spec.path is not None
        while not os.path.exists(spec.path):
            if time.monotonic() >= deadline:
                raise _unreachable(spec, timeout_s, "the store file does not exist")
            time.sleep(0.05)
        store = _open_file_store(spec.path, op_timeout_s)
    else:
        store = _connect_etcd(spec, deadline=deadline, timeout_s=timeout_s, op_timeout_s=op_timeout_s)
    return store


def _connect_etcd(spec: StoreSpec, *, deadline: float, timeout_s: float, op_timeout_s: float) -> dist.Store:
    try:
        import etcd  # python-etcd (v2 API client)
    except ImportError:
        raise ConfigurationError(
            "etcd:// stores need the python-etcd package: pip install python-etcd (or lightning_parcae[etcd])"
        ) from None
    assert spec.host is not None and spec.port is not None and spec.path is not None
    host = f"[{spec.host}]" if ":" in spec.host else spec.host
    base = f"http://{host}:{spec.port}"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    why = "no attempt"
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise _unreachable(spec, timeout_s, why)
        try:
            with opener.open(f"{base}/v2/keys/", timeout=max(0.05, min(remaining, 2.0))) as resp:
                resp.read(1 << 16)
            break
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                raise CoordinationError(
                    f"the etcd server at {base} does not serve the v2 API that the store needs: start etcd with "
                    "--enable-v2=true (etcd 3.4)"
                ) from None
            why = f"HTTP {exc.code}"
        except OSError as exc:
            why = str(getattr(exc, "reason", exc))
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
    client = etcd.Client(host=spec.host, port=spec.port, protocol="http", read_timeout=max(5, int(timeout_s)))
    return _EtcdStore(client, spec.path, timedelta(seconds=op_timeout_s), directories=KEY_DIRECTORIES)


def _etcd_store_base() -> type:
    from torch.distributed.elastic.rendezvous.etcd_store import EtcdStore

    return EtcdStore


class _EtcdStore(_etcd_store_base()):  # type: ignore[misc]
    """torch's ``EtcdStore`` with URL-safe base64 keys, reads of present keys that cost one key, plus ``multi_get``,
    ``delete_key`` and ``compare_set``.

    torch encodes keys with standard base64, whose alphabet contains ``/``; etcd v2 treats that as a directory, so
    such a key (e.g. any key with ``?`` at certain offsets) is never found again and ``get`` times out. The
    URL-safe alphabet has no ``/``.

    torch's ``get``, ``check`` and ``wait`` read the job's *whole directory* and filter it, every time: a request
    costs in proportion to every key the job has written (2.4 us a key here; gloo's rendezvous keys of every
    generation stay, so a long job with churn reaches thousands), and the N x (N - 1) address reads of a process
    group build at N members each paid it. Here a single key that is already there is read directly (one key's
    request), and only a key that is not there yet goes the directory-and-watch way (to wait for it);
    ``multi_get`` of many keys is one directory read (:meth:`multi_get`), and :meth:`wait_for` waits for one key by
    a watch of that key alone (torch's ``wait`` watches the whole directory, which every heartbeat write wakes).
    """

    def __init__(self, client: Any, prefix: str, timeout: timedelta | None = None,
                 directories: Mapping[str, str] | None = None) -> None:
        super().__init__(client, prefix, timeout)
        self.directories = dict(directories or {})
        """Key prefix -> the directory (below this store's) its keys live in (:data:`KEY_DIRECTORIES` on a job's
        store; none on a scope)."""
        for name in self.directories.values():
            _scope_dir(name)  # a name a scope could have: never meets an encoded key

    def _dir_of(self, key: str) -> str:
        """The etcd directory that holds ``key``: this store's, or the one :attr:`directories` gives its prefix."""
        for start, name in self.directories.items():
            if key.startswith(start):
                return self.prefix + _scope_dir(name)
        return self.prefix

    def _path(self, key: str) -> str:
        return self._dir_of(key) + self._encode(key)

    def _read_one(self, key: str) -> bytes | None:
        """The value of ``key`` if it is there now (one key's request), else None."""
        import etcd

        try:
            return self._decode(self.client.get(key=self._path(key)).value)
        except etcd.EtcdKeyNotFound:
            return None

    def _listing(self, directory: str) -> tuple[dict[str, bytes], int]:
        """Every key in ``directory`` (full etcd paths -> values) and the store's index at the read (one request;
        an empty listing while the directory does not exist)."""
        import etcd

        try:
            node = self.client.get(key=directory)
        except etcd.EtcdKeyNotFound as exc:
            return {}, int((exc.payload or {}).get("index") or 0)
        values = {c.key: self._decode(c.value) for c in node.children
                  if not getattr(c, "dir", False) and c.value is not None}
        return values, int(node.etcd_index or 0)

    def read_present(self, keys: list[str]) -> dict[str, bytes]:
        """The keys of ``keys`` that are there now, with their values: one listing per directory they live in
        (one for a set of heartbeats), never a wait."""
        out: dict[str, bytes] = {}
        by_dir: dict[str, list[str]] = {}
        for k in keys:
            by_dir.setdefault(self._dir_of(k), []).append(k)
        for directory, ks in by_dir.items():
            values, _ = self._listing(directory)
            for k in ks:
                v = values.get(directory + self._encode(k))
                if v is not None:
                    out[k] = v
        return out

    def snapshot(self, name: str) -> tuple[dict[str, bytes], int]:
        """Every key of the directory ``name`` of :attr:`directories` (key -> value) and the store's index at the
        read: one request. Pass the index to :meth:`await_change`."""
        values, index = self._listing(self.prefix + _scope_dir(name))
        return {self._decode(path.rsplit("/", 1)[-1]).decode(): v for path, v in values.items()}, index

    def await_change(self, name: str, index: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a write under the directory ``name`` after ``index`` (a :meth:`snapshot`'s):
        True after one (read the snapshot again), False on the timeout. Writes elsewhere (heartbeats) do not wake
        it. One request however long it waits."""
        return self._watch_dir(self.prefix + _scope_dir(name), index, timeout_s)

    def _watch_dir(self, directory: str, index: int, timeout_s: float) -> bool:
        """One recursive watch of ``directory`` from after ``index`` (a listing's): True at the next write under it
        (or when the index fell out of etcd's event window: something may have changed), False on the timeout."""
        import etcd

        try:
            self.client.watch(key=directory, recursive=True, index=index + 1 if index else None,
                              timeout=max(1e-3, timeout_s))
            return True
        except etcd.EtcdWatchTimedOut:
            return False
        except etcd.EtcdEventIndexCleared:
            return True

    def wait_for(self, key: str, timeout_s: float) -> bool:
        """Whether ``key`` is there, waiting up to ``timeout_s`` for it with a watch of that key alone.

        One read when the key is there; otherwise the read's 404 names the store's index, and a watch of the key
        from the next index returns as soon as the key is written -- no event is missed between the read and the
        watch, and writes of other keys (heartbeats: N a beat) do not wake it, unlike torch's ``wait``, which
        watches the job's whole directory. A watch that times out is not an error: False, call again.

        Regression (issue 21): a member waiting for its step's commit decision (or the next generation's record)
        polled the key every 20 ms -- up to 50 requests a second per waiting member, every one a round trip to the
        store on a cluster, and a wake-up up to 20 ms after the write.

        Args:
            key: The key.
            timeout_s: Longest wait (a slice: the caller checks its abort flag between calls).

        Returns:
            True once the key is there; False if it was not written within ``timeout_s`` (or was deleted).
        """
        import etcd

        full = self._path(key)
        try:
            self.client.get(key=full)
            return True
        except etcd.EtcdKeyNotFound as exc:
            index = int((exc.payload or {}).get("index") or 0)
        try:
            event = self.client.watch(key=full, index=index + 1 if index else None, timeout=max(1e-3, timeout_s))
        except etcd.EtcdWatchTimedOut:
            return False
        except etcd.EtcdEventIndexCleared:  # the index fell out of etcd's event window: read again
            return self._read_one(key) is not None
        return getattr(event, "action", "set") not in ("delete", "expire", "compareAndDelete")

    def wait_for_all(self, keys: list[str], timeout_s: float) -> bool:
        """Whether every key is there, waiting up to ``timeout_s`` for the next write under this store if not.

        One read of this store's directory; while a key is missing, a recursive watch of the directory from that
        read's index, which returns at the next write under it. Meant for a scope (:func:`scoped`) that holds one
        barrier's keys: there each write is an arrival, and a waiter wakes once per arrival instead of polling.

        Args:
            keys: The keys.
            timeout_s: Longest wait (a slice: the caller checks its abort flag and deadline between calls).

        Returns:
            True if all keys are there now; False otherwise (after a write under the directory, or the timeout).

        Raises:
            ValueError: A key lives in another directory (:attr:`directories`): this waits on one directory.
        """
        elsewhere = [k for k in keys if self._dir_of(k) != self.prefix]
        if elsewhere:
            raise ValueError(f"wait_for_all waits on one directory; {elsewhere[0]!r} lives in "
                             f"{self._dir_of(elsewhere[0])!r}: wait for it with wait_for")
        present, index = self._listing(self.prefix)
        if all(self.prefix + self._encode(k) in present for k in keys):
            return True
        self._watch_dir(self.prefix, index, timeout_s)
        return False

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it like torch's ``get`` if it is not there yet.

        Raises:
            LookupError: The key was not written within the store's timeout.
        """
        value = self._read_one(key)
        if value is not None:
            return value
        if self._dir_of(key) == self.prefix:
            return super().get(key)
        self._wait_elsewhere([key], None)
        value = self._read_one(key)
        if value is None:
            raise LookupError(f"key {key!r} was deleted while it was waited for in the etcd store")
        return value

    def _wait_elsewhere(self, keys: list[str], override_timeout: timedelta | None) -> None:
        """Wait for keys of :attr:`directories` one by one with :meth:`wait_for` (torch's wait watches this
        store's own directory only)."""
        timeout = self.timeout if override_timeout is None else override_timeout  # type: ignore[attr-defined]
        deadline = time.monotonic() + timeout.total_seconds()
        for k in keys:
            while not self.wait_for(k, min(5.0, max(1e-3, deadline - time.monotonic()))):
                if time.monotonic() >= deadline:
                    raise LookupError(f"key {k!r} not found in the etcd store within {timeout.total_seconds():g} s")

    def set(self, key: str, value: str | bytes) -> None:
        self.client.set(key=self._path(key), value=self._encode(value))

    def add(self, key: str, num: int) -> int:
        if self._dir_of(key) != self.prefix:
            raise ValueError(f"{key!r} is not a counter: keys under {list(self.directories)} are never added to")
        return int(super().add(key, num))

    def check(self, keys: list[str]) -> bool:
        """Whether every key is there now: one key's request for a single key, one directory read for several
        (torch's ``check`` of several keys also posts a watch with a 1 us timeout when one is missing)."""
        if len(keys) == 1:
            return self._read_one(keys[0]) is not None
        return len(self.read_present(list(keys))) == len(set(keys))

    def _children(self) -> list[Any]:
        """The nodes of this store's directory, keys and scopes (one request; none while it does not exist)."""
        import etcd

        try:
            return list(self.client.get(key=self.prefix).children)
        except etcd.EtcdKeyNotFound:
            return []

    def wait(self, keys: list[str], override_timeout: timedelta | None = None) -> None:
        """Wait until every key is there: returns after one key's request each when they already are."""
        if all(self._read_one(k) is not None for k in keys):
            return
        here = [k for k in keys if self._dir_of(k) == self.prefix]
        if here:
            super().wait(here, override_timeout)
        self._wait_elsewhere([k for k in keys if self._dir_of(k) != self.prefix], override_timeout)

    def _encode(self, value: str | bytes) -> str:
        if isinstance(value, str):
            value = value.encode()
        if not isinstance(value, bytes):
            raise ValueError("Value must be of type str or bytes")
        return urlsafe_b64encode(value).decode()

    def _decode(self, value: str | bytes) -> bytes:
        if isinstance(value, str):
            value = value.encode()
        if not isinstance(value, bytes):
            raise ValueError("Value must be of type str or bytes")
        return urlsafe_b64decode(value)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """All of ``keys`` in one read of the job's directory (torch's ``EtcdStore`` reads the whole directory for
        each key, so the inherited ``multi_get`` -- one ``get`` per key -- read it N times); waits like ``get``
        for keys not yet there.

        Raises:
            LookupError: A key was still missing after the store's timeout.
        """
        if any(self._dir_of(k) != self.prefix for k in keys):  # heartbeats: one listing of their directory
            got = self.read_present(list(keys))
            missing = [k for k in keys if k not in got]
            if missing:
                try:
                    self._wait_elsewhere([k for k in missing if self._dir_of(k) != self.prefix], None)
                    here = [k for k in missing if self._dir_of(k) == self.prefix]
                    if here:
                        super().wait(here)
                except LookupError as exc:
                    raise LookupError(f"keys {list(keys)[:4]}... not all found in the etcd store within its "
                                      f"timeout ({exc})") from None
                got.update(self.read_present(missing))
            if any(k not in got for k in keys):
                raise LookupError(f"keys {list(keys)[:4]}... not all found in the etcd store (deleted meanwhile?)")
            return [got[k] for k in keys]
        wanted = [self.prefix + self._encode(k) for k in keys]
        kvs = self._try_wait_get(list(dict.fromkeys(wanted)))
        if kvs is None:
            raise LookupError(f"keys {list(keys)[:4]}... not all found in the etcd store within its timeout")
        return [self._decode(kvs[k]) for k in wanted]

    def scope(self, name: str) -> "_EtcdStore":
        """A store for the keys of ``name`` in a subdirectory of this one (:func:`scoped`)."""
        return _EtcdStore(self.client, self.prefix + _scope_dir(name), self.timeout)

    def count_keys(self) -> int:
        """How many keys (not scopes) this store's directory holds: one read."""
        return sum(1 for node in self._children() if not getattr(node, "dir", False)
                   and node.key.rstrip("/") != self.prefix.rstrip("/"))

    def scope_names(self) -> list[str]:
        """The scopes under this store (one read of its directory; subdirectories only, not the directories of
        :attr:`directories`)."""
        names = [node.key.rstrip("/").rsplit("/", 1)[-1].replace(".", "/") for node in self._children()
                 if getattr(node, "dir", False) and node.key.rstrip("/") != self.prefix.rstrip("/")]
        return [n for n in names if n not in self.directories.values()]

    def drop_scope(self, name: str) -> bool:
        """Delete the scope ``name`` with all its keys (one request); False if it was not there."""
        import etcd

        try:
            self.client.delete(key=self.prefix + _scope_dir(name), recursive=True, dir=True)
            return True
        except etcd.EtcdKeyNotFound:
            return False

    def delete_key(self, key: str) -> bool:
        import etcd

        try:
            self.client.delete(key=self._path(key))
            return True
        except etcd.EtcdKeyNotFound:
            return False

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        import etcd

        full = self._path(key)
        expected = expected_value.encode() if isinstance(expected_value, str) else expected_value
        desired = self._encode(desired_value)
        try:
            current = self._decode(self.client.get(key=full).value)
        except etcd.EtcdKeyNotFound:
            if expected:
                return expected  # c10d semantics: missing key and non-empty expectation -> return expectation
            try:
                return self._decode(self.client.write(key=full, value=desired, prevExist=False).value)
            except etcd.EtcdAlreadyExist:
                current = self._decode(self.client.get(key=full).value)
        if current != expected:
            return current
        try:
            node = self.client.test_and_set(key=full, value=desired, prev_value=self._encode(current))
            return self._decode(node.value)
        except etcd.EtcdCompareFailed:
            return self._decode(self.client.get(key=full).value)


def _scope_dir(name: str) -> str:
    """The etcd directory of scope ``name``: ``/`` becomes ``.``, a character that no encoded key contains (the
    URL-safe base64 alphabet is ``A-Z a-z 0-9 - _ =``), so a scope never meets a key of its parent."""
    parts = [p for p in name.split("/") if p]
    if not parts or any(not p.replace("-", "").replace("_", "").isalnum() for p in parts):
        raise ValueError(f"scope name {name!r} must be non-empty path parts of letters, digits, '-' and '_' "
                         "separated by '/', e.g. 'gen/7'")
    return ".".join(parts) + "/"


def read_if_present(store: dist.Store, key: str) -> bytes | None:
    """The value of ``key`` if it is there now, else None -- without waiting for it.

    One request on etcd (a read whose 404 means "absent"); a ``check`` and a ``get`` (two) on other stores, whose
    ``get`` would wait for a missing key. Regression (issue 21): the heartbeat read of one member's beat and the
    leader's read of the standby count (an ``add(0)``: three requests on etcd, a create that fails, a read and a
    compare-and-swap) each paid more than the one read they need, at every beat or step.
    """
    read_one = getattr(store, "_read_one", None)
    if read_one is not None:
        return read_one(key)
    return bytes(store.get(key)) if store.check([key]) else None


def scoped(store: dist.Store, name: str) -> dist.Store:
    """The keys of one rendezvous (a generation's process groups) under ``name``, removable as one.

    Problem (issue 21): every generation's process groups leave their rendezvous keys (each rank's address per
    group, the arrival and connection barriers: about 5 N keys per generation at N members) in the job's store.
    On etcd they shared the job's directory, whose every listing -- each wait for a key not yet there, each batched
    heartbeat read of the leader -- then grew with the job's age (7.5 ms at 3,000 keys against 0.4 ms at 10).

    On an etcd store the scope is a subdirectory: the job's directory lists it as one entry, its own listings hold
    only its keys, and :func:`drop_scopes` deletes it with one request. On other stores (``TCPStore``,
    ``FileStore``, ``HashStore``) it is a ``PrefixStore`` of ``name + "/"`` -- the keys the code always used; a
    ``TCPStore`` looks keys up in a hash map, so their number costs memory only, and they are not removed.

    Args:
        store: The job's store (as :func:`connect_store` returns it).
        name: Path parts of letters, digits, ``-`` and ``_`` separated by ``/``, e.g. ``"gen/7"``.

    Returns:
        A store for the scope's keys: on etcd one at the subdirectory, elsewhere a ``PrefixStore`` (which files
        key ``k`` as ``name//k``: torch joins prefix and key with another ``/``).

    Raises:
        ValueError: ``name`` is empty or has other characters.
    """
    if isinstance(store, _EtcdStore):
        return store.scope(name)
    _scope_dir(name)  # the same names everywhere
    return dist.PrefixStore(name.strip("/") + "/", store)


def count_in(store: dist.Store, name: str, who: str) -> int | None:
    """Put ``who`` in the tally ``name`` and return how many are in it now; None where a store cannot (not etcd).

    A counter without contention: every participant writes its own key in the scope ``name`` (one write) and
    counts the scope's keys (one read). Counting the same ``who`` twice counts it once. On etcd the alternative,
    ``add``, is a compare-and-swap loop that sleeps a random 0-100 ms after every lost race (torch's
    ``EtcdStore.add``): N members adding at once took 78-217 ms at N = 4-32 for the last of them (median of 10).
    Other stores' ``add`` is atomic: use it there (the caller falls back to it on None).

    Args:
        store: The job's store.
        name: The tally's scope (:func:`scoped` rules, e.g. ``"commit/3/17"``).
        who: The participant (its key in the scope).
    """
    if not isinstance(store, _EtcdStore):
        return None
    tally = store.scope(name)
    tally.set(who, "1")
    return tally.count_keys()


def drop_scopes(store: dist.Store, drop: Callable[[str], bool]) -> list[str]:
    """Delete the scopes of ``store`` for which ``drop(name)`` is true (etcd only; see :func:`scoped`).

    Args:
        store: The job's store.
        drop: Tells from a scope's name (e.g. ``"gen/7"``) whether to delete it.

    Returns:
        The names deleted (always empty for stores other than etcd: their scopes are not listed or removed).
    """
    if not isinstance(store, _EtcdStore):
        return []
    return [name for name in store.scope_names() if drop(name) and store.drop_scope(name)]


# ---------------------------------------------------------------------------------------------------------------
# Job token and signed records
# ---------------------------------------------------------------------------------------------------------------
def new_token() -> str:
    """A fresh random job token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def _key_bytes(token: str) -> bytes:
    if not isinstance(token, str) or not token:
        raise WrongTokenError("wrong job token: an empty or non-text token was given")
    return token.encode("utf-8")


def _proof(token: str, salt: str) -> str:
    return hmac.new(_key_bytes(token), _PROOF_CONTEXT + salt.encode(), hashlib.sha256).hexdigest()


def _load_proof(store: dist.Store) -> dict[str, str] | None:
    if not store.check([AUTH_KEY]):
        return None
    raw = store.get(AUTH_KEY)
    try:
        doc = json.loads(raw[:4096].decode("utf-8"))
        if isinstance(doc, dict) and isinstance(doc.get("salt"), str) and isinstance(doc.get("proof"), str):
            return {"salt": doc["salt"], "proof": doc["proof"]}
    except (UnicodeDecodeError, ValueError):
        pass
    raise WrongTokenError(f"wrong job token: the token proof under {AUTH_KEY!r} is unreadable (store corrupted?)")


def install_token(store: dist.Store, token: str) -> None:
    """Install a salted proof of ``token`` (launcher side), refusing to replace another job's proof.

    The proof is ``HMAC-SHA256(token, context + salt)``: it lets a client check its token without the token ever
    being written to the store.

    Raises:
        WrongTokenError: The store (or etcd prefix) already holds a proof of a different token.
    """
    salt = secrets.token_hex(16)
    doc = json.dumps({"v": 1, "salt": salt, "proof": _proof(token, salt)}).encode()
    current = store.compare_set(AUTH_KEY, "", doc)
    if current != doc:
        try:
            check_token(store, token)
        except WrongTokenError:
            raise WrongTokenError(
                "wrong job token: this store already holds another job's token; use a fresh store or etcd prefix"
            ) from None


def check_token(store: dist.Store, token: str | None, *, wait_s: float = 0.0) -> None:
    """Check ``token`` against the proof the launcher installed.

    Args:
        store: The coordination store.
        token: The token to check, or None (accepted only if the store holds no proof).
        wait_s: With a token, how long to wait for the launcher to install its proof.

    Raises:
        WrongTokenError: The token does not match, or is missing while the store requires one, or the store holds
            no proof while a token was given.
    """
    if token is None:
        if _load_proof(store) is not None:
            raise WrongTokenError(
                f"wrong job token: none was given but this store requires one (set {JOB_TOKEN_ENV} to the "
                "launcher's token)"
            )
        return
    if wait_s > 0 and not store.check([AUTH_KEY]):
        try:
            store.wait([AUTH_KEY], timedelta(seconds=wait_s))
        except CoordinationError:
            raise
        except (LookupError, RuntimeError):
            pass
    doc = _load_proof(store)
    if doc is None:
        raise WrongTokenError(
            "wrong job token: a token was given but the store holds no token proof (wrong store, or the launcher "
            "was started without a token)"
        )
    if not hmac.compare_digest(_proof(token, doc["salt"]), doc["proof"]):
        raise WrongTokenError(f"wrong job token: it does not match the launcher's (check {JOB_TOKEN_ENV})")


def _sign(token: str, key: str, payload: bytes) -> str:
    return hmac.new(_key_bytes(token), _RECORD_CONTEXT + key.encode() + b"\0" + payload, hashlib.sha256).hexdigest()


def encode_record(key: str, value: Mapping[str, Any], token: str) -> bytes:
    """The signed JSON envelope of ``value`` for ``key`` (what :func:`publish` writes); for a caller that writes it
    itself, e.g. with ``compare_set`` so that the first writer wins.

    Raises:
        TypeError: ``value`` is not a JSON-safe dict.
    """
    if not isinstance(value, Mapping):
        raise TypeError(f"publish() takes a JSON object (dict), got {type(value).__name__}")
    try:
        payload = json.dumps(
            {"key": key, "ts": time.time(), "value": dict(value)},
            sort_keys=True,
            separators=(",", ":"),
            allow_nan=False,
        )
    except (TypeError, ValueError) as exc:
        raise TypeError(f"the record for {key!r} is not JSON-safe: {exc}") from None
    envelope = {"v": 1, "payload": payload, "sig": _sign(token, key, payload.encode())}
    return json.dumps(envelope, separators=(",", ":")).encode()


def decode_record(key: str, raw: bytes, token: str) -> dict[str, Any]:
    """The value of a signed record read from ``key`` (what :func:`read` returns), checked against the job token.

    Raises:
        TamperedRecordError: written without this job's token, altered, copied from another key, or malformed.
    """
    if len(raw) > MAX_RECORD_BYTES:
        raise TamperedRecordError(f"record {key!r} is {len(raw)} bytes, over the {MAX_RECORD_BYTES}-byte limit")
    try:
        envelope = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError):
        raise TamperedRecordError(f"record {key!r} is not a signed JSON record") from None
    if (
        not isinstance(envelope, dict)
        or envelope.get("v") != 1
        or not isinstance(envelope.get("payload"), str)
        or not isinstance(envelope.get("sig"), str)
    ):
        raise TamperedRecordError(f"record {key!r} is not a signed JSON record")
    payload = envelope["payload"]
    if not hmac.compare_digest(_sign(token, key, payload.encode()), envelope["sig"]):
        raise TamperedRecordError(
            f"record {key!r} failed verification: written without this job's token, altered, or copied from "
            "another key"
        )
    body = json.loads(payload)
    if not isinstance(body, dict) or body.get("key") != key or not isinstance(body.get("value"), dict):
        raise TamperedRecordError(f"record {key!r} is signed but malformed")
    return body["value"]


def publish(store: dist.Store, key: str, value: Mapping[str, Any], token: str) -> None:
    """Write ``value`` (a JSON object) under ``key``, signed with the job token.

    The token is checked against the installed proof first, so a process with a wrong token cannot publish.

    Raises:
        WrongTokenError: The token is wrong.
        TypeError: ``value`` is not a JSON-safe dict (NaN and infinities are rejected too).
    """
    check_token(store, token)
    store.set(key, encode_record(key, value, token))


def read(store: dist.Store, key: str, token: str, *, timeout_s: float | None = None) -> dict[str, Any]:
    """Read and verify a record written by :func:`publish`.

    Args:
        store: The coordination store.
        key: The record's key.
        token: The job token.
        timeout_s: How long to wait for the key; None uses the store's own timeout, 0 does not wait.

    Returns:
        The published JSON object.

    Raises:
        KeyError: The key is not there (within ``timeout_s``).
        TamperedRecordError: The record is not signed with ``token`` for this key, or is malformed.
    """
    _key_bytes(token)
    if timeout_s is not None:
        if timeout_s <= 0:
            present = store.check([key])
        else:
            try:
                store.wait([key], timedelta(seconds=timeout_s))
                present = True
            except (LookupError, RuntimeError):
                present = False
        if not present:
            raise KeyError(key)
    try:
        raw = store.get(key)
    except (LookupError, RuntimeError):
        raise KeyError(key) from None
    return decode_record(key, bytes(raw), token)


class TokenStore:
    """A store handle bound to a job token: checks it once, then publishes and reads signed records.

    Args:
        store: The coordination store.
        token: The job token.
        check: Verify the token against the installed proof now (raises :class:`WrongTokenError`).
    """

    def __init__(self, store: dist.Store, token: str, *, check: bool = True) -> None:
        _key_bytes(token)
        if check:
            check_token(store, token)
        self.store = store
        self._token = token

    def publish(self, key: str, value: Mapping[str, Any]) -> None:
        """Write a signed record (the token was checked at construction)."""
        self.store.set(key, encode_record(key, value, self._token))

    def read(self, key: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Read and verify a signed record; see :func:`read`."""
        return read(self.store, key, self._token, timeout_s=timeout_s)

    def __repr__(self) -> str:
        return f"TokenStore({type(self.store).__name__}, token=<hidden>)"
