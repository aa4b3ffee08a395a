"""The restart fallback: stop the whole group and relaunch it at a new size from the last checkpoint.

Problem: under ``--restart-fallback`` every change of the workers' membership -- and under ``--elastic`` the loss of a
whole stage -- restarts the job the way torchrun does (a change of idle instances beyond D x P that leaves the shape
as it is restarts nothing: :meth:`Relaunch.spares_only`): every worker stops (gracefully when it can, so rank 0 writes
``run_dir/ckpt/last.ckpt`` at an agreed step), the launcher picks a shape whose data-parallel width splits the
global batch, starts a new generation of workers that resume from the checkpoint, and measures what the restart
cost. :class:`Relaunch` is that state machine; it works on the run's :class:`~.state.RunState` (the phase changes
through its methods), reads the :class:`~.state.WorkerReports`, and handles processes through a
:class:`~.processes.WorkerControl` -- it never sees the launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any, Callable, Optional

from lightning_parcae.contract import worker_contract
from lightning_parcae.launch.config import RunConfig
from lightning_parcae.launch.job_store import StoreLink
from lightning_parcae.launch.processes import (
    Worker,
    WorkerControl,
    free_port,
    initial_members,
    start_worker_process,
    worker_environment,
)
from lightning_parcae.launch.state import EventSink, RunState, WorkerReports

__all__ = ["Relaunch"]


class Relaunch:
    """Stop-and-relaunch generations of one launcher run.

    Args:
        cfg: The run's options.
        state: The run's state; this part may change ``generation``/``n``/``shape`` (through
            :meth:`~.state.RunState.launched`), ``pending_restart``, ``fallback``, ``restarts`` and ``timeline``.
        reports: What the workers reported (read only).
        pool: The worker processes (the restart fallback replaces ``pool.workers`` per generation).
        store: The run's store (URL and token for the workers, notices).
        events: The launcher's event log.
        say: Prints one console line.
        refresh: Reads the event log's new lines (the launcher's reading, which may finish a pending restart).
    """

    def __init__(self, cfg: RunConfig, state: RunState, reports: WorkerReports, pool: WorkerControl, store: StoreLink,
                 events: EventSink, say: Callable[[str], None], refresh: Callable[[], None]) -> None:
        self.cfg, self.state, self.reports, self.pool = cfg, state, reports, pool
        self.store, self.events, self.say, self.refresh = store, events, say, refresh

    def shape_for(self, n: int) -> tuple[int, int, int]:
        """(workers, D, P) for ``n`` instances; with a fixed P, instances beyond D*P stay idle.

        D must split the job's global batch, by the rule the elastic path uses
        (:func:`~lightning_parcae.planning.costmodel.batch_splits`): once a worker has reported its global batch B and
        micro-batches M, D is the largest ``<= n // P`` that splits B into D x M; before that (the first launch)
        it is a power of two, as :func:`initial_members` chooses for ``--elastic``.
        """
        if self.cfg.pipeline_stages == "auto":
            return n, 0, 0  # the strategy picks; D, P come back in the workers' events
        p = min(int(self.cfg.pipeline_stages), n)
        if self.reports.batch is None:
            members, _ = initial_members(n, str(p))
            d = members // p
        else:
            from lightning_parcae.planning.costmodel import largest_split  # noqa: PLC0415

            b, m = self.reports.batch
            d = largest_split(b, n // p, m)
        return d * p, d, p

    def spares_only(self, target: int) -> bool:
        """Whether a change of the trace to ``target`` instances leaves the running generation as it is: none of
        its workers is removed (the trace removes the newest instances first: those beyond D x P) and ``target``
        gives the same shape. Always False with ``auto`` (every instance is a worker there)."""
        st = self.state
        if self.cfg.pipeline_stages == "auto" or not self.pool.workers or st.shape == (0, 0):
            return False
        workers, d, p = self.shape_for(target)
        return target >= len(self.pool.workers) and workers == len(self.pool.workers) and (d, p) == tuple(st.shape)

    def fewest_instances(self) -> int:
        """The fewest instances a generation of the restart fallback can run on: its fixed P (every generation
        keeps ``--pipeline-stages``; on fewer the script's P would not divide the world), or what a fallback said
        the model needs, whichever is more; 1 for ``auto``.

        Regression (issue 21, the GPT-1.5B replay of lh_80_90 at N <= 10): at a dip to 5 instances with P = 6
        the relaunch started 5 workers, which failed at once ("pipeline_stages=6 does not divide devices x nodes =
        5") and ended the run; a generation on too few instances now waits, paused, for the trace to come back.
        """
        fixed = 0 if self.cfg.pipeline_stages == "auto" else int(self.cfg.pipeline_stages)
        return max(1, fixed, self.state.min_instances)

    def start_generation(self, n: int) -> None:
        """Start the next generation of the restart fallback for ``n`` instances (resuming from ``last.ckpt``)."""
        cfg, st = self.cfg, self.state
        generation = st.generation + 1
        workers, d, p = self.shape_for(n)
        st.n, st.shape = n, (d, p)
        ckpt, ckpt_step = cfg.resume_checkpoint()
        resume_step = (int(self.reports.latest.get("step", 0)) if ckpt_step is None else ckpt_step) if ckpt else 0
        port = free_port()
        logs = cfg.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.pool.workers = []  # appended one by one: a failed start leaves the ones started for kill_all
        for rank in range(workers):
            parcae = worker_contract(
                elastic=False, store=self.store.url, token=self.store.token, run_dir=cfg.run_dir,
                generation=generation, pipeline_stages=cfg.pipeline_stages, mode=cfg.mode,
                stall_s=cfg.stall_timeout_s, resume=ckpt, checkpoint_dir=cfg.checkpoint_dir,
                max_instances=cfg.max_instances,
            )
            env = worker_environment(os.environ, rank=rank, world=workers, local_rank=rank, local_world=workers,
                                     master_port=port, parcae=parcae)
            log_path = logs / f"gen{generation}_rank{rank}.log"
            self.pool.workers.append(Worker(rank, start_worker_process(cfg.command, env, log_path), log_path))
        st.launched(generation=generation, resume_step=resume_step, instances=n, now=time.time())
        st.mark(n, workers, d, p, generation)
        self.events("launch", generation=generation, N=n, workers=workers, D=d, P=p,
                    resume_ckpt=str(ckpt) if ckpt else None, resume_step=resume_step, master_port=port)

    def stop_generation(self, target: int) -> dict[str, Any]:
        """Notice -> graceful stop of the whole group (restart fallback) -> SIGKILL after the grace period.

        Returns:
            The restart's record (its cost is completed by :meth:`finish_restart`).
        """
        st, pool = self.state, self.pool
        t_req = time.time()
        old_n = st.n
        removed = [w.rank for w in pool.workers][target:] if target < len(pool.workers) else []
        deadline = t_req + self.cfg.wall_grace_s
        for rank in removed:  # the preempted instances get their notice first
            notice = {"instance": f"rank{rank}", "kind": "preempt", "deadline_s": deadline, "source": "replay",
                      "detail": {"generation": st.generation, "target_n": target}}
            try:
                self.store.publish(f"parcae/run/notice/gen{st.generation}/rank{rank}", notice)
            except Exception as exc:  # noqa: BLE001 -- a store hiccup must not stop the notice itself
                self.events("store_error", error=str(exc))
            pool.signal(pool.workers[rank], signal.SIGTERM)
        self.events("notice", generation=st.generation, old_N=old_n, new_N=target, preempted=removed,
                    grace_s=self.cfg.wall_grace_s,
                    note="restart fallback: the whole group stops and relaunches; --elastic changes it in place")
        for w in pool.workers:
            if w.rank not in removed:
                pool.signal(w, signal.SIGTERM)
        while time.time() < deadline and any(w.alive() for w in pool.workers):
            time.sleep(0.05)
        killed = [w.rank for w in pool.workers if w.alive()]
        for w in pool.workers:
            if w.alive():
                pool.signal(w, signal.SIGKILL)
        for w in pool.workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.refresh()
        events = self.reports.events
        stopped = [e for e in events if e.get("source") == "worker" and e.get("event") == "stop"
                   and e.get("generation") == st.generation]
        last_step = max((int(e.get("step", 0)) for e in events if e.get("source") == "worker"
                         and e.get("generation") == st.generation), default=0)
        rate = float(self.reports.latest.get("samples_per_s", 0.0) or 0.0)
        self.events("stopped", generation=st.generation, stop_s=time.time() - t_req, killed=killed,
                    graceful=bool(stopped) and not killed, last_step=last_step)
        pool.workers = []
        return {"t_request": t_req, "from_generation": st.generation, "old_N": old_n, "new_N": target,
                "stop_s": time.time() - t_req, "killed": killed, "last_step": last_step, "samples_per_s": rate,
                "graceful": bool(stopped) and not killed}

    def finish_restart(self, ev: dict[str, Any]) -> Optional[dict[str, Any]]:
        """The new generation reported its first step (``ev``): complete the pending restart's cost and record it.

        Returns:
            The restart's record, or None when no restart was pending.
        """
        st = self.state
        r = st.pending_restart
        if r is None:
            return None
        st.pending_restart = None
        latest = self.reports.latest
        downtime = float(ev["time"]) - r["t_request"]
        redo_steps = max(0, int(r["last_step"]) - int(st.resume_step))
        spb = latest.get("samples", 0) / max(1, latest.get("step", 1))
        redo_s = redo_steps * spb / r["samples_per_s"] if r["samples_per_s"] > 0 else 0.0
        r.update(downtime_s=downtime, redo_steps=redo_steps, redo_s=redo_s, lost_s=downtime + redo_s,
                 to_generation=st.generation, resume_step=st.resume_step)
        st.restarts.append(r)
        self.events("restart_done", **{k: v for k, v in r.items() if k != "t_request"})
        return r

    def start_fallback(self, reason: Optional[str] = None, startup: bool = False) -> None:
        """Stop this launch and relaunch from ``last.ckpt`` (nothing if a fallback is already in progress).

        Args:
            reason: Why (default: the reason the workers reported, ``state.fallback_reason``).
            startup: The cause is an initial member lost before the first generation formed: nobody holds state
                worth a checkpoint yet, so the others (stuck in the rendezvous) are stopped at once instead of
                after the grace a checkpointing member would get.
        """
        st = self.state
        if st.fallback is not None:
            return
        if reason is not None:
            st.fallback_reason = reason
        reports = self.reports
        rate = float(reports.latest.get("samples_per_s", 0.0) or 0.0)
        last_step = max((int(e.get("step", 0)) for e in reports.events if e.get("source") == "worker"), default=0)
        st.begin_fallback({"t_request": time.time(), "from_generation": st.launch, "reason": st.fallback_reason,
                           "old_N": int(reports.shapes[-1]["N"] or 0) if reports.shapes else 0,
                           "last_step": last_step, "samples_per_s": rate, "killed": [], "graceful": True,
                           "startup": startup})
        self.events("fallback", launch=st.launch, reason=st.fallback_reason, last_step=last_step)
        self.say(f"FALLBACK: {st.fallback_reason or 'some stage lost every replica'}; waiting for every worker "
                 f"to exit, then relaunching from {self.cfg.checkpoint_dir or 'last.ckpt'}"
                 + (" (its newest complete checkpoint)" if self.cfg.checkpoint_dir else ""))
        for w in self.pool.workers:  # standbys and start-up candidates hold no state: stop them now
            if w.alive() and (w.candidate or w.joiner and reports.waiting(w)):
                self.pool.signal(w, signal.SIGKILL)
                w.killed = True

    def stop_stragglers(self) -> bool:
        """Advance the fallback in progress: once every worker exited -- or its grace is over, when the stragglers
        (stuck on a dead peer) are killed -- return True; the caller then reaps the exits and calls
        :meth:`end_fallback`."""
        fb = self.state.fallback
        if fb is None:
            raise ValueError("stop_stragglers: no fallback in progress")
        alive = [w for w in self.pool.workers if w.alive()]
        if alive and not fb.get("startup") and time.time() < fb["t_request"] + max(10.0, 2.0 * self.cfg.wall_grace_s):
            return False
        for w in alive:
            self.pool.signal(w, signal.SIGKILL)
            w.killed = True
            fb["killed"].append(w.member)
            fb["graceful"] = False
        for w in alive:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        return True

    def end_fallback(self) -> None:
        """Every worker of the fallback is stopped and reaped: record the stop; a relaunch is due
        (:meth:`~.state.RunState.end_fallback`)."""
        fb = self.state.end_fallback()
        fb["stop_s"] = time.time() - fb["t_request"]
        self.events("stopped", generation=fb["from_generation"], stop_s=fb["stop_s"], killed=fb["killed"],
                    graceful=fb["graceful"], last_step=fb["last_step"])
