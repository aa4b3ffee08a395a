"""Executing a migration plan: moving layer state between live processes and re-binding it in place.

Problem: after the planner (:mod:`lightning_parcae.planning.migration_plan`) has decided who holds which stage and which layers move
from whom to whom, the runtime must (1) ship exactly those layers -- parameters, buffers and the optimizer state of
their parameters -- between processes that keep running, (2) rebuild each process's stage module from layers it
already had plus layers it received, and (3) re-point the *existing* optimizer objects (which Lightning, LR
schedulers and callbacks hold references to) at the new parameter set without losing any moment estimate.

Transport: the transfers of one migration run in a *transition world* (every process that sends or receives,
joiners included) initialised under its own store prefix. Each (source, destination) pair exchanges one blob: the
layers' tensors serialized with ``torch.save`` and read back with ``torch.load(weights_only=True)`` -- tensors
and plain containers only, nothing unpickled. Sizes go first, then all blobs are posted at once (``isend`` /
``irecv``) so transfers run in parallel, and every wait is guarded (:mod:`lightning_parcae.runtime.liveness`). The
transition world always uses gloo over CPU tensors, which works on CPU and GPU machines alike (a GPU job pays one
device-to-host copy per moved layer).

Modelled network (emulated clusters only): the moved state of a small emulated model is tiny, so its transfer costs
nothing like the real model's would. With a :class:`~lightning_parcae.runtime.link.LinkModel` installed
(:func:`~lightning_parcae.runtime.link.set_modelled_link`, re-exported here), every :func:`exchange` also sleeps
``max(charge(sent), charge(received))`` after the real transfer. The default is no link (nothing is added);
:mod:`lightning_parcae.testing.emulated_cluster` installs one from a workload profile.
"""

from __future__ import annotations

import io
import time
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_parcae.runtime.link import LinkModel, modelled_link, set_modelled_link
from lightning_parcae.runtime.liveness import guarded_post, guarded_wait
from lightning_parcae.runtime.stage import is_released

__all__ = ["pack", "unpack", "layer_payload", "exchange", "load_layer_payload", "rebind_optimizer", "LinkModel",
           "set_modelled_link"]


def _moved_layers(objs: Any) -> list[int]:
    """Layer indices carried by transfer blobs of the form ``{"layers": {index: payload}, ...}`` (others: none)."""
    out: list[int] = []
    for obj in objs:
        layers = obj.get("layers") if isinstance(obj, Mapping) else None
        if isinstance(layers, Mapping):
            out += [int(i) for i in layers]
    return out


def _charge_modelled_link(sent: Any, received: Any) -> float:
    """Sleep the modelled link time of this process's sent and received layers (both directions share a link
    pair in parallel: the longer one counts). Returns the seconds slept (0 without a link)."""
    link = modelled_link()
    if link is None:
        return 0.0
    seconds = max(link.charge(_moved_layers(sent)), link.charge(_moved_layers(received)))
    if seconds > 0:
        time.sleep(seconds)
    return seconds


def pack(obj: Any) -> Tensor:
    """Serialize tensors + plain containers into a uint8 CPU tensor."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def unpack(t: Tensor) -> Any:
    """Inverse of :func:`pack` (``weights_only=True``: tensors and plain containers only)."""
    return torch.load(io.BytesIO(t.numpy().tobytes()), map_location="cpu", weights_only=True)


def layer_payload(module: nn.Module, layer_prefix: str, optimizers: Sequence[Optimizer],
                  extra_keys: Collection[str] = ()) -> dict[str, Any]:
    """Everything one layer carries, on CPU: state-dict tensors and, per optimizer, its parameters' state.

    Args:
        module: The LightningModule (global names).
        layer_prefix: The layer's state-dict prefix, e.g. ``"net.3"``.
        optimizers: This process's (torch) optimizers.
        extra_keys: State-dict keys outside the layer that ride with it (the parts outside the stack that belong
            to layer 0 or the last layer); they must have storage here.

    Returns:
        ``{"tensors": {global name: tensor}, "optim": [{param name: {key: value}}, ...]}``.

    Raises:
        ValueError: if an extra key has no storage on this process (it is not held here).
    """
    prefix = layer_prefix + "."
    extra = set(extra_keys)
    own = module.state_dict(keep_vars=True)
    lacking = sorted(k for k in extra if k in own and is_released(own[k]))
    if lacking:
        raise ValueError(f"cannot send {lacking[:3]} with layer {layer_prefix!r}: this process does not hold them "
                         "(they have no storage here); only a holder of the layer they ride with can send them")
    tensors = {k: v.detach().cpu().clone() for k, v in own.items() if k.startswith(prefix) or k in extra}
    params = {n: p for n, p in module.named_parameters() if n.startswith(prefix) or n in extra}
    optim: list[dict[str, Any]] = []
    for opt in optimizers:
        per: dict[str, Any] = {}
        for name, p in params.items():
            st = opt.state.get(p)
            if st:
                per[name] = {k: (v.detach().cpu().clone() if isinstance(v, Tensor) else v) for k, v in st.items()}
        optim.append(per)
    return {"tensors": tensors, "optim": optim}


def exchange(sends: Mapping[int, Any], recv_from: Sequence[int], what: str = "state transfer") -> dict[int, Any]:
    """Send one object to each destination and receive one from each source, all in parallel (default group).

    Args:
        sends: ``{destination rank: object}``.
        recv_from: source ranks to receive from.
        what: label for errors.

    Returns:
        ``{source rank: object}``.

    With a modelled link installed (:func:`~lightning_parcae.runtime.link.set_modelled_link`), also sleeps its charge for the layers moved.
    """
    blobs = {dst: pack(obj) for dst, obj in sends.items()}
    sizes_in = {src: torch.zeros(1, dtype=torch.int64) for src in recv_from}
    _send_recv({dst: torch.tensor([b.numel()], dtype=torch.int64) for dst, b in blobs.items()}, sizes_in, 1, what)
    inbox = {src: torch.empty(int(t.item()), dtype=torch.uint8) for src, t in sizes_in.items()}
    _send_recv(blobs, inbox, 2, what)
    received = {src: unpack(t) for src, t in inbox.items()}
    _charge_modelled_link(sends.values(), received.values())
    return received


def _send_recv(outgoing: Mapping[int, Tensor], incoming: Mapping[int, Tensor], tag: int, what: str) -> None:
    """Post every send and receive at once, then wait for all of them (guarded)."""
    works = [guarded_post(lambda t=t, dst=dst: dist.isend(t, dst, tag=tag), what) for dst, t in outgoing.items()]
    works += [guarded_post(lambda t=t, src=src: dist.irecv(t, src, tag=tag), what) for src, t in incoming.items()]
    for w in works:
        guarded_wait(w, what)


def load_layer_payload(module: nn.Module, payload: Mapping[str, Any], device: torch.device) -> None:
    """Copy a received layer's tensors into ``module`` (which must hold that layer under the same global names)."""
    own = dict(module.state_dict(keep_vars=True))
    with torch.no_grad():
        for name, value in payload["tensors"].items():
            target = own.get(name)
            if target is None:
                raise KeyError(f"received state for {name!r}, which this process's module does not have")
            data = target.data if isinstance(target, nn.Parameter) else target
            if data.shape != value.shape:
                raise ValueError(f"received {name!r} with shape {tuple(value.shape)}, expected {tuple(data.shape)}")
            data.copy_(value.to(data.device))


def rebind_optimizer(
    optimizer: Optimizer,
    module: nn.Module,
    group_of: Mapping[str, int],
    received: Mapping[str, Mapping[str, Any]],
) -> None:
    """Point ``optimizer`` at ``module``'s current trainable parameters, keeping or installing their state.

    Args:
        optimizer: the (inner, torch) optimizer; its param-group hyper-parameters are kept.
        module: the LightningModule after its stage was rebuilt.
        group_of: global parameter name -> index of the param group it belongs to in this optimizer (names not
            in the map are not optimized by it).
        received: name -> state for parameters whose state arrived from another process (wins over local state).
    """
    names = {id(p): n for n, p in module.named_parameters()}
    kept: dict[str, dict[str, Any]] = {}
    for p, st in optimizer.state.items():
        if id(p) in names and st:
            kept[names[id(p)]] = st
    groups: list[list[nn.Parameter]] = [[] for _ in optimizer.param_groups]
    for name, p in module.named_parameters():
        gi = group_of.get(name)
        if gi is None or not p.requires_grad or is_released(p):  # a part without storage here is not trained here
            continue
        groups[gi].append(p)
    for group, params in zip(optimizer.param_groups, groups):
        group["params"] = params
    state: defaultdict[Any, Any] = defaultdict(dict)
    for name, p in module.named_parameters():
        if is_released(p):
            continue
        st: Optional[Mapping[str, Any]] = received.get(name)
        if st is None:
            st = kept.get(name)
        if st:
            state[p] = {k: (v.to(p.device) if isinstance(v, Tensor) and k != "step" else v) for k, v in st.items()}
    optimizer.state = state
