"""The restart fallback: stop the whole group and relaunch it at a new size from the last checkpoint.

Problem: under ``--restart-fallback`` every membership change -- and under ``--elastic`` the loss of a whole stage --
restarts the job the way torchrun does: every worker stops (gracefully when it can, so rank 0 writes
``run_dir/ckpt/last.ckpt`` at an agreed step), the launcher picks a shape whose data-parallel width splits the
global batch, starts a new generation of workers that resume from the checkpoint, and measures what the restart
cost. This module is that state machine for one :class:`~lightning_parcae.launch.run.Launcher`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Any

from lightning_parcae.contract import (
    RUN_DIR_ENV,
    RESUME_ENV,
    STORE_ENV,
    JOB_TOKEN_ENV,
    GENERATION_ENV,
    GENERATION_BASE_ENV,
    PIPELINE_ENV,
    MODE_ENV,
    ELASTIC_ENV,
    STALL_ENV,
)
from lightning_parcae.launch.processes import Worker, free_port, initial_members, worker_environment

__all__ = ["Relaunch"]


class Relaunch:
    """Stop-and-relaunch generations of one launcher run.

    Args:
        rt: The :class:`~lightning_parcae.launch.run.Launcher` (workers, store, configuration, events).
    """

    def __init__(self, rt: Any) -> None:
        self.rt = rt

    def shape_for(self, n: int) -> tuple[int, int, int]:
        """(workers, D, P) for ``n`` instances; with a fixed P, instances beyond D*P stay idle.

        D must split the job's global batch, by the rule the elastic path uses
        (:func:`~lightning_parcae.planning.costmodel.batch_splits`): once a worker has reported its global batch B and
        micro-batches M, D is the largest ``<= n // P`` that splits B into D x M; before that (the first launch)
        it is a power of two, as :func:`initial_members` chooses for ``--elastic``.
        """
        if self.rt.cfg.pipeline_stages == "auto":
            return n, 0, 0  # the strategy picks; D, P come back in the workers' events
        p = min(int(self.rt.cfg.pipeline_stages), n)
        if self.rt._batch is None:
            members, _ = initial_members(n, str(p))
            d = members // p
        else:
            from lightning_parcae.planning.costmodel import batch_splits  # noqa: PLC0415

            b, m = self.rt._batch
            d = next((k for k in range(n // p, 0, -1) if batch_splits(b, k, m)), 1)
        return d * p, d, p

    def start_generation(self, n: int) -> None:
        cfg = self.rt.cfg
        self.rt.generation += 1
        workers, d, p = self.shape_for(n)
        self.rt.n, self.rt.shape = n, (d, p)
        ckpt = cfg.run_dir / "ckpt" / "last.ckpt"
        self.rt._resume_step = int(self.rt.latest.get("step", 0)) if ckpt.exists() else 0
        port = free_port()
        logs = cfg.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        self.rt.workers = []
        for rank in range(workers):
            parcae = {
                STORE_ENV: self.rt.store_url, JOB_TOKEN_ENV: self.rt.token, RUN_DIR_ENV: str(cfg.run_dir),
                GENERATION_ENV: str(self.rt.generation), GENERATION_BASE_ENV: str(1000 * self.rt.generation),
                PIPELINE_ENV: cfg.pipeline_stages, MODE_ENV: cfg.mode, ELASTIC_ENV: "0",
            }
            if cfg.stall_timeout_s:
                parcae[STALL_ENV] = f"{cfg.stall_timeout_s:g}"
            if ckpt.exists():
                parcae[RESUME_ENV] = str(ckpt)
            env = worker_environment(os.environ, rank=rank, world=workers, local_rank=rank, local_world=workers,
                                     master_port=port, parcae=parcae)
            log_path = logs / f"gen{self.rt.generation}_rank{rank}.log"
            with open(log_path, "wb") as log:
                proc = subprocess.Popen(cfg.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            self.rt.workers.append(Worker(rank, proc, log_path))
        self.rt._gen_started_at = time.time()
        self.rt._gen_first_step = False
        self.rt.timeline.append({"t": time.time() - self.rt.t0, "N": n, "workers": workers, "D": d, "P": p,
                              "generation": self.rt.generation})
        self.rt.event("launch", generation=self.rt.generation, N=n, workers=workers, D=d, P=p,
                   resume_ckpt=str(ckpt) if ckpt.exists() else None, resume_step=self.rt._resume_step,
                   master_port=port)

    def stop_generation(self, target: int) -> dict[str, Any]:
        """Notice -> graceful stop of the whole group (restart fallback) -> SIGKILL after the grace period."""
        from lightning_parcae.runtime.store import publish  # noqa: PLC0415

        t_req = time.time()
        old_n = self.rt.n
        removed = [w.rank for w in self.rt.workers][target:] if target < len(self.rt.workers) else []
        deadline = t_req + self.rt.cfg.wall_grace_s
        for rank in removed:  # the preempted instances get their notice first
            notice = {"instance": f"rank{rank}", "kind": "preempt", "deadline_s": deadline, "source": "replay",
                      "detail": {"generation": self.rt.generation, "target_n": target}}
            try:
                publish(self.rt.store, f"parcae/run/notice/gen{self.rt.generation}/rank{rank}", notice, self.rt.token)
            except Exception as exc:  # noqa: BLE001 -- a store hiccup must not stop the notice itself
                self.rt.event("store_error", error=str(exc))
            self.rt._signal(self.rt.workers[rank], signal.SIGTERM)
        self.rt.event("notice", generation=self.rt.generation, old_N=old_n, new_N=target, preempted=removed,
                   grace_s=self.rt.cfg.wall_grace_s,
                   note="restart fallback: the whole group stops and relaunches; --elastic changes it in place")
        for w in self.rt.workers:
            if w.rank not in removed:
                self.rt._signal(w, signal.SIGTERM)
        while time.time() < deadline and any(w.alive() for w in self.rt.workers):
            time.sleep(0.05)
        killed = [w.rank for w in self.rt.workers if w.alive()]
        for w in self.rt.workers:
            if w.alive():
                self.rt._signal(w, signal.SIGKILL)
        for w in self.rt.workers:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        self.rt.console.read_events()
        stopped = [e for e in self.rt.events if e.get("source") == "worker" and e.get("event") == "stop"
                   and e.get("generation") == self.rt.generation]
        last_step = max((int(e.get("step", 0)) for e in self.rt.events if e.get("source") == "worker"
                         and e.get("generation") == self.rt.generation), default=0)
        rate = float(self.rt.latest.get("samples_per_s", 0.0) or 0.0)
        self.rt.event("stopped", generation=self.rt.generation, stop_s=time.time() - t_req, killed=killed,
                   graceful=bool(stopped) and not killed, last_step=last_step)
        self.rt.workers = []
        return {"t_request": t_req, "from_generation": self.rt.generation, "old_N": old_n, "new_N": target,
                "stop_s": time.time() - t_req, "killed": killed, "last_step": last_step, "samples_per_s": rate,
                "graceful": bool(stopped) and not killed}

    def finish_restart(self, ev: dict[str, Any]) -> None:
        r = self.rt._pending_restart
        if r is None:
            return
        self.rt._pending_restart = None
        downtime = float(ev["time"]) - r["t_request"]
        redo_steps = max(0, int(r["last_step"]) - int(self.rt._resume_step))
        spb = self.rt.latest.get("samples", 0) / max(1, self.rt.latest.get("step", 1))
        redo_s = redo_steps * spb / r["samples_per_s"] if r["samples_per_s"] > 0 else 0.0
        r.update(downtime_s=downtime, redo_steps=redo_steps, redo_s=redo_s, lost_s=downtime + redo_s,
                 to_generation=self.rt.generation, resume_step=self.rt._resume_step)
        self.rt.restarts.append(r)
        self.rt.event("restart_done", **{k: v for k, v in r.items() if k != "t_request"})

    def start_fallback(self, startup: bool = False) -> None:
        """Stop this launch and relaunch from ``last.ckpt``.

        Args:
            startup: The cause is an initial member lost before the first generation formed: nobody holds state
                worth a checkpoint yet, so the others (stuck in the rendezvous) are stopped at once instead of
                after the grace a checkpointing member would get.
        """
        if self.rt._fallback is not None:
            return
        rate = float(self.rt.latest.get("samples_per_s", 0.0) or 0.0)
        last_step = max((int(e.get("step", 0)) for e in self.rt.events if e.get("source") == "worker"), default=0)
        self.rt._fallback = {"t_request": time.time(), "from_generation": self.rt.launch, "reason": self.rt._fallback_reason,
                          "old_N": int(self.rt.shapes[-1]["N"] or 0) if self.rt.shapes else 0, "last_step": last_step,
                          "samples_per_s": rate,
                          "killed": [], "graceful": True, "startup": startup}
        self.rt.event("fallback", launch=self.rt.launch, reason=self.rt._fallback_reason, last_step=last_step)
        self.rt.console.say(f"FALLBACK: {self.rt._fallback_reason or 'some stage lost every replica'}; waiting for every worker "
                  "to exit, then relaunching from last.ckpt")
        for w in self.rt.workers:  # standbys hold no state: stop them now
            if w.alive() and w.joiner and self.rt.fleet.waiting(w):
                self.rt._signal(w, signal.SIGKILL)
                w.killed = True

    def advance_fallback(self) -> None:
        fb = self.rt._fallback
        assert fb is not None
        alive = [w for w in self.rt.workers if w.alive()]
        if alive and not fb.get("startup") and time.time() < fb["t_request"] + max(10.0, 2.0 * self.rt.cfg.wall_grace_s):
            return
        for w in alive:  # stragglers (stuck on a dead peer): stop them
            self.rt._signal(w, signal.SIGKILL)
            w.killed = True
            fb["killed"].append(w.member)
            fb["graceful"] = False
        for w in alive:
            try:
                w.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        # reap while the fallback is still in progress: the stragglers just killed are not new losses (regression:
        # reaped after it ended, a straggler of a start-up loss started a second fallback, "initial member i0 lost
        # during start-up", for the member parcae run had itself killed)
        self.rt.fleet.reap()
        self.rt._fallback = None
        fb["stop_s"] = time.time() - fb["t_request"]
        self.rt._fallback_seen.clear()
        self.rt._fallback_reason = ""
        self.rt._pending_restart = fb
        self.rt.event("stopped", generation=fb["from_generation"], stop_s=fb["stop_s"], killed=fb["killed"],
                   graceful=fb["graceful"], last_step=fb["last_step"])
        self.rt._need_launch = True
