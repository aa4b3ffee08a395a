"""``parcae run``: a one-machine spot cluster -- N worker processes, optionally replaying an availability trace.

Problem: Parcae's value shows only when instances come and go, and trying that on real spot instances is slow and
costly. ``parcae run`` turns one machine into a small cluster: it hosts the coordination store on loopback, creates
the job token, starts one worker process per instance (one per GPU when there are GPUs) with torchrun-compatible
environment variables, and -- with ``--trace`` -- replays a spot-availability trace, time-compressed, by sending
preemption notices (SIGTERM, plus a signed record in the store), killing instances after the grace period, and
adding new ones.

What happens on a membership change TODAY is the *restart fallback*: in-place live reconfiguration (issue 4) is not
implemented yet, so, like a torchrun-style elastic job, the launcher stops the whole group (gracefully: the notice
lets every rank agree on a stop step and rank 0 write ``run_dir/ckpt/last.ckpt``, see
:class:`~lightning_parcae.callbacks.ParcaeRunCallback`) and relaunches it at the new size, resuming from that
checkpoint (``PARCAE_RESUME_CKPT``). The time each restart costs is measured and reported; it is the baseline that
issue 4's in-place migration will replace.

Usage::

    python -m lightning_parcae.run --instances 3 --trace hh_55_65 -- python examples/train_run.py --max-steps 3000

Outputs in the run directory: ``events.jsonl`` (launcher and worker events), ``logs/gen<G>_rank<R>.log``,
``ckpt/last.ckpt``, ``report.json`` and ``report.png``.
"""

from __future__ import annotations

import argparse
import atexit
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

from lightning_parcae.callbacks import WRONG_TOKEN_EXIT, append_event
from lightning_parcae.errors import ConfigurationError, CoordinationError, ParcaeError

__all__ = ["build_parser", "main", "RunConfig", "Launcher", "host_capacity", "scale_counts"]

MODE = "restart-fallback"
"""How membership changes are handled today (issue 4's in-place migration will replace it)."""
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
        "availability trace (membership changes use the restart fallback until in-place migration lands).",
        epilog="example: parcae run --instances 3 --trace hh_55_65 -- python examples/train_run.py --max-steps 3000",
    )
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
                   "to workers as PARCAE_PIPELINE_STAGES")
    p.add_argument("--run-dir", default=None, help="run directory (default ./parcae_runs/<timestamp>)")
    p.add_argument("--store-host", default="127.0.0.1", help="address the hosted store binds to (loopback only)")
    p.add_argument("--store", default=None,
                   help="use an existing store instead of hosting one: tcp://HOST:PORT or etcd://HOST:PORT/PREFIX")
    p.add_argument("--store-timeout", type=float, default=10.0, help="seconds to reach the store (default 10)")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="seconds a generation may take to report its first step (default 120)")
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
    if not ns.grace >= 0:
        raise ConfigurationError(f"--grace must be >= 0, got {ns.grace}")
    max_inst = ns.instances if ns.max_instances is None else ns.max_instances
    if max_inst < 1:
        raise ConfigurationError(f"--max-instances must be >= 1, got {max_inst}")
    cap = host_capacity()
    need = max(ns.instances, max_inst) if ns.trace is None else max_inst
    if need > cap:
        raise ConfigurationError(
            f"more instances than the machine can host: {need} requested, this machine hosts at most {cap} (one per "
            "GPU, or two per CPU core); lower --instances/--max-instances"
        )
    if ns.pipeline_stages != "auto" and not (ns.pipeline_stages.isdigit() and int(ns.pipeline_stages) >= 1):
        raise ConfigurationError(f"--pipeline-stages must be a positive integer or 'auto', got {ns.pipeline_stages!r}")
    run_dir = Path(ns.run_dir or os.path.join("parcae_runs", time.strftime("%Y%m%d-%H%M%S"))).resolve()
    cfg = RunConfig(
        instances=ns.instances, command=command, run_dir=run_dir, trace=ns.trace, time_scale=ns.time_scale,
        interval_s=ns.interval, grace_s=ns.grace, max_instances=max_inst, pipeline_stages=ns.pipeline_stages,
        store_host=ns.store_host, store_url=ns.store, store_timeout_s=ns.store_timeout,
        startup_timeout_s=ns.startup_timeout, progress_every_s=ns.progress_every, plot=not ns.no_plot,
    )
    if ns.trace is not None:
        cfg.trace_counts, cfg.schedule = _load_schedule(ns.trace, ns.interval, max_inst)
        if not any(cfg.schedule):
            raise ConfigurationError(f"trace {ns.trace!r} never has any instance: nothing to run")
    return cfg


def _load_schedule(name: str, interval_s: float, cap: int) -> tuple[list[int], list[int]]:
    from lightning_parcae.traces import BUNDLED_TRACES, bundled_trace_path, load_trace  # noqa: PLC0415

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
        append_event(self.cfg.run_dir, {"source": "launcher", "event": kind, "mode": MODE,
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
                rate = ev.get("samples_per_s", self.latest.get("samples_per_s", 0.0))
                if ev.get("event") != "progress" and ev.get("generation") == self.latest.get("generation"):
                    rate = self.latest.get("samples_per_s", 0.0)  # only progress events carry a fresh rate
                self.latest = {**ev, "samples_per_s": rate}
                if ev.get("generation") == self.generation and ev.get("event") in ("progress", "checkpoint", "end",
                                                                                   "stop"):
                    if ev.get("step", 0) > self._resume_step and not self._gen_first_step:
                        self._gen_first_step = True
                        self._finish_restart(ev)

    # ------------------------------------------------------------------------------------------------ workers
    def _shape_for(self, n: int) -> tuple[int, int, int]:
        """(workers, D, P) for ``n`` instances; with a fixed P, instances beyond D*P stay idle."""
        if self.cfg.pipeline_stages == "auto":
            return n, 0, 0  # the strategy picks; D, P come back in the workers' events
        p = min(int(self.cfg.pipeline_stages), n)
        d = n // p
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
        base = {k: v for k, v in os.environ.items() if k not in ("PARCAE_RESUME_CKPT",)}
        self.workers = []
        for rank in range(workers):
            env = {
                **base,
                "RANK": str(rank), "WORLD_SIZE": str(workers), "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": str(workers), "GROUP_RANK": "0", "NODE_RANK": "0",
                "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                "PARCAE_STORE": self.store_url, "PARCAE_JOB_TOKEN": self.token, "PARCAE_RUN_DIR": str(cfg.run_dir),
                "PARCAE_GENERATION": str(self.generation), "PARCAE_GENERATION_BASE": str(1000 * self.generation),
                "PARCAE_PIPELINE_STAGES": cfg.pipeline_stages, "PARCAE_MODE": MODE,
            }
            env.setdefault("OMP_NUM_THREADS", "1")
            if ckpt.exists():
                env["PARCAE_RESUME_CKPT"] = str(ckpt)
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
            self._signal(w, signal.SIGKILL)  # also reaps grandchildren left in the group
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass

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
        d, p = (ev.get("D"), ev.get("P")) if current else self.shape
        state = "" if current or not self.workers else " (starting)"
        lost = sum(r["lost_s"] for r in self.restarts)
        print(f"[parcae run {now - self.t0:6.1f}s] N={self.n} DxP={d}x{p} gen={self.generation} "
              f"step={ev.get('step', 0)} samples/s={float(ev.get('samples_per_s', 0.0)) if current else 0.0:.0f} "
              f"restarts={len(self.restarts)} time_lost={lost:.1f}s{state}", file=self.out, flush=True)

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
                   trace=cfg.trace, time_scale=cfg.time_scale, schedule=cfg.schedule)
        print(f"[parcae run] run dir {cfg.run_dir}; store {self.store_url}; membership changes use the restart "
              "fallback (stop all, checkpoint, relaunch) until in-place migration (issue 4) lands",
              file=self.out, flush=True)
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
        report = {
            "mode": MODE,
            "command": cfg.command,
            "run_dir": str(cfg.run_dir),
            "trace": {"name": cfg.trace, "time_scale": cfg.time_scale, "interval_s": cfg.interval_s,
                      "wall_interval_s": cfg.wall_interval_s, "trace_counts": cfg.trace_counts,
                      "instances_per_interval": cfg.schedule} if cfg.trace else None,
            "static_instances": None if cfg.trace else cfg.instances,
            "timeline": self.timeline,
            "restarts": self.restarts,
            "num_restarts": len(self.restarts),
            "time_lost_s": sum(r["lost_s"] for r in self.restarts),
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


def _plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, axes = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    tl = report["timeline"]
    t_end = report["wall_s"]
    tr = report["trace"]
    if tr:
        xs = [k * tr["wall_interval_s"] for k in range(len(tr["instances_per_interval"]))]
        axes[0].step(xs, tr["instances_per_interval"], where="post", label="available (trace, scaled)")
    axes[0].step([e["t"] for e in tl] + [t_end], [e["N"] for e in tl] + [tl[-1]["N"] if tl else 0], where="post",
                 label="instances in use")
    for r in report["restarts"]:
        axes[0].axvspan(r["t_request"] - report["events"][0]["time"] if report["events"] else 0,
                        (r["t_request"] - (report["events"][0]["time"] if report["events"] else 0)) + r["downtime_s"],
                        color="red", alpha=0.2)
    axes[0].set_ylabel("instances")
    axes[0].legend(loc="best", fontsize=8)
    t0 = report["events"][0]["time"] if report["events"] else 0.0
    starts = [e for e in report["events"] if e.get("source") == "worker" and e.get("event") == "start"]
    axes[1].step([e["time"] - t0 for e in starts] + [t_end], [e["D"] for e in starts] + [starts[-1]["D"] if starts
                 else 0], where="post", label="D")
    axes[1].step([e["time"] - t0 for e in starts] + [t_end], [e["P"] for e in starts] + [starts[-1]["P"] if starts
                 else 0], where="post", label="P")
    axes[1].set_ylabel("shape in use")
    axes[1].legend(loc="best", fontsize=8)
    prog = [e for e in report["events"] if e.get("source") == "worker" and e.get("event") == "progress"]
    for g in sorted({e.get("generation", 0) for e in prog}):  # one line per generation: no line across restarts
        pts = [e for e in prog if e.get("generation", 0) == g]
        axes[2].plot([e["time"] - t0 for e in pts], [e.get("samples_per_s", 0) for e in pts], ".-", color="C0")
    axes[2].set_ylabel("samples/s")
    axes[2].set_xlabel("wall time (s); red: restart downtime (restart fallback)")
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
    print(f"[parcae run] done: final step {report['final_step']}, {report['samples']} samples, "
          f"{report['samples_per_s_overall']:.0f} samples/s overall, {report['num_restarts']} restarts "
          f"({report['time_lost_s']:.1f} s lost); report: {cfg.run_dir / 'report.json'}", flush=True)
    return 0


def _is_main_thread() -> bool:
    import threading  # noqa: PLC0415

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
