"""An emulated cluster faithful to a profiled workload: modelled compute, memory, network, storage and boot.

Problem: :mod:`~lightning_parcae.testing.emulated_device` gives every instance of a ``parcae run`` cluster its own
(modelled) accelerator, but with one made-up number -- every block takes the same few modelled milliseconds, and
everything else (what a migration moves, how long a checkpoint takes, which shapes fit in memory, how long a new
instance takes to boot) is whatever the tiny CPU model happens to cost. Parcae's decisions hinge on exactly those
ratios: a step of GPT-1.5B on p3.2xlarge takes seconds, moving one stage's state takes seconds at 10 Gbps, a
checkpoint save + load takes ~14 s and the model needs P >= 6 stages on a 16 GB V100. An emulation with the wrong
ratios exercises the control plane against a workload nobody runs.

:class:`EmulatedWorkload` is that workload, per layer, from a profile: modelled forward and backward milliseconds
per sample, the state each layer carries (parameters + optimizer state) and the activations it produces (what
crosses a stage boundary) and stashes for its backward (what limits memory); plus each instance's modelled memory
capacity, network bandwidth, checkpoint write/read bandwidth and boot time. Every modelled duration is divided by
one ``time_scale`` (a 3 s modelled step runs in 0.1 s at scale 30), so a run keeps the workload's ratios while
finishing in minutes. Real processes, the real protocol and real (small) state still run and move; only sizes and
speeds are virtual: the emulated example (``examples/gpt``, ``model.emulate``) sleeps the scaled per-layer times
(:func:`~lightning_parcae.testing.emulated_device.emulated_compute`), and the runtime's state transfers, pipeline
sends and data-parallel all-reduces sleep the scaled time the real model's bytes would take on the modelled network
(:func:`install_modelled_link`, on top of the real transfer).

Sources of the GPT-1.5B numbers (:meth:`EmulatedWorkload.gpt_1_5b`): per-layer times, parameters and boundary
activations from the artifact's p3.2xlarge profile (:meth:`~lightning_parcae.planning.costmodel.LayerProfile.
synthetic_transformer`); stashed activations from the standard transformer count (Korthikanti et al. 2022:
``s*h*(34 + 5*a*s/h)`` bytes per layer and sample in fp16, ``s*V*6`` for the logits and their fp32 softmax);
mixed-precision Adam memory (16 bytes per parameter: fp16 weights and gradients, fp32 master weights and two fp32
moments) and the artifact's 12 bytes per parameter moved in a migration (fp32 weights + two moments). With 16 GB
(1 GB of it reserved for the CUDA context, workspaces and fragmentation) the memory rule gives P >= 6 -- the
artifact's ``min_pp`` and the smallest depth in its GPT-1.5B table (P = 5 misses by 0.6 GB: the margin is narrow,
see :meth:`EmulatedWorkload.stage_memory_bytes`).

What it is not: a claim about any real cluster's speed. Figures measured on an emulated cluster say how the control
plane behaves against this modelled workload; modelled seconds are the real seconds times ``time_scale``.

The workload is pure Python (no torch): the planner side can price with it and the example can map onto it.
:func:`install_modelled_link` imports the runtime's link module (:mod:`lightning_parcae.runtime.link`, no torch
either) when it is called.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Optional, Sequence, Tuple

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.costmodel import LayerProfile, ShapeLimits, balanced_partition

__all__ = ["EmulatedWorkload", "ModelledLink", "install_modelled_link"]

_GPT15_SEQ, _GPT15_HIDDEN, _GPT15_HEADS, _GPT15_VOCAB = 1024, 1600, 25, 50257


def _floats(name: str, values: Sequence[float]) -> Tuple[float, ...]:
    out = tuple(float(v) for v in values)
    if any(not math.isfinite(v) or v < 0 for v in out):
        raise ConfigurationError(f"{name} has a negative or non-finite entry ({list(out)[:8]}...): every per-layer "
                                 "value must be a finite number >= 0")
    return out


@dataclass(frozen=True)
class EmulatedWorkload:
    """One model on one kind of instance, per layer, with every duration compressed by ``time_scale``.

    Per-layer attributes are unscaled (modelled) values; the methods return scaled real seconds/milliseconds unless
    their name says ``modelled``.

    Attributes:
        name: Label for reports.
        forward_ms: Modelled forward milliseconds of each layer per sample.
        backward_ms: Modelled backward milliseconds of each layer per sample.
        params: Parameters of each layer.
        boundary_bytes: Bytes of each layer's output per sample (what a stage boundary after it sends forward, and
            its gradient backward).
        stash_bytes: Activation bytes each layer keeps per sample for its backward (memory).
        time_scale: Every modelled duration is divided by this (>= 1 compresses time).
        memory_bytes: Modelled memory capacity of one instance's accelerator.
        reserved_bytes: Part of ``memory_bytes`` not available to the model (context, workspaces, fragmentation).
        memory_bytes_per_param: Training memory per parameter (mixed-precision Adam: 16).
        state_bytes_per_param: State moved per parameter in a migration or checkpoint (fp32 weights + Adam: 12).
        grad_bytes_per_param: Gradient bytes per parameter all-reduced per step (fp16: 2).
        bandwidth_bytes_per_s: Modelled network bandwidth between two instances (10 Gbps = 1.25e9).
        latency_ms: Modelled per-message latency.
        state_bandwidth_bytes_per_s: Modelled bandwidth of a migration's state transfers only (None: the
            ``bandwidth_bytes_per_s`` of every other message). A lower value models a job whose stages are costly
            to move -- a bigger model, a slower or shared path, a runtime that stages state through storage --
            while its steps (pipeline messages, all-reduces) keep the network they have.
        checkpoint_write_bytes_per_s: Modelled checkpoint write bandwidth of one instance.
        checkpoint_read_bytes_per_s: Modelled checkpoint read bandwidth of one instance.
        boot_s: Modelled seconds from an instance being granted to its process being ready to register.
        global_batch: Samples per optimizer step of the profiled job.
        micro_batch: Samples per micro-batch of the profiled job.
        limits: Shapes the profiled job allows (beyond memory).
    """

    name: str
    forward_ms: Tuple[float, ...]
    backward_ms: Tuple[float, ...]
    params: Tuple[float, ...]
    boundary_bytes: Tuple[float, ...]
    stash_bytes: Tuple[float, ...]
    time_scale: float = 1.0
    memory_bytes: float = 16e9
    reserved_bytes: float = 1e9
    memory_bytes_per_param: float = 16.0
    state_bytes_per_param: float = 12.0
    grad_bytes_per_param: float = 2.0
    bandwidth_bytes_per_s: float = 1.25e9
    latency_ms: float = 0.15
    checkpoint_write_bytes_per_s: float = 450e6
    checkpoint_read_bytes_per_s: float = 450e6
    boot_s: float = 3.05
    global_batch: int = 128
    micro_batch: int = 1
    limits: ShapeLimits = field(default_factory=ShapeLimits)
    state_bandwidth_bytes_per_s: Optional[float] = None

    def __post_init__(self) -> None:
        lists = {"forward_ms": self.forward_ms, "backward_ms": self.backward_ms, "params": self.params,
                 "boundary_bytes": self.boundary_bytes, "stash_bytes": self.stash_bytes}
        lens = {k: len(v) for k, v in lists.items()}
        if min(lens.values()) == 0 or len(set(lens.values())) != 1:
            raise ConfigurationError(f"per-layer lists of workload {self.name!r} differ in length or are empty "
                                     f"({lens}): give one value per layer in each")
        for k, v in lists.items():
            object.__setattr__(self, k, _floats(k, v))
        positive = ("time_scale", "memory_bytes", "bandwidth_bytes_per_s", "checkpoint_write_bytes_per_s",
                    "checkpoint_read_bytes_per_s")
        for k in positive:
            if not getattr(self, k) > 0:
                raise ConfigurationError(f"{k}={getattr(self, k)} must be > 0 (workload {self.name!r})")
        if self.state_bandwidth_bytes_per_s is not None and not self.state_bandwidth_bytes_per_s > 0:
            raise ConfigurationError(f"state_bandwidth_bytes_per_s={self.state_bandwidth_bytes_per_s} must be > 0 "
                                     f"or None (the network's bandwidth_bytes_per_s) (workload {self.name!r})")
        for k in ("reserved_bytes", "latency_ms", "boot_s", "memory_bytes_per_param", "state_bytes_per_param",
                  "grad_bytes_per_param"):
            if getattr(self, k) < 0:
                raise ConfigurationError(f"{k}={getattr(self, k)} must be >= 0 (workload {self.name!r})")
        if self.micro_batch < 1 or self.global_batch < self.micro_batch:
            raise ConfigurationError(f"micro_batch={self.micro_batch}, global_batch={self.global_batch}: need "
                                     "1 <= micro_batch <= global_batch")

    # -- construction -------------------------------------------------------------------------------------------
    @classmethod
    def gpt_1_5b(cls, time_scale: float = 1.0, **overrides: Any) -> "EmulatedWorkload":
        """The Parcae artifact's GPT-1.5B on p3.2xlarge (1x V100 16 GB, 10 Gbps): embedding, 48 blocks, head.

        Args:
            time_scale: Divides every modelled duration.
            **overrides: Any other attribute (e.g. ``memory_bytes``, ``bandwidth_bytes_per_s``).
        """
        prof = LayerProfile.synthetic_transformer(layers=48, global_batch=128, micro_batch=1)
        s, h, a, v = _GPT15_SEQ, _GPT15_HIDDEN, _GPT15_HEADS, _GPT15_VOCAB
        block_stash = s * h * (34 + 5 * a * s / h)
        stash = (4.0 * s * h,) + (block_stash,) * 48 + (6.0 * s * v + 4.0 * s * h,)
        kw: dict[str, Any] = dict(
            name="gpt-1.5b", forward_ms=prof.forward_ms, backward_ms=prof.backward_ms,
            params=tuple(b / 2.0 for b in prof.param_bytes),  # the profile's bytes are fp16 weights
            boundary_bytes=prof.activation_bytes, stash_bytes=stash, time_scale=time_scale,
            bandwidth_bytes_per_s=prof.bandwidth_bytes_per_s, latency_ms=prof.latency_ms,
            global_batch=prof.global_batch, micro_batch=prof.micro_batch, limits=ShapeLimits(max_p=32),
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def named(cls, name: str, time_scale: float = 1.0, **overrides: Any) -> "EmulatedWorkload":
        """A bundled workload by name (``gpt-1.5b``) or a JSON file (:meth:`from_json`) by path."""
        if name.lower() in ("gpt-1.5b", "gpt_1_5b", "gpt1.5b"):
            return cls.gpt_1_5b(time_scale, **overrides)
        if name.endswith(".json"):
            return replace(cls.from_json(name), time_scale=time_scale, **overrides)
        raise ConfigurationError(f"unknown emulated workload {name!r}: use 'gpt-1.5b' or the path of a JSON "
                                 "workload file (EmulatedWorkload.to_json writes one)")

    @classmethod
    def from_json(cls, path: str) -> "EmulatedWorkload":
        """Read a workload from a JSON object whose keys are the attributes (``limits``: a dict of ShapeLimits)."""
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigurationError(f"cannot read emulated workload {path}: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigurationError(f"emulated workload {path} must be a JSON object, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigurationError(f"emulated workload {path}: unknown keys {unknown}; expected some of "
                                     f"{sorted(known)}")
        lim = raw.pop("limits", {}) or {}
        try:
            limits = ShapeLimits(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in lim.items()})
            return cls(limits=limits, **raw)
        except TypeError as e:
            raise ConfigurationError(f"emulated workload {path}: {e}") from None

    def to_json(self, path: str) -> None:
        """Write this workload as :meth:`from_json` reads it."""
        with open(path, "w") as f:
            json.dump(asdict(self), f, indent=1)

    def coarsened(self, blocks: int) -> "EmulatedWorkload":
        """The same model as ``blocks`` + 2 layers: first and last kept, the middle layers grouped contiguously.

        A small example with ``blocks`` blocks emulates the whole profiled model: its block ``i`` stands for the
        middle layers ``[1 + i*B//blocks, 1 + (i+1)*B//blocks)`` (B middle layers) -- their summed times, parameters
        and stashed activations, and the boundary bytes of the group's last layer. ``blocks == B`` is the identity.

        Raises:
            ConfigurationError: ``blocks`` is not in ``1..B``.
        """
        mid = self.num_layers - 2
        if not 1 <= blocks <= mid:
            raise ConfigurationError(f"cannot map {blocks} blocks onto the {mid} middle layers of {self.name!r}: "
                                     f"use between 1 and {mid} blocks")
        groups = [(0, 1)] + [(1 + i * mid // blocks, 1 + (i + 1) * mid // blocks) for i in range(blocks)]
        groups.append((self.num_layers - 1, self.num_layers))

        def summed(xs: Tuple[float, ...]) -> Tuple[float, ...]:
            return tuple(sum(xs[a:b]) for a, b in groups)

        return replace(self, name=f"{self.name}/{blocks}", forward_ms=summed(self.forward_ms),
                       backward_ms=summed(self.backward_ms), params=summed(self.params),
                       stash_bytes=summed(self.stash_bytes),
                       boundary_bytes=tuple(self.boundary_bytes[b - 1] for _, b in groups))

    @property
    def num_layers(self) -> int:
        """Number of layers."""
        return len(self.forward_ms)

    # -- compute --------------------------------------------------------------------------------------------------
    def forward_ms_per_sample(self, layer: int) -> float:
        """Scaled (real) forward milliseconds of ``layer`` per sample -- what the emulated device sleeps."""
        return self.forward_ms[layer] / self.time_scale

    def backward_ms_per_sample(self, layer: int) -> float:
        """Scaled (real) backward milliseconds of ``layer`` per sample."""
        return self.backward_ms[layer] / self.time_scale

    def partition(self, p: int) -> list[int]:
        """Stage boundaries of depth ``p``, balanced by layer time (the partitioner the planner and runtime use)."""
        return balanced_partition([f + b for f, b in zip(self.forward_ms, self.backward_ms)], p)

    def step_s(self, d: int, p: int, micro_batches: Optional[int] = None) -> float:
        """Scaled seconds of one optimizer step of shape (d, p), by simulating its 1F1B schedule.

        Each stage runs its operations in 1F1B order (``p - k - 1`` warm-up forwards, then one forward and one
        backward alternately, then the remaining backwards); an operation starts when its stage is free and its
        input has arrived; sending an activation forward or a gradient backward keeps the sender busy for the modelled
        link time of the micro-batch's boundary bytes (blocking point-to-point, as pipeline engines send). A ring all-reduce of the
        largest stage's gradients over the ``d`` replicas ends the step. Independent of the closed formula of
        :class:`~lightning_parcae.planning.costmodel.ProfileThroughput`, which it should approach.

        Args:
            d: Data-parallel pipelines.
            p: Stages per pipeline.
            micro_batches: Micro-batches per pipeline (default: the profiled job's ``global_batch / (d *
                micro_batch)``).

        Raises:
            ConfigurationError: the batch does not split over ``d`` pipelines, or ``p`` is out of range.
        """
        per_pipeline = self.global_batch / d
        m = micro_batches if micro_batches is not None else per_pipeline / self.micro_batch
        if d < 1 or m != int(m) or m < 1 or per_pipeline != int(per_pipeline):
            raise ConfigurationError(f"global batch {self.global_batch} does not split over D={d} pipelines of "
                                     f"{m} micro-batches: choose D dividing it")
        m = int(m)
        samples = per_pipeline / m
        b = self.partition(p)
        fwd = [samples * sum(self.forward_ms[b[k]:b[k + 1]]) for k in range(p)]
        bwd = [samples * sum(self.backward_ms[b[k]:b[k + 1]]) for k in range(p)]
        link = [self.latency_ms + 1000.0 * samples * self.boundary_bytes[b[k + 1] - 1] / self.bandwidth_bytes_per_s
                for k in range(p - 1)]
        f_done: list[list[Optional[float]]] = [[None] * m for _ in range(p)]
        b_done: list[list[Optional[float]]] = [[None] * m for _ in range(p)]
        orders = []
        for k in range(p):
            warm = min(p - k - 1, m)
            ops = [("F", i) for i in range(warm)]
            for i in range(m - warm):
                ops += [("F", warm + i), ("B", i)]
            ops += [("B", i) for i in range(m - warm, m)]
            orders.append(ops)
        pos, free = [0] * p, [0.0] * p
        remaining = sum(len(o) for o in orders)
        while remaining:
            progressed = False
            for k in range(p):
                while pos[k] < len(orders[k]):
                    kind, i = orders[k][pos[k]]
                    if kind == "F":
                        dep = 0.0 if k == 0 else f_done[k - 1][i]
                        busy = fwd[k] + (link[k] if k < p - 1 else 0.0)  # blocking send of the activation
                    else:
                        dep = f_done[k][i] if k == p - 1 else b_done[k + 1][i]
                        busy = bwd[k] + (link[k - 1] if k > 0 else 0.0)  # blocking send of the gradient
                    if dep is None:
                        break
                    free[k] = max(free[k], dep) + busy
                    (f_done if kind == "F" else b_done)[k][i] = free[k]
                    pos[k] += 1
                    remaining -= 1
                    progressed = True
            if not progressed:  # pragma: no cover -- the 1F1B order above has no cycle
                raise RuntimeError("1F1B simulation deadlocked")
        pipeline_ms = max(free)
        grads = max(sum(self.params[b[k]:b[k + 1]]) for k in range(p)) * self.grad_bytes_per_param
        allreduce_ms = 0.0 if d == 1 else 1000.0 * 2 * (d - 1) / d * grads / self.bandwidth_bytes_per_s
        return (pipeline_ms + allreduce_ms) / 1000.0 / self.time_scale

    def layer_profile(self) -> LayerProfile:
        """This workload as the planner's :class:`~lightning_parcae.planning.costmodel.LayerProfile` (modelled ms).

        Per micro-batch values (``micro_batch`` samples), fp16 parameter bytes, Adam state factor 2: what
        :class:`~lightning_parcae.planning.costmodel.ProfileThroughput` predicts a shape's step from.
        """
        mb = self.micro_batch
        return LayerProfile(tuple(mb * f for f in self.forward_ms), tuple(mb * x for x in self.backward_ms),
                            tuple(self.grad_bytes_per_param * x for x in self.params),
                            tuple(mb * x for x in self.boundary_bytes), mb, self.global_batch,
                            bandwidth_bytes_per_s=self.bandwidth_bytes_per_s, latency_ms=self.latency_ms,
                            limits=replace(self.limits, min_p=max(self.limits.min_p, self.min_stages() or 1)))

    # -- memory ---------------------------------------------------------------------------------------------------
    def stage_memory_bytes(self, p: int, stage: int, micro_batches: Optional[int] = None) -> float:
        """Modelled memory of ``stage`` of a depth-``p`` pipeline: training state + stashed activations.

        Training state is ``memory_bytes_per_param`` per parameter; under 1F1B stage ``k`` holds the activations of
        ``min(M, p - k)`` micro-batches in flight (stage 0 the most).
        """
        b = self.partition(p)
        lo, hi = b[stage], b[stage + 1]
        m = micro_batches if micro_batches is not None else self.global_batch // self.micro_batch
        in_flight = min(m, p - stage)
        return (self.memory_bytes_per_param * sum(self.params[lo:hi])
                + in_flight * self.micro_batch * sum(self.stash_bytes[lo:hi]))

    def fits(self, p: int, micro_batches: Optional[int] = None) -> bool:
        """Whether every stage of a depth-``p`` pipeline fits the usable memory (capacity - reserved)."""
        usable = self.memory_bytes - self.reserved_bytes
        return p <= self.num_layers and all(self.stage_memory_bytes(p, k, micro_batches) <= usable for k in range(p))

    def min_stages(self) -> Optional[int]:
        """The smallest pipeline depth whose largest stage fits the memory capacity (None: no depth fits)."""
        return next((p for p in range(1, self.num_layers + 1) if self.fits(p)), None)

    # -- network, storage, boot -----------------------------------------------------------------------------------
    def state_bytes(self, layers: Sequence[int]) -> float:
        """Modelled bytes of the given layers' state (parameters + optimizer state)."""
        return self.state_bytes_per_param * sum(self.params[i] for i in layers)

    def modelled_transfer_s(self, layers: Sequence[int]) -> float:
        """Modelled (unscaled) seconds to move the given layers' state over one instance's link."""
        layers = list(layers)
        if not layers:
            return 0.0
        bandwidth = self.state_bandwidth_bytes_per_s or self.bandwidth_bytes_per_s
        return self.latency_ms / 1000.0 + self.state_bytes(layers) / bandwidth

    def transfer_s(self, layers: Sequence[int]) -> float:
        """Scaled seconds to move the given layers' state (what a migration sleeps on top of the real transfer)."""
        return self.modelled_transfer_s(layers) / self.time_scale

    def modelled_boundary_s(self, layer: int, samples: float) -> float:
        """Modelled (unscaled) seconds of one pipeline message across the boundary after ``layer`` for ``samples``
        samples: the activation forward, or its gradient back (same bytes); latency included, as :meth:`step_s`
        charges each send."""
        return self.latency_ms / 1000.0 + samples * self.boundary_bytes[layer] / self.bandwidth_bytes_per_s

    def boundary_s(self, layer: int, samples: float) -> float:
        """Scaled seconds of :meth:`modelled_boundary_s` (what a pipeline send sleeps before it is posted)."""
        return self.modelled_boundary_s(layer, samples) / self.time_scale

    def modelled_allreduce_s(self, layers: Sequence[int], replicas: int) -> float:
        """Modelled (unscaled) seconds of a ring all-reduce of ``layers``' gradients (``grad_bytes_per_param``
        each) over ``replicas`` pipelines: ``2 (d - 1) / d`` of the bytes cross each link, as :meth:`step_s`
        charges it; 0 for one replica."""
        if replicas <= 1:
            return 0.0
        grads = self.grad_bytes_per_param * sum(self.params[i] for i in layers)
        return 2.0 * (replicas - 1) / replicas * grads / self.bandwidth_bytes_per_s

    def allreduce_s(self, layers: Sequence[int], replicas: int) -> float:
        """Scaled seconds of :meth:`modelled_allreduce_s` (what the data-parallel all-reduce sleeps before it
        starts)."""
        return self.modelled_allreduce_s(layers, replicas) / self.time_scale

    def checkpoint_write_s(self, layers: Sequence[int]) -> float:
        """Scaled seconds to write the given layers' state to the checkpoint store."""
        return self.state_bytes(layers) / self.checkpoint_write_bytes_per_s / self.time_scale

    def checkpoint_read_s(self, layers: Sequence[int]) -> float:
        """Scaled seconds to read the given layers' state from the checkpoint store."""
        return self.state_bytes(layers) / self.checkpoint_read_bytes_per_s / self.time_scale

    def boot_scaled_s(self) -> float:
        """Scaled seconds a new instance takes to boot before its process can register."""
        return self.boot_s / self.time_scale


class ModelledLink:
    """The modelled network of a workload, in the form the runtime's link hooks call
    (:class:`~lightning_parcae.runtime.link.LinkModel`).

    ``charge(layers)`` is the scaled seconds one process's link needs to move those layers' state
    (:meth:`EmulatedWorkload.transfer_s`), slept by a migration on top of the real transfer; ``boundary_s(layer,
    samples)`` one pipeline message across the boundary after ``layer`` (:meth:`EmulatedWorkload.boundary_s`),
    slept before each pipeline send; ``allreduce_s(layers, replicas)`` the data-parallel ring all-reduce of those
    layers' gradients (:meth:`EmulatedWorkload.allreduce_s`), slept before the real all-reduce. Layer indices are
    those of the emulated model's layer list (the workload must have been :meth:`~EmulatedWorkload.coarsened` to
    the example's layers).

    Args:
        workload: The workload whose network is modelled.
    """

    def __init__(self, workload: EmulatedWorkload) -> None:
        self.workload = workload

    def _check(self, layers: Sequence[int]) -> list[int]:
        bad = [i for i in layers if not 0 <= int(i) < self.workload.num_layers]
        if bad:
            raise ConfigurationError(f"modelled link of {self.workload.name!r} asked to move layers {bad}; the "
                                     f"workload has layers 0..{self.workload.num_layers - 1}: map the model onto it "
                                     "with EmulatedWorkload.coarsened(n_blocks)")
        return [int(i) for i in layers]

    def charge(self, layers: Sequence[int]) -> float:
        """Scaled seconds to move ``layers`` over one link (unknown indices are an error, not free)."""
        return self.workload.transfer_s(self._check(layers))

    def boundary_s(self, layer: int, samples: int) -> float:
        """Scaled seconds of one pipeline message after ``layer`` for ``samples`` samples (unknown layer: error)."""
        (i,) = self._check([layer])
        return self.workload.boundary_s(i, samples)

    def allreduce_s(self, layers: Sequence[int], replicas: int) -> float:
        """Scaled seconds of the ring all-reduce of ``layers``' gradients over ``replicas`` pipelines."""
        return self.workload.allreduce_s(self._check(layers), replicas)


def install_modelled_link(workload: Optional[EmulatedWorkload]) -> Optional[Any]:
    """Make every state transfer, pipeline send and data-parallel all-reduce of this process also take
    ``workload``'s modelled network time (None: remove).

    Returns:
        The link installed before (to restore it).
    """
    from lightning_parcae.runtime import link  # runtime is below testing: this direction is allowed

    return link.set_modelled_link(None if workload is None else ModelledLink(workload))
