"""The step-boundary agreement: every member learns the same MAX of a small flags vector, by a binomial tree.

Problem: at every step boundary each member of a generation must learn the same two things -- the highest
generation anyone proposes (0: none) and which members saw a preemption notice -- so that all switch together or
none does. Until stop 59 that was a MAX all-reduce of ``1 + N`` float64 flags (in two levels for a D x P shape:
over each pipeline, then over each stage's replicas). gloo's all-reduce is a ring: 2(n-1) steps in series, and in
each step *every* rank of the group sends and receives, so about 2 n^2 messages for a vector of a few hundred
bytes. On a machine of its own a step is a network hop; on the 2-core emulation every message is a process
wake-up, and the agreement's time after its last member arrived grew 23x from N=4 to N=32
(``bench_scale.py``, stop 59) -- the one control-plane cost the issue's table still showed growing faster than N
once waiting for the slowest member is counted apart.

Solution: the same MAX by a binomial tree over the generation's ranks -- reduce to rank 0 (each rank takes its
children's subtrees, smallest first, and hands the result to its parent), then broadcast the result down the same
tree (largest subtree first). 2(N-1) messages in all, at most 2 ceil(log2 N) deep; no rank handles more than
2 ceil(log2 N) of them (the root). The walk (:func:`tree`) is pure; :func:`tree_max` runs it over any send and receive, so
the runtime gives it guarded point-to-point operations on the generation's world group under their own tag
(:data:`AGREEMENT_TAG`: pipeline messages use ``3m..3m+2``, migrations 1 and 2, tied gradients ``2**20 + k``) and
the tests give it queues. A member lost mid-agreement is what it was for the all-reduce: a guarded wait that the
liveness watch aborts (:class:`~lightning_parcae.errors.PeerLostError`), then the recovery path.

Measured (``python benchmarks/bench_agreement.py``, the operation alone, 2 cores, stop 59): the tree takes
0.18-0.37x the two-level all-reduce's time at N = 4..32 (16 ms against 48 ms at N=32).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from torch import Tensor

__all__ = ["AGREEMENT_TAG", "tree", "tree_max"]

AGREEMENT_TAG = 1 << 21
"""The point-to-point tag of the agreement's messages (apart from every other tag the runtime sends under)."""


def tree(rank: int, world: int) -> tuple[list[int], Optional[int]]:
    """``rank``'s place in the binomial tree over ``world`` ranks rooted at 0.

    Args:
        rank: This rank, ``0 <= rank < world``.
        world: The number of ranks.

    Returns:
        ``(children, parent)``: the children in the order their subtrees are reduced (smallest first; the broadcast
        goes to them in the reverse order) and the parent (None for rank 0).

    Raises:
        ValueError: ``rank`` is not in ``range(world)``.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of the {world} ranks of the agreement: expected 0 <= rank < world")
    children = []
    k = 1
    while k < world and not rank & k:
        if rank + k < world:
            children.append(rank + k)
        k <<= 1
    return children, (rank - (rank & -rank) if rank else None)


def tree_max(flags: Tensor, rank: int, world: int, send: Callable[[Tensor, int], Any],
             recv: Callable[[Tensor, int], None], wait: Callable[[Any], None]) -> None:
    """Replace ``flags`` on every rank by the elementwise MAX of all ranks' ``flags``.

    Every rank of the world calls this with tensors of one shape and dtype.

    Args:
        flags: This rank's flags, overwritten with the world's MAX.
        rank: This rank in the world.
        world: The number of ranks.
        send: Posts a send of a tensor to a rank and returns something for ``wait`` (the tensor is not touched
            again before that wait).
        recv: Receives into a tensor from a rank (returns once the data is there).
        wait: Waits for what ``send`` returned.
    """
    children, parent = tree(rank, world)
    got = flags.clone()
    for child in children:
        recv(got, child)
        flags.copy_(flags.maximum(got))
    pending = []
    if parent is not None:
        up = flags.clone()  # the receive below overwrites flags while this send may still be reading
        pending.append(send(up, parent))
        recv(flags, parent)
    for child in reversed(children):
        pending.append(send(flags, child))
    for work in pending:
        wait(work)
