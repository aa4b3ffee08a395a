"""The elastic instance manager of ``parcae run``: one process per live instance, changed in place.

Problem: under ``--elastic`` the launcher plays the cloud. It keeps one worker process per instance, starts added
instances as warm standbys (joiners), delivers preemption notices with a grace period and kills what outlives it,
treats a worker that dies from outside as a lost instance (and starts a fresh standby in its place, up to
``--max-restarts``), restarts members the runtime released or fenced as standbys, relaunches everything from the
checkpoint when a stage lost every replica, and fails the job -- with the worker's log -- when the user's code
fails. This module is that manager for one :class:`~lightning_parcae.launch.run.Launcher`.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from typing import Any

from lightning_parcae.contract import (
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
from lightning_parcae.launch.processes import POLL_S, Worker, free_port, initial_members, worker_environment

__all__ = ["Fleet"]


class Fleet:
    """Instances and their worker processes of one ``--elastic`` launcher run.

    Args:
        rt: The :class:`~lightning_parcae.launch.run.Launcher` (configuration, store, events, console).
    """

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self._slots: dict[int, int] = {}  # instance -> device slot (LOCAL_RANK), see device_slot
        self._victim_rng = random.Random(int(rt.cfg.seed))  # --victims random

    def member_name(self, instance: int) -> str:
        c = self.rt._incarnations.get(instance, -1) + 1
        self.rt._incarnations[instance] = c
        return f"i{instance}" if c == 0 else f"i{instance}.{c}"

    def device_slot(self, instance: int) -> int:
        """This machine's device index for a new process of ``instance`` (its ``LOCAL_RANK``).

        Regression: every joiner was started with ``LOCAL_RANK=0``, so on a multi-GPU machine all warm standbys --
        and, once admitted, the members they became -- trained on ``cuda:0`` next to the first member. A device
        belongs to the instance, not to a rank (ranks change at every reconfiguration while a process cannot
        change its device): an instance keeps its slot across its restarts, and a new instance takes the lowest
        slot that neither another instance of the cluster nor a still-running worker of a removed one holds
        (``--max-instances`` slots in all; past that, a departing worker's slot is shared until it exits).
        """
        slots = self._slots
        if instance in slots:
            return slots[instance]
        busy = {slots[w.instance] for w in self.rt.workers
                if w.alive() and w.instance != instance and w.instance in slots}
        held = {slots[k] for k in self.rt.instances if k != instance and k in slots}
        free = [k for k in range(self.rt.cfg.max_instances) if k not in busy | held] or \
            [k for k in range(self.rt.cfg.max_instances) if k not in held] or [0]
        slots[instance] = free[0]
        return free[0]

    def spawn(self, instance: int, *, join: bool, rank: int = 0, world: int = 1, p: int = 1,
               resume: bool = False) -> Worker:
        """Start one worker process for ``instance``: an initial member of a (re)launch, or a joiner."""
        cfg = self.rt.cfg
        member = self.member_name(instance)
        slot = self.device_slot(instance)
        parcae = {
            ELASTIC_ENV: "1", STORE_ENV: self.rt.store_url, JOB_TOKEN_ENV: self.rt.token,
            MEMBER_ENV: member, JOIN_ENV: "1" if join else "0", RUN_DIR_ENV: str(cfg.run_dir),
            GENERATION_ENV: str(self.rt.launch), GENERATION_BASE_ENV: str(1000 * self.rt.launch),
            PIPELINE_ENV: str(p) if p else "auto", MODE_ENV: cfg.mode,
            INTERVAL_ENV: f"{cfg.wall_interval_s:g}",
            # every instance of this one-machine cluster shares its cores (the measured model's contention term)
            SHARED_CORES_ENV: str(self.rt.shared_units),
        }
        if cfg.stall_timeout_s:
            parcae[STALL_ENV] = f"{cfg.stall_timeout_s:g}"
        env = worker_environment(os.environ, rank=rank, world=world, local_rank=slot,
                                 local_world=max(cfg.max_instances, slot + 1), master_port=free_port(), parcae=parcae)
        ckpt = cfg.run_dir / "ckpt" / "last.ckpt"
        if resume and ckpt.exists():
            env[RESUME_ENV] = str(ckpt)
        logs = cfg.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log_path = logs / f"{member}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(cfg.command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        w = Worker(rank if not join else -1, proc, log_path, member=member, instance=instance, joiner=join,
                    launch=self.rt.launch, started=time.time())
        self.rt.workers.append(w)
        self.rt.instances[instance] = w
        return w

    def launch_instances(self) -> None:
        """(Re)launch: the oldest instances as the initial members (D a power of two), the others as joiners."""
        cfg = self.rt.cfg
        ids = sorted(self.rt.instances)
        m, p = initial_members(len(ids), cfg.pipeline_stages)
        self.rt.launch += 1
        self.rt.generation = self.rt.launch
        if self.rt._pending_restart is not None:
            self.rt._pending_restart["new_N"] = len(ids)
        ckpt = cfg.run_dir / "ckpt" / "last.ckpt"
        resume = self.rt.launch > 0 and ckpt.exists()
        self.rt._resume_step = self.rt._last_ckpt_step if resume else 0
        for r, k in enumerate(ids[:m]):
            self.spawn(k, join=False, rank=r, world=m, p=p, resume=resume)
        for k in ids[m:]:
            self.spawn(k, join=True)
        self.rt._gen_started_at = time.time()
        self.rt._gen_first_step = False
        members = [self.rt.instances[k].member for k in ids[:m]]  # type: ignore[union-attr]
        standbys = [self.rt.instances[k].member for k in ids[m:]]  # type: ignore[union-attr]
        self.rt.event("launch", launch=self.rt.launch, generation=self.rt.launch, N=len(ids), members=members,
                   standbys=standbys, P=p or "auto", resume_ckpt=str(ckpt) if resume else None,
                   resume_step=self.rt._resume_step)
        what = "relaunch from last.ckpt" if resume else "launch"
        self.rt.console.say(f"{what} #{self.rt.launch}: {len(ids)} instances, members {members}"
                  + (f", warm standbys {standbys}" if standbys else "") + f" (P={p or 'auto'})")

    def waiting(self, w: Worker) -> bool:
        """A joiner that has not been admitted yet (holds no training state)."""
        return w.joiner and self.rt.phases.get(w.member) in (None, "starting", "standby")

    def notice(self, w: Worker) -> str:
        """Remove ``w``'s instance: notice (store key + SIGTERM), or SIGKILL at once if it is a waiting standby."""
        from lightning_parcae.runtime.liveness import notice_key  # noqa: PLC0415
        from lightning_parcae.runtime.store import publish  # noqa: PLC0415

        now = time.time()
        if self.waiting(w) or self.rt._fallback is not None and w.joiner:
            self.rt._signal(w, signal.SIGKILL)
            w.killed = True
            return "standby stopped"
        w.noticed_at, w.deadline = now, now + self.rt.cfg.wall_grace_s
        try:
            publish(self.rt.store, notice_key(w.member), {"member": w.member, "kind": "preempt", "source": "replay",
                                                       "deadline": w.deadline}, self.rt.token)
        except Exception as exc:  # noqa: BLE001 -- a store hiccup must not stop the notice itself
            self.rt.event("store_error", error=str(exc))
        if w.member in self.rt.phases:  # its handler is installed: SIGTERM is a notice, not a kill
            self.rt._signal(w, signal.SIGTERM)
            w.sigterm_sent = True
        return "notice"

    def _removal_order(self, ids: list[int]) -> list[int]:
        """Instances in the order the trace removes them: those not training in the job (standbys, including
        members released by a shape change and restarted) before members; within each, newest first
        (``--victims newest``) or in a seeded random order (``--victims random``: a spot provider does not pick
        by age, so a drop can take any stage -- two at once can leave a stage short, the case an inter-stage
        migration repairs).

        Regression: a member released by a 4 -> 2 shape change restarts as a standby under its *old* instance
        number, so "newest first" noticed an older training member while the restarted standby (still importing,
        not yet counted by the leader) stayed -- the job found no shape for 1 instance and fell back to the
        checkpoint.
        """
        busy = ("training", "planning", "migrating", "recovering")

        def member(k: int) -> bool:
            w = self.rt.instances.get(k)
            return w is not None and self.rt.phases.get(w.member) in busy

        if self.rt.cfg.victims == "random":
            shuffled = sorted(ids)
            self._victim_rng.shuffle(shuffled)
            rank = {k: i for i, k in enumerate(shuffled)}
            return sorted(ids, key=lambda k: (member(k), rank[k]))
        return sorted(ids, key=lambda k: (member(k), -k))

    def change(self, target: int) -> None:
        """The trace moved to ``target`` instances: notice some (:meth:`_removal_order`), or start joiners."""
        ids = sorted(self.rt.instances)
        cur = len(ids)
        running = self.rt.launch >= 0 and not self.rt._need_launch and self.rt._fallback is None
        if target < cur:
            done = []
            for k in self._removal_order(ids)[: cur - target]:
                w = self.rt.instances.pop(k)
                action = self.notice(w) if w is not None and w.alive() else "no process"
                done.append({"instance": k, "member": w.member if w else None, "action": action})
            self.rt.event("remove", old_N=cur, new_N=target, victims=done, grace_s=self.rt.cfg.wall_grace_s)
            self.rt.changes.append({"t": time.time() - self.rt.t0, "old_N": cur, "new_N": target, "removed": done})
            self.rt.console.say(f"trace: {cur} -> {target} instances: " + ", ".join(
                f"{d['action']} to {d['member']}" if d["action"] == "notice" else f"{d['member']}: {d['action']}"
                for d in done) + (f" (grace {self.rt.cfg.wall_grace_s:.1f} s)" if any(d["action"] == "notice"
                                                                                   for d in done) else ""))
        else:
            added = []
            for _ in range(target - cur):
                k = self.rt._next_instance
                self.rt._next_instance += 1
                self.rt.instances[k] = None
                if running and not self.rt.finished:
                    added.append(self.spawn(k, join=True).member)
                else:
                    added.append(f"i{k}")
            self.rt.event("add", old_N=cur, new_N=target, joiners=added)
            self.rt.changes.append({"t": time.time() - self.rt.t0, "old_N": cur, "new_N": target, "added": added})
            how = "started as warm standby" if running and not self.rt.finished else "will start at the next launch"
            self.rt.console.say(f"trace: {cur} -> {target} instances: new {', '.join(added)} {how}")
        self.rt.n = target
        self.rt.timeline.append({"t": time.time() - self.rt.t0, "N": target, "workers": len(self.rt.instances),
                              "D": self.rt.shapes[-1]["D"] if self.rt.shapes else 0,
                              "P": self.rt.shapes[-1]["P"] if self.rt.shapes else 0, "generation": self.rt.egen})
        if target == 0:
            self.rt.event("paused", reason="no instances available")

    def reap(self) -> None:
        """Account for workers that exited: released ones restart as joiners, 75 starts the fallback, others fail."""
        for w in self.rt.workers:
            if w.handled or w.proc.poll() is None:
                continue
            w.handled = True
            rc = int(w.proc.returncode)
            current = self.rt.instances.get(w.instance) is w
            self.rt.event("exit", member=w.member, instance=w.instance, rc=rc, noticed=w.noticed_at is not None,
                       killed=w.killed)
            if current:
                self.rt.instances[w.instance] = None
            if rc == WRONG_TOKEN_EXIT:
                self.rt.kill_all()
                raise self.rt._fail("parcae run failed: a worker rejected the job token (wrong or missing "
                                 "PARCAE_JOB_TOKEN); stopped all workers", [w])
            if rc == FALLBACK_EXIT:
                self.rt.relaunch.start_fallback()
                continue
            if rc in (RELEASED_EXIT, FENCED_EXIT):
                why = "released by the new shape" if rc == RELEASED_EXIT else "fenced (declared dead while silent)"
                if current and not self.rt.finished and self.rt._fallback is None and not self.rt._need_launch:
                    self.spawn(w.instance, join=True)
                    self.rt.console.say(f"{w.member} {why}: restarted as warm standby "
                              f"{self.rt.instances[w.instance].member}")  # type: ignore[union-attr]
                continue
            ours = w.killed or (w.noticed_at is not None and rc in (-signal.SIGTERM, -signal.SIGKILL))
            lost = rc < 0 and not ours  # a signal nobody here sent (kill -9, the OOM killer): a lost instance
            if lost:
                self._count_lost(w, rc)
            if rc == 0 or ours or lost:
                if (not w.joiner and w.launch == self.rt.launch and w.member not in self.rt.phases and not self.rt.finished
                        and self.rt._fallback is None):
                    # lost before the first generation formed: the other initial members cannot go on without it
                    self.rt._fallback_reason = f"initial member {w.member} lost during start-up"
                    self.rt.relaunch.start_fallback(startup=True)
                elif lost and current and not self.rt.finished and self.rt._fallback is None and not self.rt._need_launch:
                    self.spawn(w.instance, join=True)  # the survivors recover in place; a fresh standby for it
                    self.rt.console.say(f"{w.member} died by signal {-rc} (not sent by parcae run): a lost instance; the "
                              f"others recover in place, restarted as warm standby "
                              f"{self.rt.instances[w.instance].member}")  # type: ignore[union-attr]
                continue
            # an exception in the script (or any exit that is neither a signal nor a protocol status): like
            # Lightning, the job fails with the worker's traceback
            self.rt.kill_all()
            raise self.rt._fail(f"parcae run failed: worker {w.member} (launch {w.launch}) exited with {rc}; stopped "
                             "all workers", [w])

    def _check_members_left(self, alive: list[Worker]) -> None:
        """Every training member is gone (killed together, or the last one lost) while standbys wait: nobody is
        left to hand state over or to exit 75, so the launcher starts the fallback itself (relaunch from
        last.ckpt). The condition must hold for 3 s: phase events reach the launcher with a delay."""
        members = [w for w in alive if not self.waiting(w)]
        if members or not self.rt._gen_first_step or self.rt.finished or self.rt._fallback is not None or self.rt._need_launch:
            self.rt._no_members_since = None
            return
        now = time.time()
        if self.rt._no_members_since is None:
            self.rt._no_members_since = now
        elif now - self.rt._no_members_since > 3.0:
            self.rt._no_members_since = None
            self.rt._fallback_reason = "every training member was lost (no live process holds the model)"
            self.rt.relaunch.start_fallback()

    def _count_lost(self, w: Worker, rc: int) -> None:
        """Count one unrequested death by signal of ``w``'s instance; past ``--max-restarts`` the run fails."""
        n = self.rt._lost[w.instance] = self.rt._lost.get(w.instance, 0) + 1
        self.rt.event("lost", member=w.member, instance=w.instance, rc=rc, count=n, max_restarts=self.rt.cfg.max_restarts)
        if n > self.rt.cfg.max_restarts:
            self.rt.kill_all()
            raise self.rt._fail(f"parcae run failed: instance {w.instance} lost its process to a signal {n} times "
                             f"(last: {w.member}, signal {-rc}), more than --max-restarts {self.rt.cfg.max_restarts}; "
                             "stopped all workers", [w])

    def enforce_deadlines(self) -> None:
        now = time.time()
        for w in self.rt.workers:
            if not w.alive() or w.noticed_at is None:
                continue
            if not w.sigterm_sent and w.member in self.rt.phases:
                self.rt._signal(w, signal.SIGTERM)
                w.sigterm_sent = True
            if not w.killed and w.deadline is not None and now >= w.deadline:
                self.rt._signal(w, signal.SIGKILL)
                w.killed = True
                self.rt._kill_times.append(now - self.rt.t0)
                self.rt.event("kill", member=w.member, instance=w.instance, reason="grace period over")
                self.rt.console.say(f"{w.member} still alive when its grace period ended: SIGKILL (the others recover)")

    def run_elastic(self) -> None:
        cfg = self.rt.cfg
        n0 = self.rt.target_at(0.0)
        for _ in range(n0):
            self.rt.instances[self.rt._next_instance] = None
            self.rt._next_instance += 1
        self.rt.n = n0
        self.rt.timeline.append({"t": 0.0, "N": n0, "workers": n0, "D": 0, "P": 0, "generation": -1})
        self.rt._need_launch = True
        if not n0:
            self.rt.event("paused", reason="no instances available")
        while True:
            if self.rt._need_launch and self.rt.instances and self.rt._fallback is None and not self.rt.finished:
                self.rt._need_launch = False
                self.launch_instances()
            time.sleep(POLL_S)
            self.rt.console.read_events()
            self.reap()
            self.enforce_deadlines()
            if self.rt._fallback is not None:
                self.rt.relaunch.advance_fallback()
            alive = [w for w in self.rt.workers if w.alive()]
            self._check_members_left(alive)
            if self.rt.finished:
                if not alive:
                    break
                if self.rt._finished_at is not None and time.time() - self.rt._finished_at > 15.0:
                    for w in alive:  # e.g. a standby that never heard that the job is over
                        self.rt._signal(w, signal.SIGKILL)
                        w.killed = True
                continue
            if not alive and self.rt._fallback is None and not self.rt._need_launch:
                time.sleep(0.5)
                self.rt.console.read_events()
                if not self.rt.finished:
                    raise self.rt._fail("parcae run failed: every worker exited but training did not finish",
                                     [w for w in self.rt.workers if w.launch == self.rt.launch][:2])
                break
            target = self.rt.target_at(time.time() - self.rt.t0)
            if target != len(self.rt.instances):
                self.change(target)
            if (not self.rt._need_launch and self.rt._fallback is None and not self.rt._gen_first_step
                    and time.time() - self.rt._gen_started_at > cfg.startup_timeout_s):
                self.rt.kill_all()
                raise self.rt._fail(f"parcae run failed: launch {self.rt.launch} reported no training step within "
                                 f"{cfg.startup_timeout_s:g} s", [w for w in self.rt.workers if w.launch == self.rt.launch
                                                                   and not w.joiner][:1])
            self.rt.console.progress()
        self.rt.console.read_events()
        self.reap()  # the exits seen by the last check
        for m in self.rt.migrations.values():
            self.rt.console._print_migration(m)
