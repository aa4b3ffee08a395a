"""The leader's choice of the next generation: its shape, from this job's own measurements and a forecast.

Problem: at each planning interval the leader must price every shape that fits the instances it will have --
by the step times *this* job has measured where it ran a shape, by a model fitted to them elsewhere -- and pick
the next one with the same decision the simulator scores (:func:`~lightning_parcae.planning.policy.decide_with_forecast`),
then apply the runtime's guards: never move to a shape measured slower unless availability forces it, explore an
unmeasured shape when the model is unsure and the interval is long, honour an operator's one-off resize request.
It also decides who takes part (standbys whose heartbeat moves) and plans the migration to the chosen
shape, publishing the next generation's record. This module holds that state (the measured model, the optimizer,
the predictor) for one :class:`~lightning_parcae.runtime.elastic.ElasticRuntime`, which owns the protocol around
it (when to plan, how to agree and switch).
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any, Iterable, Optional

from lightning_parcae.contract import SHARED_CORES_ENV
from lightning_parcae.planning.costmodel import DefaultCostModel, MigrationConstants, Shape
from lightning_parcae.planning.forecast import make_predictor
from lightning_parcae.planning.measured import MeasuredThroughput, PipelineThroughput, min_stages_for_memory
from lightning_parcae.planning.policy import decide_with_forecast
from lightning_parcae.planning.migration_plan import StageLostError, plan_migration
from lightning_parcae.planning.shape_optimizer import PAUSED, LiveputOptimizer
from lightning_parcae.runtime.liveness import hb_key

if TYPE_CHECKING:  # pragma: no cover
    import pytorch_lightning as pl

__all__ = ["ShapeChooser", "RUNTIME_CONSTANTS", "MEASURED_KEY"]

log = logging.getLogger("lightning_parcae.elastic")

MEASURED_KEY = "parcae/measured"
"""Store key of the measured profile (the leader publishes it each interval, so a new leader keeps it)."""


RUNTIME_CONSTANTS = MigrationConstants(group_base_ms=30.0, join_ms=150.0, restart_ms=10000.0)
"""Migration costs of this runtime as measured by ``benchmarks/bench_migration.py`` on loopback: a group rebuild
is tens of ms, a *warm* standby joins in ~0.1-0.2 s (its imports and model were done while it waited -- the
simulator's default ``join_ms`` of 2.5 s prices a cold process), a full restart ~10 s. With the cold value a short
planning interval made the optimizer reach (4,1) through (2,2) instead of directly."""


class ShapeChooser:
    """The leader-side planning state of one process's runtime (every process keeps one: a new leader takes over).

    Args:
        rt: The :class:`~lightning_parcae.runtime.elastic.ElasticRuntime` it plans for (its layout, coordinator,
            host strategy, options, events and statistics are read; it is not imported here, so that the runtime
            owns its chooser without an import cycle).
    """

    def __init__(self, rt: Any) -> None:
        self.rt = rt
        self.measured: Optional[MeasuredThroughput] = None
        self._optimizer: Optional[LiveputOptimizer] = None
        self._predictor: Any = None
        self._request_done: Any = None
        # (generation, step, time, first in its generation) at the last step boundary
        self._step_mark: Optional[tuple[int, int, float, bool]] = None
        self._warmup = 0

    def mark_step(self, generation: int, step: int) -> None:
        """A step boundary's work is done: the next step is timed from here (planning, agreement and migrations
        are not step time); the first steps of a new shape are marked as warm-up."""
        if self._step_mark is None or self._step_mark[0] != generation:
            self._warmup = 2  # a new shape: new process groups and joiners warm up during its first steps
        fresh = self._warmup > 0
        self._warmup -= 1
        self._step_mark = (generation, step, time.monotonic(), fresh)

    @property
    def throughput_model(self) -> Any:
        """The optimizer's throughput model (``None`` before the first decision)."""
        return self._optimizer.thr if self._optimizer is not None else None

    def record_step(self, step: int) -> None:
        """Time the step that just ended, if it ran whole in the current shape (not the first after a switch)."""
        mark, now = self._step_mark, time.monotonic()
        if mark is None or self.rt.layout is None or mark[0] != self.rt.generation or step != mark[1] + 1 or mark[3]:
            return  # the first steps of a shape warm up new process groups and joiners: not representative
        model = self.model()
        if model is not None:
            model.record(self.rt.layout.data_parallel, self.rt.layout.pipeline_stages, 1000.0 * (now - mark[2]))

    def choose(self, n_now: int, n_next: int, observe: bool) -> Optional[Shape]:
        """Next shape: the liveput optimizer over the known next interval and the predicted ones after it.

        Args:
            n_now: Instances the job has now (members + live standbys, including any under notice or just lost).
            n_next: Instances it will have for the next interval (notices and losses removed).
            observe: This is a planning interval: record ``n_next`` in the availability history.
        """
        s = self.rt.s
        assert self.rt.layout is not None and self.rt.coord is not None
        if n_next < 1 or s.global_batch is None:
            return None
        measured = self.model()
        assert measured is not None
        by_measurement = self.rt.throughput_mode == "measured"
        if self._optimizer is None:
            cm = measured.cost_model(RUNTIME_CONSTANTS)
            if not by_measurement:
                cm = DefaultCostModel(measured.prior, cm.layer_params, RUNTIME_CONSTANTS)
            self._optimizer = LiveputOptimizer(cm, interval_s=max(self.rt.interval_s, 1.0), look_ahead=self.rt.look_ahead)
            self._predictor = make_predictor(self.rt.predictor_name, max_instances=self.rt.max_instances)
            for c in self.rt.coord.history():
                self._predictor.observe(c)
        pred = self._predictor
        if observe or not len(pred.history):
            pred.observe(n_next)
            if observe:
                self.rt.coord.append_history(n_next)
        cur = (self.rt.layout.data_parallel, self.rt.layout.pipeline_stages)
        thr = measured if by_measurement else measured.prior
        stay = 1  # planning intervals the forecast keeps n_next (1 if planning fails)
        # prices change as steps are measured: drop the optimizer's per-count cache of candidate throughputs
        self._optimizer._targets_cache.clear()
        try:
            # the simulator's parcae policy, literally: the interval about to run is known (notices are in, losses
            # seen, standbys counted); only the intervals after it are forecast, as quantile scenarios
            now = (n_now, max(0, n_next - n_now), max(0, n_now - n_next))
            decision, scenarios, weights = decide_with_forecast(self._optimizer, pred, cur, now)
            shape = decision.next_shape
            median = scenarios[len(scenarios) // 2] if scenarios else []
            # how long the forecast keeps this count: the time an exploration's gain can pay back in
            for iv in median[: max(0, self.rt.look_ahead - 1)]:
                if int(iv[0] + iv[1] - iv[2]) != n_next:
                    break
                stay += 1
            self.rt.stats["predicted_N"] = [int(n_next)] + [int(iv[0] + iv[1] - iv[2]) for iv in median[:1]]
            self.rt.stats["decision"] = {"reactive": list(decision.reactive), "departs": decision.departs,
                                      "expected_gain": float(decision.expected_gain),
                                      "gain_std": float(decision.gain_std), "scenarios": len(scenarios)}
            if shape != PAUSED:
                plan = self._optimizer.plan(n_now, cur, [now, *median][: self.rt.look_ahead], first=shape)
                self.rt.stats["liveput"] = float(plan.expected_samples)
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
            self.rt.event("veto", current=list(cur), chosen=list(shape), measured_current=measured.measured(*cur),
                       measured_chosen=measured.measured(*shape))
            shape = cur
        if by_measurement and shape == cur and observe:
            # an exploration pays back over the intervals the forecast keeps this count, not just the next one.
            # Also after a veto: the veto refuses to move on an unsure fit, the try is what measures it
            # (regression: with ``elif`` here a job launched as 1x2 on 3 instances was vetoed from 1x3, fitted
            # 13 % faster, every interval for 15 s and never tried it)
            explore = measured.exploration(n_next, cur, self.rt.interval_s * stay, self._move_cost_s())
            if explore is not None:
                self.rt.event("explore", current=list(cur), chosen=list(explore),
                           measured_current=measured.measured(*cur), fitted=measured.throughput(*explore),
                           uncertainty=measured.uncertainty(*explore))
                shape = explore
        self.rt.stats["throughput"] = {"current": thr.throughput(*cur) if cur[0] else None,
                                    "chosen": thr.throughput(*shape), "measured": measured.measured(*shape)}
        return shape

    def _move_cost_s(self) -> float:
        """Typical in-place migration time of this job so far (0.5 s before the first one)."""
        done = [float(m["duration_s"]) for m in self.rt.migrations if m.get("kind") != "fallback"]
        return float(sum(done) / len(done)) if done else 0.5

    def _stage_memory(self) -> list[float]:
        """Per-layer resident training memory (as the strategy checks it against ``max_stage_memory_bytes``)."""
        s = self.rt.s
        full = s.full_stack
        if full is not None:
            from lightning_parcae.runtime.partition import layer_memory_bytes  # noqa: PLC0415

            return [float(layer_memory_bytes(full._modules[n], s.optimizer_state_factor)) for n in s.layer_names]
        factor = 1.0 + s.optimizer_state_factor
        return [b * (1.0 + factor) / factor for b in self.rt._layer_bytes()]

    def model(self) -> Optional[MeasuredThroughput]:
        """This job's throughput model, learned from its own steps (built once the global batch is known; a new
        leader starts from the measurements the previous one published)."""
        if self.measured is not None:
            return self.measured
        s = self.rt.s
        if s.global_batch is None or not s.layer_names:
            return None
        factor = 1.0 + s.optimizer_state_factor
        min_p = min_stages_for_memory(self._stage_memory(), s.max_stage_memory_bytes)
        # the strategy profiles layers in seconds (time.perf_counter); the throughput model and profile.json are in ms
        layer_ms = [1000.0 * float(t) for t in s.layer_times] if s.layer_times else [1.0] * len(s.layer_names)
        prior = PipelineThroughput(layer_ms, s.global_batch,
                                   s.micro_batches, s.max_pipeline_stages, min_p=min_p)
        cores = int(os.environ.get(SHARED_CORES_ENV) or 0) or None
        model = MeasuredThroughput(prior, layer_bytes=[b / factor for b in self.rt._layer_bytes()], cores=cores)
        model.constants = RUNTIME_CONSTANTS
        raw = self.rt.coord.get(MEASURED_KEY) if self.rt.coord is not None else None
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
        if model is None or not self.rt.is_leader:
            return
        try:
            moves = [(m["kind"], float(m.get("bytes_moved", 0)), int(m.get("N", 1)), 1000.0 * float(m["duration_s"]))
                     for m in self.rt.migrations if m.get("kind") in ("intra-stage", "inter-stage", "repartition")]
            fitted = MigrationConstants.fit(moves, base=RUNTIME_CONSTANTS) if moves else RUNTIME_CONSTANTS
            model.constants = fitted
            raw = model.to_json()
            model.constants = RUNTIME_CONSTANTS
            if self.rt.coord is not None:
                self.rt.coord.put(MEASURED_KEY, raw)
            if self.rt.run_dir:
                tmp = os.path.join(self.rt.run_dir, f".profile.json.{os.getpid()}")
                with open(tmp, "w") as f:
                    json.dump(raw, f, indent=1)
                os.replace(tmp, os.path.join(self.rt.run_dir, "profile.json"))
        except Exception as exc:  # noqa: BLE001 -- a profile is a by-product: never stop training for it
            log.warning("could not save the measured profile: %s", exc)

    def requested_shape(self, n: int) -> Optional[Shape]:
        """An operator's one-off resize request (record ``parcae/request`` = ``{"id", "D", "P"}``), if new and valid.

        This is how a person (or a benchmark) forces a shape regardless of the optimizer; it is applied at the next
        planning interval, once per ``id``.
        """
        assert self.rt.coord is not None
        req = self.rt.coord.get("parcae/request")
        if not req or req.get("id") == self._request_done:
            return None
        self._request_done = req.get("id")
        shape = (int(req.get("D", 0)), int(req.get("P", 0)))
        thr = self._optimizer.thr if self._optimizer is not None else None
        if shape[0] * shape[1] > n or shape[1] > len(self.rt.s.layer_names) or (thr and thr.throughput(*shape) <= 0):
            log.warning("ignoring the requested shape %s: it does not fit %d instances / this job's batch", shape, n)
            self.rt.event("request_ignored", requested=list(shape), N=n)
            return None
        return shape

    def _fresh_standbys(self) -> list[str]:
        """Registered standbys whose heartbeat moves and says ``standby``.

        A heartbeat "moves" if it changed since the previous planning interval; a standby seen for the first time
        is watched for two heartbeat periods (the only time the leader waits).
        """
        assert self.rt.coord is not None and self.rt.layout is not None
        cands = [m for m in dict.fromkeys(self.rt.coord.standbys()) if m not in self.rt.layout.members]

        def beats(members: list[str]) -> dict[str, Optional[bytes]]:
            return {m: bytes(self.rt.store.get(hb_key(m))) if self.rt.store.check([hb_key(m)]) else None for m in members}

        now = beats(cands)
        new = [m for m in cands if m not in self.rt._standby_seen and now[m] is not None]
        moved = {m for m in cands if m in self.rt._standby_seen and now[m] != self.rt._standby_seen[m]}
        if new:
            time.sleep(2.5 * self.rt.heartbeat_s)
            later = beats(new)
            moved |= {m for m in new if later[m] != now[m]}
            now.update(later)
        self.rt._standby_seen = {m: b for m, b in now.items() if b is not None}
        alive = []
        for m in cands:
            b = now[m]
            if m in moved and b is not None and json.loads(b.decode()).get("phase") == "standby":
                alive.append(m)
        return alive

    def partition_for(self, p: int) -> list[int]:
        s = self.rt.s
        assert self.rt.layout is not None
        if p == self.rt.layout.pipeline_stages:
            return list(self.rt.layout.partition)
        from lightning_parcae.runtime.partition import balance_stages  # noqa: PLC0415

        times = s.layer_times or [1.0] * len(s.layer_names)
        memory = self.rt._layer_bytes()
        return balance_stages(times, p, memory, s.max_stage_memory_bytes)

    def decide(self, trainer: "pl.Trainer", reason: str, leaving: Iterable[str],
               admit: bool = True) -> Optional[dict[str, Any]]:
        """Leader: choose the next generation and publish it (None: keep the current one).

        ``admit=False`` leaves standbys out (a validation runs right after this step: see
        :meth:`~lightning_parcae.runtime.elastic.ElasticRuntime.validation_follows`).
        """
        assert self.rt.layout is not None and self.rt.coord is not None
        leaving = list(leaving)
        old = self.rt.layout
        standbys = self._fresh_standbys() if admit else []
        staying = [m for m in old.members if m not in leaving]
        avail = staying + standbys
        cur = (old.data_parallel, old.pipeline_stages)
        shape = self.choose(len(old.members) + len(standbys), len(avail), observe=not leaving)
        self.save_profile()
        requested = self.requested_shape(len(avail))
        if requested is not None:
            shape, reason = requested, f"{reason}; operator requested D={requested[0]} P={requested[1]}"
        if shape != cur or leaving or standbys != self.rt._last_standbys:
            self.rt._last_standbys = list(standbys)
            self.rt.event("decision", reason=reason, N=len(avail), current=list(cur),
                       chosen=list(shape) if shape else None, standbys=standbys, leaving=leaving,
                       predicted=self.rt.stats.get("predicted_N"), liveput=self.rt.stats.get("liveput"),
                       throughput=self.rt.stats.get("throughput"))
        if shape is None:  # every member is alive here: save a checkpoint before stopping
            return self.rt.recovery.propose_fallback(int(trainer.global_step), f"{reason}: no shape fits {len(avail)} instances",
                                          checkpoint=True)
        if shape == cur and not leaving:
            return None
        try:
            plan = plan_migration(old, avail, shape, self.partition_for(shape[1]), self.rt._layer_bytes(),
                                  senders=list(old.members))
        except StageLostError as exc:
            return self.rt.recovery.propose_fallback(int(trainer.global_step), f"{reason}: {exc}")
        if plan.kind.value == "none":
            return None
        rec = self.rt._record(self.rt.generation + 1, plan.new, plan, plan.kind.value, int(trainer.global_step),
                           reason=reason)
        return self.rt.coord.propose(rec)
