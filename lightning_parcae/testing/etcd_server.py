"""Start a throw-away local etcd server (tests and one-machine jobs).

Problem: the etcd coordination store needs a running etcd, and starting one by hand is fiddly: it must listen on
loopback only, serve the v2 API that ``torch.distributed.elastic``'s ``EtcdStore`` speaks (``--enable-v2=true`` on
etcd 3.4), pick ports that are free, be *healthy* before anyone connects, and be stopped and cleaned up even when a
test fails. :class:`EtcdServer` does exactly that with the Debian ``etcd`` binary (package ``etcd-server``). It is
also the single-member etcd that ``parcae store start`` runs for a job (``host``: the address clients reach it on,
given explicitly); it is not a replicated etcd cluster (see ``docs/cloud.md``).

Example::

    with EtcdServer() as etcd:
        store = connect_store(etcd.store_url("/parcae/job1"), token=None)
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from types import TracebackType

from lightning_parcae.errors import CoordinationError

__all__ = ["EtcdServer", "EtcdBinaryMissingError", "etcd_binary"]

_INSTALL_HINT = "install it with `apt-get install etcd-server` (Debian/Ubuntu) or put an etcd 3.4+ binary on PATH"


class EtcdBinaryMissingError(CoordinationError, FileNotFoundError):
    """The ``etcd`` executable was not found, so no local etcd server can be started."""


def etcd_binary(binary: str = "etcd") -> str | None:
    """Return the absolute path of the etcd executable, or None when it is not installed.

    Args:
        binary: Name or path of the executable.
    """
    return shutil.which(binary)


def _bracket(host: str) -> str:
    """``host`` as it goes into a URL (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class EtcdServer:
    """A single-member etcd server (on 127.0.0.1 unless told otherwise), with the v2 API enabled, as a context manager.

    Args:
        data_dir: Where etcd keeps its data. ``None`` creates a temporary folder that is removed on :meth:`stop`;
            a given folder is created if needed and kept.
        client_port: Client port; 0 picks a free one.
        peer_port: Peer port (unused by clients but etcd always listens on it); 0 picks a free one.
        binary: Name or path of the etcd executable.
        startup_timeout_s: How long to wait for ``/health`` to report healthy.
        name: Member name.
        host: The address the client port listens on (loopback by default; any other must be asked for). The peer
            port always listens on loopback: a single member has no peers.
        advertise_host: The address clients are told to use (:attr:`url`, :meth:`store_url`); default ``host``.
            Needed when ``host`` is a wildcard such as ``0.0.0.0``.

    Raises:
        EtcdBinaryMissingError: On :meth:`start`, when the binary is not installed.
        CoordinationError: On :meth:`start`, when etcd exits or does not become healthy in time (the message ends
            with the tail of etcd's log).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        client_port: int = 0,
        peer_port: int = 0,
        binary: str = "etcd",
        startup_timeout_s: float = 20.0,
        name: str = "parcae-etcd",
        host: str = "127.0.0.1",
        advertise_host: str | None = None,
    ) -> None:
        self._requested_data_dir = Path(data_dir) if data_dir is not None else None
        self._requested_client_port = client_port
        self._requested_peer_port = peer_port
        self._binary = binary
        self._startup_timeout_s = startup_timeout_s
        self._name = name
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp_dir: Path | None = None
        self._log_path: Path | None = None
        self._listen_host = host
        self.host = advertise_host or host
        self.client_port = 0
        self.peer_port = 0

    # -- addresses ---------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        """The client URL, e.g. ``http://127.0.0.1:40123``."""
        return f"http://{_bracket(self.host)}:{self.client_port}"

    def store_url(self, prefix: str = "/parcae") -> str:
        """The ``etcd://`` store URL for :func:`lightning_parcae.runtime.store.parse_store_url` under ``prefix``."""
        return f"etcd://{_bracket(self.host)}:{self.client_port}/{prefix.strip('/')}"

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Wait up to ``timeout_s`` (None: forever) for etcd to exit; its exit status, or None while it runs."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return None

    @property
    def running(self) -> bool:
        """Whether the etcd process is alive."""
        return self._proc is not None and self._proc.poll() is None

    # -- life cycle --------------------------------------------------------------------------------------------
    def start(self) -> EtcdServer:
        """Start etcd and wait until it reports healthy. Returns self."""
        if self._proc is not None:
            raise CoordinationError("this EtcdServer was already started")
        path = etcd_binary(self._binary)
        if path is None:
            raise EtcdBinaryMissingError(f"the etcd binary {self._binary!r} was not found on PATH: {_INSTALL_HINT}")
        if self._requested_data_dir is None:
            self._tmp_dir = Path(tempfile.mkdtemp(prefix="parcae-etcd-"))
            root = self._tmp_dir
        else:
            root = self._requested_data_dir
            root.mkdir(parents=True, exist_ok=True)
        self._log_path = root / "etcd.log"
        self.client_port = self._requested_client_port or _free_port()
        self.peer_port = self._requested_peer_port or _free_port()
        peer = f"http://127.0.0.1:{self.peer_port}"
        cmd = [
            path,
            "--name", self._name,
            "--data-dir", str(root / "data"),
            "--listen-client-urls", f"http://{_bracket(self._listen_host)}:{self.client_port}",
            "--advertise-client-urls", self.url,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self._name}={peer}",
            "--initial-cluster-state", "new",
            "--enable-v2=true",
            "--log-level", "warn",
        ]  # fmt: skip
        with open(self._log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
            )
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self._startup_timeout_s
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        last = "no answer yet"
        local = self._listen_host if self._listen_host not in ("0.0.0.0", "::", "") else "127.0.0.1"
        health = f"http://{_bracket(local)}:{self.client_port}/health"
        while time.monotonic() < deadline:
            assert self._proc is not None
            if self._proc.poll() is not None:
                raise CoordinationError(
                    f"etcd exited with status {self._proc.returncode} while starting on {self.url}:\n{self._log_tail()}"
                )
            try:
                with opener.open(health, timeout=1.0) as resp:
                    body = json.loads(resp.read(4096).decode("utf-8", "replace"))
                if str(body.get("health")) == "true":
                    return
                last = f"/health answered {body!r}"
            except (OSError, ValueError) as exc:  # URLError is an OSError
                last = str(exc)
            time.sleep(0.05)
        raise CoordinationError(
            f"etcd on {self.url} did not become healthy within {self._startup_timeout_s:g} s ({last}):\n"
            f"{self._log_tail()}"
        )

    def _log_tail(self, n: int = 2000) -> str:
        try:
            assert self._log_path is not None
            return self._log_path.read_text(errors="replace")[-n:]
        except (OSError, AssertionError):
            return "(no etcd log)"

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop etcd (SIGTERM, then SIGKILL after ``timeout_s``) and remove a temporary data folder. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout_s)
        if self._tmp_dir is not None:
            shutil.rmtree(self._tmp_dir, ignore_errors=True)
            self._tmp_dir = None

    def __enter__(self) -> EtcdServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"EtcdServer({self.url}, {state})"
