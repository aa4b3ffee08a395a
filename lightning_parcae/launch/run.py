"""``parcae run``: a one-machine spot cluster -- N worker processes, optionally replaying an availability trace.

Problem: Parcae's value shows only when instances come and go, and trying that on real spot instances is slow and
costly. ``parcae run`` turns one machine into a small cluster: it hosts the coordination store on loopback, creates
the job token, starts one worker process per instance (one per GPU when there are GPUs) with torchrun-compatible
environment variables, and -- with ``--trace`` -- replays a spot-availability trace, time-compressed, by sending
preemption notices, killing instances after the grace period, and adding new ones.

Two ways to handle a membership change:

* ``--elastic`` (the default): *live reconfiguration in place* (:mod:`lightning_parcae.runtime.elastic`). Workers
  run with ``PARCAE_ELASTIC=1``. A removed instance gets a notice (SIGTERM, and a ``parcae/notice/<member>`` key in
  the store), hands its state to the others and exits 0 by itself; if it is still alive when the (scaled) grace
  period ends it gets SIGKILL and the others recover from a sudden loss. An added instance is a *joiner*
  (``PARCAE_JOIN=1``): a warm standby the leader admits at a planning interval. The others keep running. A worker
  that exits with ``RELEASED_EXIT`` (76, healthy but unused by the new shape) or ``FENCED_EXIT`` (77, declared dead
  while silent) is restarted as a joiner; one that exits with ``FALLBACK_EXIT`` (75, some stage lost every replica)
  makes the launcher wait for everyone to exit and relaunch all instances from ``run_dir/ckpt/last.ckpt`` -- the
  only case that restarts the job.
* ``--restart-fallback``: like a torchrun-style elastic job, every change stops the whole group (gracefully: the
  notice lets every rank agree on a stop step and rank 0 write ``run_dir/ckpt/last.ckpt``, see
  :class:`~lightning_parcae.training.callbacks.ParcaeRunCallback`) and relaunches it at the new size, resuming from that
  checkpoint (``PARCAE_RESUME_CKPT``). The time each restart costs is measured and reported.

Usage::

    python -m lightning_parcae.launch.run --instances 4 --trace hh_55_65 -- python examples/train_run.py --max-steps 3000

Outputs in the run directory: ``events.jsonl`` (launcher and worker events), ``logs/*.log`` (one per process),
``ckpt/last.ckpt``, ``report.json`` and ``report.png``.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Optional, Sequence

from lightning_parcae.contract import (
    ENV_PREFIX,
    RUN_DIR_ENV,
    RESUME_ENV,
    STORE_ENV,
    JOB_TOKEN_ENV,
    MEMBER_ENV,
    JOIN_ENV,
    GENERATION_ENV,
    GENERATION_BASE_ENV,
    PIPELINE_ENV,
    INTERVAL_ENV,
    MODE_ENV,
    ELASTIC_ENV,
    STALL_ENV,
    SHARED_CORES_ENV,
    WRONG_TOKEN_EXIT,
    FALLBACK_EXIT,
    RELEASED_EXIT,
    FENCED_EXIT,
)
from lightning_parcae.training.environment import with_boot_path
from lightning_parcae.events import append_event
from lightning_parcae.errors import ConfigurationError, CoordinationError, ParcaeError

__all__ = ["build_parser", "main", "RunConfig", "Launcher", "host_capacity", "scale_counts", "initial_members",
           "ELASTIC", "RESTART_FALLBACK", "FALLBACK_EXIT", "RELEASED_EXIT", "FENCED_EXIT"]

ELASTIC = "elastic"
"""Mode: membership changes are live reconfigurations in place (the default)."""
RESTART_FALLBACK = "restart-fallback"
"""Mode: every membership change stops the whole group and relaunches it from the checkpoint."""
MODE = RESTART_FALLBACK  # kept for compatibility: the mode the launcher had before live reconfiguration
_DEFAULT_TIME_SCALE = 20.0  # a 1-hour segment of 60-s intervals replays in 3 minutes
_POLL_S = 0.2


# ---------------------------------------------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    """The ``parcae run`` argument parser (the worker command follows ``--``)."""
    p = argparse.ArgumentParser(
        prog="parcae run",
        description="Run a training script on a one-machine cluster of N instances, optionally replaying a spot "
        "availability trace. Membership changes are live reconfigurations in place (--elastic, the default) or full "
        "restarts from the checkpoint (--restart-fallback).",
        epilog="example: parcae run --instances 4 --trace hh_55_65 -- python examples/train_run.py --max-steps 3000",
    )
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--elastic", dest="mode", action="store_const", const=ELASTIC,
                      help="live reconfiguration in place: notices, kills and additions change D x P while the "
                      "others keep training; only a stage with no live replica restarts from the checkpoint "
                      "(default)")
    mode.add_argument("--restart-fallback", dest="mode", action="store_const", const=RESTART_FALLBACK,
                      help="every membership change stops the whole group and relaunches it from the checkpoint")
    p.set_defaults(mode=ELASTIC)
    p.add_argument("--instances", type=int, required=True, help="instances (worker processes) of a static cluster; "
                   "with --trace, the default for --max-instances")
    p.add_argument("--trace", default=None, help="trace file (events/counts/segment/skypilot) or bundled name "
                   "(p3, hh_55_65, hl_15_25, lh_80_90, ll_10_11)")
    p.add_argument("--time-scale", type=float, default=_DEFAULT_TIME_SCALE,
                   help=f"replay speed-up: trace seconds per wall second (default {_DEFAULT_TIME_SCALE:g})")
    p.add_argument("--interval", type=float, default=60.0, help="trace interval length in trace seconds (default 60)")
    p.add_argument("--grace", type=float, default=120.0,
                   help="preemption notice period in trace seconds, divided by --time-scale (default 120, AWS)")
    p.add_argument("--max-instances", type=int, default=None,
                   help="the trace's peak count is scaled down to this many instances (default --instances)")
    p.add_argument("--pipeline-stages", default="1",
                   help="P for every generation (D = instances // P), or 'auto' to let the strategy choose; passed "
                   "to workers as PARCAE_PIPELINE_STAGES (with --elastic: P of each (re)launch only; the liveput "
                   "optimizer chooses D x P after that)")
    p.add_argument("--run-dir", default=None, help="run directory (default ./parcae_runs/<timestamp>)")
    p.add_argument("--store-host", default="127.0.0.1", help="address the hosted store binds to (loopback only)")
    p.add_argument("--store", default=None,
                   help="use an existing store instead of hosting one: tcp://HOST:PORT or etcd://HOST:PORT/PREFIX")
    p.add_argument("--store-timeout", type=float, default=10.0, help="seconds to reach the store (default 10)")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds a generation may take to report its first step (default 120)")
    p.add_argument("--max-restarts", type=int, default=3,
                   help="how often one instance may be restarted after its process died by a signal nobody here "
                   "sent (kill -9, the OOM killer): it counts as a lost instance, the others recover and a fresh "
                   "standby takes its place; past this the run fails (default 3)")
    p.add_argument("--stall-timeout", type=float, default=None,
                   help="progress watchdog in seconds: an operation that makes no progress this long while every "
                   "heartbeat is fine becomes a recovery (passed to workers as PARCAE_STALL_S; default: the "
                   "strategy's stall_after_s, 60)")
    p.add_argument("--oversubscribe", action="store_true",
                   help="allow more instances than this machine hosts well (one per GPU, two per CPU core): for "
                   "tests of the protocol with many small workers")
    p.add_argument("--progress-every", type=float, default=2.0, help="seconds between progress lines")
    p.add_argument("--no-plot", action="store_true", help="skip report.png")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command, e.g. python train.py")
    return p


@dataclass
class RunConfig:
    """Validated options of one ``parcae run``."""

    instances: int
    command: list[str]
    run_dir: Path
    trace: Optional[str] = None
    time_scale: float = _DEFAULT_TIME_SCALE
    interval_s: float = 60.0
    grace_s: float = 120.0
    max_instances: int = 1
    pipeline_stages: str = "1"
    store_host: str = "127.0.0.1"
    store_url: Optional[str] = None
    store_timeout_s: float = 10.0
    startup_timeout_s: float = 120.0
    progress_every_s: float = 2.0
    plot: bool = True
    mode: str = ELASTIC
    max_restarts: int = 3
    stall_timeout_s: Optional[float] = None
    schedule: list[int] = field(default_factory=list)
    """Instances during each (scaled) replay interval; empty for a static cluster."""
    trace_counts: list[int] = field(default_factory=list)

    @property
    def wall_interval_s(self) -> float:
        """One trace interval in wall seconds."""
        return self.interval_s / self.time_scale

    @property
    def wall_grace_s(self) -> float:
        """The notice period in wall seconds."""
        return self.grace_s / self.time_scale


def host_capacity() -> int:
    """How many instances this machine can host: one per GPU, else two per CPU core."""
    try:
        import torch  # noqa: PLC0415

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        gpus = 0
    return gpus if gpus > 0 else 2 * (os.cpu_count() or 1)


def scale_counts(counts: Sequence[int], peak: int, cap: int) -> list[int]:
    """Map trace counts to instance counts: proportional, so that ``peak`` becomes ``cap``; 0 stays 0.

    Args:
        counts: Instances in each trace interval.
        peak: The trace's largest count.
        cap: Instances the largest count maps to.

    Returns:
        One count per interval, each in ``[0, cap]``; a non-zero count maps to at least 1.
    """
    if peak <= 0:
        return [0 for _ in counts]
    return [0 if c <= 0 else max(1, min(cap, int(round(c * cap / peak)))) for c in counts]


def _config(argv: Sequence[str]) -> RunConfig:
    parser = build_parser()
    argv = list(argv)
    if "--" in argv:
        k = argv.index("--")
        opts, command = argv[:k], argv[k + 1:]
    else:
        opts, command = argv, []
    ns = parser.parse_args(opts)
    if ns.command:
        raise ConfigurationError(f"unexpected arguments {ns.command}: put the worker command after '--'")
    if not command:
        raise ConfigurationError("no worker command: give it after '--', e.g. -- python examples/train_run.py")
    if ns.instances < 1:
        raise ConfigurationError(f"--instances must be >= 1, got {ns.instances}")
    for name in ("time_scale", "interval", "store_timeout", "startup_timeout", "progress_every"):
        if not getattr(ns, name) > 0:
            raise ConfigurationError(f"--{name.replace('_', '-')} must be > 0, got {getattr(ns, name)}")
    if ns.max_restarts < 0:
        raise ConfigurationError(f"--max-restarts must be >= 0, got {ns.max_restarts}")
    if ns.stall_timeout is not None and not ns.stall_timeout > 0:
        raise ConfigurationError(f"--stall-timeout must be > 0 seconds, got {ns.stall_timeout}")
    if not ns.grace >= 0:
        raise ConfigurationError(f"--grace must be >= 0, got {ns.grace}")
    max_inst = ns.instances if ns.max_instances is None else ns.max_instances
    if max_inst < 1:
        raise ConfigurationError(f"--max-instances must be >= 1, got {max_inst}")
    cap = host_capacity()
    need = max(ns.instances, max_inst) if ns.trace is None else max_inst
    if need > cap and not ns.oversubscribe:
        raise ConfigurationError(
            f"more instances than the machine can host: {need} requested, this machine hosts at most {cap} (one per "
            "GPU, or two per CPU core); lower --instances/--max-instances (or pass --oversubscribe)"
        )
    if ns.pipeline_stages != "auto" and not (ns.pipeline_stages.isdigit() and int(ns.pipeline_stages) >= 1):
        raise ConfigurationError(f"--pipeline-stages must be a positive integer or 'auto', got {ns.pipeline_stages!r}")
    run_dir = Path(ns.run_dir or os.path.join("parcae_runs", time.strftime("%Y%m%d-%H%M%S"))).resolve()
    cfg = RunConfig(
        instances=ns.instances, command=command, run_dir=run_dir, trace=ns.trace, time_scale=ns.time_scale,
        interval_s=ns.interval, grace_s=ns.grace, max_instances=max_inst, pipeline_stages=ns.pipeline_stages,
        store_host=ns.store_host, store_url=ns.store, store_timeout_s=ns.store_timeout,
        startup_timeout_s=ns.startup_timeout, progress_every_s=ns.progress_every, plot=not ns.no_plot,
        mode=ns.mode, max_restarts=ns.max_restarts, stall_timeout_s=ns.stall_timeout,
    )
    if ns.trace is not None:
        cfg.trace_counts, cfg.schedule = _load_schedule(ns.trace, ns.interval, max_inst)
        if not any(cfg.schedule):
            raise ConfigurationError(f"trace {ns.trace!r} never has any instance: nothing to run")
    return cfg


def initial_members(n: int, pipeline_stages: str) -> tuple[int, int]:
    """How many of ``n`` instances start a (re)launch as initial members under ``--elastic``, and their P.

    The first generation's D must split the script's global batch; the launcher does not know the batch, so it
    takes the largest count whose D is a power of two (any usual batch size splits). The other instances start as
    warm standbys, and the liveput optimizer admits them when a shape that uses them is better.

    Args:
        n: Instances available (>= 1).
        pipeline_stages: ``--pipeline-stages`` (a number or ``auto``).

    Returns:
        (members, P): ``members`` is ``D * P`` with D a power of two (for ``auto``, P is 0: the strategy picks a
        divisor of ``members``).
    """
    p = 0 if pipeline_stages == "auto" else min(int(pipeline_stages), n)
    d = 1
    while (2 * d) * max(p, 1) <= n:
        d *= 2
    return d * max(p, 1), p


def _load_schedule(name: str, interval_s: float, cap: int) -> tuple[list[int], list[int]]:
    from lightning_parcae.signals.traces import BUNDLED_TRACES, bundled_trace_path, load_trace  # noqa: PLC0415

    if os.path.exists(name):
        path: Any = name
    elif name in BUNDLED_TRACES:
        path = bundled_trace_path(name)
    else:
        raise ConfigurationError(
            f"unknown trace {name!r}: not a file and not a bundled trace (bundled: {', '.join(BUNDLED_TRACES)})"
        )
    trace = load_trace(path, interval_s=interval_s)  # TraceFormatError names the file, line and expectation
    if not len(trace):
        raise ConfigurationError(f"trace {name!r} has no intervals")
    counts = [int(c) for c in trace.counts()]
    return counts, scale_counts(counts, trace.max_n, cap)


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class _Worker:
    rank: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    # --elastic only
    member: str = ""
    instance: int = -1
    joiner: bool = False
    launch: int = 0
    started: float = 0.0
    noticed_at: Optional[float] = None
    """When the trace removed this worker's instance (its notice); None if it was not removed."""
    deadline: Optional[float] = None
    sigterm_sent: bool = False
    killed: bool = False
    """The launcher sent SIGKILL (grace period over, a removed standby, a fallback's stragglers, the end)."""
    handled: bool = False

    def alive(self) -> bool:
        return self.proc.poll() is None


class RunFailed(ParcaeError, RuntimeError):
    """A worker failed (crashed, rejected the token, or never started training); the message holds its log tail."""


class Launcher:
    """Hosts the store, starts and replaces worker generations, replays the trace and writes the report.

    Args:
        cfg: Validated options (see :func:`build_parser`).
        out: Where progress lines go.
    """

    def __init__(self, cfg: RunConfig, out: Any = None) -> None:
        self.cfg = cfg
        self.out = out if out is not None else sys.stdout
        self.workers: list[_Worker] = []
        self.generation = -1
        self.n = 0
        self.shape = (0, 0)
        self.store: Any = None
        self.store_url = ""
        self.token = ""
        self.t0 = 0.0
        self.restarts: list[dict[str, Any]] = []
        self._pending_restart: Optional[dict[str, Any]] = None
        self._gen_started_at = 0.0
        self._gen_first_step = False
        self._events_offset = 0
        self._resume_step = 0
        self.events: list[dict[str, Any]] = []
        self.latest: dict[str, Any] = {}
        self._last_line = 0.0
        self.timeline: list[dict[str, Any]] = []  # (time, N, D, P) whenever the running group changes
        # --elastic: instances (id -> its current process, None while it has none), processes, what they report
        self.instances: dict[int, Optional[_Worker]] = {}
        self._next_instance = 0
        self._incarnations: dict[int, int] = {}
        self.launch = -1
        self.phases: dict[str, str] = {}
        self.migrations: dict[int, dict[str, Any]] = {}
        self.decision: dict[str, Any] = {}
        self.egen = -1
        self.changes: list[dict[str, Any]] = []
        self.shapes: list[dict[str, Any]] = []  # (t, N members, D, P, generation) whenever the job's shape changes
        self.finished = False
        self._finished_at: Optional[float] = None
        self._fallback: Optional[dict[str, Any]] = None
        self._last_ckpt_step = 0
        self._need_launch = False
        self._fallback_seen: set[str] = set()
        self._fallback_reason = ""
        self._recoveries: set[Any] = set()
        self._recovering_since: dict[int, float] = {}
        self._kill_times: list[float] = []
        self._batch: Optional[tuple[int, int]] = None
        """(global batch, micro-batches) as the workers report them (None until the first report)."""
        self._lost: dict[int, int] = {}
        """Instance -> how often its process died by a signal nobody here sent."""
        self._lost_relaunches = 0
        self._no_members_since: Optional[float] = None

    # ------------------------------------------------------------------------------------------------ store
    def _open_store(self) -> None:
        from lightning_parcae.runtime.store import host_store, new_token, parse_store_url  # noqa: PLC0415

        self.token = new_token()
        cfg = self.cfg
        if cfg.store_url is None:
            self.store = host_store(f"tcp://{cfg.store_host}:0", token=self.token, timeout_s=cfg.store_timeout_s)
            self.store_url = f"tcp://{cfg.store_host}:{self.store.port}"
            return
        spec = parse_store_url(cfg.store_url)
        if spec.scheme == "tcp" and spec.port:
            from lightning_parcae.runtime.store import connect_store, install_token  # noqa: PLC0415

            self.store = connect_store(spec, token=None, timeout_s=cfg.store_timeout_s, op_timeout_s=30.0)
            install_token(self.store, self.token)
        else:
            self.store = host_store(spec, token=self.token, timeout_s=cfg.store_timeout_s)
            if spec.scheme == "tcp":
                spec = spec.with_port(self.store.port)
        self.store_url = spec.url

    # ------------------------------------------------------------------------------------------------ events
    def event(self, kind: str, **fields: Any) -> None:
        """Append a launcher event to ``events.jsonl``."""
        append_event(self.cfg.run_dir, {"source": "launcher", "event": kind, "mode": self.cfg.mode,
                                        "elapsed_s": time.time() - self.t0, **fields})

    def _read_events(self) -> None:
        path = self.cfg.run_dir / "events.jsonl"
        try:
            with open(path, "rb") as f:
                f.seek(self._events_offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        self._events_offset += end
        for line in data[:end].splitlines():
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            self.events.append(ev)
            if ev.get("source") == "worker":
                if ev.get("global_batch"):
                    self._batch = (int(ev["global_batch"]), int(ev.get("micro_batches") or 1))
                rate = ev.get("samples_per_s", self.latest.get("samples_per_s", 0.0))
                if ev.get("event") != "progress" and ev.get("generation") == self.latest.get("generation"):
                    rate = self.latest.get("samples_per_s", 0.0)  # only progress events carry a fresh rate
                self.latest = {**ev, "samples_per_s": rate}
                if ev.get("generation") == self.generation and ev.get("event") in ("progress", "checkpoint", "end",
                                                                                   "stop"):
                    if ev.get("step", 0) > self._resume_step and not self._gen_first_step:
                        self._gen_first_step = True
                        self._finish_restart(ev)
                if ev.get("event") == "checkpoint":
                    self._last_ckpt_step = int(ev.get("step", 0))
                if ev.get("event") == "end" and self.cfg.mode == ELASTIC and not self.finished:
                    self.finished, self._finished_at = True, time.time()
                    self.event("finished", step=ev.get("step"))
            elif ev.get("source") == "elastic":
                self._on_elastic_event(ev)

    # ------------------------------------------------------------------------------------------------ workers
    def _shape_for(self, n: int) -> tuple[int, int, int]:
        """(workers, D, P) for ``n`` instances; with a fixed P, instances beyond D*P stay idle.

        D must split the job's global batch, by the rule the elastic path uses
        (:func:`~lightning_parcae.planning.costmodel.batch_splits`): once a worker has reported its global batch B and
        micro-batches M, D is the largest ``<= n // P`` that splits B into D x M; before that (the first launch)
        it is a power of two, as :func:`initial_members` chooses for ``--elastic``.
        """
        if self.cfg.pipeline_stages == "auto":
            return n, 0, 0  # the strategy picks; D, P come back in the workers' events
        p = min(int(self.cfg.pipeline_stages), n)
        if self._batch is None:
            members, _ = initial_members(n, str(p))
            d = members // p
        else:
            from lightning_parcae.planning.costmodel import batch_splits  # noqa: PLC0415

            b, m = self._batch
            d = next((k for k in range(n // p, 0, -1) if batch_splits(b, k, m)), 1)
        return d * p, d, p

    def _start_generation(self, n: int) -> None:
        cfg = self.cfg
        self.generation += 1
        workers, d, p = self._shape_for(n)
        self.n, self.shape = n, (d, p)
        ckpt = cfg.run_dir / "ckpt" / "last.ckpt"
        self._resume_step = int(self.latest.get("step", 0)) if ckpt.exists() else 0
        port = _free_port()
        logs = cfg.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        base = {k: v for k, v in os.environ.items() if k not in (RESUME_ENV, ELASTIC_ENV, JOIN_ENV)}
        self.workers = []
        for rank in range(workers):
            env = {
                **base,
                "RANK": str(rank), "WORLD_SIZE": str(workers), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(workers), "GROUP_RANK": "0", "NODE_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                STORE_ENV: self.store_url, JOB_TOKEN_ENV: self.token, RUN_DIR_ENV: str(cfg.run_dir),
                GENERATION_ENV: str(self.generation), GENERATION_BASE_ENV: str(1000 * self.generation),
                PIPELINE_ENV: cfg.pipeline_stages, MODE_ENV: cfg.mode, ELASTIC_ENV: "0",
            }
            env.setdefault("OMP_NUM_THREADS", "1")
            with_boot_path(env)  # strategy="parcae" resolves without an import of lightning_parcae
            if cfg.stall_timeout_s:
                env[STALL_ENV] = f"{cfg.stall_timeout_s:g}"
            if ckpt.exists():
                env[RESUME_ENV] = str(ckpt)
            log_path = logs / f"gen{self.generation}_rank{rank}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(cfg.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            self.workers.append(_Worker(rank, proc, log_path))
        self._gen_started_at = time.time()
        self._gen_first_step = False
        self.timeline.append({"t": time.time() - self.t0, "N": n, "workers": workers, "D": d, "P": p,
                              "generation": self.generation})
        self.event("launch", generation=self.generation, N=n, workers=workers, D=d, P=p,
                   resume_ckpt=str(ckpt) if ckpt.exists() else None, resume_step=self._resume_step,
                   master_port=port)

    def _signal(self, w: _Worker, sig: int) -> None:
        try:
            os.killpg(w.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def _stop_generation(self, target: int) -> dict[str, Any]:
        """Notice -> graceful stop of the whole group (restart fallback) -> SIGKILL after the grace period."""
        from lightning_parcae.runtime.store import publish  # noqa: PLC0415

        t_req = time.time()
        old_n = self.n
        removed = [w.rank for w in self.workers][target:] if target < len(self.workers) else []
        deadline = t_req + self.cfg.wall_grace_s
        for rank in removed:  # the preempted instances get their notice first
            notice = {"instance": f"rank{rank}", "kind": "preempt", "deadline_s": deadline, "source": "replay",
                      "detail": {"generation": self.generation, "target_n": target}}
            try:
                publish(self.store, f"parcae/run/notice/gen{self.generation}/rank{rank}", notice, self.token)
            except Exception as exc:  # noqa: BLE001 -- a store hiccup must not stop the notice itself
                self.event("store_error", error=str(exc))
            self._signal(self.workers[rank], signal.SIGTERM)
        self.event("notice", generation=self.generation, old_N=old_n, new_N=target, preempted=removed,
                   grace_s=self.cfg.wall_grace_s,
                   note="restart fallback: the whole group stops and relaunches (in-place migration is issue 4)")
        for w in self.workers:
            if w.rank not in removed:
                self._signal(w, signal.SIGTERM)
        while time.time() < deadline and any(w.alive() for w in self.workers):
            time.sleep(0.05)
        killed = [w.rank for w in self.workers if w.alive()]
        for w in self.workers:
            if w.alive():
                self._signal(w, signal.SIGKILL)
        for w in self.workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._read_events()
        stopped = [e for e in self.events if e.get("source") == "worker" and e.get("event") == "stop"
                   and e.get("generation") == self.generation]
        last_step = max((int(e.get("step", 0)) for e in self.events if e.get("source") == "worker"
                         and e.get("generation") == self.generation), default=0)
        rate = float(self.latest.get("samples_per_s", 0.0) or 0.0)
        self.event("stopped", generation=self.generation, stop_s=time.time() - t_req, killed=killed,
                   graceful=bool(stopped) and not killed, last_step=last_step)
        self.workers = []
        return {"t_request": t_req, "from_generation": self.generation, "old_N": old_n, "new_N": target,
                "stop_s": time.time() - t_req, "killed": killed, "last_step": last_step, "samples_per_s": rate,
                "graceful": bool(stopped) and not killed}

    def _finish_restart(self, ev: dict[str, Any]) -> None:
        r = self._pending_restart
        if r is None:
            return
        self._pending_restart = None
        downtime = float(ev["time"]) - r["t_request"]
        redo_steps = max(0, int(r["last_step"]) - int(self._resume_step))
        spb = self.latest.get("samples", 0) / max(1, self.latest.get("step", 1))
        redo_s = redo_steps * spb / r["samples_per_s"] if r["samples_per_s"] > 0 else 0.0
        r.update(downtime_s=downtime, redo_steps=redo_steps, redo_s=redo_s, lost_s=downtime + redo_s,
                 to_generation=self.generation, resume_step=self._resume_step)
        self.restarts.append(r)
        self.event("restart_done", **{k: v for k, v in r.items() if k != "t_request"})

    def _fail(self, why: str, workers: Sequence[_Worker]) -> RunFailed:
        tails = []
        for w in workers:
            try:
                text = w.log_path.read_text(errors="replace")
            except OSError:
                text = ""
            tail = "\n".join(text.splitlines()[-25:])
            tails.append(f"--- {w.log_path} (exit {w.proc.returncode}) ---\n{tail}")
        return RunFailed(f"{why}\n" + "\n".join(tails))

    def kill_all(self) -> None:
        """SIGTERM, then SIGKILL every worker's process group (idempotent; also run at exit)."""
        for w in self.workers:
            if w.alive():
                self._signal(w, signal.SIGTERM)
        t_end = time.time() + 2.0
        while time.time() < t_end and any(w.alive() for w in self.workers):
            time.sleep(0.05)
        for w in self.workers:
            if w.handled and not w.alive():
                continue  # exited and accounted for long ago: its pid may belong to someone else by now
            self._signal(w, signal.SIGKILL)  # also reaps grandchildren left in the group
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

    # ------------------------------------------------------------------------------------------------ elastic
    def _say(self, msg: str) -> None:
        print(f"[parcae run {time.time() - self.t0:6.1f}s] {msg}", file=self.out, flush=True)

    def _on_elastic_event(self, ev: dict[str, Any]) -> None:
        """Follow what the workers' live-reconfiguration runtime reports (phases, plans, migrations, losses)."""
        member = str(ev.get("member", ""))
        kind = ev.get("event")
        t = float(ev.get("time", time.time())) - self.t0
        if kind == "phase":
            self.phases[member] = str(ev.get("new"))
            g = int(ev.get("generation", -1))
            if ev.get("new") == "recovering":
                self._recovering_since.setdefault(g, t)
            if ev.get("new") == "training" and ev.get("old") == "starting" and g > self.egen:  # a (re)launch trains
                self.egen = g
                d, p = int(ev.get("D", 0) or 0), int(ev.get("P", 0) or 0)
                self.shapes.append({"t": t, "N": d * p, "D": d, "P": p, "generation": g, "why": "launch"})
        elif kind == "decision":
            self.decision = ev
            if ev.get("chosen") != ev.get("current") or ev.get("leaving"):
                cur, new = ev.get("current") or [0, 0], ev.get("chosen")
                to = f"{new[0]}x{new[1]}" if new else "no shape (fallback)"
                self._say(f"plan: {cur[0]}x{cur[1]} -> {to} for N={ev.get('N')} ({ev.get('reason')}; predicted "
                          f"N={ev.get('predicted')})")
        elif kind == "migration":
            g = int(ev.get("generation", -1))
            m = self.migrations.get(g)
            if m is None:
                m = {"generation": g, "kind": ev.get("kind"), "reason": ev.get("reason", ""),
                     "duration_s": 0.0, "transfer_s": 0.0, "bytes_moved": int(ev.get("bytes_moved", 0) or 0),
                     "step": int(ev.get("step", 0) or 0), "D": ev.get("D"), "P": ev.get("P"), "N": ev.get("N"),
                     "joiners": list(ev.get("joiners") or []), "t_end": t, "members": [], "printed": False,
                     "recovery": "recovery" in str(ev.get("reason", "")), "lost_from": None}
                if m["recovery"]:  # the job stalled from the loss (our SIGKILL, if any) until the survivors resumed
                    prev = max((x["t_end"] for x in self.migrations.values()), default=0.0)
                    kills = [k for k in self._kill_times if prev <= k <= t]
                    m["lost_from"] = min(kills) if kills else self._recovering_since.get(g - 1)
                self.migrations[g] = m
                if g > self.egen:
                    self.egen = g
                    self.shapes.append({"t": t, "N": ev.get("N"), "D": ev.get("D"), "P": ev.get("P"),
                                        "generation": g, "why": ev.get("kind")})
            m["duration_s"] = max(m["duration_s"], float(ev.get("duration_s", 0.0) or 0.0))
            m["transfer_s"] = max(m["transfer_s"], float(ev.get("transfer_s", 0.0) or 0.0))
            m["t_end"] = max(m["t_end"], t)
            m["members"].append(member)
            if len(m["members"]) >= int(m["N"] or 0) - len(m["joiners"]):
                self._print_migration(m)
        elif kind == "left":
            self._say(f"{member} left ({ev.get('reason')}): handed its state over in {float(ev.get('transfer_s', 0)):.2f} s")
        elif kind == "recovering" and ev.get("generation") not in self._recoveries:
            self._recoveries.add(ev.get("generation"))
            self._say(f"sudden loss of {ev.get('dead')}: survivors {ev.get('survivors')} recover in place")
        elif kind == "fallback" and member not in self._fallback_seen:
            self._fallback_seen.add(member)
            self._fallback_reason = str(ev.get("reason", ""))

    def _print_migration(self, m: dict[str, Any]) -> None:
        if m["printed"]:
            return
        m["printed"] = True
        extra = f", joiners {m['joiners']}" if m["joiners"] else ""
        reason = m["reason"] if len(m["reason"]) <= 90 else m["reason"][:87] + "..."
        stall = f" (stalled {_lost(m):.2f} s since the loss)" if m["recovery"] else ""
        self._say(f"migration -> gen {m['generation']}: {m['kind']} to {m['D']}x{m['P']} (N={m['N']}) at step "
                  f"{m['step']} in {m['duration_s']:.2f} s{stall}, {m['bytes_moved'] / 1e6:.2f} MB moved{extra} "
                  f"[{reason}]")

    def _member_name(self, instance: int) -> str:
        c = self._incarnations.get(instance, -1) + 1
        self._incarnations[instance] = c
        return f"i{instance}" if c == 0 else f"i{instance}.{c}"

    @functools.cached_property
    def shared_units(self) -> int:
        """Processing units the workers of this one-machine cluster share: GPUs, else CPU cores."""
        capacity = host_capacity()
        cores = os.cpu_count() or 1
        return cores if capacity == 2 * cores else capacity

    def _spawn(self, instance: int, *, join: bool, rank: int = 0, world: int = 1, p: int = 1,
               resume: bool = False) -> _Worker:
        """Start one worker process for ``instance``: an initial member of a (re)launch, or a joiner."""
        cfg = self.cfg
        member = self._member_name(instance)
        base = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
        env = {
            **base,
            "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
            "GROUP_RANK": "0", "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            ELASTIC_ENV: "1", STORE_ENV: self.store_url, JOB_TOKEN_ENV: self.token,
            MEMBER_ENV: member, JOIN_ENV: "1" if join else "0", RUN_DIR_ENV: str(cfg.run_dir),
            GENERATION_ENV: str(self.launch), GENERATION_BASE_ENV: str(1000 * self.launch),
            PIPELINE_ENV: str(p) if p else "auto", MODE_ENV: cfg.mode,
            INTERVAL_ENV: f"{cfg.wall_interval_s:g}",
            # every instance of this one-machine cluster shares its cores (the measured model's contention term)
            SHARED_CORES_ENV: str(self.shared_units),
        }
        env.setdefault("OMP_NUM_THREADS", "1")
        with_boot_path(env)  # strategy="parcae" resolves without an import of lightning_parcae
        if cfg.stall_timeout_s:
            env[STALL_ENV] = f"{cfg.stall_timeout_s:g}"
        ckpt = cfg.run_dir / "ckpt" / "last.ckpt"
        if resume and ckpt.exists():
            env[RESUME_ENV] = str(ckpt)
        logs = cfg.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{member}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cfg.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        w = _Worker(rank if not join else -1, proc, log_path, member=member, instance=instance, joiner=join,
                    launch=self.launch, started=time.time())
        self.workers.append(w)
        self.instances[instance] = w
        return w

    def _launch(self) -> None:
        """(Re)launch: the oldest instances as the initial members (D a power of two), the others as joiners."""
        cfg = self.cfg
        ids = sorted(self.instances)
        m, p = initial_members(len(ids), cfg.pipeline_stages)
        self.launch += 1
        self.generation = self.launch
        if self._pending_restart is not None:
            self._pending_restart["new_N"] = len(ids)
        ckpt = cfg.run_dir / "ckpt" / "last.ckpt"
        resume = self.launch > 0 and ckpt.exists()
        self._resume_step = self._last_ckpt_step if resume else 0
        for r, k in enumerate(ids[:m]):
            self._spawn(k, join=False, rank=r, world=m, p=p, resume=resume)
        for k in ids[m:]:
            self._spawn(k, join=True)
        self._gen_started_at = time.time()
        self._gen_first_step = False
        members = [self.instances[k].member for k in ids[:m]]  # type: ignore[union-attr]
        standbys = [self.instances[k].member for k in ids[m:]]  # type: ignore[union-attr]
        self.event("launch", launch=self.launch, generation=self.launch, N=len(ids), members=members,
                   standbys=standbys, P=p or "auto", resume_ckpt=str(ckpt) if resume else None,
                   resume_step=self._resume_step)
        what = "relaunch from last.ckpt" if resume else "launch"
        self._say(f"{what} #{self.launch}: {len(ids)} instances, members {members}"
                  + (f", warm standbys {standbys}" if standbys else "") + f" (P={p or 'auto'})")

    def _waiting(self, w: _Worker) -> bool:
        """A joiner that has not been admitted yet (holds no training state)."""
        return w.joiner and self.phases.get(w.member) in (None, "starting", "standby")

    def _notice(self, w: _Worker) -> str:
        """Remove ``w``'s instance: notice (store key + SIGTERM), or SIGKILL at once if it is a waiting standby."""
        from lightning_parcae.runtime.liveness import notice_key  # noqa: PLC0415
        from lightning_parcae.runtime.store import publish  # noqa: PLC0415

        now = time.time()
        if self._waiting(w) or self._fallback is not None and w.joiner:
            self._signal(w, signal.SIGKILL)
            w.killed = True
            return "standby stopped"
        w.noticed_at, w.deadline = now, now + self.cfg.wall_grace_s
        try:
            publish(self.store, notice_key(w.member), {"member": w.member, "kind": "preempt", "source": "replay",
                                                       "deadline": w.deadline}, self.token)
        except Exception as exc:  # noqa: BLE001 -- a store hiccup must not stop the notice itself
            self.event("store_error", error=str(exc))
        if w.member in self.phases:  # its handler is installed: SIGTERM is a notice, not a kill
            self._signal(w, signal.SIGTERM)
            w.sigterm_sent = True
        return "notice"

    def _removal_order(self, ids: list[int]) -> list[int]:
        """Instances in the order the trace removes them: those not training in the job (standbys, including
        members released by a shape change and restarted) before members, newest first within each.

        Regression: a member released by a 4 -> 2 shape change restarts as a standby under its *old* instance
        number, so "newest first" noticed an older training member while the restarted standby (still importing,
        not yet counted by the leader) stayed -- the job found no shape for 1 instance and fell back to the
        checkpoint.
        """
        busy = ("training", "planning", "migrating", "recovering")

        def member(k: int) -> bool:
            w = self.instances.get(k)
            return w is not None and self.phases.get(w.member) in busy

        return sorted(ids, key=lambda k: (member(k), -k))

    def _change(self, target: int) -> None:
        """The trace moved to ``target`` instances: notice the newest ones, or start joiners."""
        ids = sorted(self.instances)
        cur = len(ids)
        running = self.launch >= 0 and not self._need_launch and self._fallback is None
        if target < cur:
            done = []
            for k in self._removal_order(ids)[: cur - target]:
                w = self.instances.pop(k)
                action = self._notice(w) if w is not None and w.alive() else "no process"
                done.append({"instance": k, "member": w.member if w else None, "action": action})
            self.event("remove", old_N=cur, new_N=target, victims=done, grace_s=self.cfg.wall_grace_s)
            self.changes.append({"t": time.time() - self.t0, "old_N": cur, "new_N": target, "removed": done})
            self._say(f"trace: {cur} -> {target} instances: " + ", ".join(
                f"{d['action']} to {d['member']}" if d["action"] == "notice" else f"{d['member']}: {d['action']}"
                for d in done) + (f" (grace {self.cfg.wall_grace_s:.1f} s)" if any(d["action"] == "notice"
                                                                                   for d in done) else ""))
        else:
            added = []
            for _ in range(target - cur):
                k = self._next_instance
                self._next_instance += 1
                self.instances[k] = None
                if running and not self.finished:
                    added.append(self._spawn(k, join=True).member)
                else:
                    added.append(f"i{k}")
            self.event("add", old_N=cur, new_N=target, joiners=added)
            self.changes.append({"t": time.time() - self.t0, "old_N": cur, "new_N": target, "added": added})
            how = "started as warm standby" if running and not self.finished else "will start at the next launch"
            self._say(f"trace: {cur} -> {target} instances: new {', '.join(added)} {how}")
        self.n = target
        self.timeline.append({"t": time.time() - self.t0, "N": target, "workers": len(self.instances),
                              "D": self.shapes[-1]["D"] if self.shapes else 0,
                              "P": self.shapes[-1]["P"] if self.shapes else 0, "generation": self.egen})
        if target == 0:
            self.event("paused", reason="no instances available")

    def _reap(self) -> None:
        """Account for workers that exited: released ones restart as joiners, 75 starts the fallback, others fail."""
        for w in self.workers:
            if w.handled or w.proc.poll() is None:
                continue
            w.handled = True
            rc = int(w.proc.returncode)
            current = self.instances.get(w.instance) is w
            self.event("exit", member=w.member, instance=w.instance, rc=rc, noticed=w.noticed_at is not None,
                       killed=w.killed)
            if current:
                self.instances[w.instance] = None
            if rc == WRONG_TOKEN_EXIT:
                self.kill_all()
                raise self._fail("parcae run failed: a worker rejected the job token (wrong or missing "
                                 "PARCAE_JOB_TOKEN); stopped all workers", [w])
            if rc == FALLBACK_EXIT:
                self._start_fallback()
                continue
            if rc in (RELEASED_EXIT, FENCED_EXIT):
                why = "released by the new shape" if rc == RELEASED_EXIT else "fenced (declared dead while silent)"
                if current and not self.finished and self._fallback is None and not self._need_launch:
                    self._spawn(w.instance, join=True)
                    self._say(f"{w.member} {why}: restarted as warm standby "
                              f"{self.instances[w.instance].member}")  # type: ignore[union-attr]
                continue
            ours = w.killed or (w.noticed_at is not None and rc in (-signal.SIGTERM, -signal.SIGKILL))
            lost = rc < 0 and not ours  # a signal nobody here sent (kill -9, the OOM killer): a lost instance
            if lost:
                self._count_lost(w, rc)
            if rc == 0 or ours or lost:
                if (not w.joiner and w.launch == self.launch and w.member not in self.phases and not self.finished
                        and self._fallback is None):
                    # lost before the first generation formed: the other initial members cannot go on without it
                    self._fallback_reason = f"initial member {w.member} lost during start-up"
                    self._start_fallback()
                elif lost and current and not self.finished and self._fallback is None and not self._need_launch:
                    self._spawn(w.instance, join=True)  # the survivors recover in place; a fresh standby for it
                    self._say(f"{w.member} died by signal {-rc} (not sent by parcae run): a lost instance; the "
                              f"others recover in place, restarted as warm standby "
                              f"{self.instances[w.instance].member}")  # type: ignore[union-attr]
                continue
            # an exception in the script (or any exit that is neither a signal nor a protocol status): like
            # Lightning, the job fails with the worker's traceback
            self.kill_all()
            raise self._fail(f"parcae run failed: worker {w.member} (launch {w.launch}) exited with {rc}; stopped "
                             "all workers", [w])

    def _check_members_left(self, alive: list[_Worker]) -> None:
        """Every training member is gone (killed together, or the last one lost) while standbys wait: nobody is
        left to hand state over or to exit 75, so the launcher starts the fallback itself (relaunch from
        last.ckpt). The condition must hold for 3 s: phase events reach the launcher with a delay."""
        members = [w for w in alive if not self._waiting(w)]
        if members or not self._gen_first_step or self.finished or self._fallback is not None or self._need_launch:
            self._no_members_since = None
            return
        now = time.time()
        if self._no_members_since is None:
            self._no_members_since = now
        elif now - self._no_members_since > 3.0:
            self._no_members_since = None
            self._fallback_reason = "every training member was lost (no live process holds the model)"
            self._start_fallback()

    def _count_lost(self, w: _Worker, rc: int) -> None:
        """Count one unrequested death by signal of ``w``'s instance; past ``--max-restarts`` the run fails."""
        n = self._lost[w.instance] = self._lost.get(w.instance, 0) + 1
        self.event("lost", member=w.member, instance=w.instance, rc=rc, count=n, max_restarts=self.cfg.max_restarts)
        if n > self.cfg.max_restarts:
            self.kill_all()
            raise self._fail(f"parcae run failed: instance {w.instance} lost its process to a signal {n} times "
                             f"(last: {w.member}, signal {-rc}), more than --max-restarts {self.cfg.max_restarts}; "
                             "stopped all workers", [w])

    def _start_fallback(self) -> None:
        if self._fallback is not None:
            return
        rate = float(self.latest.get("samples_per_s", 0.0) or 0.0)
        last_step = max((int(e.get("step", 0)) for e in self.events if e.get("source") == "worker"), default=0)
        self._fallback = {"t_request": time.time(), "from_generation": self.launch, "reason": self._fallback_reason,
                          "old_N": int(self.shapes[-1]["N"] or 0) if self.shapes else 0, "last_step": last_step,
                          "samples_per_s": rate,
                          "killed": [], "graceful": True}
        self.event("fallback", launch=self.launch, reason=self._fallback_reason, last_step=last_step)
        self._say(f"FALLBACK: {self._fallback_reason or 'some stage lost every replica'}; waiting for every worker "
                  "to exit, then relaunching from last.ckpt")
        for w in self.workers:  # standbys hold no state: stop them now
            if w.alive() and w.joiner and self._waiting(w):
                self._signal(w, signal.SIGKILL)
                w.killed = True

    def _advance_fallback(self) -> None:
        fb = self._fallback
        assert fb is not None
        alive = [w for w in self.workers if w.alive()]
        if alive and time.time() < fb["t_request"] + max(10.0, 2.0 * self.cfg.wall_grace_s):
            return
        for w in alive:  # stragglers (stuck on a dead peer): stop them
            self._signal(w, signal.SIGKILL)
            w.killed = True
            fb["killed"].append(w.member)
            fb["graceful"] = False
        for w in alive:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self._fallback = None
        self._reap()
        fb["stop_s"] = time.time() - fb["t_request"]
        self._fallback_seen.clear()
        self._fallback_reason = ""
        self._pending_restart = fb
        self.event("stopped", generation=fb["from_generation"], stop_s=fb["stop_s"], killed=fb["killed"],
                   graceful=fb["graceful"], last_step=fb["last_step"])
        self._need_launch = True

    def _enforce_deadlines(self) -> None:
        now = time.time()
        for w in self.workers:
            if not w.alive() or w.noticed_at is None:
                continue
            if not w.sigterm_sent and w.member in self.phases:
                self._signal(w, signal.SIGTERM)
                w.sigterm_sent = True
            if not w.killed and w.deadline is not None and now >= w.deadline:
                self._signal(w, signal.SIGKILL)
                w.killed = True
                self._kill_times.append(now - self.t0)
                self.event("kill", member=w.member, instance=w.instance, reason="grace period over")
                self._say(f"{w.member} still alive when its grace period ended: SIGKILL (the others recover)")

    def _run_elastic(self) -> None:
        cfg = self.cfg
        n0 = self.target_at(0.0)
        for _ in range(n0):
            self.instances[self._next_instance] = None
            self._next_instance += 1
        self.n = n0
        self.timeline.append({"t": 0.0, "N": n0, "workers": n0, "D": 0, "P": 0, "generation": -1})
        self._need_launch = True
        if not n0:
            self.event("paused", reason="no instances available")
        while True:
            if self._need_launch and self.instances and self._fallback is None and not self.finished:
                self._need_launch = False
                self._launch()
            time.sleep(_POLL_S)
            self._read_events()
            self._reap()
            self._enforce_deadlines()
            if self._fallback is not None:
                self._advance_fallback()
            alive = [w for w in self.workers if w.alive()]
            self._check_members_left(alive)
            if self.finished:
                if not alive:
                    break
                if self._finished_at is not None and time.time() - self._finished_at > 15.0:
                    for w in alive:  # e.g. a standby that never heard that the job is over
                        self._signal(w, signal.SIGKILL)
                        w.killed = True
                continue
            if not alive and self._fallback is None and not self._need_launch:
                time.sleep(0.5)
                self._read_events()
                if not self.finished:
                    raise self._fail("parcae run failed: every worker exited but training did not finish",
                                     [w for w in self.workers if w.launch == self.launch][:2])
                break
            target = self.target_at(time.time() - self.t0)
            if target != len(self.instances):
                self._change(target)
            if (not self._need_launch and self._fallback is None and not self._gen_first_step
                    and time.time() - self._gen_started_at > cfg.startup_timeout_s):
                self.kill_all()
                raise self._fail(f"parcae run failed: launch {self.launch} reported no training step within "
                                 f"{cfg.startup_timeout_s:g} s", [w for w in self.workers if w.launch == self.launch
                                                                   and not w.joiner][:1])
            self._progress()
        self._read_events()
        self._reap()  # the exits seen by the last check
        for m in self.migrations.values():
            self._print_migration(m)

    # ------------------------------------------------------------------------------------------------ main loop
    def target_at(self, elapsed: float) -> int:
        """Instances the trace asks for ``elapsed`` wall seconds into the run (the last count after it ends)."""
        if not self.cfg.schedule:
            return self.cfg.instances
        k = min(int(elapsed / self.cfg.wall_interval_s), len(self.cfg.schedule) - 1)
        return self.cfg.schedule[k]

    def _progress(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_line < self.cfg.progress_every_s:
            return
        self._last_line = now
        ev = self.latest
        current = ev.get("generation") == self.generation
        rate = float(ev.get("samples_per_s", 0.0)) if current else 0.0
        if self.cfg.mode == ELASTIC:
            for m in self.migrations.values():  # a member that never reported: print what the others said
                if not m["printed"] and now - self.t0 - m["t_end"] > 2.0:
                    self._print_migration(m)
            sh = self.shapes[-1] if self.shapes else None
            shape = f"{sh['D']}x{sh['P']}" if sh else "-"
            standby = sum(1 for w in self.workers if w.alive() and self._waiting(w))
            lost = sum(_lost(m) for m in self.migrations.values())
            state = " (fallback: relaunching)" if self._fallback is not None else (
                " (starting)" if not self._gen_first_step and self.instances else "")
            if not self.instances:
                state = " (paused: no instances)"
            print(f"[parcae run {now - self.t0:6.1f}s] N={len(self.instances)} DxP={shape} gen={self.egen} "
                  f"step={ev.get('step', 0)} samples/s={rate:.0f} next={self._next_change()}, "
                  f"standby={standby} migrations={len(self.migrations)} ({lost:.1f}s lost) "
                  f"restarts={len(self.restarts)}{state}", file=self.out, flush=True)
            return
        d, p = (ev.get("D"), ev.get("P")) if current else self.shape
        state = "" if current or not self.workers else " (starting)"
        lost = sum(r["lost_s"] for r in self.restarts)
        print(f"[parcae run {now - self.t0:6.1f}s] N={self.n} DxP={d}x{p} gen={self.generation} "
              f"step={ev.get('step', 0)} samples/s={rate:.0f} "
              f"restarts={len(self.restarts)} time_lost={lost:.1f}s{state}", file=self.out, flush=True)

    def _next_change(self) -> str:
        """The next planned change from the leader's latest decision ('keep' when none is pending)."""
        dec = self.decision
        if not dec:
            return "-"
        pred = dec.get("predicted")
        pred_s = f" (pred N={','.join(str(c) for c in pred)})" if pred else ""
        chosen, cur = dec.get("chosen"), dec.get("current")
        if int(dec.get("generation", -1)) >= self.egen and (chosen != cur or dec.get("leaving")):
            to = f"{chosen[0]}x{chosen[1]}" if chosen else "fallback"
            return f"{to}{pred_s}"
        return f"keep{pred_s}"

    def run(self) -> dict[str, Any]:
        """Run the job to completion; returns the report (also written to ``report.json``).

        Raises:
            RunFailed: A worker failed; every other worker has been stopped.
            CoordinationError: The store could not be hosted or reached.
        """
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / "events.jsonl").unlink(missing_ok=True)
        self.t0 = time.time()
        self._open_store()
        self.event("run_start", command=shlex.join(cfg.command), store=self.store_url, instances=cfg.instances,
                   trace=cfg.trace, time_scale=cfg.time_scale, schedule=cfg.schedule, grace_s=cfg.wall_grace_s,
                   interval_s=cfg.wall_interval_s)
        if cfg.mode == ELASTIC:
            print(f"[parcae run] run dir {cfg.run_dir}; store {self.store_url}; membership changes are live "
                  "reconfigurations in place (--elastic); a stage with no live replica restarts from last.ckpt",
                  file=self.out, flush=True)
            self._run_elastic()
            self._progress(force=True)
            self.event("run_end", restarts=len(self.restarts), migrations=len(self.migrations))
            return self.report()
        print(f"[parcae run] run dir {cfg.run_dir}; store {self.store_url}; membership changes use the restart "
              "fallback (stop all, checkpoint, relaunch)", file=self.out, flush=True)
        n0 = self.target_at(0.0)
        if n0:
            self._start_generation(n0)
        while True:
            time.sleep(_POLL_S)
            self._read_events()
            elapsed = time.time() - self.t0
            if self.workers:
                codes = [w.proc.poll() for w in self.workers]
                bad = [w for w, c in zip(self.workers, codes) if c not in (None, 0)]
                lost = [w for w in bad if w.proc.returncode < 0]
                if lost and self._lost_relaunches < cfg.max_restarts:
                    # a worker died by a signal nobody here sent: a lost instance. The others cannot go on without
                    # it (no live reconfiguration here): stop the generation and relaunch it from last.ckpt
                    self._lost_relaunches += 1
                    self.event("lost", ranks=[w.rank for w in lost], rc=[w.proc.returncode for w in lost],
                               count=self._lost_relaunches, max_restarts=cfg.max_restarts)
                    print(f"[parcae run] worker(s) {[w.rank for w in lost]} died by signal "
                          f"{[-int(w.proc.returncode) for w in lost]}: relaunching generation {self.generation + 1} "
                          "from last.ckpt", file=self.out, flush=True)
                    self._pending_restart = self._stop_generation(self.n)
                    self._start_generation(self.n)
                    continue
                if bad:
                    if any(w.proc.returncode == WRONG_TOKEN_EXIT for w in bad):
                        why = "a worker rejected the job token (wrong or missing PARCAE_JOB_TOKEN)"
                    else:
                        why = f"worker(s) {[w.rank for w in bad]} of generation {self.generation} exited with " \
                              f"{[w.proc.returncode for w in bad]}"
                    self.kill_all()
                    raise self._fail(f"parcae run failed: {why}; stopped all workers", bad)
                if all(c == 0 for c in codes):
                    self._read_events()
                    break
                if not self._gen_first_step and time.time() - self._gen_started_at > cfg.startup_timeout_s:
                    self.kill_all()
                    raise self._fail(f"parcae run failed: generation {self.generation} reported no training step "
                                     f"within {cfg.startup_timeout_s:g} s", self.workers[:1])
            target = self.target_at(elapsed)
            if target != self.n:
                if self.workers:
                    self._pending_restart = self._stop_generation(target)
                self.n = target
                if target > 0:
                    self._start_generation(target)
                else:
                    self.timeline.append({"t": time.time() - self.t0, "N": 0, "workers": 0, "D": 0, "P": 0,
                                          "generation": self.generation})
                    self.event("paused", reason="no instances available")
            self._progress()
        self._progress(force=True)
        self.event("run_end", restarts=len(self.restarts))
        report = self.report()
        return report

    # ------------------------------------------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        """Write ``report.json`` (and ``report.png``) and return the report."""
        cfg = self.cfg
        wev = [e for e in self.events if e.get("source") == "worker"]
        final = max((int(e.get("step", 0)) for e in wev), default=0)
        samples = max((int(e.get("samples", 0)) for e in wev), default=0)
        wall = time.time() - self.t0
        rates = [float(e["samples_per_s"]) for e in wev if e.get("event") == "progress" and e.get("samples_per_s")]
        migrations = [{"generation": m["generation"], "kind": m["kind"], "reason": m["reason"],
                       "t": m["t_end"] - m["duration_s"], "duration_s": m["duration_s"], "transfer_s": m["transfer_s"],
                       "bytes_moved": m["bytes_moved"], "step": m["step"], "D": m["D"], "P": m["P"], "N": m["N"],
                       "joiners": m["joiners"], "recovery": m["recovery"], "lost_s": _lost(m)}
                      for _, m in sorted(self.migrations.items())]
        by_kind: dict[str, float] = {}
        for m in migrations:  # planned migrations by kind; recoveries from a sudden loss count apart
            key = "recovery" if m["recovery"] else m["kind"]
            by_kind[key] = by_kind.get(key, 0.0) + m["lost_s"]
        by_kind["restart"] = sum(r.get("lost_s", 0.0) for r in self.restarts)
        report = {
            "mode": cfg.mode,
            "command": cfg.command,
            "run_dir": str(cfg.run_dir),
            "trace": {"name": cfg.trace, "time_scale": cfg.time_scale, "interval_s": cfg.interval_s,
                      "wall_interval_s": cfg.wall_interval_s, "trace_counts": cfg.trace_counts,
                      "instances_per_interval": cfg.schedule} if cfg.trace else None,
            "static_instances": None if cfg.trace else cfg.instances,
            "timeline": self.timeline,
            "restarts": self.restarts,
            "num_restarts": len(self.restarts),
            "migrations": migrations,
            "num_migrations": len(migrations),
            "time_lost_by_kind_s": by_kind,
            "time_lost_s": sum(by_kind.values()),
            "changes": self.changes,
            "shapes": self.shapes,
            "launches": self.launch + 1 if cfg.mode == ELASTIC else self.generation + 1,
            "final_step": final,
            "samples": samples,
            "wall_s": wall,
            "samples_per_s_overall": samples / wall if wall > 0 else 0.0,
            "samples_per_s_while_training_median": sorted(rates)[len(rates) // 2] if rates else 0.0,
            "events": self.events,
        }
        (cfg.run_dir / "report.json").write_text(json.dumps(report, indent=1, default=str))
        if cfg.plot:
            try:
                _plot(report, cfg.run_dir / "report.png")
            except Exception as exc:  # noqa: BLE001 -- a missing matplotlib must not lose the run's report
                print(f"[parcae run] report.png not written: {exc}", file=self.out, flush=True)
        return report


def _lost(m: dict[str, Any]) -> float:
    """Time one migration cost the job: its duration, or for a recovery, from the loss until training resumed."""
    if m.get("recovery") and m.get("lost_from") is not None:
        return max(float(m["duration_s"]), float(m["t_end"]) - float(m["lost_from"]))
    return float(m["duration_s"])


_KIND_COLORS = {"intra-stage": "tab:green", "inter-stage": "tab:orange", "repartition": "tab:purple",
                "recovery": "tab:red"}


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    elastic = report.get("mode") == ELASTIC
    prog = [e for e in report["events"] if e.get("source") == "worker" and e.get("event") == "progress"]
    has_loss = any("loss" in e for e in prog)
    fig, axes = plt.subplots(4 if has_loss else 3, 1, figsize=(9, 9.5 if has_loss else 7.5), sharex=True)
    tl = report["timeline"]
    t_end = report["wall_s"]
    tr = report["trace"]
    t0 = report["events"][0]["time"] if report["events"] else 0.0
    if tr:
        xs = [k * tr["wall_interval_s"] for k in range(len(tr["instances_per_interval"]))]
        axes[0].step(xs, tr["instances_per_interval"], where="post", label="available (trace, scaled)", lw=4,
                     alpha=0.35)
    axes[0].step([e["t"] for e in tl] + [t_end], [e["N"] for e in tl] + [tl[-1]["N"] if tl else 0], where="post",
                 label="instances (processes)" if elastic else "instances in use")
    for r in report["restarts"]:
        axes[0].axvspan(r["t_request"] - t0, r["t_request"] - t0 + r["downtime_s"], color="red", alpha=0.2)
    if elastic:
        sh = report.get("shapes", [])
        if sh:
            axes[0].step([e["t"] for e in sh] + [t_end], [e["N"] for e in sh] + [sh[-1]["N"]], where="post",
                         label="members training (D x P)")
            for key in ("D", "P"):
                axes[1].step([e["t"] for e in sh] + [t_end], [e[key] for e in sh] + [sh[-1][key]], where="post",
                             label=key)
        seen: set[str] = set()
        top = max([e["N"] for e in tl] + [e["N"] or 0 for e in sh] + (tr["instances_per_interval"] if tr else []) + [1])
        axes[0].set_ylim(-0.2, top + 1.0)
        for k, m in enumerate(report.get("migrations", [])):
            kind = "recovery" if m.get("recovery") else m["kind"]
            color = _KIND_COLORS.get(kind, "black")
            label = None if kind in seen else f"migration: {kind}"
            seen.add(kind)
            for ax in axes:
                ax.axvline(m["t"], color=color, ls="--", lw=0.9, alpha=0.8)
            axes[0].plot([m["t"]], [m["N"]], marker="v", color=color, ms=8, ls="none", label=label)
            axes[0].annotate(f"{m['D']}x{m['P']} {m['lost_s']:.1f}s", (m["t"], m["N"]), textcoords="offset points",
                             xytext=(3, 6 + 9 * (k % 2)), fontsize=7, color=color)
    else:
        starts = [e for e in report["events"] if e.get("source") == "worker" and e.get("event") == "start"]
        for key in ("D", "P"):
            axes[1].step([e["time"] - t0 for e in starts] + [t_end], [e[key] for e in starts] +
                         [starts[-1][key] if starts else 0], where="post", label=key)
    axes[0].set_ylabel("instances")
    axes[0].legend(loc="best", fontsize=7)
    axes[1].set_ylabel("shape in use")
    axes[1].legend(loc="best", fontsize=8)
    for g in sorted({e.get("generation", 0) for e in prog}):  # one line per launch: no line across restarts
        pts = [e for e in prog if e.get("generation", 0) == g]
        axes[2].plot([e["time"] - t0 for e in pts], [e.get("samples_per_s", 0) for e in pts], ".-", color="C0")
        if has_loss:
            lp = [e for e in pts if "loss" in e]
            axes[3].plot([e["time"] - t0 for e in lp], [e["loss"] for e in lp], ".-", color="C1",
                         label="training loss" if g == min(e.get("generation", 0) for e in prog) else None)
    if has_loss:
        val = [e for e in report["events"] if e.get("source") == "worker" and e.get("event") == "validation"
               and "val_loss" in e.get("metrics", {})]
        if val:
            axes[3].plot([e["time"] - t0 for e in val], [e["metrics"]["val_loss"] for e in val], "s", color="C3",
                         label="validation loss")
        axes[3].set_ylabel("loss")
        axes[3].legend(loc="best", fontsize=8)
    axes[2].set_ylabel("samples/s")
    if elastic:
        axes[-1].set_xlabel("wall time (s); dashed: in-place migrations (colour = kind); red: restart downtime")
        lost = report["time_lost_by_kind_s"]
        fig.suptitle(f"parcae run --elastic: {report['num_migrations']} migrations "
                     f"({sum(v for k, v in lost.items() if k != 'restart'):.1f} s), {report['num_restarts']} "
                     f"restarts ({lost.get('restart', 0.0):.1f} s), final step {report['final_step']}")
    else:
        axes[-1].set_xlabel("wall time (s); red: restart downtime (restart fallback)")
        fig.suptitle(f"parcae run: {report['num_restarts']} restarts, {report['time_lost_s']:.1f} s lost, "
                     f"final step {report['final_step']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------------------------------------------
def main(argv: Optional[Sequence[str]] = None) -> int:
    """``parcae run``: parse, launch, replay, report.

    Args:
        argv: Arguments (default ``sys.argv[1:]``).

    Returns:
        0 on success; 2 on a configuration error; 1 when the run failed (a worker crashed, the store was
        unreachable, ...). The message goes to stderr; no worker is left running in any case.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        cfg = _config(argv)
    except ParcaeError as exc:
        print(f"parcae run: error: {exc}", file=sys.stderr, flush=True)
        return 2
    launcher = Launcher(cfg)
    atexit.register(launcher.kill_all)
    previous: dict[int, Any] = {}

    def _on_signal(signum: int, frame: Optional[FrameType]) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    in_main = _is_main_thread()
    if in_main:
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, _on_signal)
    try:
        report = launcher.run()
    except (RunFailed, CoordinationError, ConfigurationError) as exc:
        print(f"parcae run: error: {exc}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print("parcae run: interrupted; stopping all workers", file=sys.stderr, flush=True)
        return 130
    finally:
        launcher.kill_all()
        atexit.unregister(launcher.kill_all)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        launcher.store = None
    if cfg.mode == ELASTIC:
        lost = report["time_lost_by_kind_s"]
        kinds = ", ".join(f"{k} {v:.1f} s" for k, v in lost.items() if k != "restart") or "none"
        changes = f"{report['num_migrations']} in-place migrations ({kinds}), {report['num_restarts']} restarts " \
                  f"({lost.get('restart', 0.0):.1f} s lost)"
    else:
        changes = f"{report['num_restarts']} restarts ({report['time_lost_s']:.1f} s lost)"
    print(f"[parcae run] done: final step {report['final_step']}, {report['samples']} samples, "
          f"{report['samples_per_s_overall']:.0f} samples/s overall, {changes}; report: "
          f"{cfg.run_dir / 'report.json'}", flush=True)
    return 0


def _is_main_thread() -> bool:
    import threading  # noqa: PLC0415

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
