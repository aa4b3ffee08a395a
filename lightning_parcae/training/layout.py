"""The stage layout: which layers this process holds, and rebuilding that in place for a new (D, P).

Problem: a D x P job cuts the model's layer stack into P stages, and each process must hold exactly its stage's
layers (on its device), a proxy that stands in for the whole stack inside the user's ``forward``, and a transport
to its pipeline neighbours -- first when training starts (from an explicit ``balance``, a fixed P, or a short
per-layer profile), and again whenever live reconfiguration moves layers between processes. A model with no layer
stack the pipeline can cut trains whole at P = 1. Replicas of a stage start identical (replica 0 is
authoritative) and torchmetrics sync over the replicas of a stage.

:class:`StageLayout` owns the :class:`~lightning_parcae.training.stage_state.StageState` (groups, stack path,
layer names, partition, layer times, stage module, proxy, transport) and is its only writer: the process setup
hands it the groups it builds (:meth:`StageLayout.use_groups`) and a joiner's admitted layout
(:meth:`StageLayout.adopt_admitted`); the strategy exposes the state read-only to Lightning and to the runtime
(:class:`~lightning_parcae.runtime.host.TrainingHost`).

Memory: the process keeps the whole stack's module structure (``full_stack``) so that it can re-cut it in place,
but only the layers it holds have parameter storage: :meth:`StageLayout.build` releases the others' parameters and
persistent buffers to the ``meta`` device (:func:`~lightning_parcae.runtime.stage.release_storage`), and
:meth:`StageLayout.apply` gives a layer that arrives storage again and fills it from the payload its previous
holder sent -- never from this process (a layer that arrives without a payload is an error).

Parts outside the stack (issue 22): the embedding before the stack rides with layer 0 and the final norm and head
with the last layer (:attr:`StageState.outside <lightning_parcae.training.stage_state.StageState.outside>`, classified
once by :meth:`~lightning_parcae.training.profiling.LayerProfiler.classify_outside` when the module is partitioned,
and recorded in every generation so a joiner adopts it). :meth:`StageLayout.build` replaces those this process does
not hold by stand-ins (:func:`~lightning_parcae.runtime.stage.release_tensors`: one element of storage; the user's
step still runs them on every stage, and the stage discards what they give), and :meth:`StageLayout.apply` gives
those it newly holds storage and fills them from the payload of layer 0 or the last layer, under the same rule.
Their memory (and measured time) counts on the first and the last layer when the stack is partitioned.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parcae.errors import ModelLayoutError
from lightning_parcae.runtime.groups import ProcessGroups
from lightning_parcae.runtime.partition import (
    balance_stages,
    choose_pipeline_stages,
    layer_memory_bytes,
    stage_bounds,
    tensors_memory_bytes,
)
from lightning_parcae.runtime.pipeline import P2P, BlockListProxy, StageProxy
from lightning_parcae.runtime.stage import (
    cut_stage,
    is_block_list,
    is_released,
    locate_layer_stack,
    materialize_storage,
    materialize_tensors,
    own_tensor_sites,
    release_storage,
    release_tensors,
    replace_submodule,
)
from lightning_parcae.training.lightning_internals import inner_optimizer
from lightning_parcae.training.stage_state import StageState

if TYPE_CHECKING:
    import pytorch_lightning as pl

    from lightning_parcae.training.options import StrategyOptions
    from lightning_parcae.training.profiling import LayerProfiler, OutsideParts

__all__ = ["StageLayout", "LayoutHost", "named_layers"]

log = logging.getLogger(__name__)


class LayoutHost(Protocol):
    """What the layout needs from the strategy: the module, its device and optimizers, and moving it there."""

    @property
    def lightning_module(self) -> Any: ...

    @property
    def root_device(self) -> torch.device: ...

    @property
    def optimizers(self) -> list[Any]: ...

    def model_to_device(self) -> None: ...


def named_layers(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """A module's direct children by name, in order -- every entry, also one module registered under two names
    (``named_children`` would yield it once)."""
    return [(n, m) for n, m in module.named_modules(remove_duplicate=False) if n and "." not in n]


class StageLayout:
    """Partition the layer stack and (re)build this process's stage (see the module docstring).

    Args:
        state: The stage state this layout owns (the only writer of its fields).
        options: The strategy's options (``layers_attr``, ``pipeline_stages``, ``balance``, memory limits, M).
        host: The strategy, for the module, its device and optimizers.
        profiler: Checks a block list can be cut and times the layers.
        resumed_layout: Returns the layout record of the checkpoint this process resumes from (None without one):
            its layer times spare a relaunch the profile (:meth:`saved_layer_times`).
    """

    def __init__(self, state: StageState, options: "StrategyOptions", host: LayoutHost,
                 profiler: "LayerProfiler", resumed_layout: Optional[Callable[[], Optional[Mapping[str, Any]]]] = None
                 ) -> None:
        self.state = state
        self.options = options
        self.host = host
        self.profiler = profiler
        self.resumed_layout = resumed_layout or (lambda: None)
        """The layout record of the checkpoint this process resumes from (read before ``setup``), or None."""

    def stack(self) -> nn.Sequential:
        """The layer stack inside the module (the stage module once the stack has been replaced by it)."""
        module = self.host.lightning_module
        assert module is not None and self.state.stack_path is not None
        return module.get_submodule(self.state.stack_path)  # type: ignore[return-value]

    def is_stage_key(self, key: str) -> bool:
        """Whether a state-dict / optimizer-state key belongs to a layer of the stack (not a replicated part)."""
        return self.state.is_stage_key(key)

    def stage_key_set(self) -> set[str]:
        """The state-dict keys (global names) of the layers this process holds."""
        return self.state.stage_key_set()

    # -------------------------------------------------------------------------------------------- given from outside
    def use_groups(self, groups: ProcessGroups) -> None:
        """Make ``groups`` (built by the process setup) this process's groups."""
        self.state.groups = groups

    def adopt_admitted(self, partition: list[int], stack_path: str, layer_names: list[str],
                       layer_times: list[float], outside: Optional[Mapping[str, str]] = None) -> None:
        """A joiner: take the layout of the generation that admitted it (its stage is built in :meth:`place`),
        with the classes of the parts outside the stack (``None``: a record without them -- all replicated)."""
        st = self.state
        st.partition = list(partition)
        st.stack_path = stack_path
        st.layer_names = list(layer_names)
        st.layer_times = list(layer_times)
        st.outside = dict(outside or {})

    # -------------------------------------------------------------------------------------------- first placement
    def place(self, trainer: "pl.Trainer", joining: bool) -> None:
        """Set up this process's stage for a Trainer stage, on its device, with replicas equal and metrics bound.

        A joiner builds the stage of the layout that admitted it (its replicas' state arrives with the layout);
        the first Trainer stage partitions the module; a later one (validate/test after fit) keeps the partition
        and only connects to the new pipeline group.
        """
        st = self.state
        if joining:
            st.full_stack = self.stack()
            self.build()
        elif st.stage is None:
            self.host.model_to_device()
            self.partition_module(trainer)
        else:
            assert st.groups is not None
            st.p2p = P2P(self.host.root_device, st.groups.pipeline_group,
                         st.held_bounds() if st.partition and not st.whole_model else None)
        self.host.model_to_device()
        if not joining:
            self.sync_replicas()
        self.bind_metrics()

    def partition_module(self, trainer: "pl.Trainer") -> None:
        """Locate the layer stack, choose the partition (balance, fixed P or profile) and build this stage."""
        st, o = self.state, self.options
        module = self.host.lightning_module
        assert module is not None and st.groups is not None
        try:
            st.stack_path = locate_layer_stack(module, o.layers_attr)
        except ModelLayoutError as err:
            if o.layers_attr is not None or (o.pipeline_stages or 1) > 1 or o.balance is not None:
                raise ModelLayoutError(
                    f"{err}. (Data parallelism needs no layer stack: with pipeline_stages=1 this model trains as is.)"
                ) from err
            self.whole_model_fallback(module, str(err))
            return
        stack = self.stack()
        if is_block_list(stack):
            verdict = self.profiler.check_block_list(trainer, stack)
            if verdict is not None:
                if o.layers_attr is not None or (o.pipeline_stages or 1) > 1 or o.balance is not None:
                    raise ModelLayoutError(f"cannot cut '{st.stack_path}' into pipeline stages: {verdict}")
                self.whole_model_fallback(module, f"'{st.stack_path}' cannot be cut: {verdict}")
                return
        layers = named_layers(stack)
        st.layer_names = [n for n, _ in layers]
        n_layers = len(st.layer_names)
        world = st.groups.world
        outside = self.classify_outside(trainer, stack)
        st.outside = dict(outside.classes)
        memory = [layer_memory_bytes(m, o.optimizer_state_factor) for _, m in layers]
        memory[0] += self.outside_memory(st.pre_keys)
        memory[-1] += self.outside_memory(st.post_keys)
        p_opt = o.pipeline_stages
        if p_opt is not None and p_opt > n_layers:
            raise ModelLayoutError(
                f"pipeline_stages={p_opt} exceeds the {n_layers} layers of '{st.stack_path}'; every stage needs at "
                f"least one layer (use pipeline_stages <= {n_layers})"
            )
        if o.balance is not None:
            if sum(o.balance) != n_layers or min(o.balance) < 1:
                raise ModelLayoutError(
                    f"balance={o.balance} must be positive layer counts summing to the {n_layers} layers"
                )
            times = [1.0] * n_layers
            sizes = list(o.balance)
            if o.max_stage_memory_bytes is not None:
                _check_sizes_memory(sizes, memory, o.max_stage_memory_bytes)
        elif p_opt == 1:
            times, sizes = [1.0] * n_layers, [n_layers]
            if o.max_stage_memory_bytes is not None:
                _check_sizes_memory(sizes, memory, o.max_stage_memory_bytes)
        else:
            times, reused = self.profiler.layer_times(trainer, stack, self.saved_layer_times())
            if reused:
                log.info("ParcaeStrategy reused the layer times of the checkpoint it resumes from")
            else:
                times[0] += outside.pre_seconds  # the outside parts run on the first and the last stage
                times[-1] += outside.post_seconds
            if p_opt is None:
                p_opt = choose_pipeline_stages(times, world, o.micro_batches, memory, o.max_stage_memory_bytes)
                log.info("ParcaeStrategy chose pipeline_stages=%d from the profile %s", p_opt, times)
            sizes = balance_stages(times, p_opt, memory, o.max_stage_memory_bytes)
        if len(sizes) != st.groups.pipeline_stages:
            st.groups = st.groups.rebuilt(world // len(sizes), len(sizes))
        st.layer_times = times
        st.partition = sizes
        st.full_stack = stack
        self.build()

    def saved_layer_times(self) -> Optional[tuple[list[float], int]]:
        """The layer times of the checkpoint this process resumes from and the global batch they were measured on,
        when they are for this layer stack (its path and layer names; the checkpoints offer only those measured on
        the same kind of device: :meth:`~lightning_parcae.training.checkpointing.StrategyCheckpoints.load`). None
        otherwise; the profiler reuses them only for a sample of that batch (:meth:`LayerProfiler.layer_times`)."""
        rec, st = self.resumed_layout(), self.state
        if not rec:
            return None
        times = rec.get("layer_times")
        if not isinstance(times, list) or not times or len(times) != len(st.layer_names):
            return None
        try:
            values, batch = [float(t) for t in times], int(rec.get("global_batch") or 0)
        except (TypeError, ValueError):
            return None
        same = rec.get("stack_path") == st.stack_path and list(rec.get("layer_names") or []) == st.layer_names
        finite = all(0 < v < float("inf") for v in values)
        placeholder = all(v == 1.0 for v in values)  # a fixed balance or P = 1 measured nothing (partition_module)
        return (values, batch) if same and finite and not placeholder and batch > 0 else None

    def classify_outside(self, trainer: "pl.Trainer", stack: nn.Module) -> "OutsideParts":
        """The classes of the parts outside the stack (:meth:`LayerProfiler.classify_outside`), when the job may
        ever run at P > 1; otherwise (and without a profiler: the layout's unit tests) all replicated."""
        from lightning_parcae.training.profiling import OutsideParts  # noqa: PLC0415

        o, g = self.options, self.state.groups
        assert g is not None
        may_cut = o.elastic or (g.world > 1 and o.pipeline_stages != 1) or (o.balance is not None and
                                                                          len(o.balance) > 1)
        if self.profiler is None or not may_cut:
            return OutsideParts({})
        return self.profiler.classify_outside(trainer, stack)

    def outside_memory(self, keys: set[str]) -> int:
        """Training memory of the outside parts named by ``keys`` (parameters, gradients, optimizer state and
        buffers, each tensor once), as :func:`~lightning_parcae.runtime.partition.layer_memory_bytes` counts a
        layer."""
        chosen: dict[int, tuple[str, Tensor]] = {}  # each tensor once (a tied weight has two keys)
        for key, (_, kind, _, t) in own_tensor_sites(self.host.lightning_module).items():
            if key in keys:
                chosen.setdefault(id(t), (kind, t))
        return tensors_memory_bytes([t for k, t in chosen.values() if k == "param"],
                                    [t for k, t in chosen.values() if k != "param"], self.options.optimizer_state_factor)

    def whole_model_fallback(self, module: nn.Module, why: str) -> None:
        """No layer stack to cut: train the whole module at P = 1 (elastic data parallelism only).

        The module's top-level children stand in for "layers" so that live reconfiguration can move their state to
        joiners exactly as it moves pipeline layers; the pipeline depth is pinned to 1 (``stack_path == ""``).
        """
        st = self.state
        assert st.groups is not None
        names = [n for n, m in module.named_children()
                 if any(True for _ in m.parameters()) or any(True for _ in m.buffers())]
        st.stack_path = ""
        st.layer_names = names
        st.partition = [len(names)]
        st.layer_times = [1.0] * len(names)
        st.no_cut_reason = why
        if st.groups.pipeline_stages != 1:
            st.groups = st.groups.rebuilt(st.groups.world, 1)
        st.full_stack = module
        log.info("ParcaeStrategy: no layer stack to cut (%s); training at P = 1", why)
        self.build()

    def build(self) -> None:
        """(Re)build this process's stage module, proxy and transport from ``partition`` and ``groups``, and
        release the storage of the stack's layers it does not hold (their structure stays in ``full_stack``)."""
        st = self.state
        module = self.host.lightning_module
        assert st.groups is not None and module is not None and st.stack_path is not None
        if st.whole_model:
            st.stage = cut_stage(module, st.layer_names)  # a view: nothing is replaced
            st.proxy = None
            st.p2p = P2P(self.host.root_device, st.groups.pipeline_group)
            return
        a, b = st.held_bounds()
        full = st.full_stack if st.full_stack is not None else self.stack()
        stage = cut_stage(full, st.layer_names[a:b])
        st.stage = stage
        replace_submodule(module, st.stack_path, stage)
        self.release_others(full, module)
        released = release_tensors(module, st.released_outside(), self.host.root_device)
        if released:
            log.debug("released %d bytes of the parts outside the stack other stages hold", released)
        if is_block_list(stage):
            st.proxy = BlockListProxy(stage, full, arity=self.profiler.block_arity)  # type: ignore[arg-type]
        else:
            st.proxy = StageProxy(stage)
        st.p2p = P2P(self.host.root_device, st.groups.pipeline_group, (a, b))

    def release_others(self, full: nn.Module, module: nn.Module) -> int:
        """Release the parameters and persistent buffers of ``full``'s layers this process does not hold (a tensor
        also reachable from ``module`` -- tied to a held layer or to a part outside the stack -- keeps its storage).

        Returns:
            The bytes released.
        """
        st = self.state
        a, b = st.held_bounds()
        held = set(st.layer_names[a:b])
        keep = {id(t) for t in module.parameters()} | {id(t) for t in module.buffers()}
        others = [m for n, m in named_layers(full) if n not in held]
        released = release_storage(others, keep)
        if released:
            log.debug("released %d bytes of the layers other stages hold", released)
        return released

    def sync_replicas(self) -> None:
        """Make replica 0's stage (and rank 0's replicated parameters) authoritative on every rank.

        A stage's tensors go from replica 0 of that stage over its data group; replicated ones from rank 0 to
        everyone; a tied outside part (``"both"``) from rank 0 too, to its holders on the first and the last stage
        (a stage without it receives into a scratch tensor), so that its two copies start equal.
        """
        g = self.state.groups
        module = self.host.lightning_module
        assert g is not None and module is not None
        if g.world == 1:
            return
        st = self.state
        stage_keys = st.stage_key_set()
        tied = {k for k, c in st.outside.items() if c == "both"}
        own, world = [], []
        for name, t in module.state_dict(keep_vars=True).items():
            tensor = t.data if isinstance(t, nn.Parameter) else t
            if not isinstance(tensor, Tensor):
                continue
            if name in tied:
                world.append((tensor, is_released(t)))
            elif name in stage_keys:
                own.append(tensor)
            elif not st.is_stage_key(name):
                world.append((tensor, False))
        with torch.no_grad():
            if g.data_parallel > 1:
                for tensor in own:
                    dist.broadcast(tensor, g.data_ranks(g.coords.stage)[0], group=g.data_group)
            for tensor, scratch in world:
                if scratch:
                    dist.broadcast(torch.empty(tensor.shape, dtype=tensor.dtype, device=tensor.device), 0)
                else:
                    dist.broadcast(tensor, 0)

    def bind_metrics(self) -> None:
        """torchmetrics sync over the replicas of this stage (each pipeline's state is mirrored P times)."""
        try:
            from torchmetrics import Metric  # noqa: PLC0415
        except ImportError:  # pragma: no cover
            return
        module = self.host.lightning_module
        assert module is not None and self.state.groups is not None
        for m in module.modules():
            if isinstance(m, Metric):
                m.process_group = self.state.groups.data_group

    # -------------------------------------------------------------------------------------------- live reconfiguration
    def apply(self, partition: list[int], groups: ProcessGroups, received: Mapping[int, Any],
              group_of: list[dict[str, int]]) -> None:
        """Rebuild this process's stage and optimizer binding for a new layout (in place).

        Args:
            partition: The new layout's layers per stage.
            groups: The new generation's process groups (already built by the process setup).
            received: Layer payloads received from live holders (parameters, buffers, optimizer state).
            group_of: Per optimizer, the param-group index of each parameter name.
        """
        from lightning_parcae.runtime.migration import load_layer_payload, rebind_optimizer  # noqa: PLC0415

        st = self.state
        module = self.host.lightning_module
        assert module is not None and st.full_stack is not None
        held_outside = st.held_outside()
        st.groups = groups
        st.partition = list(partition)
        # layers that arrived: load into the full stack (global names are "<stack_path>.<layer>.<param>")
        if not st.whole_model:
            replace_submodule(module, st.stack_path, st.full_stack)  # type: ignore[arg-type]
        device = self.host.root_device
        a, b = st.held_bounds()
        held = set(st.layer_names[a:b])
        try:
            # a layer that arrives has no storage here (released when another stage held it): give it storage on
            # the device, then fill it from its payload -- every tensor of it, or it would train on garbage
            arriving = [(st.layer_key(n), m) for n, m in named_layers(st.full_stack) if n in held]
            unfilled = materialize_storage(arriving, device)
            unfilled |= materialize_tensors(module, st.held_outside() - held_outside, device)  # with layer 0 / L-1
            for payload in received.values():
                load_layer_payload(module, payload, device)
                unfilled -= set(payload["tensors"])
            if unfilled:
                raise RuntimeError(
                    f"this process now holds layers {a}..{b - 1} of '{st.stack_path}' (and the parts outside it that "
                    f"ride with them) but received no state for "
                    f"{len(unfilled)} of their tensors (e.g. {sorted(unfilled)[:3]}); a layer another stage held "
                    "has no copy here, so its state must arrive in the migration's payload from a live holder. "
                    "The migration plan must send every layer a member newly holds"
                )
        finally:
            self.build()
        for name, layer in named_layers(st.full_stack):
            if name in held:
                layer.to(device)
        optimizers = self.host.optimizers
        opt_state: list[dict[str, Any]] = [dict() for _ in optimizers]
        for payload in received.values():
            for k, per in enumerate(payload["optim"]):
                if k < len(opt_state):
                    opt_state[k].update(per)
        for k, opt in enumerate(optimizers):
            rebind_optimizer(inner_optimizer(opt), module, group_of[k] if k < len(group_of) else {}, opt_state[k])
        self.bind_metrics()


def _check_sizes_memory(sizes: list[int], memory: list[int], limit: int) -> None:
    from lightning_parcae.errors import StageMemoryError  # noqa: PLC0415

    for s, (a, b) in enumerate(stage_bounds(sizes)):
        size = sum(memory[a:b])
        if size > limit:
            raise StageMemoryError(
                f"stage {s} (layers {a}..{b - 1}) needs ~{size} bytes (parameters + gradients + optimizer state) "
                f"but max_stage_memory_bytes={limit}"
            )
