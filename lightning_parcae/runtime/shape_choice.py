"""The leader's choice of the next generation: its shape, from this job's own measurements and a forecast.

Problem: at each planning interval the leader must price every shape that fits the instances it will have --
by the step times *this* job has measured where it ran a shape, by a model fitted to them elsewhere -- and pick
the next one with the same decision the simulator scores (:class:`~lightning_parcae.planning.policy.ShapeDecider`),
then apply the runtime's guards: never move to a shape measured slower unless availability forces it, explore an
unmeasured shape when the model is unsure and the interval is long -- within a cap on the share of wall time spent
in tries (``max_exploration_share``: at N >= 8 a job with dozens of unmeasured shapes could otherwise spend a large
part of its time trying them) -- and honour an operator's one-off resize request.
It also decides who takes part (standbys whose heartbeat moves and that have no valid notice; the joiners of one
launch batch together, :data:`BATCH_GRACE_S`) and plans the migration to the chosen shape, publishing the next
generation's record. This module holds that state (the measured model, the optimizer, the predictor, the standbys
seen) for one :class:`~lightning_parcae.runtime.elastic.ElasticRuntime`, which owns the
protocol around it (when to plan, how to agree and switch): the chooser reads the current generation and returns
the record it proposed; its own planning statistics are in :attr:`ShapeChooser.stats`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Optional, Sequence

import torch.distributed as dist

from lightning_parcae.planning.costmodel import DefaultCostModel, MigrationConstants, Shape, largest_split
from lightning_parcae.planning.measured import (
    ExplorationBudget,
    MeasuredThroughput,
    PipelineThroughput,
    min_stages_for_memory,
)
from lightning_parcae.planning.policy import DecisionOptions, ShapeDecider, ends_hold, hold_after
from lightning_parcae.planning.migration_plan import StageLostError, plan_migration
from lightning_parcae.planning.shape_optimizer import PAUSED, Decision, FirstCosts, LiveputOptimizer
from lightning_parcae.errors import ConfigurationError
from lightning_parcae.runtime.config import RuntimeConfig
from lightning_parcae.runtime.coordinator import Coordinator, booting_key
from lightning_parcae.runtime.generation import GenerationRecords, GenerationState
from lightning_parcae.runtime.host import TrainingHost
from lightning_parcae.runtime.liveness import NoticeCheck, read_beats
from lightning_parcae.runtime.part import EventSink
from lightning_parcae.runtime.prior import read_prior_profile
from lightning_parcae.runtime.store import TamperedRecordError
from lightning_parcae.runtime.torch_internals import child

if TYPE_CHECKING:  # pragma: no cover
    import pytorch_lightning as pl

__all__ = ["ShapeChooser", "Question", "RUNTIME_CONSTANTS", "MEASURED_KEY", "BATCH_GRACE_S"]

log = logging.getLogger("lightning_parcae.elastic")

MEASURED_KEY = "parcae/measured"
"""Store key of the measured profile (the leader publishes it each interval, so a new leader keeps it)."""


PROFILE_EVERY_S = 5.0
"""A planning interval republishes the measured profile at most this often unless a migration happened since (a
new leader starts from it; the end of training saves it whole)."""


BATCH_GRACE_S = 10.0
"""At a plain planning interval the leader holds a ready standby back while a mate of its launch batch (the joiners
``parcae run`` started for one trace event: ``parcae/booting/<member>``) still boots -- for at most this many
seconds (the chooser's clock, i.e. real seconds, not trace time), counted from when the first of the batch was seen
ready; then it admits what is ready. Why 10 s: the mates of the README's 2 -> 4 become ready 0.1 s apart on an idle
machine and seconds apart under load (torch's import alone takes 4.5 s idle), so the grace must cover a few seconds
of spread -- 10 s is five planning intervals of that job (2 s at ``--time-scale 30``); and it must stay below the
time to the trace's next event (12 s there: 1,800,000 -> 2,160,000 ms at scale 30) and short against what the wait
costs: the ready standby idles (it adds nothing until admitted anyway) while the job trains on in its current
shape, against a second migration -- a repartition with every member stopped, and two warm-up steps -- that one
admission of the whole batch saves."""


RUNTIME_CONSTANTS = MigrationConstants(group_base_ms=30.0, join_ms=150.0, restart_ms=10000.0)
"""Migration costs of this runtime as measured by ``benchmarks/bench_migration.py`` on loopback: a group rebuild
is tens of ms, a *warm* standby joins in ~0.1-0.2 s (its imports and model were done while it waited -- the
simulator's default ``join_ms`` of 2.5 s prices a cold process), a full restart ~10 s. With the cold value a short
planning interval made the optimizer reach (4,1) through (2,2) instead of directly."""


@dataclass
class _Try:
    """An exploration try the chooser is accounting for (owned by :class:`ShapeChooser`).

    Attributes:
        shape: The tried shape.
        origin: The measured shape it left.
        generation: The generation the try was decided in.
        phase: ``"moving"`` (decided, not entered yet), ``"trial"`` (in the shape, not measured yet) or
            ``"returning"`` (measured, lost: the migration back is the try's too).
        since: When the current phase began (the chooser's clock); in ``"returning"``, when the move back was
            decided (None: not yet).
    """

    shape: Shape
    origin: Shape
    generation: int
    phase: str
    since: Optional[float]


@dataclass
class Question:
    """What one decision of the leader is about (:meth:`ShapeChooser.gather`), and its answer.

    Attributes:
        reason: Why the leader decides (``"interval"``, ``"standbys ready: ..."``, a notice).
        leaving: The noticed members (empty at a planning interval).
        standbys: The ready standbys the next generation may take.
        available: The processes the next generation is drawn from (staying members, then ``standbys``).
        n_now: Instances the job has now (members + ``standbys``).
        generation: The generation it was asked in (an answer for an older one is stale).
        shape: The chosen shape (:meth:`ShapeChooser.choose_for`; None: nothing fits, or not chosen yet).
        spent_s: Seconds the choice took.
        ahead_steps: Steps the job trained while it was chosen (0: it was chosen at the step boundary).
    """

    reason: str
    leaving: list[str]
    standbys: list[str]
    available: list[str]
    n_now: int
    generation: int
    shape: Optional[Shape] = None
    spent_s: float = 0.0
    ahead_steps: int = 0

    @property
    def observe(self) -> bool:
        """A planning interval's question (no one leaving): its count goes into the availability history."""
        return not self.leaving


class ShapeChooser:
    """The leader-side planning state of one process's runtime (every process keeps one: a new leader takes over).

    Args:
        host: The training side (the layer stack, its times and memory, the global batch).
        state: The current generation (read only).
        config: The planning options (interval, look-ahead, predictor, throughput mode, heartbeats, run dir).
        records: Builds the next generation's record and prices layers.
        coord: The job's records (``None``: none yet -- the measured model then starts empty).
        store: The store client that reads standbys' heartbeats.
        migrations: This process's migrations so far (the runtime's list; read only).
        event: The event log.
        clock: Monotonic seconds (step timing, settling and the exploration accounting); a test passes its own.

    Attributes:
        stats: The last planning's figures (``predicted_N``, ``liveput``, ``decision``, ``throughput``,
            ``exploration``: :meth:`~lightning_parcae.planning.measured.ExplorationBudget.report`).
        exploration: The exploration budget (``config.max_exploration_share``): every try's migrations and trial
            time are charged to it, from the decision that starts the try until the shape is measured (and, if it
            lost, until the job is back in another shape); a try it refuses is an ``explore_refused`` event. The
            training time it is measured against runs from this chooser's first step boundary (a new leader
            starts its own account).
    """

    def __init__(self, host: TrainingHost, state: GenerationState, config: RuntimeConfig, records: GenerationRecords,
                 *, coord: Optional[Coordinator] = None, store: Optional[dist.Store] = None,
                 migrations: Sequence[Mapping[str, Any]] = (), event: Optional[EventSink] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.host = host
        self.state = state
        self.config = config
        self.records = records
        self.coord = coord
        self.store = store
        self.migrations = migrations
        self.event: EventSink = event if event is not None else _no_event
        self.stats: dict[str, Any] = {"predicted_N": None, "liveput": None}
        self._standby_seen: dict[str, bytes] = {}
        self._last_standbys: list[str] = []
        # standbys counted ready at the last decision (admitted or not): an arrival is a ready standby outside it
        self._considered: set[str] = set()
        self._arrived: list[str] = []  # ready standbys seen at a step boundary since the last decision
        self.measured: Optional[MeasuredThroughput] = None
        self._optimizer: Optional[LiveputOptimizer] = None
        self._decider: Optional[ShapeDecider] = None
        self._request_done: Any = None
        # (generation, step, time, first in its generation) at the last step boundary
        self._step_mark: Optional[tuple[int, int, float, bool]] = None
        self._warmup = 0
        self._profile_saved: Optional[tuple[float, int]] = None  # (when, migrations then) of the last save_profile
        self._costs_fitted_on = 0  # in-place migrations the planner's migration constants were fitted from
        self._entered: Optional[tuple[int, float]] = None  # (generation, when its first step boundary came)
        self._noted_at = float("-inf")  # when note_standbys last read the standbys' heartbeats
        self._clock = clock
        self.exploration = ExplorationBudget(config.max_exploration_share)
        self._started: Optional[float] = None  # the first step boundary: training wall time counts from here
        self._try: Optional[_Try] = None  # the exploration try being accounted for
        # migration constants the previous leader published with its measurements (model() reads them)
        self._published_constants: Optional[MigrationConstants] = None
        # the shape the last departing decision chose over the throughput-best one (a hold; see choose)
        self._held: Optional[Shape] = None
        # launch batch -> when its first member was seen ready (None: its grace is over, it is never held again)
        self._batch_ready_since: dict[str, Optional[float]] = {}
        self._notice_check = NoticeCheck(config.token, lambda name, /, **f: self.event(name, **f), "standby")

    def mark_step(self, generation: int, step: int) -> None:
        """A step boundary's work is done: the next step is timed from here (planning, agreement and migrations
        are not step time); the first steps of a new shape are marked as warm-up."""
        now = self._clock()
        if self._started is None:
            self._started = now
        if self._step_mark is None or self._step_mark[0] != generation:
            self._warmup = 2  # a new shape: new process groups and joiners warm up during its first steps
            self._entered = (generation, now)
            self._try_entered(generation, now)
        fresh = self._warmup > 0
        self._warmup -= 1
        self._step_mark = (generation, step, now, fresh)

    @property
    def throughput_model(self) -> Any:
        """The optimizer's throughput model (``None`` before the first decision)."""
        return self._optimizer.thr if self._optimizer is not None else None

    def now(self) -> float:
        """This chooser's clock (monotonic seconds)."""
        return self._clock()

    def record_step(self, step: int, ended: Optional[float] = None) -> None:
        """Time the step that just ended (at ``ended`` on :meth:`now`'s clock; default: now), if it ran whole in
        the current shape (not the first after a switch)."""
        mark, now = self._step_mark, self._clock() if ended is None else ended
        if mark is None or self.state.layout is None or mark[0] != self.state.generation or step != mark[1] + 1 or mark[3]:
            return  # the first steps of a shape warm up new process groups and joiners: not representative
        model = self.model()
        if model is not None:
            model.record(self.state.layout.data_parallel, self.state.layout.pipeline_stages, 1000.0 * (now - mark[2]))
            self._try_measured(model, now)

    # ------------------------------------------------------------------------------------------ exploration account
    def _elapsed(self, now: float) -> float:
        """Training wall seconds so far (from this chooser's first step boundary; 0 before it)."""
        return 0.0 if self._started is None else max(0.0, now - self._started)

    def _try_entered(self, generation: int, now: float) -> None:
        """A new generation's first step boundary: charge the migration that led here if it was a try's."""
        t = self._try
        if t is None or self.state.layout is None:
            return
        here = (self.state.layout.data_parallel, self.state.layout.pipeline_stages)
        since = now if t.since is None else t.since
        if t.phase == "moving" and generation != t.generation and here == t.shape:
            self.exploration.charge(now - since)  # the migration to the tried shape
            t.phase, t.since = "trial", now
            return
        if t.phase == "trial":
            self.exploration.charge(now - since)  # left before it was measured (a notice, a loss)
        elif t.phase == "returning" and t.since is not None:
            self.exploration.charge(now - since)  # the migration back from a try that lost
        self._try = None  # the try is over (or the move it was decided for went elsewhere)

    def _try_measured(self, model: MeasuredThroughput, now: float) -> None:
        """After a recorded step: a try whose shape is now measured ends its trial; if it lost (not faster than
        the shape it left by the margin) the migration back is charged too."""
        t = self._try
        if t is None or t.phase != "trial" or self.state.layout is None:
            return
        if (self.state.layout.data_parallel, self.state.layout.pipeline_stages) != t.shape:
            return
        tried, origin = model.measured(*t.shape), model.measured(*t.origin)
        if tried is None:
            return
        self.exploration.charge(now - (now if t.since is None else t.since))
        kept = origin is None or tried > origin * (1.0 + model.required_gain(t.origin, t.shape))
        self.event("explore_done", shape=list(t.shape), origin=list(t.origin), kept=kept, measured=tried,
                   measured_origin=origin, **self.exploration.report(self._elapsed(now)))
        if kept:
            self._try = None
        else:
            t.phase, t.since = "returning", None

    def choose(self, n_now: int, n_next: int, observe: bool, *, available: Optional[Sequence[str]] = None,
               senders: Optional[Sequence[str]] = None, history_recorded: bool = False) -> Optional[Shape]:
        """Next shape: the liveput optimizer over the known next interval and the predicted ones after it.

        Args:
            n_now: Instances the job has now (members + live standbys, including any under notice or just lost).
            n_next: Instances it will have for the next interval (notices and losses removed).
            observe: This is a planning interval: record ``n_next`` in the availability history.
            available: The processes the next generation is drawn from, in the order the migration plan takes
                them (``n_next`` of them): the move to each candidate is then priced by the plan the leader would
                make (:meth:`_known_moves`), not by an expectation over which members leave.
            senders: The old members that can still send state (default: every old member -- a noticed leaver
                hands its state over; after a loss only the survivors).
            history_recorded: :meth:`gather` already wrote ``n_next`` into the store's availability history (the
                caller may be a thread that must not touch the store).
        """
        s = self.host
        assert self.state.layout is not None and self.coord is not None
        if self._try is not None and self._try.phase == "moving" and self._try.generation == self.state.generation:
            self._try = None  # the try decided last time was never entered (no migration followed)
        if n_next < 1 or s.global_batch is None:
            return None
        measured = self.model()
        assert measured is not None
        by_measurement = self.config.throughput == "measured"
        if self._optimizer is None:
            self._build_decider(measured)
        decider = self._decider
        assert decider is not None
        if by_measurement:
            self._refit_migration_costs(decider)
        if observe or not decider.observed:
            decider.observe(n_next)
            if observe and not history_recorded:
                self.coord.append_history(n_next)
        cur = (self.state.layout.data_parallel, self.state.layout.pipeline_stages)
        thr = measured if by_measurement else measured.prior
        stay = 1  # planning intervals the forecast keeps n_next (1 if planning fails)
        decision: Optional[Decision] = None
        decider.prices_changed()  # prices change as steps are measured
        self.stats.pop("decision", None)  # the decision event reports this call's departure or none
        try:
            # the simulator's parcae policy, literally: the interval about to run is known (notices are in, losses
            # seen, standbys counted); only the intervals after it are forecast, as quantile scenarios
            now = (n_now, max(0, n_next - n_now), max(0, n_now - n_next))
            first_costs = None
            if self.config.policy == "reactive":
                # the baseline: the throughput-best shape for the count about to run, no plan, no forecast (the
                # simulator's live-reactive policy makes this very call)
                shape = decider.optimizer.reactive_shape(n_next)
                decision, scenarios, median = Decision(shape, shape, 0.0, 0.0, (shape,)), [], []
            else:
                first_costs = self._known_moves(decider, available, senders)
                decision, scenarios, weights = decider.decide(cur, now, first_costs=first_costs, held=self._held)
                shape = decision.next_shape
                median = scenarios[len(scenarios) // 2] if scenarios else []
            # how long the forecast keeps this count: the time an exploration's gain can pay back in
            for iv in median[: max(0, self.config.look_ahead - 1)]:
                if int(iv[0] + iv[1] - iv[2]) != n_next:
                    break
                stay += 1
            self.stats["predicted_N"] = [int(n_next)] + [int(iv[0] + iv[1] - iv[2]) for iv in median[:1]]
            self.stats["decision"] = {"reactive": list(decision.reactive), "departs": decision.departs,
                                      "expected_gain": float(decision.expected_gain),
                                      "gain_std": float(decision.gain_std), "scenarios": len(scenarios),
                                      "fit_std": float(decision.fit_std),
                                      # a bet kept: staying in the held shape cleared options.hold_risk
                                      "kept": bool(decision.departs and decision.next_shape == cur == self._held)}
            if decision.alternative is not None:  # a bet not taken: how close it came to the risk rule
                self.stats["decision"].update(alternative=list(decision.alternative),
                                              alternative_gain=float(decision.alternative_gain),
                                              alternative_std=float(decision.alternative_std))
            if shape != PAUSED:
                plan = self._optimizer.plan(n_now, cur, [now, *median][: self.config.look_ahead], first=shape,
                                            first_costs=first_costs)
                self.stats["liveput"] = float(plan.expected_samples)
        except Exception as exc:  # noqa: BLE001 -- planning must never stop training: keep a fitting shape
            log.warning("liveput planning failed (%s); taking the fastest shape that fits", exc)
            shape, decision = PAUSED, None
        if shape == PAUSED or shape[0] * shape[1] > n_next or thr.throughput(*shape) <= 0:
            cands = thr.candidates(n_next)
            if not cands:
                return None
            shape = max(cands, key=lambda sh: (thr.throughput(*sh), -abs(sh[1] - cur[1])))
        # a hold ends when the decision takes its departure back (regression, issue 21, 0.25 Gbps replay of
        # lh_80_90 at N = 32: at 16 instances parcae held 1x9 rather than repartition to 2x7; one interval later the
        # forecast no longer expected the count back and chose 2x7, and the veto refused it -- 2x7 unmeasured, its
        # fit unsure -- so the job ran one more interval at 0.72 of 2x7's rate, where live-reactive already was)
        held = ends_hold(decision, cur, self._held, shape)
        vetoed = False
        if by_measurement and measured.vetoes(cur, shape, n_next, held=held) and not self._returning(shape, measured):
            # never move to a shape measured slower than the current one unless availability forces it
            both = measured.measured(*shape) is not None and measured.measured(*cur) is not None
            self.event("veto", current=list(cur), chosen=list(shape), measured_current=measured.measured(*cur),
                       measured_chosen=measured.measured(*shape),
                       required_gain=round(measured.required_gain(cur, shape), 4) if both else None)
            shape, vetoed = cur, True
        elif held and shape != cur:
            self.event("hold_over", current=list(cur), chosen=list(shape), measured_current=measured.measured(*cur),
                       measured_chosen=measured.measured(*shape))
        young = self._young(n_next)
        if by_measurement and observe and young and shape != cur and not held and \
                not measured.measured_faster(shape, cur):
            # never leave a shape within two planning intervals of entering it, with the same instance count,
            # unless it is measured slower than the chosen one (issue 21: bench_scale's N=16 run explored 3x3 and
            # left it for 2x4 after 3.4 s, before 3x3 had a single measurement). A hold the decision takes back is
            # exempt, as it is from the veto's margin: it was entered for the forecast, not for its throughput,
            # and settling in it is what the rule exists to stop (regression, issue 21, stop 49, 0.25 Gbps replay
            # of lh_80_90: the decision took 1x26 back for 4x6 and ``settle`` kept it 32 s more, at 24 samples/s
            # where 4x6 ran 38, because 1x26 had four steps -- not yet "measured")
            self.event("settle", current=list(cur), chosen=list(shape), measured_current=measured.measured(*cur),
                       measured_chosen=measured.measured(*shape))
            shape = cur
        now = self._clock()
        t = self._try
        if t is not None and t.phase == "returning" and observe:
            if shape == cur:
                self._try = None  # the lost try's shape is kept after all: no move back to charge
            else:
                t.since = now  # the move back starts with this decision
        if by_measurement and shape == cur and observe and not young and self._try is None:
            # an exploration pays back over the intervals the forecast keeps this count, not just the next one.
            # Also after a veto: the veto refuses to move on an unsure fit, the try is what measures it
            # (regression: with ``elif`` here a job launched as 1x2 on 3 instances was vetoed from 1x3, fitted
            # 13 % faster, every interval for 15 s and never tried it)
            move_s = self._move_cost_s()
            explore = measured.exploration(n_next, cur, self.config.interval_s * stay, move_s,
                                           boundary_s=self.config.interval_s)
            if explore is not None:
                # the share of wall time in tries is capped (issue 21: at N >= 8 every next unmeasured shape can
                # be worth a try on its own while the fit stays unsure)
                cost = measured.exploration_cost_s(explore, move_s, boundary_s=self.config.interval_s)
                admitted = self.exploration.admit(cost, self._elapsed(now))
                fields = dict(current=list(cur), chosen=list(explore), measured_current=measured.measured(*cur),
                              fitted=measured.throughput(*explore), uncertainty=measured.uncertainty(*explore),
                              expected_cost_s=round(cost, 4), **self.exploration.report(self._elapsed(now)))
                if admitted:
                    self.event("explore", **fields)
                    shape = explore
                    self._try = _Try(explore, cur, self.state.generation, "moving", now)
                else:
                    self.event("explore_refused", **fields)
        # entered or kept on the forecast, not for its throughput (a vetoed one is a try)
        self._held = hold_after(decision, cur, self._held, shape, vetoed)
        self.stats["exploration"] = self.exploration.report(self._elapsed(now))
        self.stats["throughput"] = {"current": thr.throughput(*cur) if cur[0] else None,
                                    "chosen": thr.throughput(*shape), "measured": measured.measured(*shape)}
        return shape

    def _build_decider(self, measured: MeasuredThroughput) -> None:
        """The liveput decider, priced by ``measured`` (reads the availability history from the store)."""
        assert self.coord is not None
        by_measurement = self.config.throughput == "measured"
        cm = measured.cost_model(self.fitted_constants() if by_measurement else RUNTIME_CONSTANTS)
        if not by_measurement:
            cm = DefaultCostModel(measured.prior, cm.layer_params, RUNTIME_CONSTANTS)
        # a noticed leaver hands its state over (the simulator's forecast prices the replay the same way:
        # benchmarks/bench_replay.py). Regression (issue 21, GPT-1.5B replay, hh_55_65 at N=9): priced as a
        # sudden loss, a notice for one stage of 1x10 was a 24 s checkpoint restart whatever the target, the
        # restart outlasted the 6 s interval, and the optimizer's unfinished-migration rule made a detour
        # through 1x6 (0.73 of 1x9's samples/s) look cheaper than going to 1x9 at once; the job trained
        # 26 s in 1x6 while the migration itself took 0.46 s
        cm.preemption_notice = self.config.preemption_notice
        # the simulator's parcae policy builds the very same decider (planning/policy.py: one predictor factory)
        options = DecisionOptions(look_ahead=self.config.look_ahead, predictor=self.config.predictor,
                                  max_instances=self.config.max_instances, risk=self.config.risk,
                                  min_gain=self.config.min_gain, charge_unmeasured=self.config.charge_unmeasured)
        self._decider = ShapeDecider(cm, interval_s=max(self.config.interval_s, 1.0), options=options,
                                     history=self.coord.history())
        self._optimizer = self._decider.optimizer

    def _known_moves(self, decider: ShapeDecider, available: Optional[Sequence[str]],
                     senders: Optional[Sequence[str]]) -> Optional[FirstCosts]:
        """The price of the move to each candidate shape, from the migration plan the leader would make now.

        The leader knows who leaves (the noticed members, or the lost ones) and who joins (the ready standbys), so
        the interval about to run needs no expectation over victim patterns: each candidate's move is the plan
        :meth:`decide` would propose for it (same layout, order, partition and layer bytes), priced by the cost
        model (:meth:`~lightning_parcae.planning.costmodel.DefaultCostModel.plan_ms`). A target whose plan loses
        a stage, or a cost model without constants, is left to the expectation (``None``).

        Regression (issue 21, stop 49, 0.25 Gbps replay of lh_80_90 at N = 32): at a notice for five of 4x8's
        members the expectation took the victims from the last replicas and priced 4x8 -> 4x6 at 26.0 s (a peak of
        559 kB); the plan with the real leavers moved 457 kB and took 16.4 s. Against the dearer price the
        optimizer chose 1x26 (24 samples/s, where 4x6 ran 38) and the run fell behind live-reactive.
        """
        cm = decider.optimizer.cm
        old = self.state.layout
        if available is None or old is None or not isinstance(cm, DefaultCostModel):
            return None
        avail, send = list(available), list(old.members if senders is None else senders)
        layer_bytes = self.records.layer_bytes()
        partitions: dict[int, list[int]] = {}
        prices: dict[Shape, Optional[float]] = {}

        def price(target: Shape) -> Optional[float]:
            if target not in prices:
                if target[0] * target[1] > len(avail):
                    prices[target] = None
                else:
                    p = target[1]
                    if p not in partitions:
                        partitions[p] = self.partition_for(p)
                    try:
                        plan = plan_migration(old, avail, target, partitions[p], layer_bytes, senders=send)
                    except (StageLostError, ConfigurationError):
                        prices[target] = None
                    else:
                        prices[target] = cm.plan_ms(plan)
            return prices[target]

        return price

    def _returning(self, shape: Shape, measured: MeasuredThroughput) -> bool:
        """Whether ``shape`` is the way back from a lost try: the shape the try left, measured faster than the
        tried one. The veto's margin does not hold it back (the try was priced with that move back in it).

        Regression (issue 21, N = 32 replay, lh_80_90): a try of 2x13 from 4x6 measured 36.5 samples/s against
        37.3 -- lost, yet within the 10 % margin the veto asks of a move to a measured shape -- and the job stayed in
        the tried shape it had decided to leave; with the cap then full it stayed there for 180 s.
        """
        t = self._try
        return t is not None and t.phase == "returning" and shape == t.origin and \
            measured.measured_faster(t.origin, t.shape)

    def _young(self, n_next: int) -> bool:
        """Whether the current generation was entered less than two planning intervals ago and the next interval
        keeps its instance count (no standby to admit, no one leaving): then only a measurement may move it."""
        entered = self._entered
        if entered is None or entered[0] != self.state.generation or self.state.layout is None:
            return False
        if n_next != len(self.state.layout.members):
            return False
        return self._clock() - entered[1] < 2.0 * max(self.config.interval_s, 1e-3)

    def _measured_moves(self) -> list[tuple[str, float, int, float]]:
        """This job's in-place migrations as :meth:`MigrationConstants.fit` takes them (kind, bytes, N, ms).

        The bytes are the most one process sent or received (``bytes_peak``): transfers run in parallel, and the
        cost model prices a move by its largest per-process volume. Regression (stop 48, 0.25 Gbps replay of
        lh_80_90): fitted on the total (``bytes_moved``: 4.3 MB in 16.6 s, 1.2 MB in 19.0 s) the slope came out
        negative, the fit fell back to 10 Gbps after the second repartition, and the leader priced 16-24 s moves
        at milliseconds again."""
        return [(m["kind"], float(m.get("bytes_peak", m.get("bytes_moved", 0))), int(m.get("N", 1)),
                 1000.0 * float(m["duration_s"]))
                for m in self.migrations if m.get("kind") in ("intra-stage", "inter-stage", "repartition")]

    def fitted_constants(self, moves: Optional[list[tuple[str, float, int, float]]] = None) -> MigrationConstants:
        """Migration constants fitted from this process's in-place migrations, on top of the constants the
        previous leader published (:data:`RUNTIME_CONSTANTS` where nobody measured anything yet): what
        ``profile.json`` saves and, with ``throughput="measured"``, what the leader plans with. ``moves``:
        :meth:`_measured_moves`, if the caller has them already."""
        moves = self._measured_moves() if moves is None else moves
        base = self._published_constants or RUNTIME_CONSTANTS
        return MigrationConstants.fit(moves, base=base) if moves else base

    def _refit_migration_costs(self, decider: ShapeDecider) -> None:
        """Price the next decisions' migrations by what this job's migrations have cost (refit after each new one).

        Regression (issue 21): the leader planned with :data:`RUNTIME_CONSTANTS` -- a group rebuild of 30 ms and
        state at 10 Gbps, measured on loopback with a small model -- whatever its migrations really took, while
        ``profile.json`` (and so the simulator's forecast of the same run) carried constants fitted from them. On a
        job whose stages take seconds to move (an emulated GPT-1.5B on a 0.25 Gbps state link: 5-13 s a
        repartition against the 0.03-0.1 s priced) the forecast saw what holding a shape through a dip saves and
        the runtime did not: it moved at every count change, as live-reactive does.
        """
        moves = self._measured_moves()
        done = len(moves)
        if done == self._costs_fitted_on:
            return
        self._costs_fitted_on = done
        fitted = self.fitted_constants(moves)
        decider.set_constants(fitted)
        self.event("migration_costs", migrations=done, group_base_ms=round(fitted.group_base_ms, 1),
                   group_per_process_ms=round(fitted.group_per_process_ms, 2),
                   bandwidth_bytes_per_s=round(fitted.bandwidth_bytes_per_s, 1),
                   transfer_latency_ms=round(fitted.transfer_latency_ms, 1))

    def _move_cost_s(self) -> float:
        """Typical in-place migration time of this job so far (0.5 s before the first one)."""
        done = [float(m["duration_s"]) for m in self.migrations if m.get("kind") != "fallback"]
        return float(sum(done) / len(done)) if done else 0.5

    def _stage_memory(self) -> list[float]:
        """Per-layer resident training memory (as the strategy checks it against ``max_stage_memory_bytes``)."""
        s = self.host
        full = s.full_stack
        if full is not None:
            from lightning_parcae.runtime.partition import layer_memory_bytes  # noqa: PLC0415

            return [float(layer_memory_bytes(child(full, n), s.optimizer_state_factor)) for n in s.layer_names]
        factor = 1.0 + s.optimizer_state_factor
        return [b * (1.0 + factor) / factor for b in self.records.layer_bytes()]

    def model(self) -> Optional[MeasuredThroughput]:
        """This job's throughput model, learned from its own steps (built once the global batch is known; a new
        leader starts from the measurements the previous one published)."""
        if self.measured is not None:
            return self.measured
        s = self.host
        if s.global_batch is None or not s.layer_names:
            return None
        factor = 1.0 + s.optimizer_state_factor
        min_p = min_stages_for_memory(self._stage_memory(), s.max_stage_memory_bytes)
        # the strategy profiles layers in seconds (time.perf_counter); the throughput model and profile.json are in ms
        layer_ms = [1000.0 * float(t) for t in s.layer_times] if s.layer_times else [1.0] * len(s.layer_names)
        prior = PipelineThroughput(layer_ms, s.global_batch,
                                   s.micro_batches, s.max_pipeline_stages, min_p=min_p)
        cores = self.config.shared_cores
        model = MeasuredThroughput(prior, layer_bytes=[b / factor for b in self.records.layer_bytes()], cores=cores)
        model.constants = RUNTIME_CONSTANTS
        raw = self.coord.get(MEASURED_KEY) if self.coord is not None else None
        if not raw and self.config.prior_profile:
            raw = self._from_prior(model)  # this run's own published measurements win over an earlier run's
        if raw:
            try:
                for key, entry in raw.get("shapes", {}).items():
                    d, p = (int(x) for x in key.split(","))
                    for ms in entry["step_ms"]:
                        model.record(d, p, float(ms))
                if raw.get("migration_constants"):
                    # what the job's migrations have cost so far: a new leader does not price its first moves at
                    # loopback constants again (a standby admitted late has measured few migrations itself)
                    self._published_constants = MigrationConstants(**raw["migration_constants"])
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("ignoring the published measurements: %s", exc)
        self.measured = model
        return model

    def _from_prior(self, model: MeasuredThroughput) -> Optional[dict[str, Any]]:
        """The measurements to start from when nothing of this run is published: ``config.prior_profile``'s
        migration constants, and its step times if they are this job's (:mod:`.prior`); event ``prior_profile``.

        The strategy read and checked the file when it was built; one that cannot be read now (a store outage) is
        logged and the leader starts at the loopback constants -- it still refits them from its own migrations."""
        src = self.config.prior_profile
        assert src is not None and self.host.global_batch is not None
        try:
            prior = read_prior_profile(src)
        except ConfigurationError as exc:
            log.warning("%s; starting from the runtime's loopback migration constants", exc)
            self.event("prior_profile", profile=src, error=str(exc))
            return None
        shapes, mismatch = prior.step_times_for(self.host.global_batch, self.host.micro_batches,
                                                  model.layer_bytes or [])
        c = prior.constants
        self.event("prior_profile", profile=src, shapes=sorted(shapes), step_times_not_used=mismatch,
                   bandwidth_bytes_per_s=round(c.bandwidth_bytes_per_s, 1),
                   transfer_latency_ms=round(c.transfer_latency_ms, 1), group_base_ms=round(c.group_base_ms, 1))
        return {"shapes": shapes, "migration_constants": dict(vars(c))}

    def save_profile(self, every_s: float = 0.0) -> None:
        """Leader: publish the measured profile in the store and write ``run_dir/profile.json`` (with migration
        constants fitted from this job's own migrations) -- ``parcae simulate --profile`` loads it.

        Args:
            every_s: Skip it if the last one was less than this long ago and no migration happened since (a
                planning interval passes ``PROFILE_EVERY_S``; the end of training saves unconditionally).
        """
        model = self.measured
        if model is None or not self.state.is_leader:
            return
        now = time.monotonic()
        if every_s > 0 and self._profile_saved is not None and now - self._profile_saved[0] < every_s \
                and self._profile_saved[1] == len(self.migrations):
            return
        self._profile_saved = (now, len(self.migrations))
        try:
            model.constants = self.fitted_constants()
            raw = model.to_json()
            model.constants = RUNTIME_CONSTANTS
            if self.coord is not None:
                self.coord.put(MEASURED_KEY, raw)
            if self.config.run_dir:
                tmp = os.path.join(self.config.run_dir, f".profile.json.{os.getpid()}")
                with open(tmp, "w") as f:
                    json.dump(raw, f, indent=1)
                os.replace(tmp, os.path.join(self.config.run_dir, "profile.json"))
        except Exception as exc:  # noqa: BLE001 -- a profile is a by-product: never stop training for it
            log.warning("could not save the measured profile: %s", exc)

    def requested_shape(self, n: int) -> Optional[Shape]:
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
        if shape[0] * shape[1] > n or shape[1] > len(self.host.layer_names) or (thr and thr.throughput(*shape) <= 0):
            log.warning("ignoring the requested shape %s: it does not fit %d instances / this job's batch", shape, n)
            self.event("request_ignored", requested=list(shape), N=n)
            return None
        return shape

    def _fresh_standbys(self) -> list[str]:
        """Registered standbys whose heartbeat moved since the previous decision and says ``standby``.

        A standby seen for the first time (here or at a step boundary, :meth:`note_standbys`) is only noted (its
        heartbeat then); it is counted at the next decision -- a planning interval, or its own arrival
        (:attr:`arrival`) -- if its heartbeat moved by then. The leader never waits here.

        Regression (issue 21): a first sighting used to be watched for 2.5 heartbeats *inside* the decision --
        0.5 s during which every member waited in the step agreement -- and at N=16, where shape changes keep
        releasing members that come back as new standbys, that sleep was part of the step-boundary agreement's
        49x growth from N=4.
        """
        assert self.coord is not None and self.state.layout is not None and self.store is not None
        cands = self._standby_candidates()
        now = read_beats(self.store, cands)
        alive = [m for m in cands if self._ready(m, now[m])]
        self._standby_seen = {m: b for m, b in now.items() if b is not None}
        return alive

    def _ready(self, member: str, beat: Optional[bytes]) -> bool:
        """Whether standby ``member``'s heartbeat ``beat`` shows it ready: seen before, moved since, and saying
        ``standby`` (not: no heartbeat yet, a first sighting, a heartbeat that stood still, a standby already
        joining)."""
        seen = self._standby_seen.get(member)
        return beat is not None and seen is not None and beat != seen and \
            json.loads(beat.decode()).get("phase") == "standby"

    def note_standbys(self) -> None:
        """Leader, at every step boundary (at most once a heartbeat period): note standbys seen for the first time,
        so that the next planning interval counts every standby whose heartbeat moved since -- not only those
        already seen at the interval before -- and note *arrivals* (:attr:`arrival`): standbys seen before whose
        heartbeat has moved since and says ``standby``, and which the last decision did not count.

        Regression (the README's main job in the slow suite): with first sightings noted only at planning
        intervals, two instances that came back together were admitted one interval apart -- two repartitions
        where one intra-stage change (1x2 -> 2x2) had been.
        """
        now = time.monotonic()
        if self.coord is None or self.store is None or self.state.layout is None or \
                now - self._noted_at < self.config.heartbeat_s:
            return
        self._noted_at = now
        cands = self._standby_candidates()
        new = [m for m in cands if m not in self._standby_seen]
        waiting = [m for m in cands if m in self._standby_seen and m not in self._considered and m not in self._arrived]
        beats = read_beats(self.store, new + waiting) if new or waiting else {}
        self._standby_seen.update({m: beats[m] for m in new if beats.get(m) is not None})
        self._arrived += [m for m in waiting if self._ready(m, beats.get(m))]

    @property
    def arrival(self) -> list[str]:
        """Standbys that became ready since the last decision (:meth:`note_standbys`): the leader plans at the next
        step boundary that may admit, not at the next planning interval (:meth:`decide` clears this).

        Regression (issue 21, the N = 32 replay of hh_55_65, second pass): two instances launched at 420 s were
        ready 13 s later; reactive's planning interval fell at 433.4 s and admitted them, parcae's had fallen about
        432 s (its 22-s cadence; only changes are logged), so they waited for the next one, at 454 s -- 21 s more
        in 2x9 instead of 4x6, a third of the pass's gap between the two policies, decided by the phase of a clock.
        A ready instance is paid for: it is planned in within a heartbeat and a step of being ready, whatever the
        interval."""
        return list(self._arrived)

    def _standby_candidates(self) -> list[str]:
        """Registered standbys that are not members of the current generation and have no valid preemption notice
        (registry order, once each; a notice not signed with the job token is ignored: :meth:`_noticed`).

        Regression (the README's main job, slow suite): the trace removed a waiting standby (the launcher stops
        one at once: it holds no state) 0.4 s before a planning interval; its last heartbeat had moved since the
        previous sighting, so the leader admitted it, the transition world waited for it, declared it dead after
        3 s and the job fell back to the checkpoint. A removed standby's notice key is written before it is
        stopped, and a standby with a notice is never admitted.
        """
        assert self.coord is not None and self.state.layout is not None and self.store is not None
        return [m for m in dict.fromkeys(self.coord.standbys())
                if m not in self.state.layout.members and not self._noticed(m)]

    def _noticed(self, member: str) -> bool:
        """Whether ``member`` has a valid preemption notice (:class:`~.liveness.NoticeCheck`: a forged one is
        ignored, never a reason to leave a standby out)."""
        assert self.store is not None
        return self._notice_check(self.store, member)

    def _booting_record(self, member: str) -> Optional[dict[str, Any]]:
        """``member``'s launch-batch record (``parcae/booting/<member>``: ``{"batch", "members", "t"}``, written
        by ``parcae run`` for the joiners of one trace event), or None: none, or one that fails verification."""
        assert self.coord is not None
        try:
            rec = self.coord.get(booting_key(member))
        except (TamperedRecordError, ValueError, UnicodeDecodeError) as exc:
            log.warning("ignoring the launch-batch record %s: %s", booting_key(member), exc)
            return None
        return rec if isinstance(rec, dict) and rec.get("batch") is not None else None

    def _batch_mate_booting(self, mate: str, ready: set[str]) -> bool:
        """Whether ``mate`` (of a ready standby's launch batch) still boots: it is not ready, not a member of the
        current generation, not under a (valid) notice and its booting record is there and not marked gone."""
        assert self.state.layout is not None
        if mate in ready or mate in self.state.layout.members or self._noticed(mate):
            return False
        rec = self._booting_record(mate)
        return rec is not None and not rec.get("gone")

    def _hold_for_batches(self, standbys: list[str]) -> list[str]:
        """The ready ``standbys`` to admit at this plain planning interval: a standby whose launch batch (see
        :data:`BATCH_GRACE_S`) has a mate still booting is held back -- the whole batch is then admitted at a
        later interval in one generation -- until :data:`BATCH_GRACE_S` has passed since the first of its batch was
        seen ready; then what is ready is admitted. A notice for the booting mate, its exit (its record marked
        gone) or its admission end the wait. Each interval that holds someone back is an ``admission_held``
        event (``members``, ``waiting_for``, ``batch``, ``waited_s``); the end of a grace with mates still booting
        is an ``admission_grace_over`` event.

        Only plain interval admissions wait (``decide`` with no one leaving): a standby that replaces a member
        under notice never does. ``parcae agent`` starts one worker per machine and writes no batch records:
        nothing of its job is ever held here.
        """
        if not standbys:
            return standbys
        now = self._clock()
        ready = set(standbys)
        admitted: list[str] = []
        held: dict[str, tuple[list[str], list[str], float]] = {}  # batch -> (held, waiting for, waited_s)
        for m in standbys:
            rec = self._booting_record(m)
            if rec is None:
                admitted.append(m)
                continue
            batch = str(rec["batch"])
            if batch not in self._batch_ready_since:
                self._batch_ready_since[batch] = now
            since = self._batch_ready_since[batch]
            mates = [x for x in dict.fromkeys(str(x) for x in rec.get("members") or []) if x != m]
            booting = [x for x in mates if self._batch_mate_booting(x, ready)] if since is not None else []
            if not booting:
                admitted.append(m)
                continue
            assert since is not None
            if now - since >= BATCH_GRACE_S:
                self._batch_ready_since[batch] = None  # its grace is over: never held again
                self.event("admission_grace_over", batch=batch, members=[m], waiting_for=booting,
                           waited_s=round(now - since, 3), grace_s=BATCH_GRACE_S)
                admitted.append(m)
                continue
            entry = held.setdefault(batch, ([], booting, round(now - since, 3)))
            entry[0].append(m)
        for batch, (members, waiting, waited) in held.items():
            log.info("holding standbys %s back for their launch batch %s: %s still booting (%.1f s of %.0f s)",
                     members, batch, waiting, waited, BATCH_GRACE_S)
            self.event("admission_held", batch=batch, members=members, waiting_for=waiting, waited_s=waited,
                       grace_s=BATCH_GRACE_S)
        return admitted

    def partition_for(self, p: int) -> list[int]:
        s = self.host
        assert self.state.layout is not None
        if p == self.state.layout.pipeline_stages:
            return list(self.state.layout.partition)
        from lightning_parcae.runtime.partition import balance_stages  # noqa: PLC0415

        times = s.layer_times or [1.0] * len(s.layer_names)
        memory = self.records.layer_bytes()
        return balance_stages(times, p, memory, s.max_stage_memory_bytes)

    def decide(self, trainer: "pl.Trainer", reason: str, leaving: Iterable[str],
               admit: bool = True) -> Optional[dict[str, Any]]:
        """Leader: choose the next generation and publish it (None: keep the current one).

        ``admit=False`` leaves standbys out (a validation runs right after this step: see
        :meth:`~lightning_parcae.runtime.host.TrainingHost.validation_follows`). At a plain planning interval
        (``leaving`` empty) a ready standby whose launch batch still boots is held back
        (:meth:`_hold_for_batches`); a notice's decision (``leaving`` names the noticed members) admits every
        ready standby at once: it replaces members that are going away. (Recovery after a loss does not come
        here: it chooses the survivors' shape through :meth:`choose`.)

        This is :meth:`gather`, :meth:`choose_for` and :meth:`publish` in a row; a planning interval's decision
        runs the middle one on a thread while the job trains (:class:`~.plan_ahead.PlanAhead`).
        """
        question = self.gather(reason, leaving, admit)
        self.choose_for(question)
        return self.publish(trainer, question)

    def gather(self, reason: str, leaving: Iterable[str], admit: bool = True) -> "Question":
        """Leader: what the next decision is about -- who stays, which ready standbys join (everything read from
        the store is read here, on the calling thread); the count is recorded in the availability history when
        it is a planning interval's (``leaving`` empty)."""
        assert self.state.layout is not None and self.coord is not None
        leaving = list(leaving)
        old = self.state.layout
        standbys = self._fresh_standbys() if admit else []
        if admit:
            self._considered, self._arrived = set(standbys), []
        if not leaving:
            # a plain interval admission waits for booting batch-mates (never a notice's: it replaces a leaver)
            standbys = self._hold_for_batches(standbys)
        staying = [m for m in old.members if m not in leaving]
        q = Question(reason, leaving, standbys, staying + standbys, len(old.members) + len(standbys),
                     self.state.generation)
        if self.model() is not None and self._decider is None:
            self._build_decider(self.measured)  # reads the availability history from the store
        if q.observe and self._decider is not None and self.host.global_batch is not None and q.available:
            self.coord.append_history(len(q.available))
        return q

    def choose_for(self, question: "Question") -> None:
        """The decision about ``question`` (:meth:`gather`'s): sets ``question.shape``. Reads and writes only this
        chooser's planning state -- never the store -- so a thread may run it while the job trains."""
        t = time.perf_counter()
        question.shape = self.choose(question.n_now, len(question.available), observe=question.observe,
                                     available=question.available, history_recorded=True)
        question.spent_s = time.perf_counter() - t

    def publish(self, trainer: "pl.Trainer", question: "Question") -> Optional[dict[str, Any]]:
        """Leader: propose the generation :meth:`choose_for` chose for ``question``, as of ``trainer``'s step
        (None: keep the current one). Store reads and writes happen here, on the calling thread."""
        assert self.state.layout is not None and self.coord is not None
        old, leaving, standbys, avail = self.state.layout, question.leaving, question.standbys, question.available
        reason, shape = question.reason, question.shape
        cur = (old.data_parallel, old.pipeline_stages)
        self.save_profile(every_s=PROFILE_EVERY_S)
        requested = self.requested_shape(len(avail))
        if requested is not None:
            shape, reason = requested, f"{reason}; operator requested D={requested[0]} P={requested[1]}"
        if shape != cur or leaving or standbys != self._last_standbys:
            self._last_standbys = list(standbys)
            extra = {"planned_ahead_steps": question.ahead_steps} if question.ahead_steps else {}
            self.event("decision", reason=reason, N=len(avail), current=list(cur),
                       chosen=list(shape) if shape else None, standbys=standbys, leaving=leaving,
                       predicted=self.stats.get("predicted_N"), liveput=self.stats.get("liveput"),
                       throughput=self.stats.get("throughput"), exploration=self.stats.get("exploration"),
                       departure=self.stats.get("decision"), planning_s=round(question.spent_s, 4), **extra)
        if shape is None:  # every member is alive here: save a checkpoint before stopping
            return self._propose_fallback(int(trainer.global_step), f"{reason}: no shape fits {len(avail)} instances",
                                          checkpoint=True, min_instances=self.fewest_instances(len(avail)))
        if shape == cur and not leaving:
            return None
        try:
            plan = plan_migration(old, avail, shape, self.partition_for(shape[1]), self.records.layer_bytes(),
                                  senders=list(old.members))
        except StageLostError as exc:
            return self._propose_fallback(int(trainer.global_step), f"{reason}: {exc}")
        if plan.kind.value == "none":
            return None
        rec = self.records.record(self.state.generation + 1, plan.new, plan, plan.kind.value, int(trainer.global_step),
                           reason=reason)
        return self.coord.propose(rec)

    def split_global_batch(self, trainer: "pl.Trainer") -> dict[str, Any]:
        """Leader: propose a generation whose D splits the global batch, when the running one's does not.

        The launcher seats a first generation before any worker knows the script's global batch B (``D`` a power
        of two: :func:`~lightning_parcae.launch.processes.initial_members`); B = 60 on 8 instances at P = 1 is
        D = 8, which cannot split it. Once the training loader is known (before the first step) the members move
        to the same P with the largest D that splits B (here D = 6): no layer moves, the members left over are
        released and start again as standbys, and the first planning interval chooses among every shape as
        usual. Every member reaches the same conclusion from the same B (no agreement is needed); the others wait
        for this record.

        Raises:
            ConfigurationError: (internal) if B is not a multiple of M: the data path refuses that with the fix.
        """
        assert self.state.layout is not None and self.coord is not None
        b, m = self.host.global_batch, self.host.micro_batches
        old = self.state.layout
        d, p = old.data_parallel, old.pipeline_stages
        if b is None or b % m:
            raise ConfigurationError(f"internal: no D splits the global batch {b} into micro_batches={m}")
        new_d = largest_split(b, d, m)
        reason = (f"the global batch {b} does not split over D={d} pipelines of M={m} micro-batches: D={new_d}, "
                  f"{(d - new_d) * p} instance(s) released as standbys")
        self.event("decision", reason=reason, N=len(old.members), current=[d, p], chosen=[new_d, p], standbys=[],
                   leaving=[])
        step = int(trainer.global_step)
        plan = plan_migration(old, list(old.members), (new_d, p), self.partition_for(p), self.records.layer_bytes(),
                              senders=list(old.members))
        rec = self.records.record(self.state.generation + 1, plan.new, plan, plan.kind.value, step, reason=reason)
        return self.coord.propose(rec)

    def _propose_fallback(self, step: int, reason: str, checkpoint: bool = False,
                          min_instances: Optional[int] = None) -> dict[str, Any]:
        """Propose a stop for a restart from the checkpoint as the next generation."""
        assert self.coord is not None
        return self.coord.propose(self.records.fallback(self.state.generation + 1, step, reason, checkpoint,
                                                        min_instances=min_instances))

    def fewest_instances(self, above: int) -> Optional[int]:
        """The fewest instances, more than ``above``, on which some shape of this model fits (the throughput
        model's candidates: the memory rule, the batch split); None while there is no model, or if no count up to
        one stage per layer fits. A fallback for want of instances carries it, so that the launcher waits for that
        many before it relaunches (a relaunch on fewer fails: no split of the model fits them)."""
        measured = self.model()
        if measured is None:
            return None
        thr = measured if self.config.throughput == "measured" else measured.prior
        for n in range(max(1, above + 1), max(above + 1, len(self.host.layer_names)) + 1):
            if thr.candidates(n):
                return n
        return None


def _no_event(event_name: str, /, **fields: Any) -> None:
    """The event log of a chooser that has none (a test, a tool)."""
