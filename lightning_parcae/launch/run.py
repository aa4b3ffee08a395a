"""``parcae run``: a one-machine spot cluster -- N worker processes, optionally replaying an availability trace.

Problem: Parcae's value shows only when instances come and go, and trying that on real spot instances is slow and
costly. ``parcae run`` turns one machine into a small cluster: it hosts the coordination store on loopback, creates
the job token, starts one worker process per instance (one per GPU when there are GPUs) with torchrun-compatible
environment variables, and -- with ``--trace`` -- replays a spot-availability trace, time-compressed, by sending
preemption notices, killing instances after the grace period, and adding new ones.

Two ways to handle a membership change:

* ``--elastic`` (the default): *live reconfiguration in place* (:mod:`lightning_parcae.runtime.elastic`). Workers
  run with ``PARCAE_ELASTIC=1``. Every instance of a launch starts as a start-up candidate; the first generation is
  formed by a roster the launcher writes once the candidates have imported and connected
  (:mod:`lightning_parcae.launch.startup`), so one noticed, lost or silent before it is simply left out. A removed instance gets a notice (SIGTERM, and a ``parcae/notice/<member>`` key in
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

Structure: the :class:`Launcher` owns the run's state -- the phase and shared facts in a
:class:`~lightning_parcae.launch.state.RunState` (an explicit phase machine: PENDING, STARTING, RUNNING, PAUSED,
FALLBACK, FINISHED), what the workers reported in :class:`~lightning_parcae.launch.state.WorkerReports`, the processes
in a :class:`~lightning_parcae.launch.processes.WorkerPool`, the store in a
:class:`~lightning_parcae.launch.job_store.JobStore` -- and runs one loop per mode that calls the steps of its parts:
:class:`~lightning_parcae.launch.fleet.Fleet` (``--elastic``), :class:`~lightning_parcae.launch.relaunch.Relaunch`
(stop and relaunch) and :class:`~lightning_parcae.launch.console.Console` (lines and the report; it only reads). Each
part gets those objects, never the launcher. The launcher alone acts on what the event log says (a generation's
first step completes a pending restart; the job's end finishes the run).

Usage::

    python -m lightning_parcae.launch.run --instances 4 --trace hh_55_65 -- python examples/train_run.py --max-steps 3000

Outputs in the run directory: ``events.jsonl`` (launcher and worker events), ``logs/*.log`` (one per process),
``ckpt/last.ckpt``, ``report.json`` and ``report.png``.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from types import FrameType
from typing import Any, Optional, Sequence, TextIO

from lightning_parcae.contract import WRONG_TOKEN_EXIT, FALLBACK_EXIT, RELEASED_EXIT, FENCED_EXIT
from lightning_parcae.launch.config import DEFAULT_TIME_SCALE as _DEFAULT_TIME_SCALE, RunConfig
from lightning_parcae.launch.console import Console
from lightning_parcae.launch.fleet import Fleet
from lightning_parcae.launch.job_store import JobStore
from lightning_parcae.launch.processes import (
    ELASTIC,
    POLL_S,
    RESTART_FALLBACK,
    RunFailed,
    Worker,
    WorkerPool,
    initial_members,
)
from lightning_parcae.launch.relaunch import Relaunch
from lightning_parcae.launch.state import Phase, RunState, WorkerReports
from lightning_parcae.events import append_event
from lightning_parcae.errors import ConfigurationError, CoordinationError, ParcaeError
from lightning_parcae.runtime.checkpoint_store import checked_location
from lightning_parcae.signals.traces import scale_counts

__all__ = ["build_parser", "main", "RunConfig", "RunFailed", "Launcher", "host_capacity", "scale_counts",
           "initial_members", "ELASTIC", "RESTART_FALLBACK", "FALLBACK_EXIT", "RELEASED_EXIT", "FENCED_EXIT"]

VICTIM_ORDERS = ("newest", "random", "stage", "any")
"""``--victims``: which instances a trace's drop removes (idle standbys first, except under ``any``)."""

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
    p.add_argument("--trace-clock", choices=["launch", "first-step"], default="launch",
                   help="when the trace's time starts: at the launch (default; start-up takes part of the trace, as "
                        "on a real fleet), or when the first generation reports its first training step (a replay "
                        "whose changes must hit training, not start-up, however long start-up takes here)")
    p.add_argument("--grace", type=float, default=120.0,
                   help="preemption notice period in trace seconds, divided by --time-scale (default 120, AWS)")
    p.add_argument("--victims", choices=VICTIM_ORDERS, default="newest",
                   help="which instances a trace's drop removes (always idle standbys first, then training "
                   "members): 'newest' (default; reproducible), 'random' (seeded by --seed: the provider picks, "
                   "as a spot market does, so losses fall on any stage) or 'stage' (the holders of the last "
                   "pipeline stage first, newest first among them: a drop of D or more empties a stage, the "
                   "worst case for a pipeline; the README's job); 'any' (seeded by --seed, standbys NOT first: a "
                   "spot provider does not know which instances train, and the planner's cost model draws "
                   "victims from every instance present the same way)")
    p.add_argument("--seed", type=int, default=0, help="seed of --victims random and any (default 0)")
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
                   help="--elastic: seconds a launch may go without start-up progress (a candidate's arrival, the "
                   "roster, the first step); --restart-fallback: seconds a generation may take to its first step "
                   "(default 120)")
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
    p.add_argument("--emulated-devices", action="store_true",
                   help="the script emulates one accelerator per instance (its compute is modelled time, e.g. "
                   "examples/gpt's device_ms_per_sample; see lightning_parcae.testing.emulated_device), so the "
                   "instances do not share this machine's cores: the runtime's throughput model gets no CPU "
                   "contention term (PARCAE_SHARED_CORES=0)")
    p.add_argument("--checkpoint-dir", default=None, metavar="URL",
                   help="where checkpoints go: a local path, a shared mount, or s3://bucket/prefix, gs://..., az://... "
                   "(fsspec; install the extra lightning-parcae[s3|gcs|azure]); checked before any worker starts, "
                   "resumed from the newest complete checkpoint there whoever wrote it (default: run_dir/ckpt/"
                   "last.ckpt on the disk of the member that is rank 0)")
    p.add_argument("--progress-every", type=float, default=2.0, help="seconds between progress lines")
    p.add_argument("--no-plot", action="store_true", help="skip report.png")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the worker command, e.g. python train.py")
    return p


def host_capacity() -> int:
    """How many instances this machine can host: one per GPU, else two per CPU core."""
    try:
        import torch  # noqa: PLC0415

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        gpus = 0
    return gpus if gpus > 0 else 2 * (os.cpu_count() or 1)


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
    if ns.emulated_devices:  # emulated accelerators sleep through most of a step: four per core stay uncontended
        cap = max(cap, 4 * (os.cpu_count() or 1))
    need = max(ns.instances, max_inst) if ns.trace is None else max_inst
    if need > cap and not ns.oversubscribe:
        raise ConfigurationError(
            f"more instances than the machine can host: {need} requested, this machine hosts at most {cap} (one per "
            "GPU, or two per CPU core; four per core with --emulated-devices); lower --instances/--max-instances (or "
            "pass --oversubscribe)"
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
        emulated_devices=ns.emulated_devices, victims=ns.victims, seed=ns.seed,
        checkpoint_dir=checked_location(ns.checkpoint_dir), trace_clock=ns.trace_clock,
    )
    if ns.trace is not None:
        cfg.trace_counts, cfg.schedule = _load_schedule(ns.trace, ns.interval, max_inst)
        if not any(cfg.schedule):
            raise ConfigurationError(f"trace {ns.trace!r} never has any instance: nothing to run")
    return cfg


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


# ---------------------------------------------------------------------------------------------------------------
# The launcher
# ---------------------------------------------------------------------------------------------------------------
class Launcher:
    """Hosts the store, starts and replaces worker generations, replays the trace and writes the report.

    It owns the run's state and hands each part only what it needs: the :class:`~.state.RunState` (the phase and
    the shared facts), the :class:`~.state.WorkerReports` (what the workers said; written by the console), the
    :class:`~.processes.WorkerPool`, the :class:`~.job_store.JobStore` and its own :meth:`event` log. The run is one
    loop per mode (:meth:`_run_elastic`, :meth:`_run_restart`) that calls the parts' steps.

    Args:
        cfg: Validated options (see :func:`build_parser`).
        out: Where progress lines go.
    """

    def __init__(self, cfg: RunConfig, out: Optional[TextIO] = None) -> None:
        self.cfg = cfg
        self.out: TextIO = out if out is not None else sys.stdout
        self.state = RunState()
        """The run's phase and the facts the parts share."""
        self.reports = WorkerReports()
        """What the workers reported (written by the console only)."""
        self.pool = WorkerPool()
        """The worker processes."""
        self.job_store = JobStore(cfg.store_host, cfg.store_url, cfg.store_timeout_s)
        """The coordination store, its URL and the job token (opened by :meth:`run`)."""
        self.console = Console(cfg, self.state, self.reports, self.pool, self.out)
        """Event log reading, console lines and the report."""
        self.relaunch = Relaunch(cfg, self.state, self.reports, self.pool, self.job_store, self.event,
                                 self.console.say, self._read_events)
        """The stop-and-relaunch state machine (``--restart-fallback``, and fallbacks under ``--elastic``)."""
        self.fleet = Fleet(cfg, self.state, self.reports, self.pool, self.job_store, self.event, self.console.say,
                           self.relaunch, lambda: host_capacity())
        """The ``--elastic`` instance manager."""
        self._trace_t0: Optional[float] = None  # --trace-clock first-step: when the first step was reported

    @property
    def workers(self) -> list[Worker]:
        """The run's worker processes (see :class:`~.processes.WorkerPool`)."""
        return self.pool.workers

    @property
    def shared_units(self) -> int:
        """Processing units the workers of this one-machine cluster share (:func:`.fleet.shared_units`)."""
        return self.fleet.shared_units

    # ------------------------------------------------------------------------------------------------ events
    def event(self, kind: str, /, **fields: Any) -> None:
        """Append a launcher event to ``events.jsonl``."""
        append_event(self.cfg.run_dir, {"source": "launcher", "event": kind, "mode": self.cfg.mode,
                                        "elapsed_s": time.time() - self.state.t0, **fields})

    def _read_events(self) -> None:
        """Read the event log's new lines: the console records each, then the launcher acts on it."""
        for ev in self.console.read_new():
            self.console.record(ev)
            self._observe(ev)

    def _observe(self, ev: dict[str, Any]) -> None:
        """What an event changes in the run: a generation's first step (which completes a pending restart), a
        checkpoint (periodic, or the one the members saved for a fallback), the job's end, a member's reason for a
        fallback."""
        st = self.state
        if ev.get("source") == "worker":
            kind = ev.get("event")
            if kind in ("progress", "checkpoint", "end", "stop") and st.is_first_step(ev.get("generation"),
                                                                                        ev.get("step", 0)):
                self.relaunch.finish_restart(ev)
            if kind == "checkpoint":
                st.last_ckpt_step = int(ev.get("step", 0))
            if kind == "end" and self.cfg.mode == ELASTIC and not st.finished:
                st.finish(time.time())
                self.event("finished", step=ev.get("step"))
        elif ev.get("source") == "elastic" and ev.get("event") == "fallback":
            member = str(ev.get("member", ""))
            if member not in st.fallback_seen:
                st.fallback_seen.add(member)
                st.fallback_reason = str(ev.get("reason", ""))
            if ev.get("min_instances"):
                st.min_instances = int(ev["min_instances"])
            if ev.get("checkpoint") and ev.get("step") is not None:
                # the members saved this checkpoint as they stopped: the relaunch resumes from its step, not from the
                # last periodic one (regression: lh_80_90's relaunch was charged 9 steps of redo it never did)
                st.last_ckpt_step = int(ev["step"])

    # ------------------------------------------------------------------------------------------------ workers
    def kill_all(self) -> None:
        """SIGTERM, then SIGKILL every worker's process group (idempotent; also run at exit)."""
        self.pool.kill_all()

    # ------------------------------------------------------------------------------------------------ main loop
    def trace_elapsed(self) -> float:
        """Wall seconds into the trace: since the launch, or (``--trace-clock first-step``) since the first training
        step was reported (0 until then)."""
        now = time.time()
        if self.cfg.trace_clock != "first-step":
            return now - self.state.t0
        if self._trace_t0 is None:
            if self.state.phase is not Phase.RUNNING:
                return 0.0
            self._trace_t0 = now
            self.event("trace_clock", note="the trace starts now: the first training step was reported")
        return now - self._trace_t0

    def target_at(self, elapsed: float) -> int:
        """Instances the trace asks for ``elapsed`` wall seconds into the run (the last count after it ends)."""
        if not self.cfg.schedule:
            return self.cfg.instances
        k = min(int(elapsed / self.cfg.wall_interval_s), len(self.cfg.schedule) - 1)
        return self.cfg.schedule[k]

    def run(self) -> dict[str, Any]:
        """Run the job to completion; returns the report (also written to ``report.json``).

        Raises:
            RunFailed: A worker failed; every other worker has been stopped.
            CoordinationError: The store could not be hosted or reached.
        """
        cfg = self.cfg
        cfg.run_dir.mkdir(parents=True, exist_ok=True)
        (cfg.run_dir / "events.jsonl").unlink(missing_ok=True)
        self.state.t0 = time.time()
        self.job_store.open()
        self.event("run_start", command=shlex.join(cfg.command), store=self.job_store.url, instances=cfg.instances,
                   trace=cfg.trace, time_scale=cfg.time_scale, schedule=cfg.schedule, grace_s=cfg.wall_grace_s,
                   interval_s=cfg.wall_interval_s)
        if cfg.mode == ELASTIC:
            print(f"[parcae run] run dir {cfg.run_dir}; store {self.job_store.url}; membership changes are live "
                  "reconfigurations in place (--elastic); a stage with no live replica restarts from "
                  f"{cfg.checkpoint_dir or 'last.ckpt'}",
                  file=self.out, flush=True)
            self._run_elastic()
            self.console.progress(force=True, instances=len(self.fleet.instances))
            self.event("run_end", restarts=len(self.state.restarts), migrations=len(self.reports.migrations))
            return self.report()
        print(f"[parcae run] run dir {cfg.run_dir}; store {self.job_store.url}; membership changes use the restart "
              "fallback (stop all, checkpoint, relaunch)", file=self.out, flush=True)
        self._run_restart()
        self.console.progress(force=True)
        self.event("run_end", restarts=len(self.state.restarts))
        return self.report()

    def _run_elastic(self) -> None:
        """``--elastic``: one loop over the fleet's steps until the job ended and every process exited."""
        cfg, st, fleet, pool = self.cfg, self.state, self.fleet, self.pool
        n0 = self.target_at(0.0)
        fleet.add_instances(n0)
        st.mark(n0, n0, 0, 0, -1, t=0.0)
        if not n0:
            self.event("paused", reason="no instances available")
        while True:
            if st.phase is Phase.PENDING and fleet.instances:
                fleet.launch_when_enough()
            time.sleep(POLL_S)
            self._read_events()
            fleet.reap()
            fleet.enforce_deadlines()
            fleet.form_roster()
            if st.fallback is not None and self.relaunch.stop_stragglers():
                # reap while the fallback is still in progress: the stragglers just killed are not new losses
                # (regression: reaped after it ended, a straggler of a start-up loss started a second fallback,
                # "initial member i0 lost during start-up", for the member parcae run had itself killed)
                fleet.reap()
                self.relaunch.end_fallback()
            alive = [w for w in pool.workers if w.alive()]
            fleet.check_members_left(alive)
            if st.finished:
                if not alive:
                    break
                fleet.drain(alive)
                continue
            if not alive and st.training and not fleet.waiting():  # a launch that waits may lose every candidate
                time.sleep(0.5)
                self._read_events()
                if not st.finished:
                    raise pool.failure("parcae run failed: every worker exited but training did not finish",
                                       fleet.this_launch()[:2])
                break
            target = self.target_at(self.trace_elapsed())
            if target != len(fleet.instances):
                fleet.change(target)
            if st.phase is Phase.STARTING and time.time() - fleet.startup_progress_at() > cfg.startup_timeout_s:
                pool.kill_all()
                raise pool.failure(f"parcae run failed: launch {st.launch} made no start-up progress (no candidate "
                                   f"arrived, no roster, no training step) for {cfg.startup_timeout_s:g} s; if the "
                                   "machine is merely slow, raise --startup-timeout",
                                   fleet.this_launch(joiners=False)[:1])
            self.console.progress(instances=len(fleet.instances))
        self._read_events()
        fleet.reap()  # the exits seen by the last check
        self.console.flush_migrations()

    def _run_restart(self) -> None:
        """``--restart-fallback``: every change of the trace stops the generation and relaunches it."""
        cfg, st, pool = self.cfg, self.state, self.pool
        n0 = self.target_at(0.0)
        if n0 and n0 >= self.relaunch.fewest_instances():
            self.relaunch.start_generation(n0)  # (too few: the loop's first change pauses, saying why)
        lost_relaunches = 0
        while True:
            time.sleep(POLL_S)
            self._read_events()
            elapsed = self.trace_elapsed()
            if pool.workers:
                codes = [w.proc.poll() for w in pool.workers]
                bad = [w for w, c in zip(pool.workers, codes) if c not in (None, 0)]
                lost = [w for w in bad if w.proc.returncode < 0]
                if lost and lost_relaunches < cfg.max_restarts:
                    # a worker died by a signal nobody here sent: a lost instance. The others cannot go on without
                    # it (no live reconfiguration here): stop the generation and relaunch it from last.ckpt
                    lost_relaunches += 1
                    self.event("lost", ranks=[w.rank for w in lost], rc=[w.proc.returncode for w in lost],
                               count=lost_relaunches, max_restarts=cfg.max_restarts)
                    print(f"[parcae run] worker(s) {[w.rank for w in lost]} died by signal "
                          f"{[-int(w.proc.returncode) for w in lost]}: relaunching generation {st.generation + 1} "
                          "from last.ckpt", file=self.out, flush=True)
                    st.pending_restart = self.relaunch.stop_generation(st.n)
                    self.relaunch.start_generation(st.n)
                    continue
                if bad and all(w.proc.returncode == FALLBACK_EXIT for w in bad) and self._relaunch_for_batch():
                    continue
                if bad:
                    misfit = self._batch_misfit()
                    if any(w.proc.returncode == WRONG_TOKEN_EXIT for w in bad):
                        why = "a worker rejected the job token (wrong or missing PARCAE_JOB_TOKEN)"
                    elif misfit is not None:
                        b, m, d = misfit
                        why = (f"the global batch {b} does not split over the D={d} pipelines of M={m} micro-batches "
                               "the workers chose, and with --pipeline-stages auto the restart fallback cannot choose "
                               "D for them; give --pipeline-stages P (then it relaunches with a D that splits the "
                               f"batch) or a batch_size divisible by {d * m}")
                    else:
                        why = f"worker(s) {[w.rank for w in bad]} of generation {st.generation} exited with " \
                              f"{[w.proc.returncode for w in bad]}"
                    self.kill_all()
                    raise pool.failure(f"parcae run failed: {why}; stopped all workers", bad)
                if all(c == 0 for c in codes):
                    self._read_events()
                    st.finish(time.time())
                    break
                if st.phase is Phase.STARTING and time.time() - st.started_at > cfg.startup_timeout_s:
                    self.kill_all()
                    raise pool.failure(f"parcae run failed: generation {st.generation} reported no training step "
                                       f"within {cfg.startup_timeout_s:g} s", pool.workers[:1])
            target = self.target_at(elapsed)
            if target != st.n and self.relaunch.spares_only(target):
                self._spare_change(target)
            elif target != st.n:
                if pool.workers:
                    st.pending_restart = self.relaunch.stop_generation(target)
                st.n = target
                fewest = self.relaunch.fewest_instances()
                if target >= fewest:
                    self.relaunch.start_generation(target)
                elif st.phase is not Phase.PAUSED:
                    if st.phase is not Phase.PENDING:
                        st.pause()
                    st.mark(target, 0, 0, 0, st.generation)
                    why = ("no instances available" if target == 0 else
                           f"{target} instance(s), fewer than the {fewest} pipeline stages every generation keeps")
                    self.event("paused", reason=why)
                    print(f"[parcae run] paused: {why}; the job resumes from last.ckpt when the trace has "
                          f"{fewest}", file=self.out, flush=True)
            self.console.progress()

    def _relaunch_for_batch(self) -> bool:
        """``--restart-fallback``: the generation stopped before its first step because its D cannot split the
        global batch its workers reported (``batch_misfit``: the first launch seats D a power of two before the batch
        is known); relaunch it on the same instances with the largest D that splits it. False -- the run fails as
        before -- when no report came or the relaunch would take the same D (``--pipeline-stages auto``: the
        workers choose their shape)."""
        deadline = time.time() + 10.0  # the other workers of the generation stop alike; rank 0 wrote the report
        while time.time() < deadline and any(w.alive() for w in self.pool.workers):
            time.sleep(0.05)
        self._read_events()
        st = self.state
        misfit = self._batch_misfit()
        if misfit is None:
            return False
        b, m, old_d = misfit
        _, d, p = self.relaunch.shape_for(st.n)
        if not d or d == old_d:
            return False
        self.event("batch_relaunch", generation=st.generation, global_batch=b, micro_batches=m, old_D=old_d, D=d, P=p)
        print(f"[parcae run] the global batch {b} does not split over D={old_d} pipelines: relaunching "
              f"generation {st.generation + 1} as {d}x{p}", file=self.out, flush=True)
        st.pending_restart = self.relaunch.stop_generation(st.n)
        self.relaunch.start_generation(st.n)
        return True

    def _batch_misfit(self) -> Optional[tuple[int, int, int]]:
        """(B, M, D) when the running generation's workers reported that D cannot split their global batch."""
        st = self.state
        for e in self.reports.events:
            if e.get("batch_misfit") and e.get("generation") == st.generation:
                return int(e["global_batch"]), int(e.get("micro_batches") or 1), int(e.get("D") or 0)
        return None

    def _spare_change(self, target: int) -> None:
        """``--restart-fallback``: the trace changed only instances beyond the running D x P (none of its workers
        leaves, and the new count gives the same shape): the generation keeps training, nothing relaunches.

        Regression (issue 21, the restart fallback's replay of the p3 segments at P = 6 on 6-10 instances): every
        change of the count stopped and relaunched the job, also 9 -> 10 -> 8 -> 7 -> 6, where it ran 1 x 6 before
        and after each change and the instances that came and went were idle.
        """
        st = self.state
        self.event("spare_change", generation=st.generation, old_N=st.n, new_N=target, D=st.shape[0],
                   P=st.shape[1], note="only instances beyond D x P changed: the generation keeps running")
        print(f"[parcae run] {st.n} -> {target} instances: only idle instances beyond D x P = "
              f"{st.shape[0]} x {st.shape[1]} changed; generation {st.generation} keeps running",
              file=self.out, flush=True)
        st.n = target
        st.mark(target, st.shape[0] * st.shape[1], st.shape[0], st.shape[1], st.generation)

    # ------------------------------------------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        """Write ``report.json`` (and ``report.png``) and return the report. (:meth:`console.Console.report`)."""
        return self.console.report()



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
        launcher.job_store.close()
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
