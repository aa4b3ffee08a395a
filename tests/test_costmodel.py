"""Tests of lightning_parcae.planning.costmodel against hand-derived values of ARTIFACT_MODEL.md and the bundled tables.

The helpers prefixed ``_ref_`` are an independent, deliberately naive re-derivation of the artifact's formulas from
``ARTIFACT_MODEL.md`` and ``throughput_tables.json`` (read with plain ``json``); the cost model must agree with them.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from lightning_parcae.planning.costmodel import (
    ArtifactCostModel,
    DefaultCostModel,
    LayerProfile,
    MigrationConstants,
    MigrationKind,
    ProfileThroughput,
    ShapeLimits,
    TableThroughput,
    artifact_partition,
    balanced_partition,
    reference_layer_params,
    reference_models,
)
from lightning_parcae.planning.measured import load_cost_model
from lightning_parcae.errors import ConfigurationError

DATA = Path(__file__).resolve().parent.parent / "lightning_parcae" / "data"
SHARED = Path("/work/shared/reference")
TABLES = json.loads((DATA / "throughput_tables.json").read_text())
LAYERS = json.loads((DATA / "artifact_layer_params.json").read_text())
GIB = 1 << 30


# ---------------------------------------------------------------------------------------------------- reference


def _ref_p2p_ms(volume: float) -> float:
    table = sorted((int(k), float(v)) for k, v in TABLES["p2p_cost"]["table"].items())
    if volume <= table[0][0]:
        return table[0][1] / 1000.0
    if volume > table[-1][0]:
        return volume / table[-1][0] * table[-1][1] / 1000.0
    for (s0, u0), (s1, u1) in zip(table, table[1:]):
        if s0 < volume <= s1:
            return (u0 + (u1 - u0) * (volume - s0) / (s1 - s0)) / 1000.0
    raise AssertionError("unreachable")


def _ref_grp(model: str, d: int, p: int, kind: str) -> float:
    add = kind == "add"
    if model.startswith("gpt"):
        g = 500.0 if add else {"gpt-1.5b": 39.3, "gpt-6.7b": 115.6}[model]
        return 35 + g * (d + p + 1 + d * p)
    if model == "vgg19":
        return 35 + (440 if add else 340) * d * p
    t = 2000 if d >= 12 else (1500 if d >= 6 else 1000)
    return 35 + t * (1.5 if add else 1.0)


def _ref_build(model: str, p: int) -> float:
    if model == "gpt-1.5b":
        return _ref_p2p_ms(50257 * 1024 * 4) + 430 * math.ceil(48 / p)
    return float(TABLES["model_build_cost_ms"]["tables"][model][str(p)])


def _ref_restart(model: str, d: int, p: int, kind: str) -> float:
    extra = {"gpt-6.7b": 2000, "resnet152": 3360.374, "vgg19": 2000}.get(model, 0.0)
    proc = 240 if model.startswith("gpt") else 30
    return (6600 + extra if kind == "add" else 0.0) + _ref_grp(model, d, p, kind) + proc + _ref_build(model, p)


def _ref_partition(num_layers: int, p: int) -> list:
    chunk = (num_layers - 1) // p
    sizes = [chunk + 1] + [chunk] * (p - 1)
    for i in range((num_layers - 1) % p):
        sizes[-i - 2] += 1
    bounds = [0]
    for s in sizes:
        bounds.append(bounds[-1] + s)
    return bounds


def _ref_stage_params(model: str, p: int) -> list:
    layers = LAYERS[model]["layers"]
    b = _ref_partition(len(layers), p)
    return [sum(layers[b[k] : b[k + 1]]) for k in range(p)]


def _ref_same_depth(model: str, d: int, p: int, n_out: int, d2: int, victims: list) -> float:
    """ARTIFACT_MODEL.md "Migration cost", P' == P, for one victim pattern (victims[s] of stage s hit)."""
    proc = 240 if model.startswith("gpt") else 30
    if n_out == 0 and d2 == d:
        return 0.0
    r = [d - v for v in victims]
    if min(r) >= d2:
        return _ref_grp(model, d2, p, "remove") + proc
    params = _ref_stage_params(model, p)
    worst, red = 0.0, 0.0
    for s in range(p):
        q = max(d2 - r[s], 0)
        if q == 0:
            continue
        c = _ref_p2p_ms(12 * params[s])
        worst = max(worst, c)
        if q == d2 or (s == p - 1 and q == d2 - 1):
            red += c
    kind = "add" if d2 * p > d * p - n_out else "remove"
    return max(worst, red) + _ref_restart(model, d2, p, kind)


# ---------------------------------------------------------------------------------------------------- tables


def test_reference_models_lists_all_artifact_tables_if_bundled() -> None:
    assert reference_models() == sorted(["gpt-1.5b", "gpt-6.7b", "bert", "resnet152", "vgg19"])


def test_table_throughput_reads_samples_per_s_and_limits_if_from_reference() -> None:
    t = TableThroughput.from_reference("gpt-1.5b")
    assert len(t.table) == 47
    assert t.throughput(4, 8) == 43.468
    assert t.throughput(2, 9) == 32.053
    assert t.throughput(3, 3) == 0.0  # unlisted shape
    assert t.global_batch == 128
    assert t.limits == ShapeLimits(6, 32, (), ())
    v = TableThroughput.from_reference("vgg19")
    assert v.limits.ignore_d == (1,) and not v.limits.allows(1, 4) and v.limits.allows(2, 4)


def test_table_throughput_best_is_first_strict_max_in_scan_order_if_ties() -> None:
    t = TableThroughput({(1, 2): 5.0, (2, 1): 5.0, (1, 1): 3.0, (3, 1): 9.0}, global_batch=8)
    assert t.best(1) == (1, 1)
    assert t.best(2) == (1, 2)  # D=1 scanned before D=2: the first of the tie is kept
    assert t.best(3) == (3, 1)
    assert t.best(0) is None


def test_table_throughput_best_matches_full_scan_if_every_n() -> None:
    t = TableThroughput.from_reference("gpt-1.5b")
    for n in range(0, 40):
        best, thr = None, 0.0
        for d in range(1, n + 1):
            for p in range(1, n + 1):
                if d * p <= n and t.table.get((d, p), 0.0) > thr:
                    best, thr = (d, p), t.table[(d, p)]
        assert t.best(n) == best, n


@pytest.mark.skipif(not SHARED.exists(), reason="/work/shared reference data absent")
def test_table_throughput_best_reproduces_artifact_throughput_opt_if_gpt15b_p3() -> None:
    res = json.loads((SHARED / "traces" / "liveput_res" / "gpt-1.5b_p3_gbs128_mbs1.json").read_text())
    assert len(res) == 683
    t = TableThroughput.from_reference("gpt-1.5b")
    mismatches = []
    for k, rec in enumerate(res):
        prev, n_in, n_out = rec["interval"]
        got = t.best(prev + n_in - n_out)
        if list(got) != rec["throughut-opt"]:
            mismatches.append((k, rec["interval"], got, rec["throughut-opt"]))
    assert not mismatches, mismatches[:5]


def test_table_throughput_candidates_respect_limits_and_size_if_limited() -> None:
    t = TableThroughput.from_reference("gpt-1.5b")
    for n in (5, 6, 12, 20, 32):
        cands = t.candidates(n)
        assert all(d * p <= n and 6 <= p <= 32 and t.throughput(d, p) > 0 for d, p in cands)
        assert cands == sorted(s for s in t.table if s[0] * s[1] <= n)
    assert t.candidates(5) == []


def test_table_throughput_raises_if_table_empty_or_negative() -> None:
    with pytest.raises(ConfigurationError, match="empty"):
        TableThroughput({}, 8)
    with pytest.raises(ConfigurationError, match=r"\(1, 0\)"):
        TableThroughput({(1, 0): 1.0}, 8)
    with pytest.raises(ConfigurationError, match="finite"):
        TableThroughput({(1, 1): float("nan")}, 8)
    with pytest.raises(ConfigurationError, match="unknown model table 'gpt-2'"):
        TableThroughput.from_reference("gpt-2")


# ---------------------------------------------------------------------------------------------------- p2p, groups, restart


@pytest.mark.parametrize(
    "volume, expected_us",
    [
        (0, 142.907),  # below the table: the 4 B value
        (2, 142.907),
        (4, 142.907),  # at a table size
        (1024, 137.372),
        (1536, 137.372 + (140.417 - 137.372) * 0.5),  # between 1 KiB and 2 KiB
        (3 * (1 << 20), 3006.771 + (5182.599 - 3006.771) * 0.5),
        (GIB, 1198255.9),
        (2 * GIB, 2 * 1198255.9),  # linear extrapolation above 1 GiB
        (3 * GIB // 2, 1.5 * 1198255.9),
    ],
)
def test_artifact_p2p_interpolates_table_if_at_below_between_or_above_sizes(volume: float, expected_us: float) -> None:
    cm = ArtifactCostModel("gpt-1.5b")
    assert cm.p2p_ms(volume) == pytest.approx(expected_us / 1000.0, rel=1e-12)
    assert cm.p2p_ms(volume) == pytest.approx(_ref_p2p_ms(volume), rel=1e-12)
    assert cm.p2p_ms_batch(np.array([float(volume)]))[0] == pytest.approx(expected_us / 1000.0, rel=1e-12)


def test_artifact_p2p_batch_equals_scalar_if_many_volumes() -> None:
    cm = ArtifactCostModel("bert")
    vols = np.concatenate([[0.0, 3.0, 4.0, GIB, 1.7 * GIB], np.geomspace(5, 4 * GIB, 200)])
    np.testing.assert_allclose(cm.p2p_ms_batch(vols), [cm.p2p_ms(v) for v in vols], rtol=1e-12)


@pytest.mark.parametrize(
    "model, d, p, kind, expected",
    [
        ("gpt-1.5b", 2, 8, "add", 35 + 500 * 27),
        ("gpt-1.5b", 2, 8, "remove", 35 + 39.3 * 27),
        ("gpt-1.5b", 2, 8, "no-op", 35 + 39.3 * 27),
        ("gpt-6.7b", 1, 12, "remove", 35 + 115.6 * 26),
        ("gpt-6.7b", 1, 12, "add", 35 + 500 * 26),
        ("vgg19", 2, 3, "add", 35 + 440 * 6),
        ("vgg19", 2, 3, "remove", 35 + 340 * 6),
        ("bert", 12, 2, "remove", 2035),
        ("bert", 12, 2, "add", 3035),
        ("bert", 6, 2, "add", 35 + 2250),
        ("bert", 5, 4, "remove", 1035),
        ("resnet152", 6, 2, "remove", 1535),
        ("resnet152", 1, 2, "add", 1535),
    ],
)
def test_artifact_group_rebuild_uses_model_family_formula_if_add_or_remove(
    model: str, d: int, p: int, kind: str, expected: float
) -> None:
    cm = ArtifactCostModel(model)
    assert cm.group_rebuild_ms(d, p, kind) == pytest.approx(expected, rel=1e-12)
    assert cm.group_rebuild_ms(d, p, kind) == pytest.approx(_ref_grp(model, d, p, kind), rel=1e-12)


@pytest.mark.parametrize(
    "model, d, p, kind, expected",
    [
        # 6600 rendezvous + 13535 groups + 240 proc + build[8] (= p2p(50257*1024*4) + 430*6)
        ("gpt-1.5b", 2, 8, "add", 6600 + 13535 + 240 + 234.815 + 2580),
        ("gpt-1.5b", 2, 8, "remove", 1096.1 + 240 + 234.815 + 2580),
        ("gpt-1.5b", 1, 6, "remove", 35 + 39.3 * 14 + 240 + 234.815 + 430 * 8),
        ("gpt-6.7b", 1, 12, "add", 6600 + 2000 + 13035 + 240 + 7961),
        ("gpt-6.7b", 1, 12, "remove", 3040.6 + 240 + 7961),
        ("vgg19", 2, 3, "add", 6600 + 2000 + 2675 + 30 + 94),
        ("resnet152", 6, 2, "add", 6600 + 3360.374 + 2285 + 30 + 110),
        ("resnet152", 6, 2, "remove", 1535 + 30 + 110),
        ("bert", 5, 4, "remove", 1035 + 30 + 1095),
    ],
)
def test_artifact_restart_adds_rendezvous_and_extra_only_if_add(
    model: str, d: int, p: int, kind: str, expected: float
) -> None:
    cm = ArtifactCostModel(model)
    assert cm.restart_ms(d, p, kind) == pytest.approx(expected, abs=1e-3)  # 234.815 is rounded in the doc
    assert cm.restart_ms(d, p, kind) == pytest.approx(_ref_restart(model, d, p, kind), rel=1e-12)


def test_artifact_build_cost_follows_formula_if_gpt15b_every_depth() -> None:
    cm = ArtifactCostModel("gpt-1.5b")
    table = TABLES["model_build_cost_ms"]["tables"]["gpt-1.5b"]
    for p in range(6, 49):
        expected = _ref_p2p_ms(50257 * 1024 * 4) + 430 * math.ceil(48 / p)
        assert cm.build_ms[p] == pytest.approx(expected, rel=1e-12)
        assert cm.build_ms[p] == pytest.approx(table[str(p)], abs=1e-3)
        assert cm.restart_ms(1, p, "no-op") - cm.group_rebuild_ms(1, p, "no-op") - 240 == pytest.approx(expected)


def test_artifact_concurrent_restart_uses_cheap_groups_and_no_rendezvous_if_no_op() -> None:
    cm = ArtifactCostModel("gpt-6.7b")
    assert cm.concurrent_restart_ms(2, 12) == pytest.approx(_ref_restart("gpt-6.7b", 2, 12, "remove"))
    assert cm.concurrent_restart_ms(2, 12) < cm.restart_ms(2, 12, "add") - 8600


def test_artifact_restart_raises_informatively_if_depth_has_no_build_cost() -> None:
    cm = ArtifactCostModel("gpt-6.7b")
    with pytest.raises(ConfigurationError, match="depth 17"):
        cm.restart_ms(1, 17, "add")


def test_artifact_intra_stage_is_cheap_rebuild_plus_proc_if_gpt_or_other() -> None:
    assert ArtifactCostModel("gpt-1.5b").intra_stage_ms(2, 8) == pytest.approx(1096.1 + 240)
    assert ArtifactCostModel("bert").intra_stage_ms(6, 2) == pytest.approx(1535 + 30)
    assert ArtifactCostModel("vgg19").intra_stage_ms(3, 3) == pytest.approx(35 + 340 * 9 + 30)


def test_artifact_checkpoint_is_14s_if_any_model() -> None:
    for m in reference_models():
        assert ArtifactCostModel(m).checkpoint_ms() == 14000.0


# ---------------------------------------------------------------------------------------------------- partition, state


@pytest.mark.parametrize(
    "layers, stages, bounds",
    [
        (10, 4, [0, 3, 5, 8, 10]),  # chunk 2, sizes [3,2,2,2] + 1 on sizes[-2]
        (11, 4, [0, 3, 6, 9, 11]),  # +1 on sizes[-2] and sizes[-3]
        (9, 4, [0, 3, 5, 7, 9]),  # (L-1) % P == 0: no +1
        (50, 8, [0, 7, 13, 19, 25, 31, 37, 44, 50]),
        (50, 6, [0, 9, 17, 25, 33, 42, 50]),
        (50, 7, [0, 8, 15, 22, 29, 36, 43, 50]),
        (5, 1, [0, 5]),
        (5, 4, [0, 2, 3, 4, 5]),
    ],
)
def test_artifact_partition_applies_plus_one_rule_if_examples(layers: int, stages: int, bounds: list) -> None:
    assert artifact_partition(layers, stages) == bounds
    assert _ref_partition(layers, stages) == bounds


def test_artifact_partition_matches_reference_if_gpt15b_all_depths() -> None:
    for p in range(1, 50):
        b = artifact_partition(50, p)
        assert b == _ref_partition(50, p)
        assert b[0] == 0 and b[-1] == 50 and all(x < y for x, y in zip(b, b[1:]))
    assert artifact_partition(50, 32)[14:17] == [15, 17, 19]  # 17 of the 2-layer stages sit just before the last


def test_artifact_partition_raises_if_too_many_stages() -> None:
    with pytest.raises(ConfigurationError, match="cannot split 5 layer entries into 5 stages"):
        artifact_partition(5, 5)
    with pytest.raises(ConfigurationError):
        artifact_partition(5, 0)


def test_artifact_stage_state_is_12_bytes_per_param_if_gpt15b_p8() -> None:
    cm = ArtifactCostModel("gpt-1.5b")
    params = cm.stage_params(8)
    assert params[0] == 82124800 + 6 * 30740800
    assert params[6] == 7 * 30740800
    assert params[7] == 5 * 30740800 + 82128000
    assert sum(params) == 1639811200
    assert cm.stage_state_ms(8) == pytest.approx(tuple(_ref_p2p_ms(12 * x) for x in params), rel=1e-12)
    assert cm.full_state_transfer_ms(8) == pytest.approx(sum(_ref_p2p_ms(12 * x) for x in params), rel=1e-12)


def test_artifact_reactive_restart_adds_checkpoint_only_if_not_first() -> None:
    cm = ArtifactCostModel("gpt-1.5b")
    full = sum(_ref_p2p_ms(12 * x) for x in _ref_stage_params("gpt-1.5b", 9))
    assert cm.reactive_restart_ms(2, 9, "add", first=True) == pytest.approx(_ref_restart("gpt-1.5b", 2, 9, "add") + full)
    assert cm.reactive_restart_ms(2, 9, "remove", first=False) == pytest.approx(
        _ref_restart("gpt-1.5b", 2, 9, "remove") + 14000 + full
    )


# ---------------------------------------------------------------------------------------------------- same-depth


def _artifact_pattern(cm: ArtifactCostModel, n: int, d: int, p: int, n_in: int, n_out: int, d2: int, victims) -> float:
    m, a = 0.0, 0.0
    for s, v in enumerate(victims):
        tm, ta = cm.stage_term(d, p, d2, s, v)
        m, a = max(m, tm), a + ta
    return cm.combine(n, d, p, n_in, n_out, d2, m, a)


def test_artifact_same_depth_is_zero_if_no_victims_and_same_width() -> None:
    cm = ArtifactCostModel("gpt-1.5b")
    assert _artifact_pattern(cm, 16, 2, 8, 0, 0, 2, [0] * 8) == 0.0
    assert _artifact_pattern(cm, 16, 2, 8, 3, 0, 2, [0] * 8) == 0.0  # arrivals alone change nothing


def test_artifact_same_depth_costs_intra_stage_if_only_spares_lost() -> None:
    cm = ArtifactCostModel("gpt-1.5b")
    assert _artifact_pattern(cm, 18, 2, 8, 0, 1, 2, [0] * 8) == pytest.approx(cm.intra_stage_ms(2, 8))
    assert cm.kind(2, 8, 1, 2, 8, [0] * 8) is MigrationKind.INTRA_STAGE
    assert cm.kind(2, 8, 0, 2, 8, [0] * 8) is MigrationKind.NONE


def test_artifact_same_depth_costs_intra_stage_if_every_stage_keeps_target_width() -> None:
    cm = ArtifactCostModel("gpt-1.5b")
    v = [1, 0, 1, 0, 0, 0, 0, 1]
    assert _artifact_pattern(cm, 16, 2, 8, 0, 3, 1, v) == pytest.approx(cm.intra_stage_ms(1, 8))
    assert _artifact_pattern(cm, 16, 2, 8, 0, 0, 1, [0] * 8) == pytest.approx(cm.intra_stage_ms(1, 8))  # shrink


@pytest.mark.parametrize(
    "d, n_out, d2, victims, note",
    [
        (2, 1, 2, [1, 0, 0, 0, 0, 0, 0, 0], "one stage short by one: plain max"),
        (2, 1, 2, [0, 0, 0, 0, 0, 0, 0, 1], "last stage short by d2-1: redundant"),
        (2, 3, 2, [2, 0, 0, 0, 0, 0, 0, 1], "stage 0 lost all + last short by d2-1: red = c0 + c7"),
        (2, 4, 2, [2, 2, 0, 0, 0, 0, 0, 0], "two stages lost all: red = c0 + c1"),
        (2, 2, 1, [2, 0, 0, 0, 0, 0, 0, 0], "shrink to 1 with a lost stage: remove restart"),
        (3, 3, 3, [1, 1, 0, 0, 0, 0, 0, 1], "d2=3: need 1 is not redundant even on the last stage"),
        (3, 2, 3, [0, 0, 0, 0, 0, 0, 0, 2], "d2=3, last stage need 2 == d2-1: redundant"),
        (1, 0, 2, [0] * 8, "grow 1 -> 2 without victims: every stage needs d2-1, only last is redundant"),
        (2, 0, 3, [0] * 8, "grow 2 -> 3: need 1 == d2-2, nothing redundant"),
    ],
)
def test_artifact_inter_stage_applies_redundant_rule_if_patterns(d, n_out, d2, victims, note) -> None:
    cm = ArtifactCostModel("gpt-1.5b")
    n = d * 8 + 2
    got = _artifact_pattern(cm, n, d, 8, 0, n_out, d2, victims)
    assert got == pytest.approx(_ref_same_depth("gpt-1.5b", d, 8, n_out, d2, victims), rel=1e-12), note
    assert cm.kind(d, 8, n_out, d2, 8, victims) is MigrationKind.INTER_STAGE


def test_artifact_inter_stage_value_is_sum_if_redundant_stages_dominate() -> None:
    # hand-derived: stage 0 lost both replicas (q = D' = 2), last stage lost one (q = D'-1): both redundant
    cm = ArtifactCostModel("gpt-1.5b")
    c0 = _ref_p2p_ms(12 * (82124800 + 6 * 30740800))
    c7 = _ref_p2p_ms(12 * (5 * 30740800 + 82128000))
    restart_add = 6600 + 13535 + 240 + _ref_build("gpt-1.5b", 8)  # 2*8 = 16 > 16 - 3: add
    got = _artifact_pattern(cm, 18, 2, 8, 0, 3, 2, [2, 0, 0, 0, 0, 0, 0, 1])
    assert got == pytest.approx(c0 + c7 + restart_add, rel=1e-12)
    # shrink to D'=1 with stage 1 lost entirely; restart is 'remove' since 1*8 <= 16 - 2 survivors
    c1 = _ref_p2p_ms(12 * 6 * 30740800)
    got = _artifact_pattern(cm, 16, 2, 8, 0, 2, 1, [0, 2, 0, 0, 0, 0, 0, 0])
    assert got == pytest.approx(c1 + _ref_restart("gpt-1.5b", 1, 8, "remove"), rel=1e-12)


# ---------------------------------------------------------------------------------------------------- repartition


def _ref_repartition(model: str, d: int, p: int, n_out: int, d2: int, p2: int, survivors: list) -> float:
    """ARTIFACT_MODEL.md repartition for one pattern, node by node.

    ``survivors[s]`` replicas of old stage s are alive. Survivors are scanned stage by stage (the cost model's
    documented tie-break: the lowest old stage wins among equal missing volumes).
    """
    layers = LAYERS[model]["layers"]
    ob, nb = _ref_partition(len(layers), p), _ref_partition(len(layers), p2)
    nodes = {(s, r): set(range(ob[s], ob[s + 1])) for s in range(p) for r in range(survivors[s])}
    missing = 0.0
    for j in range(p2):
        need = set(range(nb[j], nb[j + 1]))
        best, best_v = None, math.inf
        for node, held in nodes.items():
            v = sum(layers[x] for x in need - held)
            if v < best_v:
                best, best_v = node, v
        if best is not None:
            del nodes[best]
            missing = best_v  # only the last new stage's volume counts (artifact quirk)
    cost = _ref_p2p_ms(12 * missing)
    if d2 > 1:
        cost += max(_ref_p2p_ms(12 * x) for x in _ref_stage_params(model, p2))
    kind = "add" if d2 * p2 > d * p - n_out else "remove"
    return cost + _ref_restart(model, d2, p2, kind)


def test_artifact_repartition_counts_only_last_new_stage_if_gpt15b_8_to_6() -> None:
    cm = ArtifactCostModel("gpt-1.5b")
    # old [0,7,13,19,25,31,37,44,50] -> new [0,9,17,25,33,42,50]; new stage 5 = layers 42..49 is taken by old
    # stage 7 (layers 44..49), missing the two transformer layers 42, 43
    missing_last = 2 * 30740800
    expected = _ref_p2p_ms(12 * missing_last) + _ref_restart("gpt-1.5b", 1, 6, "remove")
    got = cm.repartition_cost(8, 1, 8, 0, 0, 1, 6, (1,) * 8)
    assert got == pytest.approx(expected, rel=1e-12)
    assert got == pytest.approx(_ref_repartition("gpt-1.5b", 1, 8, 0, 1, 6, [1] * 8), rel=1e-12)
    # the sum over all new stages would be much larger: the quirk is really "last only"
    total_missing = (2 + 4 + 2 + 2 + 4 + 2) * 30740800
    transfer = cm.repartition_transfer_ms(8, 6, (1,) * 8)
    assert transfer == pytest.approx(_ref_p2p_ms(12 * missing_last), rel=1e-12)
    assert transfer < _ref_p2p_ms(12 * total_missing) * 0.5


def test_artifact_repartition_adds_broadcast_if_target_width_above_one() -> None:
    cm = ArtifactCostModel("gpt-1.5b")
    bcast = max(_ref_p2p_ms(12 * x) for x in _ref_stage_params("gpt-1.5b", 6))
    got = cm.repartition_cost(16, 2, 8, 0, 0, 2, 6, (2,) * 8)
    expected = _ref_p2p_ms(12 * 2 * 30740800) + bcast + _ref_restart("gpt-1.5b", 2, 6, "remove")
    assert got == pytest.approx(expected, rel=1e-12)
    # growing past what survived: 'add' restart
    got = cm.repartition_cost(20, 2, 8, 4, 0, 2, 10, (2,) * 8)
    assert got == pytest.approx(_ref_repartition("gpt-1.5b", 2, 8, 0, 2, 10, [2] * 8), rel=1e-12)


def test_artifact_repartition_keeps_last_assigned_volume_if_survivors_run_out() -> None:
    # (1,8) -> (1,10): ten new stages, eight old nodes; the last new stages find no old node
    cm = ArtifactCostModel("gpt-1.5b")
    got = cm.repartition_cost(10, 1, 8, 2, 0, 1, 10, (1,) * 8)
    assert got == pytest.approx(_ref_repartition("gpt-1.5b", 1, 8, 0, 1, 10, [1] * 8), rel=1e-12)


@pytest.mark.parametrize("model", ["gpt-1.5b", "bert", "vgg19"])
def test_artifact_repartition_matches_reference_if_every_survivor_vector(model: str) -> None:
    cm = ArtifactCostModel(model)
    d, p = 2, 4
    n_out = 3
    for p2 in (2, 3, 5, 6, 8):
        if p2 not in cm.build_ms:
            continue
        for d2 in (1, 2):
            for surv in itertools.product(range(d + 1), repeat=p):
                got = cm.repartition_cost(d * p, d, p, 0, n_out, d2, p2, surv)
                ref = _ref_repartition(model, d, p, n_out, d2, p2, list(surv))
                assert got == pytest.approx(ref, rel=1e-12), (p2, d2, surv)


def test_artifact_repartition_batch_equals_scalar_if_random_survivors() -> None:
    cm = ArtifactCostModel("gpt-1.5b")
    rng = np.random.default_rng(3)
    for p, p2, d in [(8, 6, 3), (6, 9, 2), (12, 8, 2), (9, 16, 1), (8, 12, 4)]:
        surv = rng.integers(0, d + 1, size=(300, p))
        surv[:20] = d  # include the unconstrained fast path
        batch = cm.repartition_transfer_batch(p, p2, surv)
        scalar = [cm.repartition_transfer_ms(p, p2, tuple(int(x) for x in row)) for row in surv]
        np.testing.assert_allclose(batch, scalar, rtol=1e-12)


# ---------------------------------------------------------------------------------------------------- default model


def _default() -> DefaultCostModel:
    return DefaultCostModel(TableThroughput.from_reference("gpt-1.5b"), LAYERS["gpt-1.5b"]["layers"])


def test_default_same_depth_falls_back_to_checkpoint_if_stage_lost_everywhere() -> None:
    cm = _default()
    c = cm.c
    m, a = cm.stage_term(2, 8, 2, 3, 2)
    assert math.isinf(m)
    got = cm.combine(16, 2, 8, 0, 2, 2, m, a)
    assert got == pytest.approx(c.restart_ms + c.group_base_ms + c.group_per_process_ms * 16 + c.checkpoint_ms)


def test_default_same_depth_prices_rebuild_transfer_and_join_if_refill() -> None:
    cm = _default()
    c = cm.c
    m, _ = cm.stage_term(2, 8, 2, 0, 1)
    assert m == pytest.approx(c.transfer_latency_ms + 1000.0 * cm._stage_bytes(8)[0] / c.bandwidth_bytes_per_s)
    got = cm.combine(18, 2, 8, 0, 1, 2, m, 0.0)
    assert got == pytest.approx(c.group_base_ms + c.group_per_process_ms * 16 + m + c.join_ms)
    assert cm.combine(18, 2, 8, 0, 1, 2, 0.0, 0.0) == pytest.approx(c.group_base_ms + c.group_per_process_ms * 16)
    assert cm.combine(16, 2, 8, 0, 0, 2, 0.0, 0.0) == 0.0


@pytest.mark.parametrize("d, d2", [(1, 2), (1, 3), (1, 4), (2, 3), (2, 5), (3, 4)])
def test_default_refill_is_priced_by_the_most_one_holder_sends(d: int, d2: int) -> None:
    """Regression (issue 21): one survivor refilling two new replicas of its stage was priced as one stage's
    transfer; it sends two, and the emulated link (like a NIC) charges it for both. The price of the largest stage's
    refill now agrees with the peak bytes of the runtime's own migration plan of the move, to within one layer."""
    cm = _default()
    p = 8
    largest = int(np.argmax(cm._stage_bytes(p)))
    m, _ = cm.stage_term(d, p, d2, largest, 0)
    priced_bytes = (m - cm.c.transfer_latency_ms) * cm.c.bandwidth_bytes_per_s / 1000.0
    assert priced_bytes == pytest.approx(cm._planned_peak_bytes(d, p, 0, d2, p), abs=12.0 * max(cm.layer_params))
    assert priced_bytes == pytest.approx(cm._stage_bytes(p)[largest] * max(1.0, (d2 - d) / d))


def test_default_refill_after_a_loss_is_shared_by_the_leavers_only_with_a_notice() -> None:
    """A stage of 2x8 losing one replica and growing to 4: its survivor sends three copies; with a notice the
    leaver hands its state over and sends its share."""
    cm = _default()
    stage = cm._stage_bytes(8)[2]
    for notice, copies in ((False, 3.0), (True, 1.5)):
        cm.preemption_notice = notice
        m, _ = cm.stage_term(2, 8, 4, 2, 1)
        assert m == pytest.approx(cm.transfer_ms(copies * stage))


def test_default_repartition_falls_back_if_old_stage_has_no_survivor() -> None:
    cm = _default()
    assert math.isinf(cm.repartition_transfer_ms(8, 6, (2, 2, 0, 2, 2, 2, 2, 2)))
    fb = cm.repartition_cost(16, 2, 8, 0, 2, 2, 6, (2, 2, 0, 2, 2, 2, 2, 2))
    assert fb == pytest.approx(cm.restart_ms(2, 6, "remove") + cm.c.checkpoint_ms)
    ok = cm.repartition_cost(16, 2, 8, 0, 1, 2, 6, (2, 2, 1, 2, 2, 2, 2, 2))
    assert ok < fb


def test_default_stage_bytes_cover_all_params_if_balanced() -> None:
    cm = _default()
    for p in (1, 6, 8, 13, 32):
        assert sum(cm._stage_bytes(p)) == pytest.approx(12 * sum(LAYERS["gpt-1.5b"]["layers"]))


# ---------------------------------------------------------------------------------------------------- balanced partition, profile


def _brute_partition_max(weights, parts):
    n = len(weights)
    best = math.inf
    for cuts in itertools.combinations(range(1, n), parts - 1):
        b = (0, *cuts, n)
        best = min(best, max(sum(weights[b[k] : b[k + 1]]) for k in range(parts)))
    return best


def test_balanced_partition_minimizes_largest_group_if_brute_forced() -> None:
    rng = np.random.default_rng(0)
    for _ in range(40):
        n = int(rng.integers(1, 9))
        w = [float(x) for x in rng.integers(1, 20, size=n)]
        for parts in range(1, n + 1):
            b = balanced_partition(w, parts)
            assert b[0] == 0 and b[-1] == n and len(b) == parts + 1 and all(x < y for x, y in zip(b, b[1:]))
            got = max(sum(w[b[k] : b[k + 1]]) for k in range(parts))
            assert got == pytest.approx(_brute_partition_max(w, parts), rel=1e-9), (w, parts, b)


def test_balanced_partition_raises_if_more_parts_than_items() -> None:
    with pytest.raises(ConfigurationError, match="cannot split 3 layers into 4 stages"):
        balanced_partition([1, 2, 3], 4)


def test_profile_throughput_is_zero_if_batch_not_divisible_or_memory_exceeded() -> None:
    prof = LayerProfile.synthetic_transformer(layers=8, global_batch=16, micro_batch=2)
    thr = ProfileThroughput(prof)
    assert thr.throughput(3, 2) == 0.0  # 16 / 3 not an integer
    assert thr.throughput(2, 2) > 0
    assert thr.throughput(1, 11) == 0.0  # more stages than layers
    tight = LayerProfile.synthetic_transformer(layers=8, global_batch=16, micro_batch=2, memory_limit_bytes=1e9)
    assert ProfileThroughput(tight).throughput(1, 1) == 0.0
    assert ProfileThroughput(tight).throughput(1, 10) > 0


def test_profile_throughput_candidates_fit_and_are_positive_if_any_n() -> None:
    thr = ProfileThroughput(LayerProfile.synthetic_transformer(layers=12, global_batch=32))
    for n in (1, 4, 9, 16):
        cands = thr.candidates(n, hint_counts=[n - 1, 2])
        assert cands, n
        assert all(d * p <= n and thr.throughput(d, p) > 0 for d, p in cands)


def test_layer_profile_raises_if_lengths_differ() -> None:
    with pytest.raises(ConfigurationError, match="differ in length"):
        LayerProfile((1.0, 1.0), (1.0,), (1.0, 1.0), (1.0, 1.0), 1, 1)


# ---------------------------------------------------------------------------------------------------- fitting, loading


def test_migration_constants_fit_recovers_constants_if_synthetic_measurements() -> None:
    truth = MigrationConstants(
        group_base_ms=37.0, group_per_process_ms=2.5, bandwidth_bytes_per_s=3.0e9, transfer_latency_ms=11.0,
        restart_ms=9100.0,
    )

    def groups(n):
        return truth.group_base_ms + truth.group_per_process_ms * n

    meas = [("intra-stage", 0.0, n, groups(n)) for n in (4, 8, 16, 32)]
    for b, n, kind in [(1e8, 8, "inter-stage"), (5e8, 16, "repartition"), (2e9, 12, "inter-stage")]:
        meas.append((kind, b, n, groups(n) + truth.transfer_latency_ms + 1000.0 * b / truth.bandwidth_bytes_per_s))
    meas += [("restart", 0.0, 16, 9000.0 + groups(16)), ("restart", 0.0, 8, 9200.0 + groups(8))]
    fit = MigrationConstants.fit(meas)
    assert fit.group_base_ms == pytest.approx(37.0, rel=1e-9)
    assert fit.group_per_process_ms == pytest.approx(2.5, rel=1e-9)
    assert fit.transfer_latency_ms == pytest.approx(11.0, rel=1e-6)
    assert fit.bandwidth_bytes_per_s == pytest.approx(3.0e9, rel=1e-9)
    assert fit.restart_ms == pytest.approx(9100.0)
    assert fit.join_ms == MigrationConstants().join_ms  # not measured: kept from base


def test_migration_constants_fit_keeps_base_if_no_measurements() -> None:
    base = MigrationConstants(join_ms=1.0)
    assert MigrationConstants.fit([], base) == base


def test_migration_constants_fit_accepts_enum_kinds_if_given() -> None:
    fit = MigrationConstants.fit([(MigrationKind.RESTART, 0.0, 4, 5000.0)])
    base = MigrationConstants()
    assert fit.restart_ms == 5000.0 - base.group_base_ms - 4 * base.group_per_process_ms


def test_migration_constants_fit_reproduces_measured_restart_if_priced_by_default_model() -> None:
    # Regression: fit() used to store the mean measured restart as restart_ms, but DefaultCostModel.restart_ms
    # adds the group rebuild on top, so a fitted model priced every restart one group rebuild too high.
    meas = [("intra-stage", 0.0, n, 20.0 + 3.0 * n) for n in (2, 4, 8)] + [("restart", 0.0, 8, 6000.0)]
    fit = MigrationConstants.fit(meas)
    dcm = DefaultCostModel(TableThroughput({(2, 4): 10.0}, 8), [1.0] * 8, fit)
    assert dcm.restart_ms(2, 4, "remove") == pytest.approx(6000.0)


def test_migration_constants_fit_raises_if_unknown_kind() -> None:
    with pytest.raises(ConfigurationError, match="unknown migration kinds.*teleport"):
        MigrationConstants.fit([("teleport", 1.0, 2, 3.0), ("restart", 0.0, 2, 100.0)])


def test_load_cost_model_builds_each_kind_if_valid_options(tmp_path) -> None:
    cm = load_cost_model("artifact", model="bert")
    assert isinstance(cm, ArtifactCostModel) and cm.throughput.name == "bert"
    dm = load_cost_model("default", model="gpt-1.5b")
    assert isinstance(dm, DefaultCostModel) and len(dm.layer_params) == 50
    prof = LayerProfile.synthetic_transformer(layers=4)
    path = tmp_path / "prof.json"
    path.write_text(json.dumps({
        "forward_ms": list(prof.forward_ms), "backward_ms": list(prof.backward_ms),
        "param_bytes": list(prof.param_bytes), "activation_bytes": list(prof.activation_bytes),
        "micro_batch": 1, "global_batch": 8, "limits": {"min_p": 2},
    }))
    pm = load_cost_model("default", profile_path=str(path))
    assert isinstance(pm.throughput, ProfileThroughput)
    assert pm.throughput.limits.min_p == 2
    assert pm.layer_params[1] == pytest.approx(prof.param_bytes[1] / 4)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(kind="artifact"), "exactly one"),
        (dict(kind="artifact", model="bert", profile_path="x.json"), "exactly one"),
        (dict(kind="artifact", profile_path="x.json"), "needs --model-table"),
        (dict(kind="magic", model="bert"), "unknown cost model 'magic'"),
        (dict(kind="artifact", model="nope"), "unknown model table 'nope'"),
        (dict(kind="default", profile_path="/nonexistent/p.json"), "cannot read layer profile"),
    ],
)
def test_load_cost_model_raises_informatively_if_bad_options(kwargs, match) -> None:
    with pytest.raises(ConfigurationError, match=match):
        load_cost_model(**kwargs)


@pytest.mark.parametrize("model", ["gpt-1.5b", "bert", "vgg19"])
def test_repartition_greedy_gives_same_transfer_row_by_row_and_batched_if_random_survivors(model: str) -> None:
    """The greedy has two paths (plain Python for a few patterns, numpy with a first-choice shortcut for many);
    both must give the artifact's greedy result for every pattern."""
    cm = ArtifactCostModel(model)
    rng = np.random.default_rng(0)
    depths = sorted({p for _, p in cm.throughput.candidates(32)})
    for p in depths[:6]:
        for p2 in depths[:8]:
            surv = rng.integers(0, 4, size=(40, p))
            batched = cm._greedy_batch(p, p2, surv)
            single = np.array([cm._greedy_batch(p, p2, surv[i : i + 1])[0] for i in range(len(surv))])
            assert np.array_equal(batched, single), (p, p2)


@pytest.mark.parametrize("n, shape, target", [(3, (1, 3), (1, 2)), (3, (1, 2), (1, 2)), (4, (1, 4), (1, 3)),
                                               (4, (2, 2), (1, 2))])
def test_preemption_notice_prices_a_lost_stage_as_a_copy_not_a_restart(n, shape, target) -> None:
    """Regression (bench_replay forecasts): the replay gives every drop a notice and the runtime hands the leaver's
    state over, but the cost model priced a 1x3 losing any instance as a checkpoint restart, so the forecast kept
    1x2 on 3 instances "for safety" where the job ran 1x3. With ``preemption_notice`` no preemption restarts."""
    from lightning_parcae.planning.costmodel import DefaultCostModel, MigrationConstants
    from lightning_parcae.planning.liveput import expected_transition_cost
    from lightning_parcae.planning.measured import PipelineThroughput

    thr = PipelineThroughput([1.0] + [4.0] * 8 + [2.0], 48, 4, max_p=4, min_p=1)
    c = MigrationConstants(restart_ms=10_000.0)
    sudden = expected_transition_cost(DefaultCostModel(thr, [1e5] * 10, c), n, shape, 0, 1, target).mean
    noticed = expected_transition_cost(DefaultCostModel(thr, [1e5] * 10, c, preemption_notice=True), n, shape, 0, 1,
                                       target).mean
    assert math.isfinite(noticed) and noticed < 0.25 * c.restart_ms  # a copy (and a join of the spare), no restart
    if shape[0] == 1:  # the only replica of the lost member's stage: a restart (in expectation) without a notice
        assert sudden > 0.5 * c.restart_ms
    else:  # two replicas: a stage is never lost, the notice changes nothing
        assert noticed == pytest.approx(sudden)


def test_reference_layer_params_are_each_bundled_models_layers_and_name_the_tables_if_unknown() -> None:
    """The artifact's per-layer parameter counts, as both the artifact's and our default cost model price them."""
    for model in reference_models():
        layers = reference_layer_params(model)
        assert layers and all(x > 0 for x in layers)
        assert ArtifactCostModel(model).layer_params == layers
        assert load_cost_model("default", model).layer_params == [float(x) for x in layers]  # type: ignore[attr-defined]
    assert len(reference_layer_params("gpt-1.5b")) == 50  # embedding, 48 blocks, head
    with pytest.raises(ConfigurationError, match="bundled tables are"):
        reference_layer_params("gpt-99b")


def test_the_largest_split_is_the_largest_d_up_to_the_bound_that_splits_the_batch_else_one() -> None:
    from lightning_parcae.planning.costmodel import batch_splits, largest_split

    assert largest_split(60, 8) == 6 and largest_split(120, 8, 2) == 6 and largest_split(48, 32, 2) == 24
    assert largest_split(7, 4) == 1 and largest_split(7, 4, 2) == 1  # nothing splits 7 into 2: D = 1, as before
    for b in (24, 36, 60, 72, 120):
        for bound in (1, 3, 8, 16):
            d = largest_split(b, bound, 2)
            assert d <= bound and (batch_splits(b, d, 2) or d == 1)
            assert not any(batch_splits(b, k, 2) for k in range(d + 1, bound + 1))


def test_default_set_constants_reprices_cached_repartitions_and_leaves_other_models_correct() -> None:
    """Regression (issue 21): the runtime now refits its migration constants from measured migrations while it
    plans. ``repartition_transfer_ms`` is cached per (model, depths, survivors): assigning ``cm.c`` left a repartition
    priced at the old bandwidth; ``set_constants`` drops the cached prices, and a second model's prices (the method
    caches are per class) stay its own."""
    thr = TableThroughput.from_reference("gpt-1.5b")
    layers = LAYERS["gpt-1.5b"]["layers"]
    fast, other = DefaultCostModel(thr, layers), DefaultCostModel(thr, layers)
    before, theirs = fast.repartition_transfer_ms(4, 6, (2,) * 4), other.repartition_transfer_ms(4, 6, (2,) * 4)
    assert before > 0 and theirs == before
    fast.set_constants(MigrationConstants(bandwidth_bytes_per_s=1.25e9 / 40))  # 0.25 Gbps
    after = fast.repartition_transfer_ms(4, 6, (2,) * 4)
    latency = fast.c.transfer_latency_ms
    assert after - latency == pytest.approx(40 * (before - latency), rel=1e-9)
    assert other.repartition_transfer_ms(4, 6, (2,) * 4) == theirs
    assert fast.full_state_transfer_ms(6) > 30 * other.full_state_transfer_ms(6)


def test_migration_constants_fit_takes_the_bandwidth_from_a_single_move() -> None:
    """Regression (stop 47, emulated GPT-1.5B with state at 0.25 Gbps): a repartition of 6.7 MB took 16.4 s, and
    until a second one was measured the fit kept 10 Gbps -- the leader priced its next move at milliseconds. One
    move now gives the bandwidth from its time beyond the group rebuild and the latency."""
    base = MigrationConstants(group_base_ms=30.0, group_per_process_ms=5.0, transfer_latency_ms=5.0)
    c = MigrationConstants.fit([("repartition", 6.7e6, 28, 16400.0)], base=base)
    assert c.bandwidth_bytes_per_s == pytest.approx(6.7e6 / (16.4 - 0.03 - 0.14 - 0.005))
    assert c.group_base_ms == 30.0 and c.transfer_latency_ms == 5.0
    # a move faster than its rebuild says nothing about the bandwidth
    assert MigrationConstants.fit([("repartition", 6.7e6, 28, 100.0)], base=base).bandwidth_bytes_per_s == 1.25e9


def test_an_intra_stage_migration_that_moved_bytes_is_fitted_as_a_transfer_not_a_group_rebuild() -> None:
    """Regression (stop 48, emulated GPT-1.5B with state at 0.25 Gbps, lh_80_90): a standby replacing a noticed
    leaver of 2x9 received its stage (457 kB real, 16.2 s) in a migration the plan calls intra-stage -- no member
    changes stage. The fit took it for a group rebuild (group_base_ms 16,248), and every later move, a replica
    dropped included, was priced 16 s dearer. It is fitted with the transfers now."""
    base = MigrationConstants(group_base_ms=30.0, group_per_process_ms=5.0, transfer_latency_ms=5.0)
    moves = [("repartition", 304896.0, 28, 16621.8), ("intra-stage", 457344.0, 18, 24248.5)]
    c = MigrationConstants.fit(moves, base=base)
    assert c.group_base_ms == 30.0 and c.group_per_process_ms == 5.0
    assert 1e4 < c.bandwidth_bytes_per_s < 1e5  # the two moves' slope: ~150 kB more in ~7.6 s more
    # an intra-stage move without bytes still fits the group rebuild
    alone = MigrationConstants.fit([("intra-stage", 0.0, 18, 240.0)], base=base)
    assert alone.group_base_ms == 240.0


def test_a_repartition_that_must_fill_several_replicas_of_a_stage_is_priced_by_the_planners_peak_bytes() -> None:
    """Regression (stop 48, 0.25 Gbps replay of lh_80_90): the repartition price filled each new stage once, from
    its best-placed survivor, so 1x9 -> 2x7 on 16 instances cost the same as 2x9 -> 2x7 (16.3 s and 16.2 s) and
    took 31.9 s against 18.9 s: five joiners each received a whole 2x7 stage and a holder sent to two receivers.
    Holding 1x9 through a dip looked cheap. Now the price is at least the most one process sends or receives in
    the runtime's own plan of the move."""
    from lightning_parcae.planning.liveput import expected_transition_cost
    from lightning_parcae.planning.migration_plan import Layout, plan_migration

    layers = [1e5] * 48
    c = MigrationConstants(bandwidth_bytes_per_s=1e6, transfer_latency_ms=0.0, group_base_ms=0.0,
                           group_per_process_ms=0.0, join_ms=0.0)
    table = {(d, p): 10.0 * d for d in (1, 2) for p in (7, 9)}
    cm = DefaultCostModel(TableThroughput(table, 64), layers, c, preemption_notice=True)
    from_hold = expected_transition_cost(cm, 16, (1, 9), 0, 0, (2, 7)).mean
    from_2x9 = expected_transition_cost(cm, 18, (2, 9), 0, 2, (2, 7)).mean
    assert from_hold > 1.5 * from_2x9
    # the price is the planner's peak at the state bandwidth
    b9 = [b - a for a, b in zip(cm._bounds(9), cm._bounds(9)[1:])]
    b7 = [b - a for a, b in zip(cm._bounds(7), cm._bounds(7)[1:])]
    assert sum(b9) == sum(b7) == 48
    plan = plan_migration(Layout(tuple(f"o{i}" for i in range(9)), tuple(b9)),
                          [f"o{i}" for i in range(9)] + [f"j{i}" for i in range(5)], (2, 7), b7,
                          [int(12 * x) for x in layers])
    assert from_hold == pytest.approx(cm.transfer_ms(plan.peak_bytes))


def test_a_concrete_plan_is_priced_by_its_rebuild_its_peak_bytes_and_a_join() -> None:
    """``plan_ms`` -- what the runtime's leader charges for the move it would make with the members it knows --
    is the group rebuild of the new shape, plus for a state move the most one process sends or receives at the
    state bandwidth and ``join_ms`` if a process joins; nothing for a plan of kind ``none``."""
    from lightning_parcae.planning.migration_plan import Layout, plan_migration

    c = MigrationConstants(bandwidth_bytes_per_s=1e6, transfer_latency_ms=5.0, group_base_ms=100.0,
                           group_per_process_ms=10.0, join_ms=700.0)
    layers = [1e4] * 8
    cm = DefaultCostModel(TableThroughput({(2, 2): 1.0}, 8), layers, c, preemption_notice=True)
    nbytes = [int(12 * x) for x in layers]
    old = Layout(("a", "b", "c", "d"), (4, 4))
    same = plan_migration(old, ["a", "b", "c", "d"], (2, 2), [4, 4], nbytes)
    assert cm.plan_ms(same) == 0.0
    drop = plan_migration(old, ["a", "b"], (1, 2), [4, 4], nbytes)  # a whole pipeline leaves
    assert drop.kind.value == "intra-stage" and cm.plan_ms(drop) == pytest.approx(100.0 + 10.0 * 2)
    refill = plan_migration(old, ["a", "b", "c", "e"], (2, 2), [4, 4], nbytes, senders=list(old.members))
    assert refill.peak_bytes == 4 * 12e4  # e receives d's stage
    assert cm.plan_ms(refill) == pytest.approx(100.0 + 40.0 + 5.0 + 1000.0 * 4.8e5 / 1e6 + 700.0)
    cut = plan_migration(old, ["a", "b", "c", "d"], (1, 4), [2, 2, 2, 2], nbytes)
    assert cut.kind.value == "repartition"
    assert cm.plan_ms(cut) == pytest.approx(100.0 + 40.0 + cm.transfer_ms(cut.peak_bytes))


@pytest.mark.parametrize("changed", [
    dict(bandwidth_bytes_per_s=1.25e9 / 40), dict(group_base_ms=900.0), dict(transfer_latency_ms=40.0, join_ms=7.0),
    dict(bytes_per_param=4.0), dict(bytes_per_param=16.0, bandwidth_bytes_per_s=3e7)])
def test_a_refit_keeps_the_planned_bytes_and_prices_as_a_model_built_with_the_new_constants(
        monkeypatch: pytest.MonkeyPatch, changed: dict) -> None:
    """Regression (issue 21, stop 56, 0.25 Gbps replay of hl_15_25 at N = 32): the leader refits its migration
    constants after each migration, and ``set_constants`` dropped the planned bytes of every repartition with the
    prices -- bytes that depend on ``bytes_per_param`` only. The next decision re-ran the migration planner ~1,800
    times (3 s on an idle core; 1.3-1.5 s of planning phase on the loaded replay machine, the whole job waiting).
    Now a refit re-runs the planner only if ``bytes_per_param`` changed, and every price after it equals that of a
    model built with the new constants."""
    import lightning_parcae.planning.costmodel as costmodel  # noqa: PLC0415

    thr = TableThroughput.from_reference("gpt-1.5b")
    layers = LAYERS["gpt-1.5b"]["layers"]
    old = MigrationConstants(bandwidth_bytes_per_s=1.25e9 / 4, group_base_ms=30.0)
    refit = DefaultCostModel(thr, layers, old, preemption_notice=True)
    cases = [(8, 4, 6, 0, 0, 4, 7), (28, 4, 7, 0, 2, 2, 13), (24, 4, 6, 3, 1, 2, 9), (16, 2, 8, 0, 0, 2, 7)]

    def prices(cm: DefaultCostModel) -> list[float]:
        return [cm.repartition_rest_ms(n, d, p, n_in, n_out, d2, p2, False) for n, d, p, n_in, n_out, d2, p2 in cases] \
            + [cm.repartition_transfer_ms(p, p2, (1,) * p) for _, _, p, _, _, _, p2 in cases] \
            + [cm.full_state_transfer_ms(p) for p in (6, 7, 9)]

    prices(refit)
    runs = []
    real = costmodel.plan_migration
    monkeypatch.setattr(costmodel, "plan_migration", lambda *a, **k: runs.append(1) or real(*a, **k))
    new = replace(old, **changed)
    refit.set_constants(new)
    after = prices(refit)
    assert bool(runs) == ("bytes_per_param" in changed)
    monkeypatch.setattr(costmodel, "plan_migration", real)
    assert after == pytest.approx(prices(DefaultCostModel(thr, layers, new, preemption_notice=True)), rel=1e-12)
