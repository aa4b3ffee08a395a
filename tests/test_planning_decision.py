"""The simulator's ``parcae`` policy and the runtime's ``ShapeChooser`` make the same shape decision.

Both decide through :class:`~lightning_parcae.planning.policy.ShapeDecider` (one predictor factory, one optimizer
construction). Here one count history is walked twice -- by ``run_policy("parcae", ...)`` and by a
``ShapeChooser`` over a fake runtime at the simulator's previous shape -- and every call of the decision
(its inputs and its answer) and every chosen shape must be equal.

Regression: the runtime built its predictor as ``make_predictor(name, max_instances=...)`` (each class's own
window, and ``min_instances=8`` for ``artifact``), the simulator with ``window=max(look_ahead, 8),
min_instances=0``: on the cases below the old runtime construction decides otherwise than the simulator.
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import Any, Callable

import pytest
import torch.distributed as dist

from lightning_parcae.planning import policy
from lightning_parcae.planning.costmodel import DefaultCostModel
from lightning_parcae.planning.forecast import make_predictor
from lightning_parcae.planning.policy import DecisionOptions, ShapeDecider, paths_to_intervals
from lightning_parcae.planning.shape_optimizer import PAUSED
from lightning_parcae.planning.sim import run_policy
from lightning_parcae.runtime.config import RuntimeConfig
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.generation import GenerationRecords
from lightning_parcae.runtime.shape_choice import RUNTIME_CONSTANTS, ShapeChooser
from lightning_parcae.signals.corpus import generate

INTERVAL_S = 30.0
"""Long enough that no migration (the slowest: a checkpoint restart, ~24 s) outlasts an interval: the runtime
migrates between two steps, so it never plans with an unfinished one (``remain_ms`` is 0 for both)."""
MAX_INSTANCES = 8
LAYER_BYTES = 3_000_000_000
"""Bytes of each layer's state: a stage move takes seconds, so the plan over the forecast matters."""
MEMORY_LIMIT = 2.5e10
"""Training memory a stage may hold: P >= 2 (as in examples/gpt/spot.yaml), so a lost stage is a restart."""


def _host() -> SimpleNamespace:
    """A fake training host: a 10-layer job priced by its profile (what ShapeChooser reads of it)."""
    layer_times_s = [0.0116] + [0.048] * 8 + [0.03]
    n = len(layer_times_s)
    return SimpleNamespace(global_batch=48, layer_names=[str(i) for i in range(n)], layer_times=layer_times_s,
                           optimizer_state_factor=2.0, max_stage_memory_bytes=MEMORY_LIMIT, full_stack=None,
                           micro_batches=4, max_pipeline_stages=None, stack_path="net")


def _state(shape: tuple[int, int]) -> SimpleNamespace:
    """A fake GenerationState at ``shape`` (the simulator starts paused, at (0, 0), which no Layout can hold)."""
    return SimpleNamespace(member="m0", generation=0, record={"layer_bytes": [LAYER_BYTES] * 10},
                           layout=SimpleNamespace(data_parallel=shape[0], pipeline_stages=shape[1]))


def _chooser(look_ahead: int, predictor: str) -> ShapeChooser:
    """The runtime's chooser as ElasticRuntime builds it, over fakes, planning by the profile (no vetoes)."""
    config = RuntimeConfig(store_url="unused", token=None, member="m0", interval_s=INTERVAL_S, interval_steps=0,
                           look_ahead=look_ahead, predictor=predictor, heartbeat_s=0.01, dead_after_s=3.0,
                           stall_after_s=60.0, throughput="profile", max_instances=MAX_INSTANCES)
    host, state = _host(), _state((0, 0))
    return ShapeChooser(host, state, config, GenerationRecords(host, state),  # type: ignore[arg-type]
                        coord=Coordinator(dist.HashStore()))


def _cost_model(chooser: ShapeChooser) -> DefaultCostModel:
    """The cost model the chooser plans with in ``throughput="profile"`` mode (the runtime's constants, and its
    pricing of departures: ``RuntimeConfig.preemption_notice``, default True -- a noticed leaver hands its state
    over)."""
    model = chooser.model()
    assert model is not None
    return DefaultCostModel(model.prior, model.cost_model(RUNTIME_CONSTANTS).layer_params, RUNTIME_CONSTANTS,
                            preemption_notice=chooser.config.preemption_notice)


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[Any, ...]]:
    """Record every ShapeDecider.decide call: (options, shape, now, remain_ms, decision, scenarios, weights, held)
    -- ``held``, the bet the caller says it holds (stop 56), included: the two must keep the same bets too."""
    calls: list[tuple[Any, ...]] = []
    real = ShapeDecider.decide

    def decide(self: ShapeDecider, shape: Any, now: Any, *, remain_ms: float = 0.0,
               first_costs: Any = None, held: Any = None) -> policy.ForecastDecision:
        # the walk below names no next members, so the runtime prices its first move as the simulator does
        assert first_costs is None
        out = real(self, shape, now, remain_ms=remain_ms, held=held)
        calls.append((self.options, tuple(shape), tuple(now), remain_ms, out.decision, out.scenarios,
                      [float(w) for w in out.weights], held))
        return out

    monkeypatch.setattr(ShapeDecider, "decide", decide)
    return calls


def _simulate(cm: DefaultCostModel, counts: list[int], look_ahead: int, predictor: str) -> list[tuple[int, int]]:
    intervals = paths_to_intervals(counts[0], counts[1:])
    res = run_policy("parcae", cm, intervals, INTERVAL_S, look_ahead=look_ahead, predictor=predictor,
                     max_instances=MAX_INSTANCES)
    return [tuple(s) for s in res.shapes]  # type: ignore[misc]


def _walk_runtime(counts: list[int], look_ahead: int, predictor: str,
                  sim_shapes: list[tuple[int, int]]) -> list[tuple[int, int] | None]:
    """Each interval: the runtime at the simulator's previous shape chooses the next one."""
    chooser = _chooser(look_ahead, predictor)
    out = []
    shape = (0, 0)
    for k, (prev, after) in enumerate(zip(counts, counts[1:])):
        chooser.state = _state(shape)  # type: ignore[assignment]  # the runtime entered the simulator's shape
        out.append(chooser.choose(prev, after, observe=True))
        shape = sim_shapes[k]
    return out


def _histories() -> list[tuple[str, list[int]]]:
    rng = random.Random(7)
    walk = [4]
    for _ in range(30):
        walk.append(min(MAX_INSTANCES, max(1, walk[-1] + rng.choice([-2, -1, 0, 0, 1, 2]))))
    flapping = [int(c) for c in generate("flapping", 0, hours=0.5, cap=MAX_INSTANCES).counts()]
    decline = [int(c) for c in generate("decline", 1, interval_s=300.0, hours=3.0, cap=MAX_INSTANCES).counts()]
    return [("random-walk", walk), ("flapping", [MAX_INSTANCES // 2] + flapping), ("decline", [MAX_INSTANCES] + decline)]


CASES = [(12, "persistence"), (4, "persistence"), (6, "artifact"), (6, "hazard")]


@pytest.mark.parametrize("look_ahead, predictor", CASES)
@pytest.mark.parametrize("name, counts", _histories(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_simulator_and_the_runtime_decide_the_same_shape(monkeypatch: pytest.MonkeyPatch, name: str,
                                                             counts: list[int], look_ahead: int, predictor: str) -> None:
    """Same history, same cost model: the same decision inputs and answers at every interval, the same shapes."""
    calls = _spy(monkeypatch)
    cm = _cost_model(_chooser(look_ahead, predictor))
    sim_shapes = _simulate(cm, counts, look_ahead, predictor)
    sim_calls = list(calls)
    calls.clear()
    run_shapes = _walk_runtime(counts, look_ahead, predictor, sim_shapes)
    run_calls = list(calls)

    assert len(sim_calls) == len(run_calls) == len(counts) - 1
    assert all(c[3] == 0.0 for c in sim_calls)  # no migration outlasts an interval: the runtime's remain_ms = 0
    for k, (sim, run) in enumerate(zip(sim_calls, run_calls)):
        assert sim == run, f"{name} interval {k}: the simulator decided {sim}, the runtime {run}"
    # the runtime's None is the simulator's PAUSED: no allowed shape fits (the job stops / waits for instances)
    assert [shape or PAUSED for shape in run_shapes] == sim_shapes


def _old_runtime_predictor(options: DecisionOptions) -> Any:
    """How shape_choice.py built its predictor before the decision moved to planning/policy.py."""
    return make_predictor(options.predictor, max_instances=options.max_instances)  # type: ignore[arg-type]


@pytest.mark.parametrize("look_ahead, predictor", CASES[1:])
def test_the_old_runtime_predictor_decides_otherwise_on_these_cases(monkeypatch: pytest.MonkeyPatch, look_ahead: int,
                                                                    predictor: str) -> None:
    """The histories above tell the two constructions apart: with the runtime's old predictor factory some
    decision over them -- its shape or the forecast scenarios it was scored against, both of which the equality
    above compares -- differs from the simulator's (so that equality is not vacuous). Stop 48: since the
    repartition price counts every replica to fill, the chosen shapes alone no longer differ for look-ahead 4
    with persistence on these histories; the forecasts do."""
    cm = _cost_model(_chooser(look_ahead, predictor))

    def decisions(factory: Callable[[DecisionOptions], Any]) -> list[Any]:
        monkeypatch.setattr(policy, "make_decision_predictor", factory)
        calls = _spy(monkeypatch)
        for _, counts in _histories():
            _simulate(cm, counts, look_ahead, predictor)
        monkeypatch.undo()
        return [(c[4].next_shape, c[5]) for c in calls]

    assert decisions(policy.make_decision_predictor) != decisions(_old_runtime_predictor)
