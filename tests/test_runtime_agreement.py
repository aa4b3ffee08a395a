"""The step-boundary agreement (``runtime/agreement.py``): the world's MAX along a binomial tree.

Issue 21: as a gloo all-reduce (a ring, in two levels since stop 29) the agreement sent about 2 n^2 messages per
step and its time after the last member arrived grew 23x from N=4 to 32 on the 2-core emulation; the tree sends
2(N-1). These tests walk the tree for every N with queues standing for the network, and once on real gloo.
"""

from __future__ import annotations

import math
import queue
import random
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_parcae.runtime.agreement import tree, tree_max

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 31, 32, 33])
def test_every_rank_but_the_root_has_one_parent_and_the_tree_spans_the_world(world: int) -> None:
    parents = {}
    for r in range(world):
        children, parent = tree(r, world)
        parents[r] = parent
        assert all(tree(c, world)[1] == r for c in children)  # a child names this rank as its parent
        assert children == sorted(children)  # reduced smallest subtree first
    assert parents[0] is None and all(parents[r] is not None and parents[r] < r for r in range(1, world))
    # depth: a rank is as many edges from the root as its binary form has ones -- at most ceil(log2 N)
    def depth(r: int) -> int:
        return 0 if parents[r] is None else 1 + depth(parents[r])
    assert all(depth(r) == bin(r).count("1") for r in range(world))
    assert max(depth(r) for r in range(world)) <= (math.ceil(math.log2(world)) if world > 1 else 0)


def test_a_rank_outside_the_world_is_refused_with_what_was_given() -> None:
    with pytest.raises(ValueError, match="rank 4 is not one of the 4 ranks"):
        tree(4, 4)


def _run(world: int, vectors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int]:
    """Every rank on a thread; a queue per (src, dst) stands for the link. Returns the results and the messages."""
    links = {(s, d): queue.Queue() for s in range(world) for d in range(world)}
    sent = [0]
    lock = threading.Lock()
    errors: list[BaseException] = []

    def send(t: torch.Tensor, dst: int, me: int) -> Any:
        with lock:
            sent[0] += 1
        links[(me, dst)].put(t.clone())
        return None

    def recv(t: torch.Tensor, src: int, me: int) -> None:
        t.copy_(links[(src, me)].get(timeout=10))

    def rank_main(r: int) -> None:
        try:
            tree_max(vectors[r], r, world, send=lambda t, d: send(t, d, r), recv=lambda t, s: recv(t, s, r),
                     wait=lambda work: None)
        except BaseException as exc:  # noqa: BLE001 -- reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    assert all(q.empty() for q in links.values())  # no message left unread
    return vectors, sent[0]


@pytest.mark.parametrize("world", [1, 2, 3, 5, 8, 13, 16, 24, 32, 33])
@pytest.mark.parametrize("seed", [0, 1])
def test_every_rank_ends_with_the_worlds_elementwise_max_in_2_n_minus_2_messages(world: int, seed: int) -> None:
    rng = random.Random(seed)
    vectors = [torch.tensor([float(rng.choice([0, 0, 0, rng.randint(1, 9)])) for _ in range(1 + world)],
                            dtype=torch.float64) for _ in range(world)]
    want = torch.stack(vectors).max(dim=0).values
    out, messages = _run(world, [v.clone() for v in vectors])
    assert all(torch.equal(v, want) for v in out)
    assert messages == 2 * (world - 1)


def test_the_step_agreement_flags_reach_every_rank_on_real_gloo_processes() -> None:
    """Eight gloo processes run the runtime's tree (and the older forms) with point-to-point sends; in each round
    one rank raises its flag and every rank must see it, and only it (the benchmark's ranks assert it)."""
    from bench_agreement import measure  # noqa: PLC0415

    result = measure(8, 2, rounds=5, warmup=1)
    assert set(result) == {"flat", "two-level", "doubling", "tree", "reduce-bcast"}
    assert all(v > 0 for v in result.values())
