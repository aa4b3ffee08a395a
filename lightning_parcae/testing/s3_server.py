"""Start a throw-away S3 API server on loopback (tests of checkpoints on object storage).

Problem: checkpoints on S3 must be tested against something that speaks the S3 protocol over HTTP, fails the way a
remote service fails (refuses a bucket that does not exist, goes silent, goes away) and is not a mock of the
client. :class:`S3Server` runs moto's standalone server (``moto_server``, from the ``moto[server]`` test extra) in
its own process on 127.0.0.1, waits until it answers, creates buckets, and can be frozen (SIGSTOP: silence, no
reset) or stopped like a vanished service.

Example::

    with S3Server() as s3:
        s3.create_bucket("ckpts")
        store = CheckpointStore("s3://ckpts/job", storage_options=s3.storage_options())
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Any, Optional

__all__ = ["S3Server", "moto_server_binary", "CREDENTIALS"]

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "parcae-test", "AWS_SECRET_ACCESS_KEY": "parcae-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}
"""What a client of the test server needs in its environment (any key pair works with moto; the metadata service
is disabled so that botocore never looks for an instance role off this machine)."""


def moto_server_binary() -> Optional[str]:
    """The ``moto_server`` executable next to this Python, or on PATH; None when moto[server] is not installed."""
    here = Path(sys.executable).with_name("moto_server")
    return str(here) if here.exists() else shutil.which("moto_server")


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class S3Server:
    """moto's S3 API server in a child process, bound to ``host`` (loopback by default).

    Args:
        host: Address to bind; a test's network namespace may give its own.
        port: Port; 0 picks a free one on loopback.
        startup_timeout_s: How long to wait for the server to answer.
        netns: Run the server inside this network namespace (``ip netns exec``), for multi-machine tests.

    Raises:
        FileNotFoundError: On :meth:`start`, when ``moto_server`` is not installed (``pip install 'moto[server]'``).
        RuntimeError: On :meth:`start`, when the server exits or does not answer in time (with its log tail).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, startup_timeout_s: float = 30.0,
                 netns: Optional[str] = None) -> None:
        self.host = host
        self.port = port or _free_port()
        self.startup_timeout_s = startup_timeout_s
        self.netns = netns
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._log = Path(tempfile.mkstemp(prefix="parcae-moto-", suffix=".log")[1])

    @property
    def endpoint_url(self) -> str:
        """``http://host:port``."""
        return f"http://{self.host}:{self.port}"

    def storage_options(self, **config: Any) -> dict[str, Any]:
        """fsspec/s3fs options that reach this server (``config`` goes to botocore, e.g. ``read_timeout=2``)."""
        opts: dict[str, Any] = {"client_kwargs": {"endpoint_url": self.endpoint_url}, "key": CREDENTIALS[
            "AWS_ACCESS_KEY_ID"], "secret": CREDENTIALS["AWS_SECRET_ACCESS_KEY"]}
        if config:
            opts["config_kwargs"] = dict(config)
        return opts

    def env(self) -> dict[str, str]:
        """Environment variables for a process that should reach this server with no options of its own."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint_url}

    def start(self) -> "S3Server":
        """Start the server and wait until it answers."""
        binary = moto_server_binary()
        if binary is None:
            raise FileNotFoundError("moto_server is not installed: pip install 'moto[server]' (the test extra)")
        cmd = [binary, "-H", self.host, "-p", str(self.port)]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns, *cmd]
        log = open(self._log, "wb")  # noqa: SIM115 -- kept open by the child
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env={**os.environ, **CREDENTIALS})
        log.close()
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto_server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.netns or self._answers():
                if not self.netns:
                    return self
                time.sleep(1.0)
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"moto_server did not answer on {self.endpoint_url} within {self.startup_timeout_s:g} s:\n"
                           f"{self.log_tail()}")

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.endpoint_url + "/", timeout=1.0):
                return True
        except urllib.error.HTTPError:
            return True  # it answered, with an S3 error
        except OSError:
            return False

    def create_bucket(self, name: str) -> None:
        """Create a bucket (through the S3 API, as a user's tooling would)."""
        import boto3  # noqa: PLC0415

        boto3.client("s3", endpoint_url=self.endpoint_url, aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
                     aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
                     region_name=CREDENTIALS["AWS_DEFAULT_REGION"]).create_bucket(Bucket=name)

    def freeze(self) -> None:
        """SIGSTOP the server: connections stay open and nothing answers (a vanished machine, no reset)."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        """SIGCONT a frozen server."""
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop the server (idempotent); its buckets are gone with it."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGCONT)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log."""
        try:
            return "\n".join(self._log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, exc_type: Optional[type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        self.stop()
        self._log.unlink(missing_ok=True)
