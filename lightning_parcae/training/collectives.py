"""Lightning's collectives over a D x P job: metric reductions, decisions, barriers and broadcasts.

Problem: Lightning calls ``reduce`` / ``reduce_boolean_decision`` / ``barrier`` / ``broadcast`` on the strategy for
logging, checkpoint agreement and early stopping. Under ParcaeStrategy every stage of a pipeline holds a mirror of
its pipeline's logged values, so a plain all-rank sum would count each pipeline P times; a joiner that has not yet
been admitted must not enter collectives the running members never match; and under live reconfiguration a peer
lost in the middle of one (in validation, in a checkpoint's barrier) must not crash the script -- the generation
is already aborted and the next step boundary recovers in place. This part runs those collectives accordingly.

The strategy owns one :class:`Collectives` and forwards Lightning's calls to it.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any, Callable, Optional, Protocol, Union

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ReduceOp

from lightning_parcae.errors import PeerLostError
from lightning_parcae.runtime.liveness import guarded
from lightning_parcae.training.stage_state import StageState

__all__ = ["Collectives", "CollectivesHost", "op_name"]

log = logging.getLogger(__name__)


class CollectivesHost(Protocol):
    """What the collectives need from the strategy: its device and elastic runtime."""

    @property
    def root_device(self) -> torch.device: ...

    @property
    def elastic_runtime(self) -> Any: ...


class Collectives:
    """The collectives Lightning runs through one strategy (see the module docstring).

    Args:
        state: The stage state (read only: this generation's groups).
        host: The strategy, for its device and elastic runtime.
    """

    def __init__(self, state: StageState, host: CollectivesHost) -> None:
        self.state = state
        self.host = host

    @property
    def solo(self) -> bool:
        """A joiner before it trains: Lightning's set-up collectives would not be matched by the running members,
        so ``broadcast`` / ``barrier`` / ``reduce`` act locally until it has joined -- and never again after: once
        admitted it is a member like any other, also after ``fit`` (a joiner whose barrier in
        ``trainer.save_checkpoint`` returned at once exited while the others were still in it)."""
        er = self.host.elastic_runtime
        return er is not None and er.joining and not er.admitted

    def reduce(self, tensor: Any, group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Any:
        """Reduce over the replicas (every stage holds a mirror of its pipeline's values, so P copies are folded).

        With ``group=None`` the reduction runs over all ranks; since the P stages of a pipeline hold identical
        (mirrored) values, ``mean`` / ``max`` / ``min`` are unaffected and ``sum`` is divided by P.
        """
        groups = self.state.groups
        if not isinstance(tensor, Tensor) or groups is None or groups.world == 1 or self.solo:
            return tensor
        op = op_name(reduce_op)
        out = tensor.detach().clone()
        if op in ("mean", "sum") and not out.is_floating_point():
            out = out.float()
        torch_op = {"max": ReduceOp.MAX, "min": ReduceOp.MIN}.get(op, ReduceOp.SUM)
        if not self.guarded(lambda: dist.all_reduce(out, op=torch_op, group=group, async_op=True), "metric reduction"):
            return tensor  # a peer was lost: this rank's value; the next step boundary recovers
        if op == "mean":
            return out / dist.get_world_size(group)
        if op == "sum" and group is None:
            return out / groups.pipeline_stages
        return out

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:  # noqa: A002
        """All (or any) over every rank of the job."""
        groups = self.state.groups
        if groups is None or groups.world == 1 or self.solo:
            return decision
        t = torch.tensor(int(decision), device=self.host.root_device)
        if not self.guarded(lambda: dist.all_reduce(t, op=ReduceOp.SUM, async_op=True), "decision all-reduce"):
            return decision
        return bool(t.item() == groups.world) if all else bool(t.item() > 0)

    def guarded(self, post: Callable[[], Any], what: str) -> bool:
        """Run a guarded collective of Lightning's (metric sync, barrier); False if a peer was lost during it.

        Under live reconfiguration a loss outside the optimizer step (in validation, a checkpoint's barrier) must
        not crash the script: the generation is already aborted, the caller goes on with its local value, and the
        next step boundary recovers in place. Without live reconfiguration the error propagates.
        """
        try:
            guarded(post, what)
        except PeerLostError:
            er = self.host.elastic_runtime
            if er is None or er.live is None:
                raise
            log.warning("%s abandoned: a peer was lost; recovering at the next step boundary", what)
            return False
        return True

    def barrier(self) -> None:
        """Barrier over every rank."""
        if not dist.is_initialized() or self.solo:
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.host.root_device.index])
        else:
            self.guarded(lambda: dist.barrier(async_op=True), "barrier")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Broadcast a picklable object from global rank ``src``.

        Under live reconfiguration it is guarded like the other collectives: Lightning broadcasts during its
        set-up (``log_dir``, checkpoint paths) and in ``ModelCheckpoint``, and ``broadcast_object_list`` blocks
        without an abort. Regression: a member lost (or silent) while the others were in such a broadcast crashed
        them with gloo's "Connection closed by peer" -- or, for a silent one, left them waiting for the 30-minute
        group timeout. A broadcast a lost peer interrupted returns this rank's own ``obj`` (the values Lightning
        broadcasts are the same on every rank) and the next step boundary recovers in place.
        """
        if not dist.is_initialized() or dist.get_world_size() == 1 or self.solo:
            return obj
        er = self.host.elastic_runtime
        if er is None or er.live is None:
            box = [obj]
            dist.broadcast_object_list(box, src)
            return box[0]
        device = torch.device("cpu") if "gloo" in str(dist.get_backend()) else self.host.root_device
        mine = dist.get_rank() == src
        payload = pickle.dumps(obj) if mine else b""
        size = torch.tensor([len(payload)], dtype=torch.int64, device=device)
        if not self.guarded(lambda: dist.broadcast(size, src, async_op=True), "broadcast (size)"):
            return obj
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device) if mine
                else torch.empty(int(size.item()), dtype=torch.uint8, device=device))
        if not self.guarded(lambda: dist.broadcast(data, src, async_op=True), "broadcast"):
            return obj
        return obj if mine else pickle.loads(data.cpu().numpy().tobytes())  # noqa: S301 -- our own job's ranks


def op_name(reduce_op: Any) -> str:
    """The name (``"mean"``, ``"sum"``, ``"max"``, ``"min"``) of a reduce op given as a string or a ``ReduceOp``."""
    if reduce_op is None:
        return "mean"
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        return "mean" if name == "avg" else name
    for name, op in (("sum", ReduceOp.SUM), ("max", ReduceOp.MAX), ("min", ReduceOp.MIN), ("mean", ReduceOp.AVG)):
        try:
            if reduce_op == op:
                return name
        except TypeError:
            continue
    return "sum"
