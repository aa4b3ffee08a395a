"""What a shape trains per second, and what a change of shape costs.

Problem: the liveput optimizer compares shapes (D data-parallel pipelines x P stages) across future intervals.
For that it needs two numbers it cannot measure ahead of time: the throughput of every (D, P) on the cluster, and
the time lost when the job moves from one shape to another after some instances were preempted. Parcae's
artifact scores policies with one particular set of formulas; our runtime has its own measured costs. This
module gives both behind one interface so the simulator and the runtime call the *same* optimizer:

* :class:`ThroughputModel` -- samples/s of each (D, P): :class:`TableThroughput` (a profiled table, e.g. the
  artifact's, bundled as package data) or :class:`ProfileThroughput` (a per-layer profile through a pipeline +
  ring all-reduce model with a per-stage memory limit).
* :class:`MigrationCostModel` -- the time of a transition, by kind (:class:`MigrationKind`): intra-stage (only
  groups change), inter-stage (a process takes over another stage: weights + optimizer state), repartition (P
  changes: move only the layers a process lacks), restart from checkpoint. A transition's cost depends on
  *which* instances were preempted; the cost model prices one victim pattern (survivors per stage) and
  :mod:`lightning_parcae.planning.liveput` takes the expectation over patterns.
* :class:`ArtifactCostModel` reproduces ``ARTIFACT_MODEL.md`` exactly (group-rebuild formulas, restart, p2p
  table, the inter-stage "redundant" rule and the repartition quirk), so our policies can be scored on the same
  work as Parcae's own. :class:`DefaultCostModel` is our own, simpler and fittable from measurements
  (:meth:`MigrationConstants.fit`).

No torch here: plain Python + numpy.
"""

from __future__ import annotations

import abc
import bisect
import functools
import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.kinds import MigrationKind
from lightning_parcae.planning.migration_plan import Layout, MigrationPlan, StageLostError, plan_migration

__all__ = [
    "Shape",
    "batch_splits",
    "largest_split",
    "min_max_partition",
    "MigrationKind",
    "ThroughputModel",
    "TableThroughput",
    "LayerProfile",
    "ProfileThroughput",
    "MigrationCostModel",
    "ArtifactCostModel",
    "MigrationConstants",
    "DefaultCostModel",
    "reference_models",
    "reference_layer_params",
]

Shape = Tuple[int, int]
"""A training shape ``(D, P)``: D data-parallel pipelines of P stages each (D*P processes)."""


def batch_splits(global_batch: int, data_parallel: int, micro_batches: int = 1) -> bool:
    """Whether a global batch splits over ``data_parallel`` pipelines of ``micro_batches`` micro-batches each.

    The one rule every choice of D uses: the runtime's data path (:mod:`lightning_parcae.runtime.data`), the
    throughput model's candidate shapes (:class:`~lightning_parcae.planning.measured.PipelineThroughput`) and
    ``parcae run --restart-fallback``.
    """
    return data_parallel >= 1 and micro_batches >= 1 and global_batch % (data_parallel * micro_batches) == 0


def largest_split(global_batch: int, at_most: int, micro_batches: int = 1) -> int:
    """The largest D <= ``at_most`` over which the global batch splits (:func:`batch_splits`); 1 if none does.

    The rule of every D chosen without the optimizer: the restart fallback's relaunch and a first generation whose
    power-of-two D cannot take the batch (:meth:`~lightning_parcae.runtime.shape_choice.ShapeChooser.split_global_batch`).
    """
    return next((d for d in range(at_most, 0, -1) if batch_splits(global_batch, d, micro_batches)), 1)


_NO_TERM = 0.0


# ----------------------------------------------------------------------------------------------------------------
# package data


@functools.lru_cache(maxsize=None)
def _data(name: str) -> dict:
    return json.loads(resources.files("lightning_parcae").joinpath("data", name).read_text())


def reference_models() -> List[str]:
    """Names of the bundled profiled models (the Parcae artifact's tables).

    Returns:
        Model names usable with :meth:`TableThroughput.from_reference` and :class:`ArtifactCostModel`.
    """
    return sorted(_data("throughput_tables.json")["strategy_tables"])


def reference_layer_params(model: str) -> List[float]:
    """Parameters of each layer of a bundled profiled model (the artifact's ``artifact_layer_params.json``).

    Args:
        model: One of :func:`reference_models`.

    Returns:
        One parameter count per layer, in layer order.

    Raises:
        ConfigurationError: ``model`` is not a bundled table.
    """
    _check_model(model)
    return list(_data("artifact_layer_params.json")[model]["layers"])


def _check_model(name: str) -> None:
    names = reference_models()
    if name not in names:
        raise ConfigurationError(
            f"unknown model table {name!r}: the bundled tables are {', '.join(names)}. "
            "Pass one of them, or give a per-layer profile (--profile FILE) instead."
        )


# ----------------------------------------------------------------------------------------------------------------
# throughput


@dataclass(frozen=True)
class ShapeLimits:
    """Which shapes are allowed at all (pipeline-depth limits, excluded depths and widths).

    Attributes:
        min_p: Smallest pipeline depth (the model does not fit in fewer stages).
        max_p: Largest pipeline depth.
        ignore_p: Depths never used.
        ignore_d: Data-parallel widths never used.
    """

    min_p: int = 1
    max_p: int = 1 << 30
    ignore_p: Tuple[int, ...] = ()
    ignore_d: Tuple[int, ...] = ()

    def allows(self, d: int, p: int) -> bool:
        """Whether (d, p) respects the limits."""
        return d >= 1 and self.min_p <= p <= self.max_p and p not in self.ignore_p and d not in self.ignore_d


class ThroughputModel(abc.ABC):
    """Samples per second of each shape (D, P); 0 where the shape cannot run.

    Attributes:
        global_batch: Samples per optimizer step (fixed across shapes).
        limits: Shapes the optimizer may choose.
    """

    global_batch: int
    limits: ShapeLimits

    @abc.abstractmethod
    def throughput(self, d: int, p: int) -> float:
        """Samples/s of shape (d, p), or 0.0 if it cannot run."""

    @abc.abstractmethod
    def candidates(self, n: int, hint_counts: Iterable[int] = ()) -> List[Shape]:
        """Shapes with positive throughput that fit on ``n`` instances and respect :attr:`limits`.

        Args:
            n: Instances available.
            hint_counts: Other instance counts the caller cares about (forecast values); models with very many
                shapes use them to keep the candidate list short.
        """

    def best(self, n: int) -> Optional[Shape]:
        """The throughput-optimal shape on ``n`` instances, ignoring :attr:`limits`.

        Scans D = 1..n (outer), P = 1..n (inner) and keeps the first strict maximum, as the artifact does.

        Returns:
            The best shape, or None if no shape fits.
        """
        best_shape, best_thr = None, 0.0
        for d, p in sorted(self._all_shapes(n)):
            thr = self.throughput(d, p)
            if thr > best_thr:
                best_shape, best_thr = (d, p), thr
        return best_shape

    def _all_shapes(self, n: int) -> Iterable[Shape]:
        return ((d, p) for d in range(1, n + 1) for p in range(1, n // d + 1))


class TableThroughput(ThroughputModel):
    """Throughput looked up in a profiled table; unlisted shapes have throughput 0.

    Args:
        table: ``{(D, P): samples_per_second}``.
        global_batch: Samples per optimizer step.
        limits: Allowed shapes for the optimizer.
        name: Label for reports.
    """

    def __init__(
        self,
        table: Mapping[Shape, float],
        global_batch: int,
        limits: ShapeLimits = ShapeLimits(),
        name: str = "table",
    ) -> None:
        if not table:
            raise ConfigurationError("the throughput table is empty: give at least one (D, P) -> samples/s entry")
        for (d, p), thr in table.items():
            if d < 1 or p < 1 or not math.isfinite(thr) or thr < 0:
                raise ConfigurationError(
                    f"throughput table entry ({d}, {p}) -> {thr} is invalid: D and P must be >= 1 and the "
                    "throughput a finite number >= 0"
                )
        self.table: Dict[Shape, float] = {(int(d), int(p)): float(t) for (d, p), t in table.items()}
        self.global_batch = int(global_batch)
        self.limits = limits
        self.name = name
        self._best_cache: Dict[int, Optional[Shape]] = {}

    @classmethod
    def from_reference(cls, model: str) -> "TableThroughput":
        """The bundled profiled table of one of the artifact's models (see :func:`reference_models`)."""
        _check_model(model)
        data = _data("throughput_tables.json")
        raw = data["strategy_tables"][model]
        table = {tuple(int(x) for x in k.split(",")): float(v[1]) for k, v in raw.items()}
        c = data["monte_carlo_pipeline_depth_constraints"][model]
        limits = ShapeLimits(c["min_pp"], c["max_pp"], tuple(c["ignore_pp"]), tuple(c["ignore_dp"]))
        batch = int(data["strategy_table_info"][model]["train_batch_size"])
        return cls(table, batch, limits, name=model)  # type: ignore[arg-type]

    def throughput(self, d: int, p: int) -> float:
        return self.table.get((d, p), 0.0)

    def candidates(self, n: int, hint_counts: Iterable[int] = ()) -> List[Shape]:
        return sorted(s for s, t in self.table.items() if t > 0 and s[0] * s[1] <= n and self.limits.allows(*s))

    def best(self, n: int) -> Optional[Shape]:
        if n not in self._best_cache:
            # Same result as the full scan (unlisted shapes have throughput 0), in the artifact's scan order.
            best_shape, best_thr = None, 0.0
            for d, p in sorted(s for s in self.table if s[0] * s[1] <= n):
                if self.table[(d, p)] > best_thr:
                    best_shape, best_thr = (d, p), self.table[(d, p)]
            self._best_cache[n] = best_shape
        return self._best_cache[n]


@dataclass(frozen=True)
class LayerProfile:
    """A per-layer profile of one model, enough to predict the throughput of any (D, P).

    Attributes:
        forward_ms: Forward time of each layer for one micro-batch.
        backward_ms: Backward time of each layer for one micro-batch.
        param_bytes: Parameter bytes of each layer (weights only).
        activation_bytes: Bytes of each layer's output for one micro-batch (what crosses a stage boundary).
        micro_batch: Samples per micro-batch.
        global_batch: Samples per optimizer step.
        bandwidth_bytes_per_s: Link bandwidth between instances.
        latency_ms: Per-message latency.
        optimizer_state_factor: Optimizer-state bytes per parameter byte (Adam: 2).
        memory_limit_bytes: Per-process memory for one stage (weights, gradients, optimizer state, stashed
            activations); None = unlimited.
        limits: Allowed shapes.
    """

    forward_ms: Tuple[float, ...]
    backward_ms: Tuple[float, ...]
    param_bytes: Tuple[float, ...]
    activation_bytes: Tuple[float, ...]
    micro_batch: int
    global_batch: int
    bandwidth_bytes_per_s: float = 1.25e9
    latency_ms: float = 0.15
    optimizer_state_factor: float = 2.0
    memory_limit_bytes: Optional[float] = None
    limits: ShapeLimits = ShapeLimits()

    def __post_init__(self) -> None:
        n = len(self.forward_ms)
        lens = {len(self.backward_ms), len(self.param_bytes), len(self.activation_bytes)}
        if n == 0 or lens != {n}:
            raise ConfigurationError(
                f"layer profile lists differ in length (forward {n}, backward {len(self.backward_ms)}, params "
                f"{len(self.param_bytes)}, activations {len(self.activation_bytes)}): give one value per layer"
            )
        if self.micro_batch < 1 or self.global_batch < self.micro_batch:
            raise ConfigurationError(
                f"micro_batch={self.micro_batch}, global_batch={self.global_batch}: need 1 <= micro_batch <= "
                "global_batch"
            )
        if self.bandwidth_bytes_per_s <= 0:
            raise ConfigurationError(f"bandwidth_bytes_per_s={self.bandwidth_bytes_per_s} must be > 0")

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.forward_ms)

    @classmethod
    def from_json(cls, path: str) -> "LayerProfile":
        """Read a profile from JSON (keys as the attributes; ``limits`` as a dict of ShapeLimits fields)."""
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigurationError(f"cannot read layer profile {path}: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigurationError(f"layer profile {path} must be a JSON object, got {type(raw).__name__}")
        try:
            lim = raw.pop("limits", {})
            tuples = ("forward_ms", "backward_ms", "param_bytes", "activation_bytes")
            kw = {k: (tuple(float(x) for x in v) if k in tuples else v) for k, v in raw.items()}
            return cls(limits=ShapeLimits(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in lim.items()}), **kw)
        except TypeError as e:
            raise ConfigurationError(
                f"layer profile {path}: {e}. Expected keys: forward_ms, backward_ms, param_bytes, "
                "activation_bytes, micro_batch, global_batch (+ optional bandwidth_bytes_per_s, latency_ms, "
                "optimizer_state_factor, memory_limit_bytes, limits)"
            ) from None

    @classmethod
    def synthetic_transformer(
        cls, layers: int = 48, global_batch: int = 128, micro_batch: int = 1, **kw: object
    ) -> "LayerProfile":
        """A GPT-1.5B-like profile (embedding, ``layers`` blocks, head) using the artifact's per-layer numbers."""
        fwd = (0.752,) + (6.510,) * layers + (11.238,)
        bwd = (0.798,) + (13.448,) * layers + (23.762,)
        params = (82124800 * 2.0,) + (30740800 * 2.0,) * layers + (82128000 * 2.0,)  # fp16 weights
        acts = (micro_batch * 1024 * 1600 * 2.0,) * (layers + 2)
        return cls(fwd, bwd, params, acts, micro_batch, global_batch, **kw)  # type: ignore[arg-type]


def min_max_partition(
    weights: Sequence[float], parts: int, fits: Optional[Callable[[int, int], bool]] = None
) -> Optional[List[int]]:
    """Contiguous split of ``weights`` into ``parts`` non-empty groups minimizing the largest group sum.

    The one partitioner of the project: the planner's stage times (:class:`ProfileThroughput`,
    :class:`~lightning_parcae.planning.measured.PipelineThroughput`) and the runtime's stage layout
    (:func:`lightning_parcae.runtime.partition.balance_stages`, with a memory limit as ``fits``) both cut here, so
    the layout the simulator prices is the layout the runtime builds. Binary search on the largest sum; for each
    bound, groups are filled greedily as far as the bound (and ``fits``) allow -- optimal for any ``fits`` that
    holds for every sub-range of a range it holds for (a per-stage memory limit does). Among equally good splits
    the earlier groups take more items.

    Args:
        weights: Per-item cost (e.g. layer time).
        parts: Number of groups; 1 <= parts <= len(weights).
        fits: ``fits(i, j)``: whether items ``i..j-1`` may form one group (default: always).

    Returns:
        Boundaries ``[0, b1, ..., len(weights)]`` (group k holds items ``b[k]:b[k+1]``), or ``None`` if no split
        satisfies ``fits``.

    Raises:
        ConfigurationError: if ``parts`` is not in ``1..len(weights)``.
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ConfigurationError(f"cannot split {n} layers into {parts} stages: need 1 <= stages <= layers")
    prefix = np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=float))])

    def greedy(cap: float) -> Optional[List[int]]:
        bounds, start = [0], 0
        for k in range(parts):
            # furthest end such that sum <= cap, fits, and enough items left for the remaining groups
            end = int(np.searchsorted(prefix, prefix[start] + cap * (1 + 1e-12), side="right")) - 1
            end = min(end, n - (parts - k - 1))
            while fits is not None and end > start and not fits(start, end):
                end -= 1
            if end <= start:
                return None
            bounds.append(end)
            start = end
        return bounds if start == n else None

    lo, hi = float(max(weights)), float(prefix[-1])
    best = greedy(hi)
    if best is None:
        return None
    for _ in range(60):
        mid = (lo + hi) / 2
        b = greedy(mid)
        if b is None:
            lo = mid
        else:
            hi, best = mid, b
    return best


def balanced_partition(weights: Sequence[float], parts: int) -> List[int]:
    """:func:`min_max_partition` without a constraint (always succeeds): boundaries ``[0, b1, ..., len]``."""
    best = min_max_partition(weights, parts)
    assert best is not None
    return best


class ProfileThroughput(ThroughputModel):
    """Throughput of any (D, P) predicted from a :class:`LayerProfile`.

    Model: layers are split into P contiguous stages balanced by time; each pipeline runs
    M = global_batch / (D * micro_batch) micro-batches with a 1F1B/GPipe schedule, so a step takes
    ``(M + P - 1) * max_stage(fwd + bwd + p2p)`` plus a ring all-reduce of the largest stage's gradients over the D
    replicas (``2 (D-1)/D * bytes / bandwidth``). A stage whose weights + gradients + optimizer state + stashed
    activations (``min(M, P)`` micro-batches, 1F1B) exceed ``memory_limit_bytes`` makes the shape infeasible.

    Args:
        profile: The per-layer profile.
    """

    def __init__(self, profile: LayerProfile) -> None:
        self.profile = profile
        self.global_batch = profile.global_batch
        self.limits = profile.limits

    @functools.lru_cache(maxsize=None)
    def _partition(self, p: int) -> List[int]:
        pr = self.profile
        return balanced_partition([f + b for f, b in zip(pr.forward_ms, pr.backward_ms)], p)

    @functools.lru_cache(maxsize=65536)
    def step_ms(self, d: int, p: int) -> float:
        """Predicted time of one optimizer step of shape (d, p), ``inf`` if infeasible."""
        pr = self.profile
        if p > pr.num_layers or d < 1 or p < 1:
            return math.inf
        per_pipeline = pr.global_batch / d
        m = per_pipeline / pr.micro_batch
        if per_pipeline != int(per_pipeline) or m != int(m) or m < 1:
            return math.inf
        m = int(m)
        t = [f + b for f, b in zip(pr.forward_ms, pr.backward_ms)]
        bounds = self._partition(p)
        worst, worst_params = 0.0, 0.0
        for k in range(p):
            lo, hi = bounds[k], bounds[k + 1]
            comp = sum(t[lo:hi])
            comm = 0.0 if k == p - 1 else 2 * (pr.latency_ms + 1000.0 * pr.activation_bytes[hi - 1] / pr.bandwidth_bytes_per_s)
            worst = max(worst, comp + comm)
            params = sum(pr.param_bytes[lo:hi])
            worst_params = max(worst_params, params)
            if pr.memory_limit_bytes is not None:
                mem = params * (2 + pr.optimizer_state_factor) + min(m, p) * sum(pr.activation_bytes[lo:hi])
                if mem > pr.memory_limit_bytes:
                    return math.inf
        allreduce = 0.0 if d == 1 else 1000.0 * 2 * (d - 1) / d * worst_params / pr.bandwidth_bytes_per_s
        return (m + p - 1) * worst + allreduce

    def throughput(self, d: int, p: int) -> float:
        ms = self.step_ms(d, p)
        return 0.0 if not math.isfinite(ms) else self.global_batch / (ms / 1000.0)

    def candidates(self, n: int, hint_counts: Iterable[int] = ()) -> List[Shape]:
        counts = {n} | {int(c) for c in hint_counts if 1 <= int(c) <= n}
        out = set()
        for p in range(max(1, self.limits.min_p), min(n, self.limits.max_p, self.profile.num_layers) + 1):
            for c in counts:
                # the widest feasible D for this count, and the next narrower ones (batch divisibility)
                for d in range(c // p, 0, -1):
                    if self.limits.allows(d, p) and self.throughput(d, p) > 0:
                        out.add((d, p))
                        break
        return sorted(out)


# ----------------------------------------------------------------------------------------------------------------
# migration costs


def artifact_partition(num_layers: int, stages: int) -> List[int]:
    """The artifact simulator's stage boundaries for ``num_layers`` layer entries and ``stages`` stages.

    ``chunk = (L-1)//P``; sizes ``[chunk+1] + [chunk]*(P-1)``; then +1 to ``sizes[-i-2]`` for i < (L-1) % P.

    Returns:
        Boundaries ``[0, ..., num_layers]``.
    """
    if not 1 <= stages <= num_layers - 1:
        raise ConfigurationError(f"cannot split {num_layers} layer entries into {stages} stages (artifact rule)")
    chunk = (num_layers - 1) // stages
    sizes = [chunk + 1] + [chunk] * (stages - 1)
    for i in range((num_layers - 1) % stages):
        sizes[-i - 2] += 1
    return [0] + list(np.cumsum(sizes).tolist())


def _missing_matrix(layer_params: Sequence[float], old: Sequence[int], new: Sequence[int], p: int) -> np.ndarray:
    """``miss[s, j]``: parameters of new stage j (bounds ``new``) outside old stage s (bounds ``old``)."""
    lp = np.asarray(layer_params, dtype=float)
    idx = np.arange(len(lp))
    held = (idx[None, :] >= np.asarray(old[:-1])[:p, None]) & (idx[None, :] < np.asarray(old[1:])[:p, None])
    need = (idx[None, :] >= np.asarray(new[:-1])[:, None]) & (idx[None, :] < np.asarray(new[1:])[:, None])
    # sum over layers needed by j and not held by s
    return (need[None, :, :] & ~held[:, None, :]).astype(float) @ lp


class MigrationCostModel(abc.ABC):
    """Prices one transition ``(N, D, P) --(n_in, n_out, victims)--> (D', P')`` in milliseconds.

    A victim pattern is described by ``victims[s]``: how many of stage s's D replicas were preempted (instances
    beyond the D*P grid are spares; losing them changes nothing but the membership). Same-depth transitions are
    priced as ``combine(max_s m_s, sum_s a_s)`` of per-stage terms so that
    :func:`lightning_parcae.planning.liveput.expected_transition_cost` can take their exact expectation by a dynamic
    program over stages; repartitions are priced on the survivor counts directly.

    Attributes:
        throughput: The throughput model this cost model goes with.
        waits_for_unfinished: What a change decided while a migration is still unfinished costs (see
            :meth:`overlapping_ms`): ``False`` -- the artifact's accounting -- abandons the rest of the unfinished
            one and charges :meth:`concurrent_restart_ms` on top of the new transition; ``True`` -- this runtime,
            which migrates between two steps and decides again only once a migration is done -- waits for it.
    """

    throughput: ThroughputModel
    waits_for_unfinished: bool = False

    def overlapping_ms(self, remain_ms: Any, cost_ms: Any, concurrent_ms: Any) -> Any:
        """Time a change of ``cost_ms`` takes when it is decided while a migration still needs ``remain_ms``.

        Works on floats and on numpy arrays alike (the optimizer prices every source x target at once).

        Args:
            remain_ms: What the unfinished migration still needs.
            cost_ms: The new transition, priced from the shape the unfinished migration is moving to.
            concurrent_ms: :meth:`concurrent_restart_ms` of the new target.

        Returns:
            ``remain_ms + cost_ms`` if :attr:`waits_for_unfinished`, else ``cost_ms + concurrent_ms``.
        """
        if self.waits_for_unfinished:
            return remain_ms + cost_ms
        return cost_ms + concurrent_ms

    @abc.abstractmethod
    def stage_term(self, d: int, p: int, d2: int, stage: int, victims: int) -> Tuple[float, float]:
        """Per-stage contribution ``(m, a)`` of a same-depth transition (``m`` enters a max, ``a`` a sum).

        ``m == 0`` means the stage keeps enough replicas for ``d2`` and needs no transfer.
        """

    @abc.abstractmethod
    def combine(self, n: int, d: int, p: int, n_in: int, n_out: int, d2: int, m: float, a: float) -> float:
        """Cost of a same-depth transition from the combined stage terms."""

    @abc.abstractmethod
    def repartition_transfer_ms(self, p: int, p2: int, survivors: Tuple[int, ...]) -> float:
        """The victim-dependent part of a repartition from depth ``p`` to ``p2``: the state-transfer time.

        Args:
            p: Old depth.
            p2: New depth.
            survivors: ``survivors[s]`` replicas of old stage s are still alive.

        Returns:
            Milliseconds, or ``inf`` if some layer has no live holder (the job must fall back to a checkpoint).
        """

    def repartition_transfer_batch(self, p: int, p2: int, survivors: np.ndarray) -> np.ndarray:
        """:meth:`repartition_transfer_ms` for many victim patterns at once (rows of ``survivors``)."""
        return np.array([self.repartition_transfer_ms(p, p2, tuple(int(x) for x in row)) for row in survivors])

    @abc.abstractmethod
    def repartition_rest_ms(
        self, n: int, d: int, p: int, n_in: int, n_out: int, d2: int, p2: int, fallback: bool
    ) -> float:
        """The victim-independent part of a repartition (group rebuild, broadcast, restart or checkpoint fallback).

        Args:
            fallback: Whether the transfer part was ``inf`` (no live holder of some layer).
        """

    def repartition_cost(
        self, n: int, d: int, p: int, n_in: int, n_out: int, d2: int, p2: int, survivors: Sequence[int]
    ) -> float:
        """Cost of moving from depth ``p`` to ``p2 != p`` when stage s of the old shape kept ``survivors[s]``."""
        t = self.repartition_transfer_ms(p, p2, tuple(survivors))
        fallback = math.isinf(t)
        return (0.0 if fallback else t) + self.repartition_rest_ms(n, d, p, n_in, n_out, d2, p2, fallback)

    @abc.abstractmethod
    def concurrent_restart_ms(self, d2: int, p2: int) -> float:
        """Extra cost when a new change starts while a previous migration is still unfinished."""

    @abc.abstractmethod
    def restart_ms(self, d: int, p: int, kind: str) -> float:
        """Cost of restarting every process at (d, p) (``kind`` is ``"add"`` or ``"remove"``)."""

    @abc.abstractmethod
    def checkpoint_ms(self) -> float:
        """Save + load time of a checkpoint (what a restart-based job pays on every event)."""

    @abc.abstractmethod
    def full_state_transfer_ms(self, p: int) -> float:
        """Time to send every stage's full state once (a restart-based job reloading all stages)."""

    def reactive_restart_ms(self, d: int, p: int, kind: str, first: bool) -> float:
        """What a reactive, restart-based job pays per event: restart + checkpoint save/load + every stage's state.

        Args:
            d: Data-parallel width after the restart.
            p: Pipeline depth after the restart.
            kind: ``"add"`` if instances arrived (or the job starts), else ``"remove"``.
            first: The job's first start (no checkpoint to save or load).
        """
        return self.restart_ms(d, p, kind) + (0.0 if first else self.checkpoint_ms()) + self.full_state_transfer_ms(p)

    def kind(self, d: int, p: int, n_out: int, d2: int, p2: int, victims: Sequence[int]) -> MigrationKind:
        """Which kind of migration a victim pattern needs (for logs and reports)."""
        if p2 != p:
            return MigrationKind.REPARTITION
        if all(d - v >= d2 for v in victims):
            return MigrationKind.NONE if (n_out == 0 and d2 == d) else MigrationKind.INTRA_STAGE
        return MigrationKind.INTER_STAGE


class ArtifactCostModel(MigrationCostModel):
    """The Parcae artifact's cost accounting, reproduced exactly (see ``ARTIFACT_MODEL.md``).

    Args:
        model: One of :func:`reference_models`.
    """

    def __init__(self, model: str) -> None:
        _check_model(model)
        self.model = model
        self.throughput = TableThroughput.from_reference(model)
        data = _data("throughput_tables.json")
        p2p = data["p2p_cost"]["table"]
        self._p2p_sizes = sorted(int(k) for k in p2p)
        self._p2p_us = {int(k): float(v) for k, v in p2p.items()}
        self._gpt = model.startswith("gpt")
        self.proc_ms = 240.0 if self._gpt else 30.0
        self.rdzv_ms = float(data["restart_and_migration_constants"]["rdzv_time_ms"])
        extra = data["restart_and_migration_constants"]["restart_extra_cost_ms"].get(model)
        self.extra_ms = float(extra) if extra is not None else 0.0
        self.checkpoint_cost_ms = float(data["restart_and_migration_constants"]["throughput_baseline_checkpoint_ms"])
        self.layer_params: List[float] = reference_layer_params(model)
        if model == "gpt-1.5b":
            base = self.p2p_ms(50257 * 1024 * 4)
            self.build_ms = {pp: base + 430 * math.ceil(48 / pp) for pp in range(6, 49)}
        else:
            self.build_ms = {int(k): float(v) for k, v in data["model_build_cost_ms"]["tables"][model].items()}

    # -- primitive costs -------------------------------------------------------------------------------------
    def p2p_ms(self, volume_bytes: float) -> float:
        """Point-to-point time of ``volume_bytes`` (linear interpolation in the profiled table)."""
        sizes = self._p2p_sizes
        idx = bisect.bisect_left(sizes, volume_bytes)
        if idx == 0:
            us = self._p2p_us[sizes[0]]
        elif idx >= len(sizes):
            us = volume_bytes / sizes[-1] * self._p2p_us[sizes[-1]]
        else:
            lo, hi = sizes[idx - 1], sizes[idx]
            us = self._p2p_us[lo] + (self._p2p_us[hi] - self._p2p_us[lo]) * (volume_bytes - lo) / (hi - lo)
        return us / 1000.0

    def p2p_ms_batch(self, volume_bytes: np.ndarray) -> np.ndarray:
        """:meth:`p2p_ms` of many volumes (same piecewise-linear table, linear extrapolation above it)."""
        v = np.asarray(volume_bytes, dtype=float)
        sizes = np.asarray(self._p2p_sizes, dtype=float)
        us = np.array([self._p2p_us[k] for k in self._p2p_sizes])
        out = np.interp(v, sizes, us)
        out = np.where(v > sizes[-1], v / sizes[-1] * us[-1], out)
        return out / 1000.0

    def group_rebuild_ms(self, d: int, p: int, kind: str) -> float:
        """Communication-group rebuild time."""
        add = kind == "add"
        if self._gpt:
            groups = d + p + 1 + d * p
            rate = 500.0 if add else (115.6 if self.model == "gpt-6.7b" else 39.3)
            t = groups * rate
        elif self.model == "vgg19":
            t = (440.0 if add else 340.0) * d * p
        else:
            t = 2000.0 if d >= 12 else (1500.0 if d >= 6 else 1000.0)
            if add:
                t *= 1.5
        return 35.0 + t

    def restart_ms(self, d: int, p: int, kind: str) -> float:
        # memoized: the optimizer prices thousands of transitions per cold decision, each with a restart term
        memo = self.__dict__.setdefault("_restart_memo", {})
        hit = memo.get((d, p, kind))
        if hit is None:
            hit = memo[(d, p, kind)] = self._restart_ms(d, p, kind)
        return hit

    def _restart_ms(self, d: int, p: int, kind: str) -> float:
        cost = 0.0
        if kind == "add":
            cost += self.rdzv_ms + self.extra_ms
        cost += self.group_rebuild_ms(d, p, kind) + self.proc_ms
        if p not in self.build_ms:
            raise ConfigurationError(
                f"the {self.model} table has no model-build cost for pipeline depth {p} "
                f"(known depths: {sorted(self.build_ms)})"
            )
        return cost + self.build_ms[p]

    def concurrent_restart_ms(self, d2: int, p2: int) -> float:
        return self.restart_ms(d2, p2, "no-op")

    def intra_stage_ms(self, d: int, p: int) -> float:
        """Intra-stage migration: rebuild groups (cheap rate) + process init."""
        return self.group_rebuild_ms(d, p, "remove") + self.proc_ms

    def checkpoint_ms(self) -> float:
        return self.checkpoint_cost_ms

    @functools.lru_cache(maxsize=None)
    def stage_params(self, p: int) -> Tuple[float, ...]:
        """Parameters of each stage under the artifact partition rule."""
        b = artifact_partition(len(self.layer_params), p)
        return tuple(float(sum(self.layer_params[b[k] : b[k + 1]])) for k in range(p))

    @functools.lru_cache(maxsize=None)
    def stage_state_ms(self, p: int) -> Tuple[float, ...]:
        """p2p time of each stage's state (fp32 weights + two Adam moments = 12 bytes/param)."""
        return tuple(self.p2p_ms(12 * x) for x in self.stage_params(p))

    def full_state_transfer_ms(self, p: int) -> float:
        return float(sum(self.stage_state_ms(p)))

    # -- same-depth ------------------------------------------------------------------------------------------
    def stage_term(self, d: int, p: int, d2: int, stage: int, victims: int) -> Tuple[float, float]:
        need = max(d2 - (d - victims), 0)
        if need == 0:
            return _NO_TERM, 0.0
        c = self.stage_state_ms(p)[stage]
        redundant = need == d2 or (stage == p - 1 and need == d2 - 1)
        return c, (c if redundant else 0.0)

    def _restart_kind(self, d: int, p: int, n_out: int, d2: int, p2: int) -> str:
        return "add" if d2 * p2 > d * p - n_out else "remove"

    def combine(self, n: int, d: int, p: int, n_in: int, n_out: int, d2: int, m: float, a: float) -> float:
        if m == _NO_TERM:
            if n_out == 0 and d2 == d:
                return 0.0
            return self.intra_stage_ms(d2, p)
        return max(m, a) + self.restart_ms(d2, p, self._restart_kind(d, p, n_out, d2, p))

    # -- repartition ------------------------------------------------------------------------------------------
    @functools.lru_cache(maxsize=None)
    def _missing_params(self, p: int, p2: int) -> np.ndarray:
        """``miss[s, j]``: parameters new stage j lacks on a node holding old stage s (p == 0: holds nothing)."""
        if p == 0:
            return np.zeros((0, p2))
        n = len(self.layer_params)
        return _missing_matrix(self.layer_params, artifact_partition(n, p), artifact_partition(n, p2), p)

    @functools.lru_cache(maxsize=200_000)
    def repartition_transfer_ms(self, p: int, p2: int, survivors: Tuple[int, ...]) -> float:
        # New stages in order each take the surviving old node that misses the fewest parameters; only the
        # LAST new stage's missing volume is counted (the artifact's quirk, kept on purpose). Ties go to the
        # lowest old stage (the artifact breaks ties by node id; that only matters between equal volumes).
        pattern = np.asarray([survivors], dtype=np.int64).reshape(1, p)
        return float((self.repartition_transfer_batch if p > 0 else self._greedy_batch)(p, p2, pattern)[0])

    def repartition_transfer_batch(self, p: int, p2: int, survivors: np.ndarray) -> np.ndarray:
        # The greedy of repartition_transfer_ms, vectorized over patterns (argmin keeps the lowest stage on ties).
        # With unlimited replicas new stage j takes old stage s*(j); a pattern that leaves every old stage at
        # least as many survivors as it is picked there gives the same picks, so only the others run the greedy.
        survivors = np.asarray(survivors, dtype=np.int64)
        base, demand = self._unconstrained_pick(p, p2)
        out = np.full(len(survivors), base)
        short = ~(survivors >= demand[None, :]).all(axis=1)
        if short.any():
            out[short] = self._greedy_batch(p, p2, survivors[short])
        return out

    @functools.lru_cache(maxsize=None)
    def _unconstrained_pick(self, p: int, p2: int) -> Tuple[float, np.ndarray]:
        miss = self._missing_params(p, p2)
        picks = miss.argmin(axis=0)
        demand = np.bincount(picks, minlength=p)
        return float(self.p2p_ms(12 * miss[picks[-1], p2 - 1])), demand

    @functools.lru_cache(maxsize=None)
    def _preferences(self, p: int, p2: int) -> Tuple[Tuple[Tuple[int, float], ...], ...]:
        """Per new stage j: old stages ordered by missing parameters (lowest stage first on ties), with the value."""
        miss = self._missing_params(p, p2)
        return tuple(
            tuple((int(s), float(miss[s, j])) for s in np.argsort(miss[:, j], kind="stable")) for j in range(p2)
        )

    def _greedy_batch(self, p: int, p2: int, survivors: np.ndarray) -> np.ndarray:
        miss = self._missing_params(p, p2)
        left = np.array(survivors, dtype=np.int64, copy=True)
        rows = np.arange(len(left))
        last = np.zeros(len(left))
        if left.shape[1] == 0:  # the job had no stages yet: nothing to keep, nothing missing is counted
            return self.p2p_ms_batch(last)
        if len(left) <= 4:
            # A few patterns: walk each new stage's preference list in plain Python -- the vectorized loop below
            # costs ~p2 numpy calls whatever the number of rows.
            prefs = self._preferences(p, p2)
            for r, row in enumerate(left.tolist()):
                val = 0.0
                for pref in prefs:
                    for s, v in pref:
                        if row[s] > 0:
                            row[s] -= 1
                            val = v
                            break
                last[r] = val
            return self.p2p_ms_batch(12 * last)
        first = self._first_choices(p, p2)
        for j in range(p2):
            # most patterns still hold the new stage's first choice: take it there, search only the others
            s0 = int(first[j])
            has = left[:, s0] > 0
            left[has, s0] -= 1
            last[has] = miss[s0, j]
            if has.all():
                continue
            r = rows[~has]
            masked = np.where(left[r] > 0, miss[None, :, j], np.inf)
            best = masked.argmin(axis=1)
            val = masked[np.arange(len(r)), best]
            ok = np.isfinite(val)
            left[r[ok], best[ok]] -= 1
            last[r[ok]] = val[ok]
        return self.p2p_ms_batch(12 * last)

    @functools.lru_cache(maxsize=None)
    def _first_choices(self, p: int, p2: int) -> np.ndarray:
        """Per new stage: the old stage missing the fewest of its parameters (lowest on ties)."""
        return self._missing_params(p, p2).argmin(axis=0)

    def repartition_rest_ms(
        self, n: int, d: int, p: int, n_in: int, n_out: int, d2: int, p2: int, fallback: bool
    ) -> float:
        cost = max(self.stage_state_ms(p2)) if d2 > 1 else 0.0
        return cost + self.restart_ms(d2, p2, self._restart_kind(d, p, n_out, d2, p2))


@dataclass(frozen=True)
class MigrationConstants:
    """Constants of :class:`DefaultCostModel`; fittable from measured migrations (:meth:`fit`).

    Attributes:
        group_base_ms: Fixed part of rebuilding process groups in place (destroy + init under a new generation).
        group_per_process_ms: Per-process part of that rebuild.
        bandwidth_bytes_per_s: Effective point-to-point bandwidth for state transfers.
        transfer_latency_ms: Fixed cost per transfer.
        join_ms: Time for a fresh process to start and join (imports, rendezvous).
        restart_ms: Time to restart every process (kill, relaunch, rendezvous, rebuild) -- torchrun-style.
        checkpoint_ms: Time to save and then load a checkpoint.
        bytes_per_param: State bytes moved per parameter (fp32 weights + Adam moments: 12).
    """

    group_base_ms: float = 10.0
    group_per_process_ms: float = 5.0
    bandwidth_bytes_per_s: float = 1.25e9
    transfer_latency_ms: float = 5.0
    join_ms: float = 2500.0
    restart_ms: float = 7000.0
    checkpoint_ms: float = 14000.0
    bytes_per_param: float = 12.0

    @classmethod
    def fit(cls, measurements: Sequence[Tuple[str, float, int, float]], base: "MigrationConstants" = None) -> "MigrationConstants":  # type: ignore[assignment]
        """Fit the constants from measured migrations by least squares.

        Args:
            measurements: ``(kind, bytes_moved, processes, measured_ms)`` tuples; ``kind`` is one of
                ``intra-stage`` (fits ``group_*``; one that moved bytes counts as ``inter-stage``),
                ``inter-stage``/``repartition`` (fits bandwidth and latency on top of the group rebuild) and
                ``restart`` (fits ``restart_ms``).
            base: Constants kept for what the measurements do not cover.

        Returns:
            New constants.
        """
        c = base or cls()
        # an intra-stage migration that moved bytes filled a joiner's replica from a peer (the migration plan calls
        # it intra-stage: no member changes stage); its time is a transfer's, not a group rebuild's. Regression
        # (stop 48, 0.25 Gbps replay): a standby replacing a noticed leaver of 2x9 took 16.2 s to receive its
        # stage, was fitted as a group rebuild, and every later move was priced 16 s dearer.
        measurements = [(MigrationKind.INTER_STAGE.value if k == MigrationKind.INTRA_STAGE.value and b > 0 else k,
                         b, n, ms) for k, b, n, ms in measurements]
        intra = [(n, ms) for k, _, n, ms in measurements if k == MigrationKind.INTRA_STAGE.value]
        if len(intra) >= 2:
            a = np.array([[1.0, n] for n, _ in intra])
            (b0, b1), *_ = np.linalg.lstsq(a, np.array([ms for _, ms in intra]), rcond=None)
            c = replace(c, group_base_ms=max(0.0, float(b0)), group_per_process_ms=max(0.0, float(b1)))
        elif len(intra) == 1:
            c = replace(c, group_base_ms=intra[0][1])
        moves = [
            (b, n, ms)
            for k, b, n, ms in measurements
            if k in (MigrationKind.INTER_STAGE.value, MigrationKind.REPARTITION.value)
        ]
        if len(moves) >= 2:
            y = np.array([ms - c.group_base_ms - c.group_per_process_ms * n for b, n, ms in moves])
            a = np.array([[1.0, b] for b, _, _ in moves])
            (lat, per_byte), *_ = np.linalg.lstsq(a, y, rcond=None)
            if per_byte > 0:
                c = replace(c, transfer_latency_ms=max(0.0, float(lat)), bandwidth_bytes_per_s=1000.0 / float(per_byte))
        elif len(moves) == 1 and moves[0][0] > 0:
            # one move: its time beyond the group rebuild and the latency is its bytes' (as one intra-stage
            # measurement sets the group rebuild above; stop 47 -- a job whose stages take 16 s to move planned its
            # next moves at 10 Gbps until a second one had been measured)
            b, n, ms = moves[0]
            rest = ms - c.group_base_ms - c.group_per_process_ms * n - c.transfer_latency_ms
            if rest > 0:
                c = replace(c, bandwidth_bytes_per_s=1000.0 * b / rest)
        # DefaultCostModel.restart_ms adds the group rebuild to restart_ms: fit only what remains after it.
        restarts = [
            ms - c.group_base_ms - c.group_per_process_ms * n
            for k, _, n, ms in measurements
            if k == MigrationKind.RESTART.value
        ]
        if restarts:
            c = replace(c, restart_ms=max(0.0, float(np.mean(restarts))))
        unknown = {k for k, *_ in measurements} - {m.value for m in MigrationKind}
        if unknown:
            raise ConfigurationError(
                f"unknown migration kinds {sorted(unknown)}: use {[m.value for m in MigrationKind if m.value != 'none']}"
            )
        return c


class DefaultCostModel(MigrationCostModel):
    """Our runtime's migration costs: in-place group rebuilds and parallel state transfers between live peers.

    * intra-stage: ``group_base + group_per_process * D'P'`` (no state moves);
    * inter-stage: the group rebuild plus the slowest stage refill (stages are refilled in parallel from their
      surviving replicas -- with a notice the leavers too -- and a holder filling several new replicas sends their
      sum) plus ``join_ms`` if new processes join;
    * a stage with **no** surviving replica cannot be refilled from peers: restart from the latest checkpoint
      (``restart_ms + checkpoint_ms``);
    * repartition: the group rebuild plus the largest per-process missing volume (each process receives only
      the layers it lacks, all in parallel) -- or, where larger, the most one process sends or receives when the
      runtime's migration planner fills every replica of the new stages (joiners receive whole stages, a holder
      serving several receivers sends their sum); a layer no survivor holds forces the checkpoint restart.

    With ``preemption_notice=True`` every preempted instance hands its state over before it leaves (AWS gives two
    minutes; ``parcae run`` replays every drop as a notice and the runtime acts on it): a stage whose replicas all
    leave is copied from them instead of restarting, so no preemption forces the checkpoint restart.

    A change decided while a migration is unfinished waits for it (:attr:`waits_for_unfinished`): the runtime
    migrates between two steps and its leader decides again only after the migration is done, so a migration that
    outlasts its interval is paid in full before the next one starts. Regression (issue 21, 0.25 Gbps replays:
    repartitions of 16-27 s against 20 s intervals): under the artifact's rule -- the unfinished rest dropped, a
    group rebuild charged instead -- a plan could start an 18 s repartition and "leave" it one interval later for
    a shape one cheap step from its target, so moves that outlast an interval were priced as if a detour could
    skip most of them; the simulator accounted the same way, and both disagreed with what the runtime does.

    Args:
        throughput: Throughput model of the job.
        layer_params: Parameters of each layer (used for stage volumes and repartition overlaps).
        constants: Cost constants.
        preemption_notice: Preempted instances can still send their state (set before the model is first used:
            prices are cached).
    """

    waits_for_unfinished = True

    def __init__(
        self, throughput: ThroughputModel, layer_params: Sequence[float], constants: MigrationConstants = MigrationConstants(),
        *, preemption_notice: bool = False,
    ) -> None:
        if not layer_params:
            raise ConfigurationError("layer_params is empty: give the parameter count of each layer")
        self.throughput = throughput
        self.layer_params = [float(x) for x in layer_params]
        self.c = constants
        self.preemption_notice = bool(preemption_notice)

    def set_constants(self, constants: MigrationConstants) -> None:
        """Price every later transition with ``constants`` (e.g. refitted from measured migrations).

        The cached prices that depend on them are dropped (the method caches are per class: other instances
        recompute theirs on their next call). What the runtime's migration planner would move -- bytes, not
        milliseconds -- is kept unless ``bytes_per_param`` changed. Regression (issue 21, stop 56, 0.25 Gbps replay
        of hl_15_25 at N = 32): the leader refits its constants after each migration, and the refit dropped the
        planned bytes of every repartition too; its next decision re-ran the planner ~1,800 times (3 s on this
        machine alone, 1.3-1.5 s of a planning phase on the loaded one) while the whole job waited at the step
        boundary.
        """
        bytes_changed = constants.bytes_per_param != self.c.bytes_per_param
        self.c = constants
        caches: list[Any] = [self.repartition_transfer_ms]
        if bytes_changed:
            caches += [self._stage_bytes, self._missing_bytes, self._planned_peak_bytes]
        for cached in caches:
            cached.cache_clear()  # type: ignore[attr-defined]

    @functools.lru_cache(maxsize=None)
    def _bounds(self, p: int) -> List[int]:
        return balanced_partition(self.layer_params, p) if p <= len(self.layer_params) else [0] * (p + 1)

    @functools.lru_cache(maxsize=None)
    def _stage_bytes(self, p: int) -> Tuple[float, ...]:
        b = self._bounds(p)
        return tuple(self.c.bytes_per_param * sum(self.layer_params[b[k] : b[k + 1]]) for k in range(p))

    def transfer_ms(self, nbytes: float) -> float:
        """Time to move ``nbytes`` between two live processes."""
        return 0.0 if nbytes <= 0 else self.c.transfer_latency_ms + 1000.0 * nbytes / self.c.bandwidth_bytes_per_s

    def _groups(self, d: int, p: int) -> float:
        return self.c.group_base_ms + self.c.group_per_process_ms * d * p

    def restart_ms(self, d: int, p: int, kind: str) -> float:
        return self.c.restart_ms + self._groups(d, p)

    def concurrent_restart_ms(self, d2: int, p2: int) -> float:
        return self._groups(d2, p2)

    def checkpoint_ms(self) -> float:
        return self.c.checkpoint_ms

    def full_state_transfer_ms(self, p: int) -> float:
        return self.transfer_ms(max(self._stage_bytes(p)))

    def _fallback_ms(self, d2: int, p2: int) -> float:
        return self.restart_ms(d2, p2, "remove") + self.c.checkpoint_ms

    def stage_term(self, d: int, p: int, d2: int, stage: int, victims: int) -> Tuple[float, float]:
        survivors = d - victims
        need = max(d2 - survivors, 0)
        if need == 0:
            return _NO_TERM, 0.0
        if survivors == 0 and not self.preemption_notice:
            return math.inf, 0.0  # no live holder: checkpoint fallback (with a notice the leavers send it)
        # each of the ``need`` new replicas receives the whole stage, and the runtime's migration planner spreads
        # the sends over the holders that can send (with a notice the leavers too): a holder serving several
        # receivers sends their sum, and the link charges a process the larger of what it sends and receives.
        # Regression (issue 21): one survivor refilling two replicas was priced as one stage's transfer.
        senders = d if self.preemption_notice else survivors
        return self.transfer_ms(self._stage_bytes(p)[stage] * max(1.0, need / max(senders, 1))), 0.0

    def combine(self, n: int, d: int, p: int, n_in: int, n_out: int, d2: int, m: float, a: float) -> float:
        if m == _NO_TERM:
            return 0.0 if (n_out == 0 and d2 == d) else self._groups(d2, p)
        if math.isinf(m):
            return self._fallback_ms(d2, p)
        joins = d2 * p > d * p - n_out
        return self._groups(d2, p) + m + (self.c.join_ms if joins else 0.0)

    @functools.lru_cache(maxsize=None)
    def _missing_bytes(self, p: int, p2: int) -> np.ndarray:
        return _missing_matrix(self.layer_params, self._bounds(p) if p else [0], self._bounds(p2), p) * self.c.bytes_per_param

    @functools.lru_cache(maxsize=200_000)
    def repartition_transfer_ms(self, p: int, p2: int, survivors: Tuple[int, ...]) -> float:
        if p == 0:
            return 0.0  # nothing to keep: the job starts from scratch (priced in repartition_rest_ms)
        if any(r == 0 for r in survivors) and not self.preemption_notice:
            return math.inf
        # every new stage is filled from the survivor that lacks the least, all transfers in parallel
        miss = self._missing_bytes(p, p2)
        return self.transfer_ms(float(miss.min(axis=0).max()))

    def repartition_transfer_batch(self, p: int, p2: int, survivors: np.ndarray) -> np.ndarray:
        survivors = np.asarray(survivors)
        if p == 0:
            return np.zeros(len(survivors))
        base = self.repartition_transfer_ms(p, p2, (1,) * p)
        if self.preemption_notice:
            return np.full(len(survivors), base)
        return np.where((survivors == 0).any(axis=1), np.inf, base)

    def repartition_rest_ms(
        self, n: int, d: int, p: int, n_in: int, n_out: int, d2: int, p2: int, fallback: bool
    ) -> float:
        if p == 0:
            return self.restart_ms(d2, p2, "add")
        if fallback:
            return self._fallback_ms(d2, p2)
        joins = d2 * p2 > d * p - n_out
        # what the victim-dependent part (each new stage filled once, from its best-placed survivor) leaves out:
        # the D' replicas of every new stage -- joiners receive whole stages, a holder serving several receivers
        # sends their sum. Priced by the runtime's own migration planner, as the larger of the two.
        victims = min(d * p, int(round(n_out * d * p / max(n, 1))))
        fill = self.transfer_ms(self._planned_peak_bytes(d, p, victims, d2, p2))
        extra = max(0.0, fill - self.repartition_transfer_ms(p, p2, (1,) * p))
        return self._groups(d2, p2) + (self.c.join_ms if joins else 0.0) + extra

    def plan_ms(self, plan: MigrationPlan) -> float:
        """What this model charges for one concrete migration of the runtime's planner.

        At a decision the runtime knows who leaves (the noticed members) and who joins (the ready standbys), so the
        first move of every candidate is a plan it can make, not an expectation over victim patterns: the group
        rebuild of the new shape, the most one process sends or receives (:attr:`MigrationPlan.peak_bytes`, the
        quantity :meth:`MigrationConstants.fit` fits the bandwidth on) where state moves -- a new replica of a
        stage is filled whatever the plan's kind -- and ``join_ms`` if a process joins. A plan of kind ``none``
        costs nothing; one that moves no state (a replica dropped) only the rebuild.

        Args:
            plan: A plan from :func:`~lightning_parcae.planning.migration_plan.plan_migration` with the job's
                layer bytes (the unit this model's bandwidth was fitted in).

        Returns:
            Milliseconds.
        """
        if plan.kind == MigrationKind.NONE:
            return 0.0
        d2, p2 = plan.new.data_parallel, plan.new.pipeline_stages
        cost = self._groups(d2, p2)
        if not plan.transfers:
            return cost
        old = set(plan.old.members)
        joins = any(m not in old for m in plan.new.members)
        return cost + self.transfer_ms(float(plan.peak_bytes)) + (self.c.join_ms if joins else 0.0)

    @functools.lru_cache(maxsize=50_000)
    def _planned_peak_bytes(self, d: int, p: int, victims: int, d2: int, p2: int) -> float:
        """The most bytes one process sends or receives when the runtime's migration planner
        (:func:`~lightning_parcae.planning.migration_plan.plan_migration`) repartitions ``(d, p)`` to ``(d2, p2)``.

        Regression (stop 48, 0.25 Gbps replay of lh_80_90): 1x9 -> 2x7 on 16 instances was priced like 2x9 -> 2x7
        (16.3 s and 16.2 s) and took 31.9 s against 18.9 s -- five joiners each received a whole 2x7 stage and
        holders sent to two receivers (peak 610 kB against 305 kB) -- so holding 1x9 through a dip looked cheap.

        ``victims``: the expected number of members among the departures (the caller rounds it), taken from the
        last replicas; with a preemption notice they still send, without one a layer nobody holds any more prices
        nothing here (the victim-dependent part falls back to the checkpoint). 0 where the planner cannot run.
        """
        layers = len(self.layer_params)
        if not (0 < p <= layers and 0 < p2 <= layers) or d < 1:
            return 0.0
        members = d * p
        b, b2 = self._bounds(p), self._bounds(p2)
        if any(b[k + 1] <= b[k] for k in range(p)) or any(b2[k + 1] <= b2[k] for k in range(p2)):
            return 0.0
        old = Layout(tuple(f"o{i}" for i in range(members)), tuple(b[k + 1] - b[k] for k in range(p)))
        stay = list(old.members[: members - victims])
        joiners = [f"j{i}" for i in range(max(0, d2 * p2 - len(stay)))]
        senders = list(old.members) if self.preemption_notice else stay
        nbytes = [int(self.c.bytes_per_param * x) for x in self.layer_params]
        try:
            plan = plan_migration(old, stay + joiners, (d2, p2), [b2[k + 1] - b2[k] for k in range(p2)], nbytes,
                                  senders=senders)
        except (StageLostError, ConfigurationError):
            return 0.0
        return float(plan.peak_bytes)
