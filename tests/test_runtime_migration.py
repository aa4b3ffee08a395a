"""Moving layer state in place: serialization without pickle, and re-binding live optimizers."""

from __future__ import annotations

import pickle

import pytest
import torch
from torch import nn

from lightning_parcae.runtime.migration import layer_payload, load_layer_payload, pack, rebind_optimizer, unpack


class _Holder(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(*[nn.Linear(3, 3) for _ in range(n)])


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    opt.zero_grad()
    model.net(torch.ones(2, 3)).sum().backward()
    opt.step()


def test_pack_round_trips_tensors_and_containers_if_given_layer_state() -> None:
    obj = {"tensors": {"net.0.weight": torch.arange(6.0).view(2, 3)}, "optim": [{"net.0.weight": {"step": 3}}]}
    back = unpack(pack(obj))
    assert torch.equal(back["tensors"]["net.0.weight"], obj["tensors"]["net.0.weight"])
    assert back["optim"] == obj["optim"]


def test_unpack_refuses_pickled_objects_if_a_peer_sends_arbitrary_code() -> None:
    class Evil:
        def __reduce__(self):  # noqa: ANN204
            return (print, ("owned",))

    blob = torch.frombuffer(bytearray(pickle.dumps({"x": Evil()})), dtype=torch.uint8)
    with pytest.raises(Exception):
        unpack(blob)


def test_rebind_optimizer_keeps_adam_moments_if_layers_move_between_processes() -> None:
    src, dst = _Holder(), _Holder()
    dst.load_state_dict(src.state_dict())
    opt_src = torch.optim.Adam(src.parameters(), lr=0.1)
    _step(src, opt_src)
    # dst held layers 0-1 only (a stage) and now takes over layers 2-3 from src
    stage = nn.Sequential(dst.net[0], dst.net[1])
    full = dst.net
    dst.net = stage
    opt_dst = torch.optim.Adam(dst.parameters(), lr=0.1)
    _step(dst, opt_dst)
    payloads = [layer_payload(src, f"net.{i}", [opt_src]) for i in (2, 3)]
    dst.net = full
    for p in payloads:
        load_layer_payload(dst, p, torch.device("cpu"))
    received = {k: v for p in payloads for k, v in p["optim"][0].items()}
    group_of = {n: 0 for n, _ in dst.named_parameters()}
    rebind_optimizer(opt_dst, dst, group_of, received)
    assert len(opt_dst.param_groups[0]["params"]) == 8
    moved = dst.net[2].weight
    assert torch.equal(moved, src.net[2].weight)
    assert torch.equal(opt_dst.state[moved]["exp_avg"], opt_src.state[src.net[2].weight]["exp_avg"])
    kept = dst.net[0].weight
    assert float(opt_dst.state[kept]["step"]) == 1.0  # its own state survived the rebind
    _step(dst, opt_dst)  # and the optimizer still steps over the new parameter set


def test_load_layer_payload_raises_if_the_shapes_disagree() -> None:
    a, b = _Holder(), nn.Module()
    b.net = nn.Sequential(nn.Linear(3, 5))
    with pytest.raises(ValueError, match="shape"):
        load_layer_payload(b, layer_payload(a, "net.0", []), torch.device("cpu"))
