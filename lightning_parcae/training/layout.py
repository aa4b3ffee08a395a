"""The stage layout: which layers this process holds, and rebuilding that in place for a new (D, P).

Problem: a D x P job cuts the model's layer stack into P stages, and each process must hold exactly its stage's
layers (on its device), a proxy that stands in for the whole stack inside the user's ``forward``, and a transport
to its pipeline neighbours -- first when training starts (from an explicit ``balance``, a fixed P, or a short
per-layer profile), and again whenever live reconfiguration moves layers between processes. A model with no layer
stack the pipeline can cut trains whole at P = 1. Replicas of a stage start identical (replica 0 is
authoritative) and torchmetrics sync over the replicas of a stage.

The layout's state (``stack_path``, ``layer_names``, ``partition``, ``layer_times``, the stage module, proxy and
transport) stays on the strategy, which the runtime reads through
:class:`~lightning_parcae.runtime.host.TrainingHost`; :class:`StageLayout` holds the procedures that set it.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_parcae.errors import ModelLayoutError
from lightning_parcae.runtime.partition import balance_stages, choose_pipeline_stages, layer_memory_bytes, stage_bounds
from lightning_parcae.runtime.pipeline import P2P, BlockListProxy, StageProxy
from lightning_parcae.runtime.stage import cut_stage, is_block_list, locate_layer_stack, replace_submodule

if TYPE_CHECKING:
    import pytorch_lightning as pl

__all__ = ["StageLayout"]

log = logging.getLogger(__name__)


class StageLayout:
    """Partition the layer stack and (re)build this process's stage for one strategy (see the module docstring).

    Args:
        strategy: The owning ParcaeStrategy; the layout state is read from and written to it.
    """

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    def stack(self) -> nn.Sequential:
        s = self.strategy
        assert s.lightning_module is not None and s.stack_path is not None
        return s.lightning_module.get_submodule(s.stack_path)  # type: ignore[return-value]

    def is_stage_key(self, key: str) -> bool:
        """Whether a state-dict / optimizer-state key belongs to a layer of the stack (not a replicated part)."""
        s = self.strategy
        if s.stack_path:
            return key.startswith(s.stack_path + ".")
        return key.split(".", 1)[0] in set(s.layer_names)

    def stage_key_set(self) -> set[str]:
        """The state-dict keys (global names) of the layers this process holds."""
        s = self.strategy
        assert s.stack_path is not None and s._stage is not None
        return {s.layer_key(k) for k in s._stage.state_dict().keys()}

    def place(self, trainer: "pl.Trainer", joining: bool) -> None:
        """Set up this process's stage for a Trainer stage, on its device, with replicas equal and metrics bound.

        A joiner builds the stage of the layout that admitted it (its replicas' state arrives with the layout);
        the first Trainer stage partitions the module; a later one (validate/test after fit) keeps the partition
        and only connects to the new pipeline group.
        """
        s = self.strategy
        if joining:
            s._full_stack = self.stack()
            self.build()
        elif s._stage is None:
            s.model_to_device()
            self.partition_module(trainer)
        else:
            s._p2p = P2P(s.root_device, s.groups.pipeline_group)
        s.model_to_device()
        if not joining:
            self.sync_replicas()
        self.bind_metrics()

    def partition_module(self, trainer: "pl.Trainer") -> None:
        s = self.strategy
        module = s.lightning_module
        assert module is not None and s.groups is not None
        try:
            s.stack_path = locate_layer_stack(module, s.layers_attr)
        except ModelLayoutError as err:
            if s.layers_attr is not None or (s.pipeline_stages_option or 1) > 1 or s.balance is not None:
                raise ModelLayoutError(
                    f"{err}. (Data parallelism needs no layer stack: with pipeline_stages=1 this model trains as is.)"
                ) from err
            self.whole_model_fallback(module, str(err))
            return
        stack = self.stack()
        if is_block_list(stack):
            verdict = s.profiler.check_block_list(trainer)
            if verdict is not None:
                if s.layers_attr is not None or (s.pipeline_stages_option or 1) > 1 or s.balance is not None:
                    raise ModelLayoutError(f"cannot cut '{s.stack_path}' into pipeline stages: {verdict}")
                self.whole_model_fallback(module, f"'{s.stack_path}' cannot be cut: {verdict}")
                return
        s.layer_names = list(stack._modules.keys())
        n_layers = len(s.layer_names)
        world = s.groups.world
        memory = [layer_memory_bytes(stack._modules[n], s.optimizer_state_factor) for n in s.layer_names]
        p_opt = s.pipeline_stages_option
        if p_opt is not None and p_opt > n_layers:
            raise ModelLayoutError(
                f"pipeline_stages={p_opt} exceeds the {n_layers} layers of '{s.stack_path}'; every stage needs at "
                f"least one layer (use pipeline_stages <= {n_layers})"
            )
        if s.balance is not None:
            if sum(s.balance) != n_layers or min(s.balance) < 1:
                raise ModelLayoutError(
                    f"balance={s.balance} must be positive layer counts summing to the {n_layers} layers"
                )
            times = [1.0] * n_layers
            sizes = list(s.balance)
            if s.max_stage_memory_bytes is not None:
                _check_sizes_memory(sizes, memory, s.max_stage_memory_bytes)
        elif p_opt == 1:
            times, sizes = [1.0] * n_layers, [n_layers]
            if s.max_stage_memory_bytes is not None:
                _check_sizes_memory(sizes, memory, s.max_stage_memory_bytes)
        else:
            times = s.profiler.profile(trainer, stack)
            if p_opt is None:
                p_opt = choose_pipeline_stages(times, world, s.micro_batches, memory, s.max_stage_memory_bytes)
                log.info("ParcaeStrategy chose pipeline_stages=%d from the profile %s", p_opt, times)
            sizes = balance_stages(times, p_opt, memory, s.max_stage_memory_bytes)
        if len(sizes) != s.groups.pipeline_stages:
            s.groups = s.groups.rebuilt(world // len(sizes), len(sizes))
        s.layer_times = times
        s.partition = sizes
        s._full_stack = stack
        self.build()

    def whole_model_fallback(self, module: nn.Module, why: str) -> None:
        """No layer stack to cut: train the whole module at P = 1 (elastic data parallelism only).

        The module's top-level children stand in for "layers" so that live reconfiguration can move their state to
        joiners exactly as it moves pipeline layers; the pipeline depth is pinned to 1.
        """
        s = self.strategy
        assert s.groups is not None
        names = [n for n, m in module.named_children()
                 if any(True for _ in m.parameters()) or any(True for _ in m.buffers())]
        s.stack_path = ""
        s.layer_names = names
        s.partition = [len(names)]
        s.layer_times = [1.0] * len(names)
        s.max_pipeline_stages = 1
        s._no_cut_reason = why
        if s.groups.pipeline_stages != 1:
            s.groups = s.groups.rebuilt(s.groups.world, 1)
        s._full_stack = module  # type: ignore[assignment]
        log.info("ParcaeStrategy: no layer stack to cut (%s); training at P = 1", why)
        self.build()

    def build(self) -> None:
        """(Re)build this process's stage module, proxy and transport from ``partition`` and ``groups``."""
        s = self.strategy
        assert s.groups is not None and s.lightning_module is not None and s.stack_path is not None
        if s.whole_model:
            s._stage = cut_stage(s.lightning_module, s.layer_names)  # a view: nothing is replaced
            s._proxy = None
            s._p2p = P2P(s.root_device, s.groups.pipeline_group)
            return
        a, b = stage_bounds(s.partition)[s.groups.coords.stage]
        full = s._full_stack if s._full_stack is not None else self.stack()
        s._stage = cut_stage(full, s.layer_names[a:b])
        replace_submodule(s.lightning_module, s.stack_path, s._stage)
        s._proxy = BlockListProxy(s._stage) if is_block_list(s._stage) else StageProxy(s._stage)
        s._p2p = P2P(s.root_device, s.groups.pipeline_group)

    def sync_replicas(self) -> None:
        """Make replica 0's stage (and rank 0's replicated parameters) authoritative on every rank."""
        s = self.strategy
        g = s.groups
        assert g is not None and s.lightning_module is not None
        if g.world == 1:
            return
        stage_keys = s.stage_key_set()
        with torch.no_grad():
            for name, t in s.lightning_module.state_dict(keep_vars=True).items():
                tensor = t.data if isinstance(t, nn.Parameter) else t
                if not isinstance(tensor, Tensor):
                    continue
                if name in stage_keys:
                    if g.data_parallel > 1:
                        dist.broadcast(tensor, g.data_ranks(g.coords.stage)[0], group=g.data_group)
                else:
                    dist.broadcast(tensor, 0)

    def bind_metrics(self) -> None:
        """torchmetrics sync over the replicas of this stage (each pipeline's state is mirrored P times)."""
        s = self.strategy
        try:
            from torchmetrics import Metric  # noqa: PLC0415
        except ImportError:  # pragma: no cover
            return
        assert s.lightning_module is not None and s.groups is not None
        for m in s.lightning_module.modules():
            if isinstance(m, Metric):
                m.process_group = s.groups.data_group

    def apply(self, trainer: "pl.Trainer", layout: Any, generation: int, received: Mapping[int, Any],
                     group_of: list[dict[str, int]]) -> None:
        """Rebuild this process's groups, stage, optimizer binding and data slice for ``layout`` (in place)."""
        s = self.strategy
        from lightning_parcae.runtime.migration import load_layer_payload, rebind_optimizer  # noqa: PLC0415

        module = s.lightning_module
        assert module is not None and s._full_stack is not None
        rank = layout.members.index(s.elastic_runtime.member)  # type: ignore[union-attr]
        world, d, p = len(layout.members), layout.data_parallel, layout.pipeline_stages
        s.process.set_ranks(rank, world)
        s.process.build_groups(generation, rank, world, d, p)
        s.partition = list(layout.partition)
        # layers that arrived: load into the full stack (global names are "<stack_path>.<layer>.<param>")
        if not s.whole_model:
            replace_submodule(module, s.stack_path, s._full_stack)  # type: ignore[arg-type]
        try:
            for payload in received.values():
                load_layer_payload(module, payload, s.root_device)
        finally:
            self.build()
        a, b = stage_bounds(s.partition)[s.groups.coords.stage]
        held = set(s.layer_names[a:b])
        for name, layer in s._full_stack._modules.items():
            layer.to(s.root_device if name in held else torch.device("cpu"))  # type: ignore[union-attr]
        opt_state: list[dict[str, Any]] = [dict() for _ in s.optimizers]
        for payload in received.values():
            for k, per in enumerate(payload["optim"]):
                if k < len(opt_state):
                    opt_state[k].update(per)
        for k, opt in enumerate(s.optimizers):
            inner = getattr(opt, "_optimizer", opt)
            rebind_optimizer(inner, module, group_of[k] if k < len(group_of) else {}, opt_state[k])
        s.data.reshard(d, s.groups.coords.replica)
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
