"""Tests of lightning_parcae.planning.liveput: exact expectations against brute force over every victim set."""

from __future__ import annotations

import itertools
import math
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from lightning_parcae.planning.costmodel import (
    ArtifactCostModel,
    DefaultCostModel,
    MigrationConstants,
    TableThroughput,
    artifact_partition,
)
from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.liveput import (
    Expectation,
    expected_transition_cost,
    liveput,
    transition_costs,
    victim_patterns,
)


@pytest.fixture(scope="module")
def bert() -> ArtifactCostModel:
    return ArtifactCostModel("bert")


@pytest.fixture(scope="module")
def vgg() -> ArtifactCostModel:
    return ArtifactCostModel("vgg19")


@pytest.fixture(scope="module")
def gpt() -> ArtifactCostModel:
    return ArtifactCostModel("gpt-1.5b")


@pytest.fixture(scope="module")
def default() -> DefaultCostModel:
    table = {(d, p): 10.0 * d * p / (1 + 0.1 * p) for d in range(1, 7) for p in range(1, 7) if d * p <= 12}
    layers = [5.0e6, 3.0e6, 3.0e6, 3.0e6, 3.0e6, 3.0e6, 3.0e6, 4.0e6, 6.0e6]
    return DefaultCostModel(TableThroughput(table, global_batch=64), layers, MigrationConstants(join_ms=700.0))


# ---------------------------------------------------------------------------------------------------- brute force


def _victims(n: int, d: int, p: int, victim_set) -> tuple:
    v = [0] * p
    for i in victim_set:
        if i < d * p:
            v[i % p] += 1
    return tuple(v)


def _pattern_cost(cm, n, d, p, n_in, n_out, victims, target) -> float:
    """One victim pattern's cost through the cost model's per-pattern methods."""
    d2, p2 = target
    if p2 == p:
        m, a = 0.0, 0.0
        for s, v in enumerate(victims):
            tm, ta = cm.stage_term(d, p, d2, s, v)
            m, a = max(m, tm), a + ta
        return cm.combine(n, d, p, n_in, n_out, d2, m, a)
    return cm.repartition_cost(n, d, p, n_in, n_out, d2, p2, [d - v for v in victims])


def _brute_expected(cm, n, shape, n_in, n_out, target) -> float:
    d, p = shape
    total, count = 0.0, 0
    for vs in itertools.combinations(range(n), n_out):
        total += _pattern_cost(cm, n, d, p, n_in, n_out, _victims(n, d, p, vs), target)
        count += 1
    assert count == math.comb(n, n_out)
    return total / count


# (cost model fixture, N, (D, P), n_in, n_out, [targets])
CASES = [
    ("bert", 8, (2, 4), 0, 2, [(2, 4), (1, 4), (3, 2), (2, 3), (1, 5), (1, 6)]),
    ("bert", 9, (2, 4), 0, 3, [(1, 4), (2, 3), (3, 2), (1, 6), (2, 2)]),
    ("bert", 10, (3, 3), 1, 2, [(3, 3), (2, 3), (2, 4), (4, 2), (1, 8), (3, 2)]),
    ("bert", 10, (2, 2), 0, 4, [(2, 2), (3, 2), (1, 2), (2, 3), (1, 5)]),
    ("bert", 6, (3, 2), 2, 0, [(3, 2), (4, 2), (2, 4), (2, 3), (1, 8)]),
    ("bert", 7, (1, 5), 0, 1, [(1, 5), (1, 6), (3, 2), (2, 3)]),
    ("vgg", 10, (2, 4), 0, 3, [(2, 4), (1, 4), (3, 2), (2, 3), (2, 2)]),
    ("vgg", 9, (4, 2), 0, 5, [(2, 2), (4, 2), (2, 3), (3, 2)]),
    ("gpt", 12, (2, 6), 0, 2, [(2, 6), (1, 6), (1, 8), (1, 10), (1, 7)]),
    ("gpt", 10, (1, 8), 2, 0, [(1, 8), (1, 10), (1, 6)]),
    ("default", 9, (2, 4), 0, 3, [(2, 4), (1, 4), (3, 2), (2, 3), (1, 6), (2, 2)]),
    ("default", 10, (3, 3), 1, 2, [(3, 3), (2, 3), (4, 2), (1, 9), (3, 2)]),
    ("default", 8, (4, 2), 0, 4, [(4, 2), (2, 2), (1, 4), (2, 3)]),
    ("default", 7, (2, 3), 3, 0, [(2, 3), (3, 3), (2, 5), (5, 2)]),
    ("default", 10, (1, 9), 0, 2, [(1, 8), (2, 4), (1, 9)]),
]


@pytest.mark.parametrize("name, n, shape, n_in, n_out, targets", CASES)
def test_expected_transition_cost_equals_brute_force_if_small_n(request, name, n, shape, n_in, n_out, targets) -> None:
    cm = request.getfixturevalue(name)
    for target in targets:
        exact = expected_transition_cost(cm, n, shape, n_in, n_out, target)
        brute = _brute_expected(cm, n, shape, n_in, n_out, target)
        assert exact.exact and exact.stderr == 0.0
        assert exact.mean == pytest.approx(brute, rel=1e-9, abs=1e-9), (name, n, shape, n_in, n_out, target)


def test_expected_transition_cost_vector_form_matches_scalar_if_several_targets(bert) -> None:
    targets = [(2, 4), (1, 4), (3, 2), (2, 3)]
    vec = transition_costs(bert, 9, (2, 4), 0, 2, targets)
    assert vec.tolist() == [expected_transition_cost(bert, 9, (2, 4), 0, 2, t).mean for t in targets]


def test_expected_transition_cost_is_zero_if_nothing_happens(bert, default) -> None:
    for cm in (bert, default):
        assert expected_transition_cost(cm, 9, (2, 4), 0, 0, (2, 4)).mean == 0.0
        assert expected_transition_cost(cm, 9, (2, 4), 3, 0, (2, 4)).mean == 0.0


def test_expected_transition_cost_is_intra_stage_if_only_spares_can_be_lost(bert) -> None:
    # 4 of 12 are spares, but victims are drawn from all 12: only the all-spare draws are intra-stage
    exp = expected_transition_cost(bert, 12, (2, 4), 0, 1, (2, 4)).mean
    brute = _brute_expected(bert, 12, (2, 4), 0, 1, (2, 4))
    assert exp == pytest.approx(brute, rel=1e-12)
    intra = bert.intra_stage_ms(2, 4)
    one_stage = _pattern_cost(bert, 12, 2, 4, 0, 1, (1, 0, 0, 0), (2, 4))
    assert exp == pytest.approx((4 * intra + 8 * np.mean(
        [_pattern_cost(bert, 12, 2, 4, 0, 1, tuple(int(s == k) for s in range(4)), (2, 4)) for k in range(4)]
    )) / 12, rel=1e-12)
    assert one_stage > intra


def test_expected_transition_cost_prices_fresh_start_if_no_shape(gpt) -> None:
    got = expected_transition_cost(gpt, 0, (0, 0), 18, 0, (2, 9)).mean
    expected = gpt.p2p_ms(0) + max(gpt.stage_state_ms(9)) + gpt.restart_ms(2, 9, "add")
    assert got == pytest.approx(expected, rel=1e-12)
    assert expected_transition_cost(gpt, 0, (0, 0), 18, 0, (1, 9)).mean == pytest.approx(
        gpt.p2p_ms(0) + gpt.restart_ms(1, 9, "add"), rel=1e-12
    )


def test_expected_transition_cost_sampled_within_stderr_if_max_patterns_forced(bert, default) -> None:
    for cm, n, shape, n_out, target in [(bert, 10, (3, 3), 3, (2, 4)), (default, 10, (3, 3), 3, (4, 2))]:
        exact = expected_transition_cost(cm, n, shape, 0, n_out, target)
        sampled = expected_transition_cost(cm, n, shape, 0, n_out, target, max_patterns=1, samples=3000, seed=7)
        assert exact.exact and not sampled.exact
        assert sampled.stderr > 0
        assert abs(sampled.mean - exact.mean) < 4 * sampled.stderr, (sampled, exact)
        again = expected_transition_cost(cm, n, shape, 0, n_out, target, max_patterns=1, samples=3000, seed=7)
        assert again == sampled  # seeded: reproducible


def test_expected_transition_cost_uses_exact_dp_if_same_depth_even_when_max_patterns_tiny(bert) -> None:
    got = expected_transition_cost(bert, 10, (3, 3), 0, 3, (2, 3), max_patterns=1)
    assert got.exact
    assert got.mean == pytest.approx(_brute_expected(bert, 10, (3, 3), 0, 3, (2, 3)), rel=1e-9)


@pytest.mark.parametrize(
    "args, match",
    [
        ((5, (1, 4), 0, 6, (1, 4)), "cannot preempt 6 of 5"),
        ((5, (2, 4), 0, 1, (1, 4)), r"shape \(2, 4\) needs 8 instances but only 5"),
        ((8, (2, 4), 0, 1, (0, 4)), "target shape"),
        ((8, (2, 4), 0, -1, (2, 4)), "cannot preempt -1"),
    ],
)
def test_expected_transition_cost_raises_if_bad_input(bert, args, match) -> None:
    with pytest.raises(ConfigurationError, match=match):
        expected_transition_cost(bert, *args)


# ---------------------------------------------------------------------------------------------------- victim patterns


@pytest.mark.parametrize("n, d, p, k", [(8, 2, 4, 2), (10, 3, 3, 4), (9, 2, 4, 9), (7, 1, 5, 0), (12, 2, 3, 5), (6, 3, 2, 6)])
def test_victim_patterns_match_enumeration_and_sum_to_one_if_small(n, d, p, k) -> None:
    pats = dict(victim_patterns(n, d, p, k))
    assert sum(pats.values()) == pytest.approx(1.0, abs=1e-12)
    counts = Counter(_victims(n, d, p, vs) for vs in itertools.combinations(range(n), k))
    total = math.comb(n, k)
    assert set(pats) == set(counts)
    for v, c in counts.items():
        assert pats[v] == pytest.approx(float(Fraction(c, total)), rel=1e-12)
        assert sum(v) <= k and all(0 <= x <= d for x in v)


def test_victim_patterns_raise_if_shape_does_not_fit() -> None:
    with pytest.raises(ConfigurationError, match="needs 8 instances"):
        list(victim_patterns(7, 2, 4, 1))


# ---------------------------------------------------------------------------------------------------- liveput


def _brute_liveput(cm, n, shape, n_out, n_in, interval_ms=60_000.0) -> float:
    d, p = shape
    after = n + n_in - n_out
    targets = cm.throughput.candidates(after)
    if not targets:
        return 0.0
    total = 0.0
    for vs in itertools.combinations(range(n), n_out):
        v = _victims(n, d, p, vs)
        total += max(
            cm.throughput.throughput(*t) * max(0.0, interval_ms - _pattern_cost(cm, n, d, p, n_in, n_out, v, t)) / interval_ms
            for t in targets
        )
    return total / math.comb(n, n_out)


@pytest.mark.parametrize(
    "name, n, shape, n_out, n_in",
    [
        ("bert", 9, (2, 4), 2, 0),
        ("bert", 10, (3, 3), 3, 1),
        ("bert", 8, (4, 2), 0, 2),
        ("default", 9, (2, 4), 3, 0),
        ("default", 10, (3, 3), 2, 2),
        ("gpt", 12, (2, 6), 2, 0),
    ],
)
def test_liveput_equals_brute_force_of_definition_if_small(request, name, n, shape, n_out, n_in) -> None:
    cm = request.getfixturevalue(name)
    got = liveput(cm, n, shape, n_out, n_in)
    assert got.exact
    assert got.mean == pytest.approx(_brute_liveput(cm, n, shape, n_out, n_in), rel=1e-9, abs=1e-12)


def test_liveput_is_at_most_best_throughput_and_zero_if_nothing_fits(gpt, bert) -> None:
    lp = liveput(bert, 10, (3, 3), 2)
    best = bert.throughput.throughput(*bert.throughput.best(8))
    assert 0 < lp.mean <= best
    assert liveput(gpt, 6, (1, 6), 2) == Expectation(0.0)  # 4 instances left: no gpt-1.5b shape fits


def test_liveput_interval_scales_cost_share_if_longer_interval(bert) -> None:
    short = liveput(bert, 10, (3, 3), 3, interval_ms=20_000.0).mean
    long = liveput(bert, 10, (3, 3), 3, interval_ms=600_000.0).mean
    assert short < long
    assert short == pytest.approx(_brute_liveput(bert, 10, (3, 3), 3, 0, 20_000.0), rel=1e-9)


def test_liveput_sampled_within_stderr_if_max_patterns_forced(bert) -> None:
    exact = liveput(bert, 10, (3, 3), 3)
    sampled = liveput(bert, 10, (3, 3), 3, max_patterns=1, samples=2000, seed=3)
    assert not sampled.exact and sampled.stderr > 0
    assert abs(sampled.mean - exact.mean) < 4 * sampled.stderr


# ---------------------------------------------------------------------------------------------------- artifact node ids


def _artifact_node_level_cost(cm, n, d, p, n_out, victim_set, d2, p2) -> float:
    """The artifact's repartition on node ids: survivors scanned by node id, ties to the lowest id."""
    lp = cm.layer_params
    ob, nb = artifact_partition(len(lp), p), artifact_partition(len(lp), p2)
    nodes = {i: set(range(ob[i % p], ob[i % p + 1])) for i in range(d * p) if i not in victim_set}
    last = 0.0
    for j in range(p2):
        need = set(range(nb[j], nb[j + 1]))
        best, best_v = None, math.inf
        for i, held in nodes.items():
            v = sum(lp[x] for x in need - held)
            if v < best_v:
                best, best_v = i, v
        if best is not None:
            del nodes[best]
            last = best_v
    cost = cm.p2p_ms(12 * last) + (max(cm.stage_state_ms(p2)) if d2 > 1 else 0.0)
    return cost + cm.restart_ms(d2, p2, "add" if d2 * p2 > d * p - n_out else "remove")


@pytest.mark.parametrize("n, d, p, k, d2, p2", [(20, 2, 9, 1, 3, 6), (24, 3, 8, 2, 2, 10), (12, 2, 6, 2, 1, 8)])
def test_expected_transition_cost_matches_artifact_node_ids_if_no_cross_stage_ties(gpt, n, d, p, k, d2, p2) -> None:
    # no two old stages tie on a new stage's missing volume here, so counting victims per stage is exact
    brute = np.mean([_artifact_node_level_cost(gpt, n, d, p, k, set(vs), d2, p2) for vs in itertools.combinations(range(n), k)])
    assert expected_transition_cost(gpt, n, (d, p), 0, k, (d2, p2)).mean == pytest.approx(brute, rel=1e-9)


@pytest.mark.xfail(
    strict=True,
    reason="known deviation: the artifact breaks repartition ties by node id (which replica died matters), "
    "ArtifactCostModel by old stage index over victim counts; e.g. (2,9)->(1,16) after 2 preemptions on 18 nodes "
    "differs by ~900 ms (~20%)",
)
def test_expected_transition_cost_matches_artifact_node_ids_if_ties_between_stages(gpt) -> None:
    n, d, p, k, d2, p2 = 18, 2, 9, 2, 1, 16
    brute = np.mean([_artifact_node_level_cost(gpt, n, d, p, k, set(vs), d2, p2) for vs in itertools.combinations(range(n), k)])
    assert expected_transition_cost(gpt, n, (d, p), 0, k, (d2, p2)).mean == pytest.approx(brute, rel=1e-9)


# ---------------------------------------------------------------------------------------------------- caching


class _FlatRepartition(DefaultCostModel):
    """A cost model without method caches whose repartition transfer is a constant."""

    def __init__(self, transfer_ms: float) -> None:
        super().__init__(TableThroughput({(1, 4): 1.0, (2, 2): 1.0}, 8), [1.0] * 6)
        self.flat = transfer_ms

    def repartition_transfer_ms(self, p, p2, survivors):
        return self.flat

    def repartition_transfer_batch(self, p, p2, survivors):
        return np.full(len(survivors), self.flat)

    def repartition_rest_ms(self, n, d, p, n_in, n_out, d2, p2, fallback):
        return 0.0


def test_expected_transition_cost_is_not_reused_if_new_cost_model_at_same_address() -> None:
    import gc

    seen = {}
    for k in range(30):
        cm = _FlatRepartition(100.0 + k)
        got = expected_transition_cost(cm, 6, (1, 4), 0, 1, (2, 2)).mean
        assert got == pytest.approx(100.0 + k), (k, id(cm) in seen)
        seen[id(cm)] = k
        del cm
        gc.collect()


# ------------------------------------------------------------------------------------- speed paths, same numbers


def _random_cases(cm, n_max: int, count: int, seed: int):
    import random

    rng = random.Random(seed)
    shapes = cm.throughput.candidates(n_max)
    for _ in range(count):
        d, p = rng.choice(shapes)
        n = rng.randint(d * p, n_max)
        n_out = rng.randint(0, min(3, n))
        n_in = rng.randint(0, 2)
        after = n + n_in - n_out
        targets = cm.throughput.candidates(after) or [(0, 0)]
        yield n, (d, p), n_in, n_out, targets


@pytest.mark.parametrize("seed", range(3))
def test_transition_costs_vector_equals_scalar_if_random_transitions(gpt, bert, default, seed) -> None:
    """The vector form (checks and per-depth transfer lookups hoisted) prices every transition exactly as the
    scalar :func:`expected_transition_cost` does -- for the artifact's and our cost model, many shapes."""
    for cm, n_max in ((gpt, 32), (bert, 20), (default, 12)):
        for n, shape, n_in, n_out, targets in _random_cases(cm, n_max, 25, seed):
            vec = transition_costs(cm, n, shape, n_in, n_out, targets)
            ref = [0.0 if t == (0, 0) else expected_transition_cost(cm, n, shape, n_in, n_out, t).mean for t in targets]
            assert vec.tolist() == pytest.approx(ref, rel=1e-12, abs=1e-9), (n, shape, n_in, n_out)


@pytest.mark.parametrize("model", ["gpt-1.5b", "bert"])
def test_repartition_costs_equal_fresh_model_if_patterns_cached_across_n(model) -> None:
    """Victim-pattern transfers are shared by every N (only the probabilities differ): pricing N = 20 after
    N = 30 on one cost model gives what a fresh cost model gives for N = 20 alone."""
    from lightning_parcae.planning.liveput import prepare_transfers

    warm = ArtifactCostModel(model)
    shapes = [s for s in warm.throughput.candidates(20) if s[0] * s[1] <= 18]
    depths = sorted({s[1] for s in warm.throughput.candidates(30)})
    assert prepare_transfers(warm, shapes, depths, max_out=2) > 0
    for shape in shapes[:8]:
        targets = warm.throughput.candidates(19)
        for n, n_out in ((30, 2), (20, 1), (20, 2)):
            if shape[0] * shape[1] > n:
                continue
            fresh = ArtifactCostModel(model)
            a = transition_costs(warm, n, shape, 0, n_out, targets)
            b = transition_costs(fresh, n, shape, 0, n_out, targets)
            assert a.tolist() == pytest.approx(b.tolist(), rel=1e-12), (shape, n, n_out)
