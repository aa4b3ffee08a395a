"""The one place the runtime touches torch's private internals.

Problem: two things the runtime must do have no public torch API. (1) After a failure, survivors must forget a
generation's process groups *without* shutting them down (a gloo shutdown blocks on an operation stuck on a dead
peer) and shorten a live group's timeout to the progress watchdog's bound: both need ``distributed_c10d``'s private
registry. (2) Cutting a layer stack into stages keeps the stack's own child names (so state-dict keys stay global),
including the holes of an ``nn.ModuleList`` with blocks left out, and walks children in registration order without
``named_children``'s de-duplication of a module held twice: both read ``nn.Module``'s child table. (3) fp16 loss
scaling over a pipeline needs one inf/nan verdict for the whole job, but ``torch.amp.GradScaler`` keeps each
optimizer's verdict (and whether it was unscaled) in a private per-optimizer table, and an optimizer that unscales
inside its own ``step`` (fused Adam) says so only by a private flag. (4) A stage releases the storage of layers
other stages hold and gives it back when one arrives: that swaps a module's *own* parameter and buffer objects in
place (shared ones stay shared) and must know which buffers are persistent, which only ``nn.Module``'s tables say.
Every such read
is here, so that a torch upgrade that renames them breaks one module, and ``tests/test_ownership.py`` can check
that nothing else under ``runtime/`` reads another object's private attributes.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Optional

from torch import nn

__all__ = ["set_group_timeout", "forget_process_groups", "child", "children", "put_child", "scaler_found_inf",
           "set_scaler_found_inf", "scaler_unscaled", "optimizer_unscales_itself", "own_tensors", "put_own_tensor",
           "own_buffers"]


def set_group_timeout(timeout: timedelta, group: Optional[Any] = None) -> None:
    """Set the timeout of ``group``'s operations (``None``: the default group) after it was built.

    Args:
        timeout: The new bound of each operation.
        group: A process group of this process, or ``None`` for the world.
    """
    from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415

    c10d._set_pg_timeout(timeout, group)


def forget_process_groups() -> list[Any]:
    """Drop every process group from torch's registry without shutting any down; returns them (to be kept alive).

    These are the steps ``destroy_process_group`` takes after its shutdown calls: afterwards ``init_process_group``
    may build a new world, while the old groups' objects -- whose destructors would block on a dead peer -- are
    the caller's to keep referenced.
    """
    from torch.distributed import distributed_c10d as c10d  # noqa: PLC0415

    world = c10d._world
    kept: list[Any] = list(world.pg_map.keys())
    c10d._update_default_pg(None)
    for table in (world.pg_map, world.pg_names, world.pg_group_ranks, world.pg_backend_config, world.pg_to_tag,
                  world.tags_to_pg, world.pg_coalesce_state):
        table.clear()
    c10d._unregister_all_process_groups()
    world.group_count = 0
    return kept


def child(module: nn.Module, name: str) -> nn.Module:
    """``module``'s direct child registered as ``name`` (a ``KeyError`` when there is none)."""
    return module._modules[name]  # type: ignore[return-value]


def children(module: nn.Module) -> list[nn.Module]:
    """``module``'s direct children in registration order, a module registered twice listed twice."""
    return list(module._modules.values())  # type: ignore[arg-type]


def put_child(container: nn.Module, name: str, sub: nn.Module) -> None:
    """Register ``sub`` in ``container`` under ``name`` as it is (also a non-contiguous index of a ``ModuleList``)."""
    container._modules[name] = sub


def scaler_found_inf(scaler: Any, optimizer: Any) -> list[Any]:
    """The inf/nan flags ``scaler.unscale_(optimizer)`` found, one float tensor per device (empty before it ran).

    Reads ``GradScaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]`` (torch 2.13) without adding an
    entry for an optimizer the scaler has not seen.
    """
    state = scaler._per_optimizer_states.get(id(optimizer))
    return list(state["found_inf_per_device"].values()) if state is not None else []


def set_scaler_found_inf(scaler: Any, optimizer: Any, found_inf: Any) -> None:
    """Make ``found_inf`` (a 0-d float tensor, > 0: skip) the scaler's only verdict for ``optimizer``'s step, as if
    ``unscale_`` had found it; ``scaler.step`` then skips or steps by it and ``scaler.update`` backs off or grows by
    it. Writes ``GradScaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]`` (torch 2.13)."""
    scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"] = {found_inf.device: found_inf}


def scaler_unscaled(scaler: Any) -> bool:
    """Whether some optimizer of ``scaler`` was unscaled or stepped since the last ``update()`` (its table of
    per-optimizer stages, ``GradScaler._per_optimizer_states``, torch 2.13, holds a stage other than READY)."""
    from torch.amp.grad_scaler import OptState  # noqa: PLC0415

    return any(st["stage"] is not OptState.READY for st in scaler._per_optimizer_states.values())


def optimizer_unscales_itself(optimizer: Any) -> bool:
    """Whether ``optimizer.step`` takes the scale and finds infs itself (fused Adam/AdamW/SGD: the private flag
    ``Optimizer._step_supports_amp_scaling``, torch 2.13; Lightning's fabric reads the same flag)."""
    return bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def own_tensors(m: nn.Module) -> list[tuple[str, str, Any]]:
    """``(kind, name, tensor)`` of ``m``'s own (not its children's) parameters (``"param"``) and *persistent*
    buffers (``"buffer"``), in registration order; ``None`` entries left out."""
    out: list[tuple[str, str, Any]] = [("param", n, t) for n, t in m._parameters.items() if t is not None]
    out += [("buffer", n, t) for n, t in m._buffers.items()
            if t is not None and n not in m._non_persistent_buffers_set]
    return out


def own_buffers(m: nn.Module) -> list[tuple[str, Any]]:
    """``(name, tensor)`` of every buffer of ``m`` itself, persistent or not (``None`` entries left out)."""
    return [(n, t) for n, t in m._buffers.items() if t is not None]


def put_own_tensor(m: nn.Module, kind: str, name: str, tensor: Any) -> None:
    """Replace ``m``'s own parameter (``kind="param"``) or buffer (``"buffer"``) ``name`` by ``tensor`` in place,
    keeping its registration (and a buffer's persistence)."""
    (m._parameters if kind == "param" else m._buffers)[name] = tensor

