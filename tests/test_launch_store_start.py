"""``parcae store start`` runs a real etcd with the token and its proof; ``parcae store status`` reads it back.

Regression (issue 20): a multi-machine job's store took four hand-made steps (etcd with the right flags, a token, a
``python -c`` one-liner for its proof, a 0600 file) and nothing said what the store held. These tests start the
system's etcd (``etcd-server``) on a free loopback port through the real command, as a user would, and skip, saying
why, where it is not installed.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import pytest

from lightning_parcae.errors import ConfigurationError, CoordinationError
from lightning_parcae.launch.agent import build_parser as agent_parser
from lightning_parcae.launch.cli import main as parcae
from lightning_parcae.launch.rendezvous import Relaunch, Rendezvous, Roster
from lightning_parcae.launch.store_start import StoreService, parse_listen, store_report
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.liveness import notice_record, write_notice
from lightning_parcae.runtime.store import connect_store, host_store, new_token
from lightning_parcae.testing.etcd_server import etcd_binary

try:
    import etcd as _python_etcd  # noqa: F401

    HAVE_PYTHON_ETCD = True
except ImportError:
    HAVE_PYTHON_ETCD = False

needs_etcd = pytest.mark.skipif(etcd_binary() is None or not HAVE_PYTHON_ETCD,
                                reason="needs the etcd binary (apt-get install etcd-server) and python-etcd")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class _Started:
    """``parcae store start`` in a child process, read until it says it runs in the foreground."""

    def __init__(self, *args: str, timeout_s: float = 60.0) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "lightning_parcae.launch.cli", "store", "start", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.out: list[str] = []
        lines: queue.Queue[Optional[str]] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(x) for x in self.proc.stdout] + [lines.put(None)],  # type: ignore[union-attr]
                         daemon=True).start()
        self._lines = lines
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                continue
            if line is None:
                break
            self.out.append(line.rstrip("\n"))
            if "running in the foreground" in line:
                return
        self.stop()
        raise AssertionError(f"parcae store start did not come up: {self.out}")

    def rest(self) -> list[str]:
        """The lines printed after start-up (once it exited)."""
        out = []
        while (line := self._lines.get(timeout=10)) is not None:
            out.append(line.rstrip("\n"))
        return out

    def line(self, marker: str) -> str:
        """The first printed line containing ``marker``."""
        return next(x for x in self.out if marker in x)

    def stop(self) -> int:
        """SIGTERM it, as a scheduler does; its exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=30)


@needs_etcd
def test_store_start_serves_a_job_that_status_reads_and_stops_on_sigterm(tmp_path: Path) -> None:
    port, peer = _free_port(), _free_port()
    data, token_file = tmp_path / "store", tmp_path / "job.token"
    args = ["--listen", f"127.0.0.1:{port}", "--peer-port", str(peer), "--data-dir", str(data),
            "--token-file", str(token_file), "--job", "t1"]
    started = _Started(*args)
    try:
        url = started.line("the job's store:").split("the job's store: ")[1]
        assert url == f"etcd://127.0.0.1:{port}/parcae/t1"
        token = token_file.read_text().strip()
        assert token and stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
        assert all(token not in line for line in started.out)  # never printed
        # the printed agent command is the real CLI's
        agent_line = started.line("parcae agent ").strip().split()
        assert agent_line[:2] == ["parcae", "agent"]
        ns = agent_parser().parse_args(agent_line[2:])
        assert (ns.store, ns.token_file) == (url, str(token_file))
        connect_store(url, token=token, timeout_s=5.0)  # an agent with the token is let in

        code, lines = store_report(url, token)
        assert code == 0 and "token proof: installed, matches this token" in lines
        assert "agents: none registered yet" in lines and "generation: none started yet" in lines
        code, lines = store_report(url, new_token())
        assert code == 1 and any("does NOT match" in x for x in lines)
        code, lines = store_report(url, None)
        assert code == 0 and any("give --token-file" in x for x in lines)

        # what agents and workers write: MIN:MAX, a roster, a relaunch, a generation, a notice
        store = connect_store(url, token=token, timeout_s=5.0)
        rdv = Rendezvous(store, token, "a", min_nodes=2, max_nodes=4)
        rdv.publish_bounds()
        store.add(rdv.key(0, "count"), 2)  # two arrivals
        rdv.records.claim(rdv.key(0, "roster"), Roster(0, ("a", "b"), written_by="a").record())
        rdv.declare(Relaunch(1, "s3://bucket/t1/step-40.ckpt", 40, 2, 4, reason="stage 1 lost", declared_by="b"))
        coord = Coordinator(store, token)
        coord.propose({"generation": 1000, "kind": "start", "step": 40, "D": 1, "P": 2,
                       "layout": {"members": ["a.1", "b.1"], "partition": [0, 2]}})
        coord.set_current(1000)
        write_notice(store, "b.1", notice_record("b.1", source="agent", why="SIGTERM"), token)
        assert parcae(["store", "status", "--store", url, "--token-file", str(token_file)]) == 0
        code, lines = store_report(url, token)
        text = "\n".join(lines)
        assert code == 0, text
        assert "agents: --nodes 2:4" in text
        assert "round 0: roster ['a', 'b'] (written by a), 2 arrived" in text
        assert "relaunch round 1: declared by b (stage 1 lost), --nodes 2:4, resume from " \
               "s3://bucket/t1/step-40.ckpt (step 40)" in text
        assert "generation 1000: start at step 40, D=1 P=2, members ['a.1', 'b.1']" in text
        assert "notice for b.1: preempt from agent (SIGTERM)" in text
        # a forged record is reported, not trusted
        store.set("parcae/notice/a.1", b'{"member": "a.1", "kind": "preempt"}')
        code, lines = store_report(url, token)
        assert code == 1 and any(x.startswith("notice for a.1: unreadable") for x in lines)
    finally:
        assert started.stop() == 0
    assert any("stopping etcd" in x for x in started.rest())
    with socket.socket() as s:  # etcd is gone with it
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


@needs_etcd
def test_a_restarted_store_keeps_its_job_and_refuses_a_new_token(tmp_path: Path) -> None:
    """Restarted with the same data directory and token file it serves the same job, records and proof kept; a
    new token against that data directory is refused, and leaves no token file behind."""
    data, token_file = tmp_path / "store", tmp_path / "job.token"

    def service(tf: Path) -> StoreService:
        return StoreService(f"127.0.0.1:{_free_port()}", str(data), str(tf), peer_port=_free_port(), job="t2")

    first = service(token_file)
    url = first.start()
    assert first.created_token_file
    try:
        token = token_file.read_text().strip()
        Rendezvous(connect_store(url, token=token), token, "a", min_nodes=3, max_nodes=5).publish_bounds()
    finally:
        first.stop()
    again = service(token_file)
    url = again.start()
    try:
        assert not again.created_token_file and token_file.read_text().strip() == token
        code, lines = store_report(url, token)
        assert code == 0 and "agents: --nodes 3:5" in lines, lines
    finally:
        again.stop()
    other = tmp_path / "other.token"
    with pytest.raises(CoordinationError, match="another job's token"):
        service(other).start()
    assert not other.exists()


@needs_etcd
def test_the_advertised_name_need_not_resolve_while_the_store_starts(tmp_path: Path) -> None:
    """In Kubernetes the store is advertised as its Service's name, which resolves only once the pod is ready: the
    proof must go in over the machine's own address, and the name be what the agents are told."""
    port = _free_port()
    svc = StoreService(f"127.0.0.1:{port}", str(tmp_path / "d"), str(tmp_path / "t"), peer_port=_free_port(),
                       advertise="parcae-etcd.invalid", job="k8s")
    try:
        assert svc.start() == f"etcd://parcae-etcd.invalid:{port}/parcae/k8s"
        assert f"--store etcd://parcae-etcd.invalid:{port}/parcae/k8s" in svc.agent_command()
        token = (tmp_path / "t").read_text().strip()
        connect_store(f"etcd://127.0.0.1:{port}/parcae/k8s", token=token, timeout_s=5.0)  # the proof is there
    finally:
        svc.stop()


@needs_etcd
def test_store_start_names_a_taken_port_and_writes_no_token(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        rc = parcae(["store", "start", "--listen", f"127.0.0.1:{port}", "--data-dir", str(tmp_path / "d"),
                     "--token-file", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert rc == 2 and f"127.0.0.1:{port} is taken" in err and "--listen HOST:PORT" in err
    assert not (tmp_path / "t").exists()


def test_store_start_says_how_to_install_etcd_when_it_is_missing(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    rc = parcae(["store", "start", "--listen", f"127.0.0.1:{_free_port()}", "--peer-port", str(_free_port()),
                 "--etcd", str(tmp_path / "no-etcd-here"), "--data-dir", str(tmp_path / "d"),
                 "--token-file", str(tmp_path / "t")])
    err = capsys.readouterr().err
    assert rc == 2 and "etcd is not installed" in err and "apt-get install etcd-server" in err
    assert not (tmp_path / "t").exists()


def test_store_start_binds_elsewhere_only_when_told_and_usably(tmp_path: Path) -> None:
    assert StoreService(data_dir=str(tmp_path)).host == "127.0.0.1"  # the default is loopback
    assert parse_listen("10.0.0.5") == ("10.0.0.5", 2379) and parse_listen("[::1]:2400") == ("::1", 2400)
    with pytest.raises(ConfigurationError, match="--advertise"):
        StoreService("0.0.0.0:2379", str(tmp_path))
    with pytest.raises(ConfigurationError, match="HOST:PORT"):
        parse_listen("a:b:c")
    with pytest.raises(ConfigurationError, match="not an address of this machine"):
        StoreService("192.0.2.7:2379", str(tmp_path), str(tmp_path / "t")).start()  # TEST-NET-1: nobody's
    assert not (tmp_path / "t").exists()


def test_status_of_an_unreachable_store_says_what_to_start(capsys: pytest.CaptureFixture[str]) -> None:
    rc = parcae(["store", "status", "--store", f"etcd://127.0.0.1:{_free_port()}/parcae/x", "--timeout", "0.5"])
    err = capsys.readouterr().err
    assert rc == 2 and ("parcae store start" in err or "python-etcd" in err)


def test_status_of_an_open_store_and_of_a_token_it_lacks(tmp_path: Path) -> None:
    hosted = host_store("tcp://127.0.0.1:0")
    url = f"tcp://127.0.0.1:{hosted.port}"
    code, lines = store_report(url, None)
    assert code == 0 and any("none installed" in x for x in lines)
    code, lines = store_report(url, new_token())
    assert code == 1 and any("--reuse-token-file" in x for x in lines)
