"""``parcae store start`` and ``parcae store status``: the job's store in one command, and a look inside it.

Problem: a multi-machine job needs an etcd with the v2 API enabled, a job token, the token's proof in the store and
the token in a file only its owner can read -- four steps with their own flags (``etcd --enable-v2=true
--listen-client-urls ... --advertise-client-urls ...``, then ``parcae store init``), each easy to get subtly wrong
(etcd on every interface, the v2 API off, the token printed into a terminal). And once agents run, "what is the
store doing?" had no answer short of ``etcdctl`` and base64-decoding keys.

``parcae store start`` runs the system's etcd (Debian's ``etcd-server``) in the foreground as a single member with
the v2 API, on loopback unless ``--listen`` names another address, with its data in ``--data-dir`` (kept: a restart
with the same directory and token file serves the same job). It takes the token from ``--token-file`` when that
file exists, else creates one (``$PARCAE_JOB_TOKEN`` or a fresh 256-bit one) and writes it there with mode 0600;
installs the token's proof (:func:`lightning_parcae.launch.store_init.install_proof`); prints the ``--store`` URL
and the agent command line; and stops etcd on Ctrl-C or SIGTERM. The token itself is never printed.

``parcae store status --store URL [--token-file F]`` says whether the store answers, whether the token proof is
installed and matches the token, and what the job's records say: the agents' MIN:MAX, each rendezvous round's
roster and relaunch record, the current generation and its members, and notices waiting for them.

    parcae store start --listen 10.0.0.5:2379 --data-dir /var/lib/parcae/job1 --token-file job1.token
    parcae store status --store etcd://10.0.0.5:2379/parcae/job1 --token-file job1.token
"""

from __future__ import annotations

import argparse
import errno
import ipaddress
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

from lightning_parcae.contract import JOB_TOKEN_ENV
from lightning_parcae.errors import ConfigurationError, CoordinationError, ParcaeError
from lightning_parcae.launch.store_init import install_proof, read_token_file, write_token_file

__all__ = ["build_start_parser", "build_status_parser", "start_main", "status_main", "StoreService", "parse_listen",
           "store_report"]

DEFAULT_LISTEN = "127.0.0.1:2379"
_INSTALL = ("install it (Debian/Ubuntu: `sudo apt-get install etcd-server`; elsewhere an etcd 3.4 release from "
            "https://github.com/etcd-io/etcd/releases on PATH), or pass --etcd /path/to/etcd")


def build_start_parser() -> argparse.ArgumentParser:
    """The argument parser of ``parcae store start``."""
    p = argparse.ArgumentParser(
        prog="parcae store start",
        description="Run the job's coordination store in the foreground: the system's etcd (v2 API, one member), "
        "a job token in --token-file (created with mode 0600 unless the file exists; never printed) and its proof "
        "in the store. Prints the --store URL and the agent command line. Ctrl-C or SIGTERM stops etcd; its data "
        "stays in --data-dir.",
        epilog="example: parcae store start --listen 10.0.0.5:2379 --data-dir /var/lib/parcae/job1 "
        "--token-file job1.token",
    )
    p.add_argument("--listen", default=DEFAULT_LISTEN, metavar="HOST:PORT",
                   help=f"address etcd's client port binds (default {DEFAULT_LISTEN}: this machine only). Agents on "
                   "other machines need this host's private address, e.g. 10.0.0.5:2379, and a firewall rule that "
                   "lets only the job's instances reach it")
    p.add_argument("--advertise", default=None, metavar="HOST",
                   help="the address agents use, when it differs from --listen's host (required with a wildcard "
                   "such as 0.0.0.0)")
    p.add_argument("--peer-port", type=int, default=None,
                   help="etcd's peer port, always on loopback (default: the client port + 1)")
    p.add_argument("--data-dir", default="parcae-store", help="etcd's data and log (default ./parcae-store); kept "
                   "when the store stops")
    p.add_argument("--token-file", default=None, help="the job token: read if the file exists, else created with "
                   "mode 0600 (default DATA_DIR/job.token)")
    p.add_argument("--job", default="job1", help="the job's name: its records live under the etcd prefix "
                   "/parcae/JOB (default job1)")
    p.add_argument("--etcd", default="etcd", help="the etcd executable (default: etcd on PATH)")
    p.add_argument("--startup-timeout", type=float, default=30.0, help="seconds etcd may take to become healthy "
                   "(default 30)")
    return p


def build_status_parser() -> argparse.ArgumentParser:
    """The argument parser of ``parcae store status``."""
    p = argparse.ArgumentParser(
        prog="parcae store status",
        description="Say whether the job's store answers, whether its token proof is installed and matches "
        "--token-file, and what the job's records say (agents' MIN:MAX, rendezvous rosters, relaunches, the "
        "current generation, pending notices). Exit 0: reachable and the token matches (or an open store); 1: "
        "the token does not match or the proof is missing; 2: unreachable or bad input.",
        epilog="example: parcae store status --store etcd://10.0.0.5:2379/parcae/job1 --token-file job1.token",
    )
    p.add_argument("--store", required=True, help="etcd://HOST:PORT/PREFIX or tcp://HOST:PORT")
    p.add_argument("--token-file", default=None, help="the job token (default $PARCAE_JOB_TOKEN; without one only "
                   "reachability and the presence of a proof are reported)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds to reach the store (default 5)")
    return p


# ---------------------------------------------------------------------------------------------------------------
# start
# ---------------------------------------------------------------------------------------------------------------
def parse_listen(spec: str) -> tuple[str, int]:
    """``--listen``: ``HOST:PORT``, ``[IPv6]:PORT``, ``HOST`` or a bare IPv6 address (port 2379).

    Raises:
        ConfigurationError: Anything else.
    """
    text = spec.strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_s = rest[1:] if rest.startswith(":") else ("" if not rest else None)
    elif text.count(":") == 1:
        host, port_s = text.split(":")
    else:  # no port: a host name, or a bare IPv6 address
        host, port_s = text, ""
        if ":" in host:
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                port_s = None
    if not host or port_s is None:
        raise ConfigurationError(f"--listen {spec!r}: expected HOST:PORT, e.g. 127.0.0.1:2379 or 10.0.0.5:2379")
    try:
        port = int(port_s) if port_s else 2379
    except ValueError:
        raise ConfigurationError(f"--listen {spec!r}: the port must be a number, e.g. 127.0.0.1:2379") from None
    if not 1 <= port <= 65535:
        raise ConfigurationError(f"--listen {spec!r}: the port must be in 1..65535")
    return host, port


def _is_wildcard(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_unspecified
    except ValueError:
        return False


def _check_port_free(host: str, port: int, what: str) -> None:
    """Bind ``host:port`` once (as etcd will, with SO_REUSEADDR) to turn "taken" into a clear error now.

    Raises:
        ConfigurationError: The port is taken, or ``host`` is not an address of this machine.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigurationError(f"--listen {host}:{port}: {host!r} does not resolve ({exc})") from None
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise ConfigurationError(
                    f"{what} {host}:{port} is taken (another etcd or service listens there; `ss -ltnp "
                    f"'sport = :{port}'` shows which): stop it, or pick another port"
                    + (" with --listen HOST:PORT" if what == "--listen" else " with --peer-port")) from None
            if exc.errno == errno.EADDRNOTAVAIL:
                raise ConfigurationError(f"--listen {host}:{port}: {host} is not an address of this machine "
                                         "(`ip -brief addr` lists them)") from None
            raise ConfigurationError(f"{what} {host}:{port} cannot be bound: {exc}") from None


class StoreService:
    """One job's store as ``parcae store start`` runs it: etcd, the token file and the token's proof.

    Args:
        listen: ``--listen`` (HOST:PORT).
        data_dir: etcd's data and log folder (created, kept).
        token_file: The token file (read if it exists, else created with mode 0600); default ``data_dir/job.token``.
        job: The job's name (etcd prefix ``/parcae/<job>``).
        advertise: The address agents use (default: the listen host; required for a wildcard).
        peer_port: etcd's loopback peer port (default: client port + 1).
        etcd: The etcd executable.
        startup_timeout_s: Seconds etcd may take to become healthy.
        environ: Where ``$PARCAE_JOB_TOKEN`` is looked up for a new token file (default ``os.environ``).

    Raises:
        ConfigurationError: Bad ``listen``/``advertise``/``job``, or a wildcard without ``advertise``.
    """

    def __init__(self, listen: str = DEFAULT_LISTEN, data_dir: str = "parcae-store", token_file: Optional[str] = None,
                 *, job: str = "job1", advertise: Optional[str] = None, peer_port: Optional[int] = None,
                 etcd: str = "etcd", startup_timeout_s: float = 30.0,
                 environ: Optional[Mapping[str, str]] = None) -> None:
        self.host, self.port = parse_listen(listen)
        if _is_wildcard(self.host) and not advertise:
            raise ConfigurationError(
                f"--listen {listen}: a wildcard address binds every interface and is no address agents can use; "
                "give --advertise <this machine's private IP> (or listen on that IP instead)")
        if not job or not all(c.isalnum() or c in "._-" for c in job):
            raise ConfigurationError(f"--job {job!r}: use letters, digits and . _ - (e.g. job1)")
        self.advertise = advertise or self.host
        self.peer_port = peer_port if peer_port is not None else self.port + 1
        if not 1 <= self.peer_port <= 65535 or self.peer_port == self.port:
            raise ConfigurationError(f"--peer-port {self.peer_port}: must be in 1..65535 and differ from the "
                                     f"client port {self.port}")
        self.data_dir = Path(data_dir).absolute()
        self.token_file = str(Path(token_file).absolute() if token_file else self.data_dir / "job.token")
        self.job, self.etcd, self.startup_timeout_s = job, etcd, startup_timeout_s
        self.environ = os.environ if environ is None else environ
        self.server: Any = None
        """The running :class:`~lightning_parcae.testing.etcd_server.EtcdServer` (None until :meth:`start`)."""
        self.store_url = ""
        """The job's ``--store`` URL (set by :meth:`start`)."""
        self.created_token_file = False

    @property
    def loopback(self) -> bool:
        """Whether only this machine can reach the store."""
        from lightning_parcae.runtime.store import is_loopback  # noqa: PLC0415

        return is_loopback(self.host)

    def start(self) -> str:
        """Start etcd, make sure the token file and the proof are there; the job's ``--store`` URL.

        Raises:
            ConfigurationError: etcd is not installed, a port is taken, the token file is unusable.
            CoordinationError: etcd did not start or become healthy (the message ends with its log).
            WrongTokenError: The data directory's store holds another token's proof.
        """
        from lightning_parcae.runtime.store import new_token  # noqa: PLC0415
        from lightning_parcae.testing.etcd_server import EtcdServer, etcd_binary  # noqa: PLC0415

        _check_port_free(self.host, self.port, "--listen")
        _check_port_free("127.0.0.1", self.peer_port, "the peer port")
        if etcd_binary(self.etcd) is None:
            raise ConfigurationError(f"etcd is not installed: {self.etcd!r} was not found on PATH; {_INSTALL}")
        if os.path.exists(self.token_file):
            token = read_token_file(self.token_file)
        else:
            token = self.environ.get(JOB_TOKEN_ENV) or new_token()
            Path(self.token_file).parent.mkdir(parents=True, exist_ok=True)
            write_token_file(self.token_file, token)
            self.created_token_file = True
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            self.data_dir.chmod(0o700)  # etcd wants its data private, and the token file may live here
            self.server = EtcdServer(self.data_dir, client_port=self.port, peer_port=self.peer_port, binary=self.etcd,
                                     startup_timeout_s=self.startup_timeout_s, name=f"parcae-{self.job}",
                                     host=self.host, advertise_host=self.advertise).start()
            # the proof goes in over this machine's own address: the advertised name (a Kubernetes Service, say)
            # may resolve only once the store is up and ready
            local = "127.0.0.1" if _is_wildcard(self.host) else self.host
            local = f"[{local}]" if ":" in local else local
            install_proof(f"etcd://{local}:{self.port}/parcae/{self.job}", token,
                          timeout_s=min(10.0, self.startup_timeout_s))
            self.store_url = self.server.store_url(f"/parcae/{self.job}")
        except BaseException:
            self.stop()
            if self.created_token_file:  # nobody holds a proof of it: leave no token file behind
                os.unlink(self.token_file)
                self.created_token_file = False
            raise
        return self.store_url

    def agent_command(self) -> str:
        """The agent command line every instance runs (MIN:MAX, the checkpoint location and the script are the
        user's)."""
        return (f"parcae agent --store {self.store_url} --token-file {self.token_file} --nodes MIN:MAX "
                "--checkpoint-dir s3://BUCKET/JOB -- python train.py")

    def wait(self, timeout_s: Optional[float] = None) -> Optional[int]:
        """Wait up to ``timeout_s`` for etcd to exit by itself; its exit status, or None while it runs."""
        return None if self.server is None else self.server.wait(timeout_s)

    def stop(self) -> None:
        """Stop etcd (its data stays). Idempotent."""
        server, self.server = self.server, None
        if server is not None:
            server.stop()


def _serve(service: StoreService, say: Callable[[str], None]) -> int:
    """Start ``service``, print how to use it, and run until SIGINT/SIGTERM (0) or etcd exits by itself (1)."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = service.start()
        assert service.server is not None
        made = "created" if service.created_token_file else "read from"
        say(f"etcd serving {service.server.url} (v2 API, one member); data and log in {service.data_dir}")
        say(f"the job's store: {url}")
        say(f"the job token: {made} {service.token_file} (mode 0600; give it to every agent as a secret, "
            "never on a command line)")
        say("start each agent with:")
        print(f"  {service.agent_command()}", flush=True)
        say(f"check it with: parcae store status --store {url} --token-file {service.token_file}")
        if service.loopback:
            say(f"listening on {service.host} only: agents on other machines cannot reach it; to serve them, "
                "--listen <this machine's private IP>:PORT behind a firewall rule for the job's instances")
        else:
            say(f"listening on {service.host}:{service.port}: anyone who can reach this port can read and disturb "
                "the job; allow only the job's instances to reach it (security group / firewall)")
        say("running in the foreground; Ctrl-C or SIGTERM stops etcd (its data stays)")
        while not stop.is_set():
            code = service.wait(0.5)
            if code is not None:
                say(f"etcd exited by itself with status {code}; see its log, {service.data_dir / 'etcd.log'}")
                return 1
        say("stopping etcd")
        return 0
    finally:
        service.stop()
        for s, h in previous.items():
            signal.signal(s, h)


def start_main(argv: Optional[Sequence[str]] = None) -> int:
    """``parcae store start`` (exit 2 with a message on bad input, 1 when etcd dies by itself, 0 when stopped)."""
    args = build_start_parser().parse_args(argv)

    def say(line: str) -> None:
        print(f"parcae store start: {line}", flush=True)

    try:
        service = StoreService(args.listen, args.data_dir, args.token_file, job=args.job, advertise=args.advertise,
                               peer_port=args.peer_port, etcd=args.etcd, startup_timeout_s=args.startup_timeout)
        return _serve(service, say)
    except ParcaeError as exc:
        print(f"parcae store start: error: {exc}", file=sys.stderr)
        return 2


# ---------------------------------------------------------------------------------------------------------------
# status
# ---------------------------------------------------------------------------------------------------------------
def _token(token_file: Optional[str], environ: Mapping[str, str]) -> Optional[str]:
    if token_file:
        return read_token_file(token_file)
    return environ.get(JOB_TOKEN_ENV) or None


def store_report(store_url: str, token: Optional[str], *, timeout_s: float = 5.0) -> tuple[int, list[str]]:
    """What ``parcae store status`` prints: (exit status, lines).

    Raises:
        ConfigurationError: A malformed URL.
        CoordinationError: The store cannot be reached within ``timeout_s``.
    """
    from lightning_parcae.runtime.store import WrongTokenError, connect_store, parse_store_url  # noqa: PLC0415

    spec = parse_store_url(store_url)
    lines: list[str] = []
    try:
        store = connect_store(spec, token=None, timeout_s=timeout_s, op_timeout_s=10.0)
        proof = False
    except WrongTokenError as exc:
        if "unreadable" in str(exc):
            return 1, [f"store {spec.url}: reachable", f"token proof: {exc}"]
        proof = True
    except CoordinationError as exc:
        raise CoordinationError(f"{exc}. If it is the job's etcd, start it on that machine with `parcae store start "
                                "--listen HOST:PORT`") from None
    lines.append(f"store {spec.url}: reachable")
    if not proof:
        lines.append("token proof: none installed (an open store: records are unsigned"
                     + ("; this token is not needed" if token else "") + ")")
        if token:
            lines.append("  run `parcae store init --store URL --token-file F --reuse-token-file` (or `parcae store "
                         "start`) to install the proof; agents with a token refuse a store without it")
            return 1, lines
        return _records(store, None, lines), lines
    if token is None:
        lines.append(f"token proof: installed; give --token-file (or set {JOB_TOKEN_ENV}) to check it and read "
                     "the job's records")
        return 0, lines
    try:
        store = connect_store(spec, token=token, timeout_s=timeout_s, op_timeout_s=10.0)
    except WrongTokenError:
        lines.append("token proof: installed, does NOT match this token (another job's store, or the wrong token "
                     "file); records signed with the job token cannot be read with it")
        return 1, lines
    lines.append("token proof: installed, matches this token")
    return _records(store, token, lines), lines


def _records(store: Any, token: Optional[str], lines: list[str]) -> int:
    """Append what the job's records say (rendezvous rounds, relaunches, generation, notices); 0, or 1 when a
    record fails verification."""
    from lightning_parcae.launch.rendezvous import Rendezvous  # noqa: PLC0415
    from lightning_parcae.runtime.coordinator import Coordinator  # noqa: PLC0415
    from lightning_parcae.runtime.liveness import read_notice  # noqa: PLC0415
    from lightning_parcae.runtime.store import TamperedRecordError  # noqa: PLC0415

    status = 0
    rdv = Rendezvous(store, token, "parcae-store-status", min_nodes=0, max_nodes=0)
    coord = Coordinator(store, token)
    members: list[str] = []

    def safely(what: str, fn: Callable[[], Any]) -> Any:
        nonlocal status
        try:
            return fn()
        except (TamperedRecordError, ValueError, KeyError) as exc:
            status = 1
            lines.append(f"{what}: unreadable: {exc}")
            return None

    bounds = safely("agents' MIN:MAX", lambda: rdv.bounds(0))
    if bounds is not None:
        lines.append("agents: none registered yet" if bounds[:2] == (0, 0) else
                     f"agents: --nodes {bounds[0]}:{bounds[1]}")
    newest = safely("relaunch rounds", rdv.newest_round) or 0
    for k in range(newest + 1):
        arrivals = int(store.add(rdv.key(k, "count"), 0)) if store.check([rdv.key(k, "count")]) else 0
        if k >= 1:
            rel = safely(f"relaunch round {k}", lambda: rdv.relaunch(k))
            if rel is not None:
                lines.append(f"relaunch round {k}: declared by {rel.declared_by or '?'} ({rel.reason or 'no reason'})"
                             f", --nodes {rel.min_nodes}:{rel.max_nodes}, resume from "
                             + (f"{rel.checkpoint}" + (f" (step {rel.step})" if rel.step is not None else "")
                                if rel.checkpoint else "nothing (step 0)"))
        roster = safely(f"round {k} roster", lambda: rdv.roster(k))
        if roster is not None:
            members = [m if k == 0 else f"{m}.{k}" for m in roster.members]
            lines.append(f"round {k}: roster {list(roster.members)} (written by {roster.written_by}), "
                         f"{arrivals} arrived")
        elif arrivals:
            lines.append(f"round {k}: forming, {arrivals} arrived")
    current = safely("current generation", coord.current)
    if current is None or current < 0:
        lines.append("generation: none started yet")
    else:
        rec = safely(f"generation {current}", lambda: coord.generation(current))
        if rec is not None:
            gm = list(rec.get("layout", {}).get("members", []))
            members = gm or members
            lines.append(f"generation {current}: {rec.get('kind', '?')} at step {rec.get('step', '?')}, "
                         f"D={rec.get('D', '?')} P={rec.get('P', '?')}, members {gm}")
        elif status == 0:
            lines.append(f"generation {current}: started, record not found")
    for m in members:
        note = safely(f"notice for {m}", lambda: read_notice(store, m, token))
        if note is not None:
            lines.append(f"notice for {m}: {note.get('kind')} from {note.get('source')}"
                         + (f" ({note['why']})" if note.get("why") else ""))
    return status


def status_main(argv: Optional[Sequence[str]] = None) -> int:
    """``parcae store status`` (see :func:`build_status_parser` for the exit statuses)."""
    args = build_status_parser().parse_args(argv)
    try:
        token = _token(args.token_file, os.environ)
        code, lines = store_report(args.store, token, timeout_s=args.timeout)
    except ParcaeError as exc:
        print(f"parcae store status: error: {exc}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return code
