"""The step-boundary agreement (``runtime/elastic.agreement_groups``): two levels for a D x P generation.

Issue 21: the agreement was one MAX all-reduce of ``1 + N`` flags over the whole world, 2(N-1) ring hops; over
each pipeline and then each stage's replicas it is 2(P-1) + 2(D-1) hops with the same result.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from lightning_parcae.runtime.elastic import agreement_groups

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def _groups(d: int, p: int, world: int | None = None, built: bool = True) -> SimpleNamespace:
    return SimpleNamespace(world=d * p if world is None else world, built=built, data_parallel=d, pipeline_stages=p,
                           pipeline_group="pipe", data_group="data")


def test_a_d_by_p_generation_agrees_over_its_pipeline_then_its_stages_replicas() -> None:
    assert agreement_groups(_groups(2, 2), 4) == ["pipe", "data"]
    assert agreement_groups(_groups(16, 2), 32) == ["pipe", "data"]


@pytest.mark.parametrize("d,p", [(1, 4), (4, 1), (1, 1)])
def test_one_replica_or_one_stage_agrees_over_the_world(d: int, p: int) -> None:
    assert agreement_groups(_groups(d, p), d * p) == [None]


def test_groups_of_another_world_or_not_built_are_not_used() -> None:
    assert agreement_groups(_groups(2, 2, world=6), 4) == [None]  # a generation being replaced
    assert agreement_groups(_groups(2, 2, built=False), 4) == [None]
    assert agreement_groups(None, 4) == [None]


def test_two_levels_give_every_rank_the_worlds_max_on_real_gloo_processes() -> None:
    """Eight gloo processes as 4 x 2: each round one rank per round raises its flag; every rank must see every
    flag after the two all-reduces (the benchmark's ranks assert it and report their times)."""
    from bench_agreement import measure  # noqa: PLC0415

    result = measure(8, 2, rounds=5, warmup=1)
    assert set(result) == {"flat", "two-level"} and all(v > 0 for v in result.values())
