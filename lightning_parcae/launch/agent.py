"""``parcae agent``: the one process per machine that runs that machine's worker of a multi-machine job.

Problem: on real spot instances there is no single launcher that sees every machine. Each instance must, on its
own, (1) find the job's shared store (etcd, or a TCPStore on a stable controller host) and prove it holds the job
token, (2) start the training script with the environment live reconfiguration expects -- as one of the initial
N members (a torchrun-style ``--nodes N --node-rank R`` start) or as a new instance that joins the running job
(``--join``), (3) turn the cloud's preemption notice into the job's notice (the store key the worker's heartbeat
thread reads, plus SIGTERM to the worker), and (4) restart its worker as a warm standby when the job releases a
healthy instance (exit 76) or fences one that was wrongly declared dead (exit 77).

What it does not do: a *fallback* (exit 75: some stage lost every replica) needs every machine to restart from
the last checkpoint together; the agent exits 75 and says so, and the job is restarted like any torchrun job
(all agents, ``PARCAE_RESUME_CKPT`` pointing at shared storage).

    export PARCAE_JOB_TOKEN=...            # the same secret on every machine (never on the command line)
    parcae agent --store etcd://10.0.0.5:2379/parcae/job1 --nodes 4 --node-rank 0 -- python train.py
    parcae agent --store etcd://10.0.0.5:2379/parcae/job1 --join -- python train.py      # a machine added later
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

from lightning_parcae.contract import (
    RUN_DIR_ENV,
    RESUME_ENV,
    STORE_ENV,
    JOB_TOKEN_ENV,
    MEMBER_ENV,
    JOIN_ENV,
    ELASTIC_ENV,
    FALLBACK_EXIT,
    RELEASED_EXIT,
    FENCED_EXIT,
)
from lightning_parcae.errors import ConfigurationError, ParcaeError
from lightning_parcae.launch.processes import worker_environment

__all__ = ["main", "build_parser", "worker_env"]



def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``parcae agent``."""
    p = argparse.ArgumentParser(
        prog="parcae agent",
        description="Run this machine's worker of a multi-machine job with live reconfiguration: connect to the "
        "shared store, start the training script as an initial member (--nodes/--node-rank) or a joining "
        "instance (--join), forward preemption notices, restart the worker as a standby when it is released.",
    )
    p.add_argument("--store", required=True, help="shared store URL: etcd://host:2379/parcae/JOB or tcp://host:port")
    p.add_argument("--member", default=None, help="this instance's member id (default: hostname-pid)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--nodes", type=int, help="initial number of machines (with --node-rank)")
    group.add_argument("--join", action="store_true", help="join a running job as a new instance")
    p.add_argument("--node-rank", type=int, default=None, help="this machine's rank among the initial --nodes")
    p.add_argument("--notices", default="auto",
                   help="preemption-notice source: auto (probe AWS/GCP/Azure metadata, else SIGTERM), aws, gcp, "
                   "azure, sigterm, none (default auto)")
    p.add_argument("--run-dir", default=None, help="run directory for events/checkpoints (shared storage for "
                   "fallback restarts)")
    p.add_argument("--token-file", default=None, help="read the job token from this file instead of "
                   "$PARCAE_JOB_TOKEN")
    p.add_argument("--max-restarts", type=int, default=100, help="how often a released/fenced worker is "
                   "restarted as a standby (default 100)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ...")
    return p


def worker_env(base: dict[str, str], *, store: str, token: Optional[str], member: str, join: bool,
               rank: int, world: int, run_dir: Optional[str]) -> dict[str, str]:
    """The environment of this machine's worker (one process, one device).

    Args:
        base: The agent's environment.
        store: Store URL.
        token: Job token (or None for an open store).
        member: Member id.
        join: Start as a joining standby.
        rank: Initial rank (ignored when joining).
        world: Initial world size (ignored when joining).
        run_dir: Run directory, if any.
    """
    parcae = {ELASTIC_ENV: "1", STORE_ENV: store, MEMBER_ENV: member, JOIN_ENV: "1" if join else "0"}
    if token:
        parcae[JOB_TOKEN_ENV] = token
    if run_dir:
        parcae[RUN_DIR_ENV] = run_dir
    return worker_environment(base, rank=0 if join else rank, world=1 if join else world, local_rank=0,
                              local_world=1, node_rank=0 if join else rank,
                              master_addr=base.get("MASTER_ADDR", "127.0.0.1"),
                              master_port=base.get("MASTER_PORT", "29500"), parcae=parcae, keep=(RESUME_ENV,),
                              shared_machine=False)


class Agent:
    """One machine's agent (see the module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.member = args.member or f"{socket.gethostname()}-{os.getpid()}"
        self.token = _token(args)
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.noticed = False

    def _connect(self) -> Any:
        from lightning_parcae.runtime.store import connect_store  # noqa: PLC0415

        return connect_store(self.args.store, token=self.token, timeout_s=10.0)

    def _notice(self, why: str) -> None:
        """The instance is going away: tell the job (store key) and the worker (SIGTERM)."""
        if self.noticed:
            return
        self.noticed = True
        print(f"parcae agent {self.member}: preemption notice ({why}); handing over", file=sys.stderr, flush=True)
        try:
            from lightning_parcae.runtime.liveness import notice_key  # noqa: PLC0415

            self._connect().set(notice_key(self.member), json.dumps({"why": why, "time": time.time()}))
        except Exception as exc:  # noqa: BLE001 -- the SIGTERM below still reaches the worker
            print(f"parcae agent: could not write the notice to the store: {exc}", file=sys.stderr, flush=True)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def _watch_notices(self) -> Any:
        """A watcher thread on the cloud's notice source; None when SIGTERM to the agent is the only signal."""
        spec = self.args.notices
        if spec in ("none", "sigterm"):  # SIGTERM to the agent is handled by its own handler (see run)
            return None
        from lightning_parcae.signals.notices import NoticeWatcher, SignalNoticeSource, make_notice_source  # noqa: PLC0415

        source = make_notice_source(spec)
        if isinstance(source, SignalNoticeSource):  # "auto" found no cloud metadata service
            source.close()
            return None
        return NoticeWatcher(source, lambda n: self._notice(f"{n.source}: {n.kind}")).start()

    def run(self) -> int:
        """Start the worker, forward notices, restart it as a standby when released; returns the exit status."""
        args = self.args
        self._connect()  # fail fast: unreachable store, wrong token
        signal.signal(signal.SIGTERM, lambda s, f: self._notice("SIGTERM to the agent"))
        watcher = self._watch_notices()
        join = bool(args.join)
        restarts = 0
        try:
            while True:
                env = worker_env(dict(os.environ), store=args.store, token=self.token, member=self.member, join=join,
                                 rank=args.node_rank or 0, world=args.nodes or 1, run_dir=args.run_dir)
                self.proc = subprocess.Popen(args.command, env=env)
                code = self.proc.wait()
                if code in (RELEASED_EXIT, FENCED_EXIT) and not self.noticed and restarts < args.max_restarts:
                    restarts += 1
                    why = "released by the new shape" if code == RELEASED_EXIT else "fenced after a silence"
                    print(f"parcae agent {self.member}: worker {why}; restarting it as a standby", file=sys.stderr,
                          flush=True)
                    join = True
                    continue
                if code == FALLBACK_EXIT:
                    print(f"parcae agent {self.member}: the job lost every replica of a stage and must restart from "
                          "its last checkpoint: restart all agents (PARCAE_RESUME_CKPT on shared storage)",
                          file=sys.stderr, flush=True)
                return code
        finally:
            if watcher is not None:
                watcher.stop()
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()


def _token(args: argparse.Namespace) -> Optional[str]:
    if args.token_file:
        try:
            with open(args.token_file, encoding="utf-8") as f:
                return f.read().strip() or None
        except OSError as exc:
            raise ConfigurationError(f"cannot read --token-file {args.token_file!r}: {exc}") from None

    return os.environ.get(JOB_TOKEN_ENV) or None


def _check(args: argparse.Namespace) -> None:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    args.command = cmd
    if not cmd:
        raise ConfigurationError("give the training command after --, e.g. parcae agent ... -- python train.py")
    if args.nodes is not None:
        if args.nodes < 1 or args.node_rank is None or not 0 <= args.node_rank < args.nodes:
            raise ConfigurationError(
                f"--nodes {args.nodes} needs --node-rank between 0 and {max(args.nodes - 1, 0)} (got "
                f"{args.node_rank}); a machine added to a running job uses --join instead"
            )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``parcae agent`` (exit 2 with a message on bad input)."""
    args = build_parser().parse_args(argv)
    try:
        _check(args)
        return Agent(args).run()
    except ParcaeError as exc:
        print(f"parcae agent: {exc}", file=sys.stderr)
        return 2




if __name__ == "__main__":
    sys.exit(main())
