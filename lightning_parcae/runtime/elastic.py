"""Live reconfiguration: the per-process runtime that changes a running job's D x P shape in place.

Problem: while ``Trainer.fit`` runs, instances receive preemption notices, die without notice, or arrive. The job
must (a) decide ahead of time which shape to run next (predictor + liveput optimizer, once per interval, on one
process), (b) get every process to switch at the *same* step, (c) move only the state that has to move between
processes that keep running, (d) survive a sudden loss without any stage applying an optimizer step that another
did not, and (e) let a new process join with the exact model, optimizer and loop state of the running job. This
module is that protocol's spine -- connection, the step-boundary agreement, the generation records -- and owns
one part per phase: :mod:`.shape_choice` (a), :mod:`.switching` (b, c), :mod:`.recovery` (d) and :mod:`.joining`
(e). The strategy above it (a :class:`~lightning_parcae.runtime.host.TrainingHost`) calls into it at a few points.

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

import logging
import math
import os
import signal
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist

from lightning_parcae.contract import (
    RUN_DIR_ENV,
    STORE_ENV,
    JOB_TOKEN_ENV,
    MEMBER_ENV,
    JOIN_ENV,
    STALL_ENV,
    FALLBACK_EXIT,
    RELEASED_EXIT,
    FENCED_EXIT,
)
from lightning_parcae.errors import ConfigurationError, PeerLostError
from lightning_parcae.events import append_event
from lightning_parcae.planning.migration_plan import Layout, MigrationPlan
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.lifecycle import Lifecycle, Phase
from lightning_parcae.runtime import steptime
from lightning_parcae.runtime.liveness import Liveness, activate, guarded
from lightning_parcae.runtime.host import TrainingHost
from lightning_parcae.runtime.joining import Admission
from lightning_parcae.runtime.recovery import Recovery
from lightning_parcae.runtime.shape_choice import ShapeChooser
from lightning_parcae.runtime.switching import Switch

if TYPE_CHECKING:  # pragma: no cover
    import pytorch_lightning as pl


__all__ = ["ElasticRuntime", "FALLBACK_EXIT", "RELEASED_EXIT", "FENCED_EXIT", "LIVE_CHECKPOINT"]

log = logging.getLogger(__name__)

LIVE_CHECKPOINT = "parcae-live://peers"
"""The checkpoint path a joiner 'resumes' from: the state it received from live peers, not a file."""





class ElasticRuntime:
    """One process's side of the live-reconfiguration protocol (owned by :class:`ParcaeStrategy`).

    Args:
        strategy: The strategy (its groups, stage and optimizers are rebuilt in place).
        store_url: Coordination store URL (hosted by ``parcae run`` or an external etcd/TCPStore).
        token: Job token (records are signed) or None.
        member: This process's member id (stable across generations).
        joining: Start as a standby that waits to be admitted (a process added to a running job).

        The planning options below have no defaults here: they are the strategy's (``ParcaeStrategy``'s signature
        holds the one set of defaults; ``StrategyOptions.elastic_options`` passes them all).

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
        interval_s: float,
        interval_steps: int,
        look_ahead: int,
        predictor: str,
        heartbeat_s: float,
        dead_after_s: float,
        stall_after_s: float,
        throughput: str,
        joining: bool = False,
        max_instances: int = 64,
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
        self._standby_seen: dict[str, bytes] = {}
        self._last_standbys: list[str] = []
        self._recovering_since: Optional[float] = None
        self.admitted = not joining
        """Whether this process is (or was) a training member; a joiner becomes one in :meth:`joined`."""
        self.run_dir = os.environ.get(RUN_DIR_ENV)
        self.chooser = ShapeChooser(self)
        self.admission = Admission(self)
        self.recovery = Recovery(self)
        self.switching = Switch(self)
        """The leader's planning state: measured throughput, optimizer, predictor (kept by every process)."""

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
        """See :meth:`~lightning_parcae.runtime.joining.Admission.join_wait`."""
        return self.admission.join_wait()

    def joined(self, trainer: "pl.Trainer") -> None:
        """See :meth:`~lightning_parcae.runtime.joining.Admission.joined`."""
        return self.admission.joined(trainer)

    def joiner_checkpoint(self) -> dict[str, Any]:
        """See :meth:`~lightning_parcae.runtime.joining.Admission.joiner_checkpoint`."""
        return self.admission.joiner_checkpoint()


    # ============================================================================================ step boundary
    def boundary(self, trainer: "pl.Trainer") -> None:
        """After each committed step: agree on notices and plans; switch, recover or continue."""
        assert self.live is not None and self.coord is not None and self.layout is not None
        step = int(trainer.global_step)
        self.live.step = step
        with steptime.span("boundary.chooser"):
            self.chooser.record_step(step)
        try:
            with steptime.span("boundary"):
                self._boundary(trainer, step)
        finally:
            # the next step is timed from here: planning, agreement and migrations are not step time
            with steptime.span("boundary.chooser"):
                self.chooser.mark_step(self.generation, int(trainer.global_step))

    def _boundary(self, trainer: "pl.Trainer", step: int) -> None:
        assert self.live is not None and self.coord is not None and self.layout is not None
        if self.live.aborted.is_set():
            self.recover(trainer)
            return
        proposal = 0
        # a joiner restored from this step's state would skip the validation the members run right after it
        # (Lightning fast-forwards a validation pending at a train-batch-end checkpoint), or the end of fit if this
        # is the last step: admit no one here
        with steptime.span("boundary.validation_follows"):
            admit = not self.validation_follows(trainer) and not training_ends(trainer)
        if self.is_leader and admit and self._interval_due(step):
            self.life.to(Phase.PLANNING, reason="interval")
            with steptime.span("boundary.plan"):
                rec = self.chooser.decide(trainer, reason="interval", leaving=())
            proposal = int(rec["generation"]) if rec else 0
            if not rec:
                self.life.to(Phase.TRAINING)
        world = len(self.layout.members)
        flags = torch.zeros(1 + world, dtype=torch.float64)
        flags[0] = proposal
        flags[1 + self.rank] = 1.0 if self.live.noticed.is_set() else 0.0
        try:
            guarded(lambda: dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True), "step agreement",
                    collective=True)
        except PeerLostError:
            self.recover(trainer)
            return
        gen = int(flags[0].item())
        noticed = [self.layout.members[i] for i in range(world) if flags[1 + i] > 0]
        if not gen and noticed:
            if self.life.phase == Phase.TRAINING:
                self.life.to(Phase.PLANNING, reason="notice", noticed=noticed)
            if self.is_leader:
                rec = self.chooser.decide(trainer, reason=f"preemption notice for {', '.join(noticed)}", leaving=noticed,
                                          admit=admit)
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
        self.switching.switch(trainer, rec)

    @staticmethod
    def validation_follows(trainer: "pl.Trainer") -> bool:
        """Whether Lightning runs a validation right after the step that just ended.

        Regression (held-out chaos seed 1102): a standby admitted at step 21, a validation step, restored the loop
        state of the end of that step -- where Lightning treats the pending validation as done -- and went on
        training while the members validated: mismatched collectives, a 15 s stall until the watchdog. Planned
        admissions wait one step when this is true.
        """
        loop = getattr(trainer.fit_loop, "epoch_loop", None)
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if loop is None:
            return False
        try:
            return bool(loop._should_check_val_fx(fetcher))
        except Exception:  # noqa: BLE001 -- Lightning internals: when in doubt, do not hold admissions back
            return False

    def _interval_due(self, step: int) -> bool:
        now = time.monotonic()
        due = (self.interval_steps > 0 and step - self._last_interval_step >= self.interval_steps) or (
            self.interval_s > 0 and now - self._last_interval_t >= self.interval_s
        )
        if due:
            self._last_interval_t, self._last_interval_step = now, step
        return due

    # ============================================================================================ planning
    # ============================================================================================ migration
    # ============================================================================================ failures
    def decide_commit(self, step: int) -> bool:
        """See :meth:`~lightning_parcae.runtime.recovery.Recovery.decide_commit`."""
        return self.recovery.decide_commit(step)

    def commit(self, step: int) -> None:
        """See :meth:`~lightning_parcae.runtime.recovery.Recovery.commit`."""
        return self.recovery.commit(step)

    def recover(self, trainer: "pl.Trainer") -> None:
        """See :meth:`~lightning_parcae.runtime.recovery.Recovery.recover`."""
        return self.recovery.recover(trainer)

    def fallback(self, trainer: "pl.Trainer", rec: dict[str, Any]) -> None:
        """See :meth:`~lightning_parcae.runtime.recovery.Recovery.fallback`."""
        return self.recovery.fallback(trainer, rec)

    def close(self, finished: bool = False) -> None:
        """Stop heartbeats (end of fit); ``finished``: tell waiting standbys that the job is over."""
        if finished:
            self.chooser.save_profile()
        if finished and self.store is not None and self.is_leader:
            try:
                self.store.set("parcae/finished", str(self.generation))
            except Exception as exc:  # noqa: BLE001 -- best effort at exit
                log.debug("could not mark the job finished: %s", exc)
        if self.live is not None:
            activate(None)
            self.live.stop()


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


def training_ends(trainer: "pl.Trainer") -> bool:
    """Whether the step that just ended is the last one ``fit`` trains (``max_steps`` or the last epoch's end).

    Regression (chaos seed 49, under load): a standby admitted at step 22 of ``max_steps=22`` restored a loop
    that was already done, so its ``fit`` ended without the end-of-fit collectives the member still ran; the
    member's guard gave up on them ("recovering at the next step boundary" -- there is none), and the code after
    ``fit`` ran one collective apart: ``save_checkpoint``'s barrier failed, exit 1. Nobody is admitted (and
    no interval plan is made) at the last step: no step would use the new shape.
    """
    max_steps = getattr(trainer, "max_steps", -1)
    if max_steps is not None and max_steps >= 0 and int(trainer.global_step) >= max_steps:
        return True
    try:
        loop = trainer.fit_loop
        max_epochs = loop.max_epochs
        last_epoch = max_epochs is not None and max_epochs >= 0 and trainer.current_epoch + 1 >= max_epochs
        return bool(last_epoch and loop.epoch_loop.batch_progress.is_last_batch)
    except Exception:  # noqa: BLE001 -- Lightning internals: when in doubt, do not hold admissions back
        return False
