"""Find the model's layer stack and cut it down to this process's stage, keeping global names.

Problem: the user writes an ordinary LightningModule whose ``forward`` runs an ``nn.Sequential`` or loops over an
``nn.ModuleList`` of blocks; the strategy must
find that stack without help in the common case, accept one small hint otherwise, and replace it on each process by
the children of its stage only. Keeping the children under their global names (``"7"``, ``"8"``, ...) in a new
``nn.Sequential`` keeps state-dict keys global and makes ``configure_optimizers`` see only local parameters.

Lookup order: ``ParcaeStrategy(layers_attr="path.to.seq")``; else a ``parcae_layers()`` method on the module
returning the ``nn.Sequential`` / ``nn.ModuleList``; else the ``nn.Sequential`` or ``nn.ModuleList`` (at any depth)
holding the most parameters.

Layers another stage holds: every process keeps the whole stack's *structure* (so that it can be re-cut in place
when a migration hands it other layers), but not their storage. :func:`release_storage` moves the parameters and
persistent buffers of such layers to the ``meta`` device (shape and dtype stay: sizes are still priced from them);
:func:`materialize_storage` gives a layer that arrives real, uninitialized storage on this process's device, which
the layer's payload from its previous holder then fills (its values never come from this process). Non-persistent
buffers (masks, rotary tables) are not in a state dict, so no payload carries them: they stay resident.

Parts outside the stack (an embedding, a final norm and head) that this process does not hold
(:func:`release_tensors`) cannot go to ``meta``: they stay registered in the module the user's step runs, and a
``meta`` output of a released embedding would make what the step derives from it -- position ids, rotary tables, a
mask made on ``inputs_embeds.device`` (``transformers``) -- ``meta`` too, which the stage's blocks cannot use. Each
becomes a *stand-in* instead: a zero of its dtype on this process's device, broadcast to its shape (one element of
storage; every op on it gives real tensors of the right shape, device and dtype, whose values the stage discards).
:func:`is_released` tells both kinds from held tensors; :func:`materialize_tensors` gives such a part storage again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from typing import Optional

import torch
from torch import Tensor, nn

from lightning_parcae.errors import ModelLayoutError
from lightning_parcae.runtime.torch_internals import child, own_buffers, own_tensors, put_child, put_own_tensor

__all__ = ["locate_layer_stack", "is_block_list", "replace_submodule", "cut_stage", "swapped", "release_storage",
           "materialize_storage", "resident_bytes", "is_released", "stand_in", "own_tensor_sites", "release_tensors",
           "materialize_tensors"]

_STAND_IN = "_parcae_stand_in"
"""Attribute set on a stand-in tensor (see the module docstring)."""


_STACK_TYPES = (nn.Sequential, nn.ModuleList)


def locate_layer_stack(module: nn.Module, layers_attr: Optional[str] = None) -> str:
    """Dotted path of the layer stack inside ``module``: an ``nn.Sequential``, or an ``nn.ModuleList`` of blocks
    that ``forward`` loops over.

    Args:
        module: the LightningModule.
        layers_attr: explicit dotted path, if the user named it.

    Returns:
        The path (e.g. ``"net"`` or ``"transformer.h"``).

    Raises:
        ModelLayoutError: if the named attribute is missing or not an ``nn.Sequential`` / ``nn.ModuleList``, or no
            stack is found.
    """
    if layers_attr is not None:
        try:
            seq = module.get_submodule(layers_attr)
        except AttributeError as err:
            raise ModelLayoutError(
                f"layers_attr={layers_attr!r} names no submodule of {type(module).__name__}"
            ) from err
        if not isinstance(seq, _STACK_TYPES):
            raise ModelLayoutError(
                f"layers_attr={layers_attr!r} is a {type(seq).__name__}, not an nn.Sequential or nn.ModuleList; the "
                "pipeline is cut between the children of one of those"
            )
        return layers_attr
    hook = getattr(module, "parcae_layers", None)
    if callable(hook):
        seq = hook()
        if not isinstance(seq, _STACK_TYPES):
            raise ModelLayoutError(
                f"parcae_layers() must return an nn.Sequential or nn.ModuleList, got {type(seq).__name__}")
        for name, sub in module.named_modules():
            if sub is seq and name:
                return name
        raise ModelLayoutError("parcae_layers() returned a module that is not a submodule of the module")
    candidates = [(n, m) for n, m in module.named_modules() if n and isinstance(m, _STACK_TYPES) and len(m) > 0]
    if not candidates:
        raise ModelLayoutError(
            f"{type(module).__name__} has no nn.Sequential or nn.ModuleList to cut into pipeline stages. Put the "
            "layers run by forward() in an nn.Sequential (self.net = nn.Sequential(...)) or an nn.ModuleList looped "
            "in forward (for block in self.blocks: x = block(x, ...)), name it with "
            "ParcaeStrategy(layers_attr='path.to.layers'), or define parcae_layers() returning it"
        )
    return max(candidates, key=lambda nm: (sum(p.numel() for p in nm[1].parameters()), -nm[0].count(".")))[0]


def is_block_list(stack: nn.Module) -> bool:
    """Whether the stack is an ``nn.ModuleList`` (blocks looped in ``forward``) rather than an ``nn.Sequential``."""
    return isinstance(stack, nn.ModuleList)


def replace_submodule(module: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Set the submodule at dotted ``path`` to ``new``; returns the old one."""
    parent_path, _, attr = path.rpartition(".")
    parent = module.get_submodule(parent_path) if parent_path else module
    old = getattr(parent, attr)
    setattr(parent, attr, new)
    return old


def cut_stage(stack: nn.Module, names: Sequence[str]) -> nn.Module:
    """A new container of ``stack``'s type holding only ``names`` (same module objects, same names, so state-dict
    keys stay global): an ``nn.Sequential``, or an ``nn.ModuleList`` with the other blocks left out."""
    if isinstance(stack, nn.ModuleList):
        held = nn.ModuleList()
        for n in names:
            put_child(held, n, child(stack, n))
        return held
    return nn.Sequential(OrderedDict((n, child(stack, n)) for n in names))  # type: ignore[misc]


@contextmanager
def swapped(module: nn.Module, path: str, stand_in: nn.Module) -> Iterator[None]:
    """Temporarily put ``stand_in`` at ``path`` (e.g. a StageProxy while the user's step runs)."""
    old = replace_submodule(module, path, stand_in)
    try:
        yield
    finally:
        replace_submodule(module, path, old)


def _releasable(m: nn.Module) -> Iterator[tuple[str, str, Tensor]]:
    """``(kind, name, tensor)`` of ``m``'s own parameters and persistent buffers that a release may move to meta:
    plain ``nn.Parameter`` / ``Tensor`` objects (a subclass -- a lazy or quantized parameter -- is left alone)."""
    for kind, name, t in own_tensors(m):
        if type(t) is (nn.Parameter if kind == "param" else Tensor):
            yield kind, name, t


def _replacement(t: Tensor, kind: str, data: Tensor) -> Tensor:
    """``data`` in ``t``'s place: a parameter stays a parameter (same ``requires_grad`` and attributes, less the
    stand-in mark), a buffer is ``data`` itself."""
    if kind != "param":
        return data
    new = nn.Parameter(data, requires_grad=t.requires_grad)
    new.__dict__.update({k: v for k, v in t.__dict__.items() if k != _STAND_IN})
    return new


def release_storage(layers: Sequence[nn.Module], keep: Collection[int] = ()) -> int:
    """Drop the storage of ``layers``' parameters and persistent buffers: each becomes a ``meta`` tensor of the
    same shape, dtype and ``requires_grad`` (a parameter's attributes are kept; one tensor shared by several
    modules stays one). Non-persistent buffers stay, moved to the CPU.

    Args:
        layers: the layers another stage holds.
        keep: ``id`` of tensors that must keep their storage (reachable from what this process trains: a weight
            tied to a held layer or to a part outside the stack).

    Returns:
        The bytes released.
    """
    memo: dict[int, tuple[Tensor, Tensor]] = {}  # id(old) -> (old, meta); old kept alive so ids are not reused
    released = 0
    for layer in layers:
        for m in layer.modules():
            for kind, name, t in list(_releasable(m)):
                if t.is_meta or id(t) in keep:
                    continue
                if id(t) not in memo:
                    memo[id(t)] = (t, _replacement(t, kind, torch.empty_like(t, device="meta")))
                    released += t.numel() * t.element_size()
                put_own_tensor(m, kind, name, memo[id(t)][1])
            for name, b in own_buffers(m):
                if not b.is_meta and id(b) not in keep and b.device.type != "cpu":
                    put_own_tensor(m, "buffer", name, b.cpu())
    return released


def materialize_storage(layers: Sequence[tuple[str, nn.Module]], device: torch.device) -> set[str]:
    """Give the released (``meta``) parameters and buffers of ``layers`` real, *uninitialized* storage on
    ``device``, keeping their shape, dtype, ``requires_grad`` and sharing. The caller must then fill every one of
    them (from the layer's payload): their values are garbage until then.

    Args:
        layers: ``(state-dict prefix, layer)`` pairs, e.g. ``("net.3", stack[3])``.
        device: where the storage goes.

    Returns:
        The state-dict names (``"<prefix>.<path>.<name>"``) of every tensor given storage -- what must be filled.
    """
    memo: dict[int, tuple[Tensor, Tensor]] = {}
    names: set[str] = set()
    for prefix, layer in layers:
        for path, m in layer.named_modules(remove_duplicate=False):
            for kind, name, t in list(_releasable(m)):
                if not t.is_meta:
                    continue
                if id(t) not in memo:
                    memo[id(t)] = (t, _replacement(t, kind, torch.empty_like(t, device=device)))
                put_own_tensor(m, kind, name, memo[id(t)][1])
                names.add(".".join(x for x in (prefix, path, name) if x))
    return names


def resident_bytes(module: nn.Module) -> int:
    """Bytes of ``module``'s parameters and buffers that have storage on this process (``meta`` ones and stand-ins
    do not)."""
    seen: set[int] = set()
    total = 0
    for t in list(module.parameters()) + list(module.buffers()):
        if id(t) not in seen and not is_released(t):
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def is_released(t: Tensor) -> bool:
    """Whether ``t`` has no storage of its own on this process: a ``meta`` tensor or a stand-in."""
    return bool(t.is_meta or getattr(t, _STAND_IN, False))


def stand_in(t: Tensor, device: torch.device) -> Tensor:
    """A stand-in for ``t`` (see the module docstring): a zero of ``t``'s dtype on ``device`` broadcast to ``t``'s
    shape; a parameter stays a parameter (same ``requires_grad`` and attributes)."""
    zeros = torch.zeros((), dtype=t.dtype, device=device).expand(t.shape)
    new = _replacement(t, "param" if isinstance(t, nn.Parameter) else "buffer", zeros)
    setattr(new, _STAND_IN, True)
    return new


def own_tensor_sites(module: nn.Module) -> dict[str, tuple[nn.Module, str, str, Tensor]]:
    """Every state-dict key of ``module``'s parameters and persistent buffers with where it lives: ``key ->
    (owning module, kind, name, tensor)``; a tensor registered at two places (tied weights) under both keys."""
    sites: dict[str, tuple[nn.Module, str, str, Tensor]] = {}
    for path, m in module.named_modules(remove_duplicate=False):
        for kind, name, t in own_tensors(m):
            sites[f"{path}.{name}" if path else name] = (m, kind, name, t)
    return sites


def release_tensors(module: nn.Module, keys: Collection[str], device: torch.device) -> int:
    """Replace the tensors of ``module`` named by the state-dict ``keys`` by stand-ins on ``device`` (one tensor
    under two keys gets one stand-in, kept at both places); already released ones stay as they are.

    Returns:
        The bytes released.
    """
    memo: dict[int, tuple[Tensor, Tensor]] = {}  # id(old) -> (old, stand-in); old kept alive so ids are not reused
    released = 0
    for key, (m, kind, name, t) in own_tensor_sites(module).items():
        if key not in keys or is_released(t):
            continue
        if id(t) not in memo:
            memo[id(t)] = (t, stand_in(t, device))
            released += t.numel() * t.element_size()
        put_own_tensor(m, kind, name, memo[id(t)][1])
    return released


def materialize_tensors(module: nn.Module, keys: Collection[str], device: torch.device) -> set[str]:
    """Give the released tensors of ``module`` named by ``keys`` real, *uninitialized* storage on ``device`` (the
    caller fills them from a payload), keeping shape, dtype, ``requires_grad`` and sharing.

    Returns:
        The keys given storage (every key of a shared tensor, also one not in ``keys``).
    """
    sites = own_tensor_sites(module)
    chosen = {id(sites[k][3]) for k in keys if k in sites and is_released(sites[k][3])}
    memo: dict[int, tuple[Tensor, Tensor]] = {}
    names: set[str] = set()
    for key, (m, kind, name, t) in sites.items():
        if id(t) not in chosen:
            continue
        if id(t) not in memo:
            memo[id(t)] = (t, _replacement(t, kind, torch.empty(t.shape, dtype=t.dtype, device=device)))
        put_own_tensor(m, kind, name, memo[id(t)][1])
        names.add(key)
    return names
