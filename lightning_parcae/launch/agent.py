"""``parcae agent``: the one process per machine that runs that machine's worker of a multi-machine job.

Problem: on real spot instances there is no single launcher that sees every machine, and nothing hands out ranks
(a Kubernetes Deployment, an autoscaling group or SkyPilot starts N copies of one command). Each instance must, on
its own, (1) find the job's shared store (etcd, or a TCPStore on a stable controller host) and prove it holds the
job token, (2) agree with the other agents on who starts the job in which rank -- ``--nodes MIN:MAX`` (a
rendezvous through the store, :mod:`lightning_parcae.launch.rendezvous`: once MIN agents are there and a short
settle time has passed, or MAX are there, the first arrivals are the round's members and the others warm standbys;
the members' workers start as start-up candidates, and the round's first generation is composed from the workers
that arrived, :mod:`lightning_parcae.launch.agent_startup`, so a machine noticed or silent while the workers import
is left out instead of relaunching everyone),
``--nodes N --node-rank R`` (fixed ranks, torchrun style) or ``--join`` (a machine added to a running job: a
standby until a planning interval admits it), (3) turn the cloud's preemption notice into the job's notice (the
store key the worker's heartbeat thread reads, plus SIGTERM to the worker), (4) restart its worker as a warm
standby when the job releases a healthy instance (exit 76) or fences one wrongly declared dead (exit 77), and
(5) carry out a *whole-job fallback* without a person: when the worker exits 75 (some stage lost every replica),
the agents agree through the store on one relaunch -- rendezvous round ``k+1``, whose record names the checkpoint
to resume from (``--checkpoint-dir``: the newest complete checkpoint there, whoever wrote it; else
``--run-dir``/ckpt/last.ckpt, which must then be on storage every machine sees) and whose workers use generation
base ``1000 * (k+1)``. Every live agent (a standby's worker is stopped for it) re-registers for that round and
restarts its worker from it; agents started meanwhile take part. A round with fewer than MIN live agents waits,
saying so, up to ``--rendezvous-timeout`` (then exit 2).

    export PARCAE_JOB_TOKEN=...            # the same secret on every machine (never on the command line)
    parcae agent --store etcd://10.0.0.5:2379/parcae/job1 --nodes 2:8 --checkpoint-dir s3://bucket/job1 \
        -- python train.py                 # the same command on every machine
    parcae agent --store etcd://10.0.0.5:2379/parcae/job1 --nodes 4 --node-rank 0 -- python train.py
    parcae agent --store etcd://10.0.0.5:2379/parcae/job1 --join -- python train.py      # a machine added later
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Optional, Sequence

from lightning_parcae.contract import (
    RESUME_ENV,
    JOB_TOKEN_ENV,
    FALLBACK_EXIT,
    RELEASED_EXIT,
    FENCED_EXIT,
    worker_contract,
)
from lightning_parcae.errors import ConfigurationError, ParcaeError
from lightning_parcae.launch.agent_startup import StartupComposer, worker_member_id
from lightning_parcae.launch.processes import worker_environment
from lightning_parcae.launch.rendezvous import Relaunch, Rendezvous, RendezvousCancelled, Seat, parse_nodes
from lightning_parcae.runtime.startup import StartupRoster

__all__ = ["main", "build_parser", "worker_env", "Agent"]

MEMBER_GRACE_S = 60.0
"""A member's worker still running once a relaunch was declared gets this long to exit by itself (it exits 75 on
the same fallback record) before the agent stops it."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``parcae agent``."""
    p = argparse.ArgumentParser(
        prog="parcae agent",
        description="Run this machine's worker of a multi-machine job with live reconfiguration: connect to the "
        "shared store, agree with the other agents on the ranks (--nodes MIN:MAX), or take a fixed rank "
        "(--nodes N --node-rank R), or join a running job (--join); forward preemption notices, restart the worker "
        "as a standby when it is released, and relaunch the whole job from its checkpoint when a stage is lost.",
    )
    p.add_argument("--store", required=True, help="shared store URL: etcd://host:2379/parcae/JOB or tcp://host:port")
    p.add_argument("--member", default=None, help="this instance's member id (default: hostname-pid)")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--nodes", default=None, metavar="MIN:MAX",
                       help="machines of the job: N or MIN:MAX. Without --node-rank the agents agree on the ranks "
                       "through the store: once MIN are there (and --settle has passed, or MAX are there) the "
                       "first arrivals start the job, later ones are standbys")
    group.add_argument("--join", action="store_true", help="join a running job as a new instance")
    p.add_argument("--node-rank", type=int, default=None, help="this machine's fixed rank among --nodes N "
                   "(optional; torchrun-style start)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds to wait for more agents once MIN are there "
                   "(default 2)")
    p.add_argument("--rendezvous-timeout", type=float, default=600.0, help="give up (exit 2) when fewer than MIN "
                   "agents arrived within this many seconds (default 600)")
    p.add_argument("--notices", default="auto",
                   help="preemption-notice source: auto (probe AWS/GCP/Azure metadata, else SIGTERM), aws, gcp, "
                   "azure, sigterm, none (default auto)")
    p.add_argument("--run-dir", default=None, help="run directory for events (and, without --checkpoint-dir, "
                   "ckpt/last.ckpt: then it must be storage every machine sees)")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go and relaunches resume from: a "
                   "local path, a shared mount or an fsspec URL (s3://bucket/job, gs://..., az://...); checked at "
                   "start")
    p.add_argument("--token-file", default=None, help="read the job token from this file instead of "
                   "$PARCAE_JOB_TOKEN")
    p.add_argument("--max-restarts", type=int, default=100, help="how often a released/fenced worker is "
                   "restarted as a standby (default 100)")
    p.add_argument("--max-relaunches", type=int, default=20, help="how many whole-job relaunches from the "
                   "checkpoint this agent takes part in before it exits 75 (default 20)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ...")
    return p


def worker_env(base: dict[str, str], *, store: str, token: Optional[str], member: str, join: bool,
               rank: int, world: int, run_dir: Optional[str], generation: Optional[int] = None,
               resume: Optional[str] = None, checkpoint_dir: Optional[str] = None,
               roster: Optional[str] = None) -> dict[str, str]:
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
        generation: The rendezvous round after a relaunch (generation base ``1000 * generation``); None in the
            job's first round.
        resume: The checkpoint a relaunch's initial member resumes from (None: the agent's own
            ``PARCAE_RESUME_CKPT``, if any, passes through).
        checkpoint_dir: ``--checkpoint-dir``.
        roster: The store key of the round's start-up roster: the worker starts as a candidate whose rank comes
            from it (:mod:`~lightning_parcae.launch.agent_startup`; ``rank`` / ``world`` are then ignored).
    """
    parcae = worker_contract(elastic=True, store=store, token=token, member=member, join=join,
                             run_dir=run_dir or None, generation=generation, resume=resume,
                             checkpoint_dir=checkpoint_dir, roster=None if join else roster)
    placeholder = join or roster is not None  # a joiner's or a candidate's rank comes later
    return worker_environment(base, rank=0 if placeholder else rank, world=1 if placeholder else world, local_rank=0,
                              local_world=1, node_rank=0 if placeholder else rank,
                              master_addr=base.get("MASTER_ADDR", "127.0.0.1"),
                              master_port=base.get("MASTER_PORT", "29500"), parcae=parcae, keep=(RESUME_ENV,),
                              shared_machine=False)


class Agent:
    """One machine's agent (see the module docstring).

    It owns its worker process, the store client of its main thread and its place in the job: ``seat`` (the
    rendezvous round and rank its worker was started in; None for a fixed-rank or ``--join`` start in round 0).
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.member = args.member or f"{socket.gethostname()}-{os.getpid()}"
        self.token = _token(args)
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self.noticed = False
        self.worker_member = self.member
        """The member id of the running worker: the agent's id in round 0, ``<id>.<k>`` in relaunch round k."""

    def _connect(self) -> Any:
        from lightning_parcae.runtime.store import connect_store  # noqa: PLC0415

        return connect_store(self.args.store, token=self.token, timeout_s=10.0)

    def say(self, line: str) -> None:
        """One line on stderr."""
        print(f"parcae agent {self.member}: {line}", file=sys.stderr, flush=True)

    def _notice(self, why: str) -> None:
        """The instance is going away: tell the job (store key) and the worker (SIGTERM)."""
        if self.noticed:
            return
        self.noticed = True
        self.say(f"preemption notice ({why}); handing over")
        try:  # the one notice format (runtime.liveness): signed with the job token, as the launcher's
            from lightning_parcae.runtime.liveness import notice_record, write_notice  # noqa: PLC0415

            rec = notice_record(self.worker_member, source="agent", why=why)
            write_notice(self._connect(), self.worker_member, rec, self.token)
        except Exception as exc:  # noqa: BLE001 -- the SIGTERM below still reaches the worker
            self.say(f"could not write the notice to the store: {exc}")
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

    def _rendezvous(self, store: Any) -> Rendezvous:
        lo, hi = self.args.nodes_range
        return Rendezvous(store, self.token, self.member, min_nodes=lo, max_nodes=hi, settle_s=self.args.settle,
                          timeout_s=self.args.rendezvous_timeout, say=lambda line: print(line, file=sys.stderr,
                                                                                        flush=True))

    def _first_seat(self, rdv: Rendezvous) -> Optional[Seat]:
        """Where the first worker starts: a relaunch round forming (or formed) now, round 0's rendezvous, or None
        for today's fixed-rank / ``--join`` start in round 0."""
        args = self.args
        k = rdv.newest_round()
        if k >= 1:
            self.say(f"the job is in relaunch round {k}; taking part")
            return self._take_seat(rdv, k)
        if args.join or args.node_rank is not None:
            return None
        return self._take_seat(rdv, 0)

    def _take_seat(self, rdv: Rendezvous, k: int) -> Seat:
        seat = rdv.join(k, stop=lambda: self.noticed)
        if seat.standby:
            self.say(f"round {k}: a standby (members {list(seat.roster.members)})")
        else:
            self.say(f"round {k}: rank {seat.rank} of {seat.world} (members {list(seat.roster.members)})"
                     + (f", resuming from {seat.roster.checkpoint}" if seat.roster.checkpoint else ""))
        return seat

    def _resume_checkpoint(self) -> tuple[Optional[str], Optional[int]]:
        """What a relaunch declared now resumes from: (path or URL, step when known), or (None, None)."""
        from lightning_parcae.runtime.checkpoint_store import resume_point  # noqa: PLC0415

        args = self.args
        legacy = os.path.join(os.path.abspath(args.run_dir), "ckpt", "last.ckpt") if args.run_dir else None
        return resume_point(args.checkpoint_dir, legacy, self.say)

    def _relaunch_round(self, rdv: Rendezvous, k: int, why: str) -> int:
        """The relaunch round after round ``k``: the declared one, or one this agent declares now."""
        rel = rdv.relaunch(k + 1)
        if rel is None:
            ckpt, step = self._resume_checkpoint()
            lo, hi = rdv.bounds(k)[:2]
            rel = rdv.declare(Relaunch(k + 1, ckpt, step, lo, hi, reason=why, declared_by=self.member))
            if rel.declared_by == self.member:
                self.say(f"declared relaunch round {k + 1} ({why}): "
                         + (f"resuming from {rel.checkpoint}" if rel.checkpoint else "no checkpoint: from step 0"))
        return max(rel.round, rdv.newest_round())

    def _declared(self, rdv: Rendezvous, round_: int) -> bool:
        """Whether relaunch round ``round_`` was declared (False when the store cannot be read now)."""
        try:
            return rdv.relaunch(round_) is not None
        except Exception as exc:  # noqa: BLE001 -- a store hiccup must not stop the agent
            self.say(f"could not read the store: {exc}")
            return False

    def _wait_worker(self, rdv: Rendezvous, k: int, standby: bool,
                     composer: Optional[StartupComposer] = None) -> tuple[int, bool]:
        """Wait for the worker; stop it if a relaunch after round ``k`` is declared meanwhile (a standby or a
        start-up candidate at once, a member after :data:`MEMBER_GRACE_S`). While ``composer`` has no roster, take
        part in the round's start-up roster (and declare the next round when none can form). Returns (exit status,
        whether a relaunch was seen)."""
        assert self.proc is not None
        deadline: Optional[float] = None
        roster: Optional[StartupRoster] = None
        while True:
            try:
                return self.proc.wait(timeout=1.0 if composer is None or roster is not None else 0.25), \
                    deadline is not None
            except subprocess.TimeoutExpired:
                pass
            if self.noticed:
                continue
            if composer is not None and roster is None and deadline is None:
                roster = self._compose(rdv, k, composer)
            if deadline is None:
                if self._declared(rdv, k + 1):
                    self.say(f"relaunch round {k + 1} declared; stopping this "
                             + ("standby" if standby else "member" if roster is not None or composer is None
                                else "start-up candidate") + " worker for it")
                    holds_state = not standby and (composer is None or roster is not None)
                    deadline = time.monotonic() + (MEMBER_GRACE_S if holds_state else 0.0)
            if deadline is not None and time.monotonic() >= deadline and self.proc.poll() is None:
                self.proc.kill()

    def _compose(self, rdv: Rendezvous, k: int, composer: StartupComposer) -> Optional[StartupRoster]:
        """One poll of the round's start-up roster; says who is in it once written."""
        try:
            roster = composer.poll()
        except Exception as exc:  # noqa: BLE001 -- a store hiccup must not stop the agent; poll again
            self.say(f"could not read the store: {exc}")
            return None
        if roster is not None:
            self.say(f"round {k}: start-up roster {list(roster.members)}"
                     + (f", standbys {list(roster.standbys)}" if roster.standbys else "")
                     + (f", left out {list(roster.left_out)}" if roster.left_out else "") + f" ({roster.why})")
        elif composer.infeasible is not None:
            self._relaunch_round(rdv, k, f"no start-up roster can form: {composer.infeasible.why}")
        return roster

    def run(self) -> int:
        """Start the worker, forward notices, restart it as a standby when released, relaunch the job from its
        checkpoint when a stage is lost; returns the exit status."""
        args = self.args
        store = self._connect()  # fail fast: unreachable store, wrong token
        from lightning_parcae.runtime.checkpoint_store import checked_location  # noqa: PLC0415

        args.checkpoint_dir = checked_location(args.checkpoint_dir)  # CheckpointStorageError: exit 2, its message
        signal.signal(signal.SIGTERM, lambda s, f: self._notice("SIGTERM to the agent"))
        watcher = self._watch_notices()
        rdv = self._rendezvous(store)
        if not args.join:
            rdv.publish_bounds()
        restarts = relaunches = 0
        try:
            seat = self._first_seat(rdv)
            k = seat.round if seat is not None else 0
            join = bool(args.join) if seat is None else seat.standby
            seat_used = False  # a seat's start-up roster is composed once; a restart as a standby joins
            in_round = 0  # workers restarted as standbys in this round (each gets its own member id)
            while True:
                if seat is None:
                    rank, world, resume = args.node_rank or 0, args.nodes_range[0], None
                else:
                    rank, world, resume = seat.rank or 0, seat.world, seat.roster.checkpoint
                # a fresh id for every worker of this machine in a round (a restart as a standby is a new process:
                # its old id is in the records of the generation that released or fenced it), as `parcae run` does
                self.worker_member = worker_member_id(self.member, k) + (f"-r{in_round}" if in_round else "")
                if resume and "://" not in resume and not os.path.exists(resume):
                    self.say(f"the checkpoint {resume} is not on this machine: put --run-dir on storage every "
                             "machine sees, or use --checkpoint-dir")
                # a member of the round's rendezvous starts as a start-up candidate (agent_startup): its rank
                # comes from the workers that arrive, so one noticed or silent before that is simply left out
                composer = (StartupComposer(rdv.records, self.member, k, seat.roster.members)
                            if seat is not None and not join and not seat_used else None)
                seat_used = True
                env = worker_env(dict(os.environ), store=args.store, token=self.token, member=self.worker_member,
                                 join=join, rank=rank, world=world, run_dir=args.run_dir,
                                 generation=k if k >= 1 else None, resume=None if join else resume,
                                 checkpoint_dir=args.checkpoint_dir,
                                 roster=composer.key if composer is not None else None)
                if self.noticed:
                    return 0
                self.proc = subprocess.Popen(args.command, env=env)
                code, relaunch_seen = self._wait_worker(rdv, k, join, composer)
                if self.noticed:
                    # a worker still importing when the notice came has no SIGTERM handler yet: the signal ended it,
                    # and it held no state -- the hand-over the notice asks for is complete
                    return 0 if code == -signal.SIGTERM else code
                if code in (RELEASED_EXIT, FENCED_EXIT) and not relaunch_seen and restarts < args.max_restarts:
                    restarts += 1
                    in_round += 1
                    why = "released by the new shape" if code == RELEASED_EXIT else "fenced after a silence"
                    self.say(f"worker {why}; restarting it as a standby")
                    join = True
                    continue
                if code == FALLBACK_EXIT or relaunch_seen or (join and self._declared(rdv, k + 1)):
                    if relaunches >= args.max_relaunches:
                        self.say(f"the job lost every replica of a stage again, after {relaunches} relaunches "
                                 "(--max-relaunches): giving up")
                        return FALLBACK_EXIT
                    relaunches += 1
                    k = self._relaunch_round(rdv, k, "a stage lost every replica (worker exit 75)")
                    seat = self._take_seat(rdv, k)
                    join, seat_used, in_round = seat.standby, False, 0
                    continue
                return code
        except RendezvousCancelled as exc:
            self.say(f"preempted while waiting: {exc}")
            return 0
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
    args.nodes_range = (1, 1 << 20)  # --join: the job's MIN:MAX comes from the store (Rendezvous.bounds)
    if args.nodes is not None:
        try:
            args.nodes_range = parse_nodes(args.nodes)
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        lo, hi = args.nodes_range
        if args.node_rank is not None and (lo != hi or not 0 <= args.node_rank < lo):
            raise ConfigurationError(
                f"--node-rank {args.node_rank} needs --nodes N with 0 <= rank < N (got --nodes {args.nodes}); "
                "leave --node-rank out to let the agents agree on the ranks"
            )
    elif args.node_rank is not None:
        raise ConfigurationError("--node-rank goes with --nodes N, not with --join")
    if args.settle < 0 or args.rendezvous_timeout <= 0:
        raise ConfigurationError("--settle must be >= 0 and --rendezvous-timeout > 0 seconds")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``parcae agent`` (exit 2 with a message on bad input or a rendezvous that timed out)."""
    args = build_parser().parse_args(argv)
    try:
        _check(args)
        return Agent(args).run()
    except ParcaeError as exc:
        print(f"parcae agent: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
