"""Layout-independent checkpoints: state keyed by global names, gathered from the stages, written atomically.

Problem: a checkpoint written by a D x P job must load into a job of any other shape -- and into the plain,
unpartitioned LightningModule. Two things break that by default: each stage holds only some layers (so its
``state_dict`` is partial), and ``optimizer.state_dict()`` keys the state by *position* of the parameter in this
process's optimizer, which changes with the partition. Here the optimizer state is re-keyed by parameter *name*
(the same global names as the model's state dict), partial states are gathered from the stages of replica 0 to
global rank 0, merged, and written with temp-file + ``os.replace`` so a crash never leaves a torn file. Loading does
the inverse: every rank filters the full state to the names it holds and rebuilds its positional optimizer state.

The same name-keyed vocabulary serves per-layer state (:func:`layer_state`) for a later live-migration issue.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.runtime.stage import is_released

__all__ = [
    "to_cpu",
    "named_optimizer_state",
    "merge_named_optimizer_states",
    "load_named_optimizer_state",
    "gather_objects",
    "atomic_save",
    "plain_containers",
    "layer_state",
]


def to_cpu(x: Any) -> Any:
    """A detached CPU copy of every tensor in ``x`` (mappings, lists and tuples rebuilt): a snapshot that later
    updates of the live tensors do not change."""
    if isinstance(x, Tensor):
        return x.detach().cpu().clone()
    if isinstance(x, Mapping):
        return {k: to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(to_cpu(v) for v in x)
    return x


def named_optimizer_state(optimizer: Optimizer, module: nn.Module) -> dict[str, Any]:
    """The optimizer's state with parameters named by their global names instead of positions.

    Args:
        optimizer: an optimizer over (some of) ``module``'s parameters.
        module: the LightningModule (its ``named_parameters`` give the global names).

    Returns:
        ``{"state": {name: {key: tensor}}, "param_groups": [{hyper..., "params": [name, ...]}]}`` on CPU.

    Raises:
        ConfigurationError: if the optimizer holds a parameter that is not part of ``module``.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for group in optimizer.param_groups:
        g = {k: to_cpu(v) for k, v in group.items() if k != "params"}
        g["params"] = []
        for p in group["params"]:
            if id(p) not in names:
                raise ConfigurationError("the optimizer holds a parameter that is not part of the LightningModule")
            g["params"].append(names[id(p)])
            if p in optimizer.state and optimizer.state[p]:
                state[names[id(p)]] = to_cpu(dict(optimizer.state[p]))
        groups.append(g)
    return {"state": state, "param_groups": groups}


def merge_named_optimizer_states(parts: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Merge the name-keyed optimizer states of the stages (in stage order) into one.

    Param group ``i`` of the result lists the names of group ``i`` of every part, in order; its hyper-parameters
    come from the first part (all stages share them).
    """
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    for part in parts:
        state.update(part["state"])
        for i, g in enumerate(part["param_groups"]):
            if i == len(groups):
                groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": []})
            for name in g["params"]:
                if name not in groups[i]["params"]:
                    groups[i]["params"].append(name)
    return {"state": state, "param_groups": groups}


def load_named_optimizer_state(optimizer: Optimizer, module: nn.Module, named: Mapping[str, Any]) -> None:
    """Load a name-keyed optimizer state into an optimizer over this process's parameters.

    Only the names this optimizer holds are taken. Hyper-parameters (lr, betas, ...) of group ``i`` come from group
    ``i`` of ``named``.

    Raises:
        ConfigurationError: if ``named`` has fewer param groups than the optimizer.
    """
    names = {id(p): n for n, p in module.named_parameters()}
    current = optimizer.state_dict()
    if len(named["param_groups"]) < len(current["param_groups"]):
        raise ConfigurationError(
            f"checkpoint optimizer has {len(named['param_groups'])} param groups, this optimizer "
            f"{len(current['param_groups'])}; configure_optimizers must build the same groups"
        )
    new_state: dict[int, Any] = {}
    new_groups = []
    for group, cur, saved in zip(optimizer.param_groups, current["param_groups"], named["param_groups"]):
        g = {k: v for k, v in saved.items() if k != "params"}
        g["params"] = cur["params"]
        new_groups.append(g)
        for p, idx in zip(group["params"], cur["params"]):
            st = named["state"].get(names[id(p)])
            if st is not None and not is_released(p):  # no state for a part another stage holds
                new_state[idx] = dict(st)
    optimizer.load_state_dict({"state": new_state, "param_groups": new_groups})


def gather_objects(obj: Any, dst: int, group: Any) -> Optional[list[Any]]:
    """Gather state (tensors + plain containers) to global rank ``dst`` over ``group``.

    Unlike ``gather_object`` nothing is unpickled: each part travels as a ``torch.save`` blob read back with
    ``weights_only=True``. The waits are guarded (:mod:`lightning_parcae.runtime.liveness`), so a member lost
    during a checkpoint gather aborts the generation like any other collective instead of hanging it.

    Returns:
        The parts in group-rank order on ``dst``, ``None`` elsewhere.
    """
    if not dist.is_initialized() or dist.get_world_size(group) == 1:
        return [obj]
    from lightning_parcae.runtime.liveness import guarded  # noqa: PLC0415
    from lightning_parcae.runtime.migration import pack, unpack  # noqa: PLC0415

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    blob = pack(obj)
    n = dist.get_world_size(group)
    size = torch.tensor([blob.numel()], dtype=torch.int64, device=device)
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(n)]
    guarded(lambda: dist.all_gather(sizes, size, group=group, async_op=True), "checkpoint gather")
    lengths = [int(x.item()) for x in sizes]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: blob.numel()] = blob
    padded = padded.to(device) if device is not None else padded
    if dist.get_rank() != dst:
        guarded(lambda: dist.gather(padded, None, dst=dst, group=group, async_op=True), "checkpoint gather")
        return None
    outs = [torch.empty_like(padded) for _ in range(n)]
    guarded(lambda: dist.gather(padded, outs, dst=dst, group=group, async_op=True), "checkpoint gather")
    return [unpack(o[:k].cpu()) for o, k in zip(outs, lengths)]


def plain_containers(x: Any) -> Any:
    """Convert mapping subclasses (e.g. Lightning's ``AttributeDict``) to plain dicts so ``weights_only`` loads."""
    if isinstance(x, Mapping):
        return {k: plain_containers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [plain_containers(v) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(plain_containers(v) for v in x)
    return x


def atomic_save(obj: Any, path: str | os.PathLike[str]) -> None:
    """``torch.save`` to a temporary file next to ``path``, fsync, then ``os.replace`` onto ``path``."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".parcae-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def layer_state(
    module: nn.Module, layer_prefix: str, optimizers: Sequence[Optimizer] = ()
) -> dict[str, Tensor]:
    """All state of one layer as a flat dict of tensors: parameters, buffers and their optimizer state.

    Keys: the global state-dict names (``"<layer_prefix>.weight"``) and, for optimizer state,
    ``"optim<k>/<param name>/<state key>"``. This is the unit a live migration moves between processes.

    Args:
        module: the LightningModule.
        layer_prefix: the layer's global name prefix, e.g. ``"net.3"``.
        optimizers: the process's optimizers.
    """
    prefix = layer_prefix + "."
    out: dict[str, Tensor] = {k: v for k, v in module.state_dict().items() if k.startswith(prefix)}
    params = {n: p for n, p in module.named_parameters() if n.startswith(prefix)}
    for k, opt in enumerate(optimizers):
        for name, p in params.items():
            for key, value in opt.state.get(p, {}).items():
                if isinstance(value, Tensor):
                    out[f"optim{k}/{name}/{key}"] = value
    return out
