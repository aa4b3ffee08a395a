"""Live reconfiguration: the per-process runtime that changes a running job's D x P shape in place.

Problem: while ``Trainer.fit`` runs, instances receive preemption notices, die without notice, or arrive. The job
must (a) decide ahead of time which shape to run next (predictor + liveput optimizer, once per interval, on one
process), (b) get every process to switch at the *same* step, (c) move only the state that has to move between
processes that keep running, (d) survive a sudden loss without any stage applying an optimizer step that another
did not, and (e) let a new process join with the exact model, optimizer and loop state of the running job. This
module is that protocol; :class:`~lightning_parcae.training.strategy.ParcaeStrategy` calls into it at a few points.

Protocol (see ``docs/elastic.md`` for the user-facing version and :mod:`.lifecycle` for the state machine):

* **Generations.** Every configuration is a generation record in the store (:mod:`.coordinator`): members in
  rank order, partition, the migration plan that leads to it, and why. Process groups of generation ``g`` live
  under the store prefix ``gen/<g>/``; state transfers of the migration into ``g`` run in a transition world under
  ``mig/<g>/``.
* **Agreement at step boundaries.** After every optimizer step (``on_train_batch_end``) all members run one tiny
  all-reduce: the leader's proposed next generation (0 if none) and one notice flag per rank. Every rank gets the
  same answer, so all switch at the same step -- decisions never depend on when a rank happened to read the store.
* **Interval decisions.** The leader (rank 0 of the generation; after a failure, the first survivor) runs the
  predictor and the liveput optimizer -- the simulator's own decision, :func:`~lightning_parcae.planning.policy.decide_with_forecast` -- every ``interval_s`` seconds (or ``interval_steps`` steps), and at once when
  a notice is agreed. It publishes the next generation when the plan changes the shape, uses new standbys, or
  drops a member under notice.
* **Two-phase step.** A step's update is applied only after all members counted themselves in under
  ``parcae/commit/<g>/<step>``. On a failure the first process to look fixes the outcome with ``compare_set``:
  *apply* if everyone had reduced its gradients, else *discard*; everyone obeys that one decision.
* **Sudden loss.** Heartbeats (:mod:`.liveness`) abort the generation within seconds; survivors announce
  themselves, wait until every old member has announced or is dead, and the first proposal for the next
  generation (survivors only) wins. A discarded step is re-run on the new shape with the same global batch.
* **Joiners** (``PARCAE_JOIN=1``) wait as warm standbys (imports done, model built, heartbeating) until a
  generation includes them; they receive their layers from live holders and the loop state (step, epoch, sample
  cursor, schedulers, callbacks) from the leader, then enter ``fit`` through Lightning's own restore path.
* **Leaving.** A member under notice sends what it holds and exits (status 0); a survivor the new shape does not
  use exits with :data:`RELEASED_EXIT` so that a launcher restarts it as a standby.
* **Fallback.** If some layer has no live holder, every member logs it loudly and exits with
  :data:`FALLBACK_EXIT`; ``parcae run`` then restarts the job from the last checkpoint (losing the steps since it).
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import sys
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch
import torch.distributed as dist

from lightning_parcae.contract import (
    RUN_DIR_ENV,
    STORE_ENV,
    JOB_TOKEN_ENV,
    MEMBER_ENV,
    JOIN_ENV,
    STALL_ENV,
    SHARED_CORES_ENV,
    FALLBACK_EXIT,
    RELEASED_EXIT,
    FENCED_EXIT,
)
from lightning_parcae.planning.costmodel import DefaultCostModel, MigrationConstants, Shape
from lightning_parcae.errors import ConfigurationError, PeerLostError
from lightning_parcae.events import append_event
from lightning_parcae.planning.measured import MeasuredThroughput, PipelineThroughput, min_stages_for_memory
from lightning_parcae.planning.shape_optimizer import PAUSED, LiveputOptimizer
from lightning_parcae.planning.migration_plan import Layout, MigrationPlan, StageLostError, plan_migration
from lightning_parcae.planning.forecast import make_predictor
from lightning_parcae.planning.policy import decide_with_forecast
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.lifecycle import Lifecycle, Phase
from lightning_parcae.runtime.liveness import Liveness, activate, guarded, hb_key
from lightning_parcae.runtime.host import TrainingHost
from lightning_parcae.runtime.migration import exchange, layer_payload

if TYPE_CHECKING:  # pragma: no cover
    import pytorch_lightning as pl


__all__ = ["ElasticRuntime", "FALLBACK_EXIT", "RELEASED_EXIT", "FENCED_EXIT", "LIVE_CHECKPOINT"]

log = logging.getLogger(__name__)

LIVE_CHECKPOINT = "parcae-live://peers"
"""The checkpoint path a joiner 'resumes' from: the state it received from live peers, not a file."""

MEASURED_KEY = "parcae/measured"
"""Store key of the measured profile (the leader publishes it each interval, so a new leader keeps it)."""


RUNTIME_CONSTANTS = MigrationConstants(group_base_ms=30.0, join_ms=150.0, restart_ms=10000.0)
"""Migration costs of this runtime as measured by ``benchmarks/bench_migration.py`` on loopback: a group rebuild
is tens of ms, a *warm* standby joins in ~0.1-0.2 s (its imports and model were done while it waited -- the
simulator's default ``join_ms`` of 2.5 s prices a cold process), a full restart ~10 s. With the cold value a short
planning interval made the optimizer reach (4,1) through (2,2) instead of directly."""



class ElasticRuntime:
    """One process's side of the live-reconfiguration protocol (owned by :class:`ParcaeStrategy`).

    Args:
        strategy: The strategy (its groups, stage and optimizers are rebuilt in place).
        store_url: Coordination store URL (hosted by ``parcae run`` or an external etcd/TCPStore).
        token: Job token (records are signed) or None.
        member: This process's member id (stable across generations).
        joining: Start as a standby that waits to be admitted (a process added to a running job).
        interval_s: Planning interval in wall seconds (0: only ``interval_steps``).
        interval_steps: Planning interval in optimizer steps (0: only ``interval_s``).
        look_ahead: Intervals the liveput optimizer plans over.
        predictor: Predictor name (``persistence``, ``arima``, ``artifact``).
        heartbeat_s: Heartbeat period.
        dead_after_s: Silence after which a member is declared dead.
        stall_after_s: Progress watchdog: an operation of a generation (collective, point-to-point, rendezvous of
            a rebuilt group) that makes no progress for this long fails and becomes a recovery, while every
            heartbeat is fine (a mismatched collective, a peer whose traffic is silently dropped). It is the gloo
            timeout of every group after start-up; set it above the longest legitimate wait (a step, a
            checkpoint gather, the leader's planning). ``PARCAE_STALL_S`` overrides it.
        max_instances: Upper bound for forecasts.
        throughput: ``"measured"`` (price shapes by measurement and the fitted model, with the never-slower rules)
            or ``"profile"`` (the per-layer formula only; measurements are still recorded and saved).
    """

    def __init__(
        self,
        strategy: TrainingHost,
        *,
        store_url: str,
        token: Optional[str],
        member: str,
        joining: bool = False,
        interval_s: float = 60.0,
        interval_steps: int = 0,
        look_ahead: int = 12,
        predictor: str = "persistence",
        heartbeat_s: float = 0.2,
        dead_after_s: float = 3.0,
        stall_after_s: float = 60.0,
        max_instances: int = 64,
        throughput: str = "measured",
    ) -> None:
        self.s = strategy
        self.store_url = store_url
        self.token = token
        self.member = member
        self.joining = joining
        self.interval_s = float(interval_s)
        self.interval_steps = int(interval_steps)
        self.look_ahead = int(look_ahead)
        self.predictor_name = predictor
        self.heartbeat_s = heartbeat_s
        self.dead_after_s = dead_after_s
        self.stall_after_s = float(os.environ.get(STALL_ENV) or stall_after_s)
        if not self.stall_after_s > 0:
            raise ConfigurationError(f"stall_after_s must be > 0 seconds, got {self.stall_after_s}")
        self.max_instances = max_instances
        if throughput not in ("measured", "profile"):
            raise ConfigurationError(f"throughput={throughput!r}: use 'measured' or 'profile'")
        self.throughput_mode = throughput
        self.store: Any = None
        self.coord: Optional[Coordinator] = None
        self.live: Optional[Liveness] = None
        self.life = Lifecycle(member, on_transition=self._on_transition)
        self.generation = -1
        self.layout: Optional[Layout] = None
        self.record: dict[str, Any] = {}
        self.group_of: list[dict[str, int]] = []
        self.join_inbox: dict[int, Any] = {}
        self.live_checkpoint: Optional[dict[str, Any]] = None
        self.migrations: list[dict[str, Any]] = []
        self.stats: dict[str, Any] = {"predicted_N": None, "liveput": None}
        self._last_interval_t = time.monotonic()
        self._last_interval_step = 0
        self._predictor: Any = None
        self._optimizer: Optional[LiveputOptimizer] = None
        self._request_done: Any = None
        self._standby_seen: dict[str, bytes] = {}
        self._last_standbys: list[str] = []
        self._recovering_since: Optional[float] = None
        self.admitted = not joining
        """Whether this process is (or was) a training member; a joiner becomes one in :meth:`joined`."""
        self.run_dir = os.environ.get(RUN_DIR_ENV)
        self.measured: Optional[MeasuredThroughput] = None
        # (generation, step, time, first in its generation) at the last step boundary
        self._step_mark: Optional[tuple[int, int, float, bool]] = None
        self._warmup = 0

    # ============================================================================================ connection
    @classmethod
    def from_env(cls, strategy: TrainingHost, **options: Any) -> "ElasticRuntime":
        """Build from ``PARCAE_STORE`` / ``PARCAE_JOB_TOKEN`` / ``PARCAE_MEMBER`` / ``PARCAE_JOIN``.

        Raises:
            ConfigurationError: ``PARCAE_STORE`` is not set.
        """

        url = os.environ.get(STORE_ENV)
        if not url:
            raise ConfigurationError(
                "ParcaeStrategy(elastic=True) needs a coordination store that outlives the workers: run the script "
                "under `parcae run` (which hosts one) or set PARCAE_STORE=tcp://host:port or etcd://host:port/prefix"
            )
        member = os.environ.get(MEMBER_ENV) or f"{os.uname().nodename}-{os.getpid()}"
        joining = os.environ.get(JOIN_ENV, "0") not in ("", "0", "false")
        return cls(strategy, store_url=url, token=os.environ.get(JOB_TOKEN_ENV) or None, member=member,
                   joining=joining, **options)

    def connect(self) -> Any:
        """Open the main-thread store client, the coordinator and the heartbeat (not started yet)."""
        from lightning_parcae.runtime.store import connect_store  # noqa: PLC0415

        self.store = connect_store(self.store_url, token=self.token, timeout_s=30.0)
        self.coord = Coordinator(self.store, self.token)
        url, token = self.store_url, self.token
        self.live = Liveness(lambda: connect_store(url, token=token, timeout_s=30.0), self.member,
                             interval_s=self.heartbeat_s, dead_after_s=self.dead_after_s)
        self.install_signal_handler()
        return self.store

    def install_signal_handler(self) -> None:
        """SIGTERM = preemption notice: only raise the flag (the next step boundary acts on it)."""
        if threading_main():
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        assert self.live is not None
        self.live.noticed.set()

    def _on_transition(self, old: Phase, new: Phase, spent: float, info: dict[str, Any]) -> None:
        if self.live is not None:
            self.live.phase = new.value
        self.event("phase", old=old.value, new=new.value, spent_s=round(spent, 4), **info)

    def event(self, event_name: str, /, **fields: Any) -> None:
        """Append a JSON-lines event to ``run_dir/events.jsonl`` (under ``parcae run``) and log it at debug."""
        ev = {"source": "elastic", "member": self.member, "generation": self.generation, **fields,
              "event": event_name}
        log.debug("%s", ev)
        if self.run_dir:
            try:
                append_event(self.run_dir, _json_safe(ev))
            except OSError as exc:
                log.warning("could not write event: %s", exc)

    # ============================================================================================ boot
    def boot_register(self, generation: int, rank: int) -> None:
        """Initial members: publish this process's member id under its boot rank (before groups are used)."""
        assert self.store is not None
        self.generation = generation
        self.store.set(f"parcae/boot/{generation}/{rank}", self.member)

    def boot_publish(self, trainer: "pl.Trainer") -> None:
        """After partitioning: agree on generation 0's record and the parameter-group map; start heartbeats."""
        s = self.s
        g = s.groups
        assert g is not None and self.coord is not None and self.live is not None
        self._publish_group_map(g.generation, g.rank, g.world)
        if g.rank == 0:
            members = []
            for r in range(g.world):
                self.store.wait([f"parcae/boot/{g.generation}/{r}"])
                members.append(bytes(self.store.get(f"parcae/boot/{g.generation}/{r}")).decode())
            layout = Layout(tuple(members), tuple(s.partition))
            self.coord.propose(self._record(g.generation, layout, None, "start", 0, reason="initial members"))
            self.coord.set_current(g.generation)
        rec = self.coord.generation(g.generation, timeout_s=None)
        assert rec is not None
        self._enter(rec)
        self.live.start()
        self.live.set_generation(self.generation, self._watch())
        self.life.to(Phase.TRAINING, generation=self.generation, D=g.data_parallel, P=g.pipeline_stages)

    def _publish_group_map(self, generation: int, rank: int, world: int) -> None:
        """Every rank publishes which optimizer param group each of its parameters is in; all merge all."""
        s = self.s
        module = s.lightning_module
        assert module is not None and self.coord is not None
        names = {id(p): n for n, p in module.named_parameters()}
        mine = []
        for opt in s.optimizers:
            inner = getattr(opt, "_optimizer", opt)
            mine.append({names[id(p)]: gi for gi, grp in enumerate(inner.param_groups) for p in grp["params"]
                         if id(p) in names})
        self.coord.put(f"parcae/pgroups/{generation}/{rank}", {"map": mine})
        merged: list[dict[str, int]] = [dict() for _ in mine]
        for r in range(world):
            rec = self.coord.get(f"parcae/pgroups/{generation}/{r}", timeout_s=None)
            assert rec is not None
            for k, part in enumerate(rec["map"]):
                merged[k].update(part)
        self.group_of = merged
        if rank == 0:
            self.coord.put("parcae/pgroups", {"map": merged})

    def _record(self, generation: int, layout: Layout, plan: Optional[MigrationPlan], kind: str, step: int,
                alive: Optional[list[str]] = None, **extra: Any) -> dict[str, Any]:
        s = self.s
        rec: dict[str, Any] = {
            "generation": generation, "kind": kind, "step": int(step), "layout": layout.to_json(),
            "D": layout.data_parallel, "P": layout.pipeline_stages, "stack_path": s.stack_path,
            "layer_names": list(s.layer_names), "layer_times": [float(t) for t in s.layer_times],
            "layer_bytes": self._layer_bytes(), "time": time.time(), **extra,
        }
        if plan is not None:
            rec["plan"] = plan.to_json()
            old = [m for m in plan.old.members if alive is None or m in alive]
            rec["transition"] = old + [m for m in layout.members if m not in old]
            rec["loop_from"] = old[0] if old else None
            rec["bytes_moved"] = plan.bytes_moved
        return rec

    def _layer_bytes(self) -> list[int]:
        """Bytes each layer carries in a migration: parameters plus their optimizer state (from the record when
        known, so every process prices moves identically)."""
        rec_bytes = self.record.get("layer_bytes") if self.record else None
        if rec_bytes and len(rec_bytes) == len(self.s.layer_names):
            return [int(b) for b in rec_bytes]
        full = self.s.full_stack
        assert full is not None
        factor = 1.0 + self.s.optimizer_state_factor
        return [int(factor * sum(p.numel() * p.element_size() for p in full._modules[n].parameters()))
                for n in self.s.layer_names]

    def _enter(self, rec: dict[str, Any]) -> None:
        self.record = rec
        self.generation = int(rec["generation"])
        self.layout = Layout.from_json(rec["layout"])

    def _watch(self) -> list[str]:
        assert self.layout is not None
        members = list(self.layout.members)
        return members if members and members[0] == self.member else members[:1]

    @property
    def stall_timeout(self) -> timedelta:
        """The progress watchdog's bound as a group timeout (see ``stall_after_s``)."""
        return timedelta(seconds=self.stall_after_s)

    @property
    def is_leader(self) -> bool:
        """Rank 0 of the current generation plans for everyone."""
        return self.layout is not None and self.layout.members[0] == self.member

    @property
    def rank(self) -> int:
        assert self.layout is not None
        return self.layout.members.index(self.member)

    # ============================================================================================ joining
    def join_wait(self) -> dict[str, Any]:
        """Standby: register, heartbeat, and wait until a generation admits this member; receive its state.

        Returns:
            The admitting generation's record (the caller builds the process groups of it).
        """
        assert self.coord is not None and self.live is not None
        self.life.to(Phase.STANDBY)
        self.live.start()
        self.coord.register_standby(self.member)
        log.info("%s: waiting as a standby to be admitted", self.member)
        checked = -1
        while True:
            cur = self.coord.current()
            for g in range(max(checked + 1, cur), cur + 2):
                rec = self.coord.generation(g)
                if rec is None:
                    continue
                checked = max(checked, g if g <= cur else checked)
                if self.member in rec.get("transition", ()):
                    self._migrate_in(rec)
                    return rec
            if self.live.noticed.is_set():  # a preemption notice while still a standby: nothing to hand over
                log.warning("%s: preemption notice while waiting as a standby; leaving", self.member)
                self.event("standby_exit", reason="notice")
                self.life.to(Phase.STOPPED)
                self.live.stop()
                _exit(0)
            if self.store.check(["parcae/finished"]):
                log.warning("%s: the job finished before this standby was needed; exiting", self.member)
                self.event("standby_exit", reason="job finished")
                self.life.to(Phase.STOPPED)
                self.live.stop()
                _exit(0)
            time.sleep(0.05)

    def _migrate_in(self, rec: dict[str, Any]) -> None:
        """A joiner's part of a migration: receive layers + loop state in the transition world."""
        self.life.to(Phase.MIGRATING, generation=rec["generation"], kind=rec["kind"])
        plan = MigrationPlan.from_json(rec["plan"])
        transition = list(rec["transition"])
        t0 = time.monotonic()
        assert self.live is not None
        self.live.set_generation(int(rec["generation"]), [m for m in transition if m != self.member])
        activate(self.live)
        self._init_transition(rec)
        srcs = {transition.index(t.src) for t in plan.receives(self.member)}
        srcs.add(transition.index(rec["loop_from"]))
        self.join_inbox = exchange({}, sorted(srcs), "joining state transfer")
        dist.destroy_process_group()
        self._enter(rec)
        pg = self.coord.get("parcae/pgroups", timeout_s=None) if self.coord else None
        self.group_of = [dict(m) for m in pg["map"]] if pg else []
        self.stats["join_transfer_s"] = time.monotonic() - t0

    def joined(self, trainer: "pl.Trainer") -> None:
        """Called by the strategy once the joiner's stage, optimizers and loop state are in place."""
        assert self.live is not None
        activate(self.live)
        self.live.set_generation(self.generation, self._watch())
        self.admitted = True
        self.life.to(Phase.TRAINING, generation=self.generation, joined=True)
        self.event("joined", step=int(trainer.global_step), D=self.layout.data_parallel if self.layout else None,
                   P=self.layout.pipeline_stages if self.layout else None,
                   transfer_s=round(float(self.stats.get("join_transfer_s", 0.0)), 4))
        self._last_interval_t = time.monotonic()
        self._last_interval_step = int(trainer.global_step)

    def joiner_checkpoint(self) -> dict[str, Any]:
        """The checkpoint dict a joiner restores from: loop state from the leader + its received layers."""
        loop: Optional[dict[str, Any]] = None
        layers: dict[int, Any] = {}
        for blob in self.join_inbox.values():
            if "loop" in blob:
                loop = blob["loop"]
            layers.update(blob.get("layers", {}))
        if loop is None:
            raise ConfigurationError("the admitting generation sent no loop state to this joiner")
        ckpt = dict(loop)
        state = dict(ckpt.get("state_dict", {}))
        opt_states = [dict(o) for o in ckpt.get("optimizer_states", [])]
        for payload in layers.values():
            state.update(payload["tensors"])
            for k, per in enumerate(payload["optim"]):
                if k < len(opt_states):
                    opt_states[k]["state"] = {**opt_states[k].get("state", {}), **per}
        ckpt["state_dict"] = state
        ckpt["optimizer_states"] = opt_states
        return ckpt

    # ============================================================================================ step boundary
    def boundary(self, trainer: "pl.Trainer") -> None:
        """After each committed step: agree on notices and plans; switch, recover or continue."""
        assert self.live is not None and self.coord is not None and self.layout is not None
        step = int(trainer.global_step)
        self.live.step = step
        self._record_step(step)
        try:
            self._boundary(trainer, step)
        finally:
            # the next step is timed from here: planning, agreement and migrations are not step time
            if self._step_mark is None or self._step_mark[0] != self.generation:
                self._warmup = 2  # a new shape: new process groups and joiners warm up during its first steps
            fresh = self._warmup > 0
            self._warmup -= 1
            self._step_mark = (self.generation, int(trainer.global_step), time.monotonic(), fresh)

    def _record_step(self, step: int) -> None:
        """Time the step that just ended, if it ran whole in the current shape (not the first after a switch)."""
        mark, now = self._step_mark, time.monotonic()
        if mark is None or self.layout is None or mark[0] != self.generation or step != mark[1] + 1 or mark[3]:
            return  # the first steps of a shape warm up new process groups and joiners: not representative
        model = self._measured_model()
        if model is not None:
            model.record(self.layout.data_parallel, self.layout.pipeline_stages, 1000.0 * (now - mark[2]))

    def _boundary(self, trainer: "pl.Trainer", step: int) -> None:
        assert self.live is not None and self.coord is not None and self.layout is not None
        if self.live.aborted.is_set():
            self.recover(trainer)
            return
        proposal = 0
        if self.is_leader and self._interval_due(step):
            self.life.to(Phase.PLANNING, reason="interval")
            rec = self.decide(trainer, reason="interval", leaving=())
            proposal = int(rec["generation"]) if rec else 0
            if not rec:
                self.life.to(Phase.TRAINING)
        world = len(self.layout.members)
        flags = torch.zeros(1 + world, dtype=torch.float64)
        flags[0] = proposal
        flags[1 + self.rank] = 1.0 if self.live.noticed.is_set() else 0.0
        try:
            guarded(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True), "step agreement")
        except PeerLostError:
            self.recover(trainer)
            return
        gen = int(flags[0].item())
        noticed = [self.layout.members[i] for i in range(world) if flags[1 + i] > 0]
        if not gen and noticed:
            if self.life.phase == Phase.TRAINING:
                self.life.to(Phase.PLANNING, reason="notice", noticed=noticed)
            if self.is_leader:
                rec = self.decide(trainer, reason=f"preemption notice for {', '.join(noticed)}", leaving=noticed)
                if rec is None:
                    raise ConfigurationError("internal: a notice produced no new generation")
            gen = self.generation + 1
        if not gen:
            return
        if self.life.phase == Phase.TRAINING:
            self.life.to(Phase.PLANNING, reason="agreed")
        try:
            self.live.wait_key(self.store, f"parcae/genrec/{gen}", "waiting for the next generation")
        except PeerLostError:
            self.recover(trainer)
            return
        rec = self.coord.generation(gen)
        assert rec is not None
        self.switch(trainer, rec)

    def _interval_due(self, step: int) -> bool:
        now = time.monotonic()
        due = (self.interval_steps > 0 and step - self._last_interval_step >= self.interval_steps) or (
            self.interval_s > 0 and now - self._last_interval_t >= self.interval_s
        )
        if due:
            self._last_interval_t, self._last_interval_step = now, step
        return due

    # ============================================================================================ planning
    def _fresh_standbys(self) -> list[str]:
        """Registered standbys whose heartbeat moves and says ``standby``.

        A heartbeat "moves" if it changed since the previous planning interval; a standby seen for the first time
        is watched for two heartbeat periods (the only time the leader waits).
        """
        assert self.coord is not None and self.layout is not None
        cands = [m for m in dict.fromkeys(self.coord.standbys()) if m not in self.layout.members]

        def beats(members: list[str]) -> dict[str, Optional[bytes]]:
            return {m: bytes(self.store.get(hb_key(m))) if self.store.check([hb_key(m)]) else None for m in members}

        now = beats(cands)
        new = [m for m in cands if m not in self._standby_seen and now[m] is not None]
        moved = {m for m in cands if m in self._standby_seen and now[m] != self._standby_seen[m]}
        if new:
            time.sleep(2.5 * self.heartbeat_s)
            later = beats(new)
            moved |= {m for m in new if later[m] != now[m]}
            now.update(later)
        self._standby_seen = {m: b for m, b in now.items() if b is not None}
        alive = []
        for m in cands:
            b = now[m]
            if m in moved and b is not None and json.loads(b.decode()).get("phase") == "standby":
                alive.append(m)
        return alive

    def _choose_shape(self, n_now: int, n_next: int, observe: bool) -> Optional[Shape]:
        """Next shape: the liveput optimizer over the known next interval and the predicted ones after it.

        Args:
            n_now: Instances the job has now (members + live standbys, including any under notice or just lost).
            n_next: Instances it will have for the next interval (notices and losses removed).
            observe: This is a planning interval: record ``n_next`` in the availability history.
        """
        s = self.s
        assert self.layout is not None and self.coord is not None
        if n_next < 1 or s.global_batch is None:
            return None
        measured = self._measured_model()
        assert measured is not None
        by_measurement = self.throughput_mode == "measured"
        if self._optimizer is None:
            cm = measured.cost_model(RUNTIME_CONSTANTS)
            if not by_measurement:
                cm = DefaultCostModel(measured.prior, cm.layer_params, RUNTIME_CONSTANTS)
            self._optimizer = LiveputOptimizer(cm, interval_s=max(self.interval_s, 1.0), look_ahead=self.look_ahead)
            self._predictor = make_predictor(self.predictor_name, max_instances=self.max_instances)
            for c in self.coord.history():
                self._predictor.observe(c)
        pred = self._predictor
        if observe or not len(pred.history):
            pred.observe(n_next)
            if observe:
                self.coord.append_history(n_next)
        cur = (self.layout.data_parallel, self.layout.pipeline_stages)
        thr = measured if by_measurement else measured.prior
        # prices change as steps are measured: drop the optimizer's per-count cache of candidate throughputs
        self._optimizer._targets_cache.clear()
        try:
            # the simulator's parcae policy, literally: the interval about to run is known (notices are in, losses
            # seen, standbys counted); only the intervals after it are forecast, as quantile scenarios
            now = (n_now, max(0, n_next - n_now), max(0, n_now - n_next))
            decision, scenarios, weights = decide_with_forecast(self._optimizer, pred, cur, now)
            shape = decision.next_shape
            median = scenarios[len(scenarios) // 2] if scenarios else []
            self.stats["predicted_N"] = [int(n_next)] + [int(iv[0] + iv[1] - iv[2]) for iv in median[:1]]
            self.stats["decision"] = {"reactive": list(decision.reactive), "departs": decision.departs,
                                      "expected_gain": float(decision.expected_gain),
                                      "gain_std": float(decision.gain_std), "scenarios": len(scenarios)}
            if shape != PAUSED:
                plan = self._optimizer.plan(n_now, cur, [now, *median][: self.look_ahead], first=shape)
                self.stats["liveput"] = float(plan.expected_samples)
        except Exception as exc:  # noqa: BLE001 -- planning must never stop training: keep a fitting shape
            log.warning("liveput planning failed (%s); taking the fastest shape that fits", exc)
            shape = PAUSED
        if shape == PAUSED or shape[0] * shape[1] > n_next or thr.throughput(*shape) <= 0:
            cands = thr.candidates(n_next)
            if not cands:
                return None
            shape = max(cands, key=lambda sh: (thr.throughput(*sh), -abs(sh[1] - cur[1])))
        if by_measurement and measured.vetoes(cur, shape, n_next):
            # never move to a shape measured slower than the current one unless availability forces it
            self.event("veto", current=list(cur), chosen=list(shape), measured_current=measured.measured(*cur),
                       measured_chosen=measured.measured(*shape))
            shape = cur
        elif by_measurement and shape == cur and observe:
            explore = measured.exploration(n_next, cur, self.interval_s, self._move_cost_s())
            if explore is not None:
                self.event("explore", current=list(cur), chosen=list(explore),
                           measured_current=measured.measured(*cur), fitted=measured.throughput(*explore),
                           uncertainty=measured.uncertainty(*explore))
                shape = explore
        self.stats["throughput"] = {"current": thr.throughput(*cur) if cur[0] else None,
                                    "chosen": thr.throughput(*shape), "measured": measured.measured(*shape)}
        return shape

    def _move_cost_s(self) -> float:
        """Typical in-place migration time of this job so far (0.5 s before the first one)."""
        done = [float(m["duration_s"]) for m in self.migrations if m.get("kind") != "fallback"]
        return float(sum(done) / len(done)) if done else 0.5

    def _stage_memory(self) -> list[float]:
        """Per-layer resident training memory (as the strategy checks it against ``max_stage_memory_bytes``)."""
        s = self.s
        full = getattr(s, "_full_stack", None)
        if full is not None:
            from lightning_parcae.runtime.partition import layer_memory_bytes  # noqa: PLC0415

            return [float(layer_memory_bytes(full._modules[n], s.optimizer_state_factor)) for n in s.layer_names]
        factor = 1.0 + s.optimizer_state_factor
        return [b * (1.0 + factor) / factor for b in self._layer_bytes()]

    def _measured_model(self) -> Optional[MeasuredThroughput]:
        """This job's throughput model, learned from its own steps (built once the global batch is known; a new
        leader starts from the measurements the previous one published)."""
        if self.measured is not None:
            return self.measured
        s = self.s
        if s.global_batch is None or not s.layer_names:
            return None
        factor = 1.0 + s.optimizer_state_factor
        min_p = min_stages_for_memory(self._stage_memory(), s.max_stage_memory_bytes)
        prior = PipelineThroughput(list(s.layer_times or [1.0] * len(s.layer_names)), s.global_batch,
                                   s.micro_batches, s.max_pipeline_stages, min_p=min_p)
        cores = int(os.environ.get(SHARED_CORES_ENV) or 0) or None
        model = MeasuredThroughput(prior, layer_bytes=[b / factor for b in self._layer_bytes()], cores=cores)
        model.constants = RUNTIME_CONSTANTS
        raw = self.coord.get(MEASURED_KEY) if self.coord is not None else None
        if raw:
            try:
                for key, entry in raw.get("shapes", {}).items():
                    d, p = (int(x) for x in key.split(","))
                    for ms in entry["step_ms"]:
                        model.record(d, p, float(ms))
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("ignoring the published measurements: %s", exc)
        self.measured = model
        return model

    def save_profile(self) -> None:
        """Leader: publish the measured profile in the store and write ``run_dir/profile.json`` (with migration
        constants fitted from this job's own migrations) -- ``parcae simulate --profile`` loads it."""
        model = self.measured
        if model is None or not self.is_leader:
            return
        try:
            moves = [(m["kind"], float(m.get("bytes_moved", 0)), int(m.get("N", 1)), 1000.0 * float(m["duration_s"]))
                     for m in self.migrations if m.get("kind") in ("intra-stage", "inter-stage", "repartition")]
            fitted = MigrationConstants.fit(moves, base=RUNTIME_CONSTANTS) if moves else RUNTIME_CONSTANTS
            model.constants = fitted
            raw = model.to_json()
            model.constants = RUNTIME_CONSTANTS
            if self.coord is not None:
                self.coord.put(MEASURED_KEY, raw)
            if self.run_dir:
                tmp = os.path.join(self.run_dir, f".profile.json.{os.getpid()}")
                with open(tmp, "w") as f:
                    json.dump(raw, f, indent=1)
                os.replace(tmp, os.path.join(self.run_dir, "profile.json"))
        except Exception as exc:  # noqa: BLE001 -- a profile is a by-product: never stop training for it
            log.warning("could not save the measured profile: %s", exc)

    def _partition_for(self, p: int) -> list[int]:
        s = self.s
        assert self.layout is not None
        if p == self.layout.pipeline_stages:
            return list(self.layout.partition)
        from lightning_parcae.runtime.partition import balance_stages  # noqa: PLC0415

        times = s.layer_times or [1.0] * len(s.layer_names)
        memory = self._layer_bytes()
        return balance_stages(times, p, memory, s.max_stage_memory_bytes)

    def decide(self, trainer: "pl.Trainer", reason: str, leaving: Iterable[str]) -> Optional[dict[str, Any]]:
        """Leader: choose the next generation and publish it (None: keep the current one)."""
        assert self.layout is not None and self.coord is not None
        leaving = list(leaving)
        old = self.layout
        standbys = self._fresh_standbys()
        staying = [m for m in old.members if m not in leaving]
        avail = staying + standbys
        cur = (old.data_parallel, old.pipeline_stages)
        shape = self._choose_shape(len(old.members) + len(standbys), len(avail), observe=not leaving)
        self.save_profile()
        requested = self._requested_shape(len(avail))
        if requested is not None:
            shape, reason = requested, f"{reason}; operator requested D={requested[0]} P={requested[1]}"
        if shape != cur or leaving or standbys != self._last_standbys:
            self._last_standbys = list(standbys)
            self.event("decision", reason=reason, N=len(avail), current=list(cur),
                       chosen=list(shape) if shape else None, standbys=standbys, leaving=leaving,
                       predicted=self.stats.get("predicted_N"), liveput=self.stats.get("liveput"),
                       throughput=self.stats.get("throughput"))
        if shape is None:  # every member is alive here: save a checkpoint before stopping
            return self._propose_fallback(int(trainer.global_step), f"{reason}: no shape fits {len(avail)} instances",
                                          checkpoint=True)
        if shape == cur and not leaving:
            return None
        try:
            plan = plan_migration(old, avail, shape, self._partition_for(shape[1]), self._layer_bytes(),
                                  senders=list(old.members))
        except StageLostError as exc:
            return self._propose_fallback(int(trainer.global_step), f"{reason}: {exc}")
        if plan.kind.value == "none":
            return None
        rec = self._record(self.generation + 1, plan.new, plan, plan.kind.value, int(trainer.global_step),
                           reason=reason)
        return self.coord.propose(rec)

    def _requested_shape(self, n: int) -> Optional[Shape]:
        """An operator's one-off resize request (record ``parcae/request`` = ``{"id", "D", "P"}``), if new and valid.

        This is how a person (or a benchmark) forces a shape regardless of the optimizer; it is applied at the next
        planning interval, once per ``id``.
        """
        assert self.coord is not None
        req = self.coord.get("parcae/request")
        if not req or req.get("id") == self._request_done:
            return None
        self._request_done = req.get("id")
        shape = (int(req.get("D", 0)), int(req.get("P", 0)))
        thr = self._optimizer.thr if self._optimizer is not None else None
        if shape[0] * shape[1] > n or shape[1] > len(self.s.layer_names) or (thr and thr.throughput(*shape) <= 0):
            log.warning("ignoring the requested shape %s: it does not fit %d instances / this job's batch", shape, n)
            self.event("request_ignored", requested=list(shape), N=n)
            return None
        return shape

    def _propose_fallback(self, step: int, reason: str, checkpoint: bool = False) -> dict[str, Any]:
        assert self.coord is not None and self.layout is not None
        rec = {"generation": self.generation + 1, "kind": "fallback", "step": step, "reason": reason,
               "layout": self.layout.to_json(), "time": time.time(), "checkpoint": checkpoint}
        return self.coord.propose(rec)

    # ============================================================================================ migration
    def _teardown_groups(self, failed: bool = False) -> None:
        """Leave the current generation's groups: destroy them, or after a failure abandon them (see
        :meth:`ProcessGroups.abandon`: a shutdown could block on an operation stuck on a dead peer)."""
        s = self.s
        if s.groups is None:
            return
        if failed:
            assert self.live is not None
            self.live.park(s.groups.abandon())
            _exit_without_destructors_at_shutdown()
        else:
            s.groups.destroy()

    def _init_transition(self, rec: dict[str, Any]) -> None:
        transition = list(rec["transition"])
        prefixed = dist.PrefixStore(f"mig/{rec['generation']}/", self.store)
        dist.init_process_group("gloo", store=prefixed, rank=transition.index(self.member),
                                world_size=len(transition), timeout=self.stall_timeout)

    def switch(self, trainer: "pl.Trainer", rec: dict[str, Any]) -> None:
        """Move to generation ``rec``: transfer state, rebuild groups and the stage in place (or leave/fall back)."""
        assert self.layout is not None and self.coord is not None and self.live is not None
        t0 = time.monotonic()
        if self.life.phase != Phase.MIGRATING:
            self.life.to(Phase.MIGRATING, generation=rec["generation"], kind=rec["kind"])
        if rec["kind"] == "fallback":
            self.fallback(trainer, rec)
        s = self.s
        plan = MigrationPlan.from_json(rec["plan"])
        new = plan.new
        transition = list(rec["transition"])
        joiners = [m for m in new.members if m not in plan.old.members]
        loop = self._loop_state(trainer) if joiners and rec.get("loop_from") == self.member else None
        self._teardown_groups()
        t_groups = time.monotonic()
        # the transfers belong to the new generation: a death now aborts *it* (and is seen by every participant)
        self.live.set_generation(int(rec["generation"]), [m for m in transition if m != self.member])
        try:
            self._init_transition(rec)
        except RuntimeError as exc:
            self._rendezvous_failed(trainer, rec, exc)
        module = s.lightning_module
        assert module is not None
        opts = [getattr(o, "_optimizer", o) for o in s.optimizers]
        sends: dict[int, dict[str, Any]] = {}
        for t in plan.sends(self.member):
            box = sends.setdefault(transition.index(t.dst), {"layers": {}})
            box["layers"][t.layer] = layer_payload(module, s.layer_key(s.layer_names[t.layer]), opts)
        if loop is not None:
            for j in joiners:
                sends.setdefault(transition.index(j), {"layers": {}})["loop"] = loop
        srcs = sorted({transition.index(t.src) for t in plan.receives(self.member)})
        inbox = exchange(sends, srcs, "migration state transfer")
        dist.destroy_process_group()
        t_transfer = time.monotonic()
        if self.member not in new.members:
            leaving_reason = "notice" if self.live.noticed.is_set() else "released"
            self.event("left", kind=rec["kind"], reason=leaving_reason, transfer_s=t_transfer - t_groups)
            self.life.to(Phase.FENCED, reason=leaving_reason)
            _exit(0 if leaving_reason == "notice" else RELEASED_EXIT)
        received: dict[int, Any] = {}
        for blob in inbox.values():
            received.update(blob.get("layers", {}))
        try:
            s.apply_layout(trainer, new, int(rec["generation"]), received, self.group_of)
        except RuntimeError as exc:
            self._rendezvous_failed(trainer, rec, exc)
        _forget_eval_loaders(trainer)
        self._enter(rec)
        self.live.set_generation(self.generation, self._watch())
        if self.is_leader:
            self.coord.set_current(self.generation)
        dt = time.monotonic() - t0
        info = {"kind": rec["kind"], "reason": rec.get("reason", ""), "duration_s": round(dt, 4),
                "transfer_s": round(t_transfer - t_groups, 4), "bytes_moved": int(rec.get("bytes_moved", 0)),
                "bytes_received": int(sum(t.nbytes for t in plan.receives(self.member))),
                "D": new.data_parallel, "P": new.pipeline_stages, "N": len(new.members), "step": trainer.global_step,
                "joiners": joiners}
        if self._recovering_since is not None:  # from noticing the loss to training again (detection excluded)
            info["recovery_s"] = round(time.monotonic() - self._recovering_since, 4)
            self._recovering_since = None
        self.migrations.append(info)
        self.event("migration", **info)
        self.life.to(Phase.TRAINING, **{k: info[k] for k in ("kind", "duration_s", "D", "P")})

    def _rendezvous_failed(self, trainer: "pl.Trainer", rec: dict[str, Any], exc: BaseException) -> None:
        """Building a new generation's groups failed (a peer lost or stalled during the rendezvous, or gloo's
        connectFullMesh racing -- chaos seed 14 saw "Connection closed by peer" there once, not on replay). The
        generation cannot be entered consistently; rather than fail the job, fall back: exit 75 and let the
        launcher restart from the last checkpoint (at most the steps since it are lost)."""
        reason = f"process groups of generation {rec['generation']} could not be built: {str(exc).splitlines()[0][:160]}"
        self.event("rendezvous_failed", reason=reason)
        self.fallback(trainer, {"reason": reason})

    def _loop_state(self, trainer: "pl.Trainer") -> dict[str, Any]:
        """Leader: everything a joiner needs besides its layers (loop, callbacks, schedulers, replicated params)."""
        from lightning_parcae.runtime.checkpoint import plain_containers  # noqa: PLC0415

        s = self.s
        with s.local_state_dump():
            ckpt = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        stage_keys = s.stage_key_set()
        ckpt["state_dict"] = {k: v.detach().cpu().clone() for k, v in ckpt["state_dict"].items()
                              if k not in stage_keys}
        for opt in ckpt.get("optimizer_states", []):
            opt["state"] = {k: v for k, v in opt.get("state", {}).items() if not s.is_stage_key(k)}
        ckpt["parcae"] = {"version": 1, "data": s.data_state(), "layout": {}}
        return plain_containers(ckpt)

    # ============================================================================================ failures
    def decide_commit(self, step: int) -> bool:
        """After a failure inside ``step``: True if the step is applied everywhere, False if discarded everywhere."""
        assert self.coord is not None and self.layout is not None
        key = Coordinator.commit_key(self.generation, step) + "/decision"
        count = self.coord.commit_count(self.generation, step)
        proposal = b"apply" if count >= len(self.layout.members) else b"discard"
        return bytes(self.store.compare_set(key, "", proposal)) == b"apply"

    def commit(self, step: int) -> None:
        """Two-phase step: count in and wait until everyone did (or the generation aborts)."""
        assert self.coord is not None and self.layout is not None and self.live is not None
        key = Coordinator.commit_key(self.generation, step) + "/decision"
        if self.coord.commit_arrive(self.generation, step, len(self.layout.members)):
            won = bytes(self.store.compare_set(key, "", b"apply"))
            if won != b"apply":
                raise PeerLostError(f"step {step} was discarded by a survivor before everyone counted in")
            self._forget_commit(step - 1)
            return
        self.live.wait_key(self.store, key, f"commit of step {step}")
        if bytes(self.store.get(key)) != b"apply":
            raise PeerLostError(f"step {step} was discarded after a failure")

    def _forget_commit(self, step: int) -> None:
        """Delete a finished step's commit keys (everyone has passed it), so the store does not grow per step."""
        base = Coordinator.commit_key(self.generation, step)
        for key in (base, base + "/done", base + "/decision"):
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 -- a store without delete (older etcd v2 API) just keeps them
                return

    def recover(self, trainer: "pl.Trainer") -> None:
        """Survivors of an aborted generation agree on the next one (survivors only) and migrate to it."""
        assert self.layout is not None and self.coord is not None and self.live is not None
        g = self.generation
        reason = self.live.reason or "peer lost"
        self.life.to(Phase.RECOVERING, generation=g, reason=reason)
        t0 = time.monotonic()
        self._recovering_since = t0
        self.live.abort(reason)
        self._teardown_groups(failed=True)
        self.coord.announce_survivor(g, self.member, {"step": int(trainer.global_step)})
        old = self.layout
        alive: list[str] = []
        seen: dict[str, tuple[Optional[bytes], float]] = {}
        deadline = time.monotonic() + 4 * self.dead_after_s + 10.0
        while True:
            pending = []
            now = time.monotonic()
            alive = [m for m in old.members if self.coord.survivor(g, m) is not None]
            for m in old.members:
                if m in alive:
                    continue
                raw = bytes(self.store.get(hb_key(m))) if self.store.check([hb_key(m)]) else None
                last = seen.get(m)
                if last is None or last[0] != raw:
                    seen[m] = (raw, now)
                    pending.append(m)
                elif now - last[1] <= self.dead_after_s:
                    pending.append(m)
            if not pending or now > deadline:
                break
            time.sleep(0.05)
        dead = [m for m in old.members if m not in alive]
        self.event("recovering", survivors=alive, dead=dead, reason=reason, wait_s=time.monotonic() - t0)
        existing = self.coord.generation(g + 1)
        if existing is None:
            shape = self._choose_shape(len(old.members), len(alive), observe=False)
            if shape is None:
                rec = self._propose_fallback(int(trainer.global_step), f"{reason}: no shape fits {len(alive)}")
            else:
                try:
                    plan = plan_migration(old, alive, shape, self._partition_for(shape[1]), self._layer_bytes(),
                                          senders=alive)
                    rec = self.coord.propose(self._record(g + 1, plan.new, plan, plan.kind.value,
                                                          int(trainer.global_step), alive=alive,
                                                          reason=f"recovery: {reason}", dead=dead))
                except StageLostError as exc:
                    rec = self._propose_fallback(int(trainer.global_step), f"{reason}: {exc}")
        else:
            rec = existing
        if self.member not in rec.get("transition", old.members):
            # e.g. a process that hung (SIGSTOP, a frozen VM) past the heartbeat timeout and then woke up
            msg = f"{self.member} is not a member of generation {g + 1} (declared dead while silent); exiting"
            log.warning(msg)
            print(msg, file=sys.stderr, flush=True)
            self.event("fenced", reason=msg)
            self.life.to(Phase.FENCED, reason="not in the survivors' generation")
            _exit(FENCED_EXIT)
        self.switch(trainer, rec)

    def fallback(self, trainer: "pl.Trainer", rec: dict[str, Any]) -> None:
        """Some stage has no live replica (or no instance is left): say so loudly and exit for a restart from the
        last checkpoint. When every member is still alive (all under notice), a checkpoint is saved first, so
        nothing is lost."""
        saved = self._save_before_leaving(trainer) if rec.get("checkpoint") else None
        if saved:
            msg = (f"PARCAE STOP at step {trainer.global_step}: {rec.get('reason')}. Saved {saved}; the job restarts "
                   "from it when instances are back.")
            log.error(msg)
            print(msg, file=sys.stderr, flush=True)
            self.event("fallback", reason=rec.get("reason"), step=int(trainer.global_step), checkpoint=saved)
            self.life.to(Phase.FALLBACK, reason=rec.get("reason"))
            _exit(FALLBACK_EXIT)
        msg = (f"PARCAE FALLBACK at step {trainer.global_step}: {rec.get('reason')}. No live process holds some "
               "layers, so the job must restart from the last checkpoint; the steps since that checkpoint are lost "
               "and will be recomputed.")
        log.error(msg)
        print(msg, file=sys.stderr, flush=True)
        self.event("fallback", reason=rec.get("reason"), step=int(trainer.global_step))
        self.life.to(Phase.FALLBACK, reason=rec.get("reason"))
        _exit(FALLBACK_EXIT)

    def _save_before_leaving(self, trainer: "pl.Trainer") -> Optional[str]:
        """Collective save of ``run_dir/ckpt/last.ckpt`` (every member must call it); None without a run dir."""
        if not self.run_dir:
            return None
        path = os.path.join(self.run_dir, "ckpt", "last.ckpt")
        try:
            trainer.save_checkpoint(path)
            self.s.wait_for_checkpoint()
        except Exception as exc:  # noqa: BLE001 -- the periodic checkpoint is still there
            log.error("could not save a checkpoint before stopping: %s", exc)
            return None
        return path

    def close(self, finished: bool = False) -> None:
        """Stop heartbeats (end of fit); ``finished``: tell waiting standbys that the job is over."""
        if finished:
            self.save_profile()
        if finished and self.store is not None and self.is_leader:
            try:
                self.store.set("parcae/finished", str(self.generation))
            except Exception as exc:  # noqa: BLE001 -- best effort at exit
                log.debug("could not mark the job finished: %s", exc)
        if self.live is not None:
            activate(None)
            self.live.stop()


def _forget_eval_loaders(trainer: "pl.Trainer") -> None:
    """Make Lightning rebuild the validation loader (and its distributed sampler) at the next validation.

    Regression: the loader was built once, sharded for the D of the first validation; after a change of D the
    stages of one pipeline read different validation batches and the last stage's output (16 sequences) no longer
    matched its own targets (8) -- "Expected input batch_size (1024) to match target batch_size (512)".
    """
    loop = getattr(getattr(trainer.fit_loop, "epoch_loop", None), "val_loop", None)
    if loop is not None and hasattr(loop, "_combined_loader"):
        loop._combined_loader = None


_HARD_EXIT: list[bool] = []


def _exit_without_destructors_at_shutdown() -> None:
    """After a failure, end the process with ``os._exit`` once the script has finished.

    An abandoned generation keeps gloo threads blocked on the dead peer; C++ destructors that run at normal
    interpreter exit then abort the process ("terminate called without an active exception", status -6) even
    though training finished. The exit status is 1 if an exception escaped the script, else 0; non-daemon threads
    (a background checkpoint write) have finished by the time ``atexit`` handlers run.
    """
    if _HARD_EXIT:
        return
    _HARD_EXIT.append(True)
    import atexit  # noqa: PLC0415

    failed: list[bool] = []
    previous = sys.excepthook

    def hook(kind: Any, value: Any, tb: Any) -> None:
        failed.append(True)
        previous(kind, value, tb)

    sys.excepthook = hook
    atexit.register(lambda: _exit(1 if failed else 0))


def _exit(code: int) -> None:
    """Leave the job now: flush, then ``os._exit`` (Lightning's teardown would wait on dead process groups)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def threading_main() -> bool:
    """Whether this is the main thread (signal handlers can only be installed there)."""
    import threading  # noqa: PLC0415

    return threading.current_thread() is threading.main_thread()


def _json_safe(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)
