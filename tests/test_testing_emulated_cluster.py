"""An emulated cluster faithful to a profiled workload (lightning_parcae.testing.emulated_cluster): the modelled
step agrees with the planner's prediction, the memory rule reproduces the artifact's allowed shapes, and every
modelled duration is compressed by one time scale."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.costmodel import ArtifactCostModel, ProfileThroughput, TableThroughput
from lightning_parcae.testing.emulated_cluster import EmulatedWorkload, ModelledLink

GPT = EmulatedWorkload.gpt_1_5b()


@pytest.mark.parametrize("shape", [(1, 6), (2, 8), (4, 8), (8, 4), (2, 16), (1, 32), (4, 6)])
def test_simulated_1f1b_step_matches_the_costmodel_prediction_for_the_same_profile(shape):
    """The step the emulation runs (per-stage scaled layer times through a 1F1B schedule with blocking sends and a
    ring all-reduce) agrees with ProfileThroughput's closed formula within 6%; the formula charges every slot at
    the slowest stage, so the schedule may only be a little slower than it, never much."""
    d, p = shape
    w = EmulatedWorkload.gpt_1_5b(time_scale=30.0)
    predicted_s = ProfileThroughput(w.layer_profile()).step_ms(d, p) / 1000.0 / 30.0
    simulated = w.step_s(d, p)
    assert 0.94 * predicted_s <= simulated <= 1.02 * predicted_s, (simulated, predicted_s)


def test_balanced_stages_make_the_schedule_and_the_formula_agree_closely():
    uniform = EmulatedWorkload("uniform", (1.0,) * 8, (2.0,) * 8, (1e6,) * 8, (1e3,) * 8, (1e3,) * 8,
                               global_batch=32, micro_batch=1)
    for d, p in [(1, 4), (2, 4), (4, 2), (1, 8)]:
        predicted = ProfileThroughput(uniform.layer_profile()).step_ms(d, p) / 1000.0
        # within 2%: the formula also charges the last stage a send it does not make
        assert uniform.step_s(d, p) == pytest.approx(predicted, rel=0.02)


def test_time_scale_divides_every_modelled_duration():
    slow, fast = EmulatedWorkload.gpt_1_5b(time_scale=1.0), EmulatedWorkload.gpt_1_5b(time_scale=30.0)
    assert fast.step_s(4, 8) == pytest.approx(slow.step_s(4, 8) / 30.0)
    assert fast.forward_ms_per_sample(5) == pytest.approx(6.510 / 30.0)
    assert fast.backward_ms_per_sample(5) == pytest.approx(13.448 / 30.0)
    layers = list(range(1, 7))
    assert fast.transfer_s(layers) == pytest.approx(slow.transfer_s(layers) / 30.0)
    assert fast.checkpoint_write_s(layers) == pytest.approx(slow.checkpoint_write_s(layers) / 30.0)
    assert fast.boot_scaled_s() == pytest.approx(slow.boot_s / 30.0)
    # a 3 s modelled step runs in 0.1 s at scale 30 (the brief's example)
    assert 3.0 / 30.0 == pytest.approx(0.1)


def test_memory_rule_reproduces_the_artifact_allowed_depths_on_16_gb():
    """GPT-1.5B with mixed-precision Adam and 1F1B stashes needs P >= 6 on a 16 GB V100: the artifact's min_pp and
    the smallest depth its profiled table lists; every depth it lists fits."""
    table = TableThroughput.from_reference("gpt-1.5b")
    table_depths = {p for _, p in table.table}
    assert GPT.min_stages() == 6 == table.limits.min_p == min(table_depths)
    assert all(GPT.fits(p) for p in table_depths)
    assert not GPT.fits(5)  # the narrow case: stage 0 needs ~15.6 GB of the 15 usable
    assert GPT.stage_memory_bytes(5, 0) == pytest.approx(15.6e9, rel=0.01)
    # a bigger accelerator allows shallower pipelines; a smaller one needs deeper ones
    assert EmulatedWorkload.gpt_1_5b(memory_bytes=32e9).min_stages() < 6 < EmulatedWorkload.gpt_1_5b(
        memory_bytes=12e9).min_stages()


def test_transfer_of_a_stage_is_its_state_at_10_gbps():
    layers = list(range(1, 7))  # six transformer blocks
    want = 0.15e-3 + 12 * 6 * 30740800 / 1.25e9
    assert GPT.modelled_transfer_s(layers) == pytest.approx(want)
    assert GPT.transfer_s([]) == 0.0
    assert EmulatedWorkload.gpt_1_5b(bandwidth_bytes_per_s=2.5e9).transfer_s(layers) < GPT.transfer_s(layers)


def test_a_state_bandwidth_slows_migrations_only_and_survives_coarsening_and_json(tmp_path: Path):
    """``state_bandwidth_bytes_per_s`` (issue 21: stages that are costly to move): a migration's state transfer
    takes the state link's time; a step's pipeline messages and all-reduces keep the network's 10 Gbps."""
    layers = list(range(1, 7))
    slow = EmulatedWorkload.gpt_1_5b(state_bandwidth_bytes_per_s=1.25e9 / 40)
    assert slow.modelled_transfer_s(layers) - 0.15e-3 == pytest.approx(40 * (GPT.modelled_transfer_s(layers) - 0.15e-3))
    assert slow.modelled_boundary_s(3, 8) == GPT.modelled_boundary_s(3, 8)
    assert slow.modelled_allreduce_s(layers, 4) == GPT.modelled_allreduce_s(layers, 4)
    assert slow.step_s(4, 6) == GPT.step_s(4, 6)
    small = slow.coarsened(8)
    assert small.state_bandwidth_bytes_per_s == 1.25e9 / 40
    slow.to_json(str(tmp_path / "w.json"))
    assert EmulatedWorkload.from_json(str(tmp_path / "w.json")).state_bandwidth_bytes_per_s == 1.25e9 / 40
    with pytest.raises(ConfigurationError, match="state_bandwidth_bytes_per_s=0.0 must be > 0 or None"):
        EmulatedWorkload.gpt_1_5b(state_bandwidth_bytes_per_s=0.0)


def test_checkpoint_save_and_load_of_an_8_stage_job_is_the_artifact_14_s():
    """The default checkpoint bandwidth is derived from the artifact's 14 s save + load (its restart baseline):
    the largest stage of an 8-stage pipeline writes and reads its state in about that time."""
    b = GPT.partition(8)
    worst = max(GPT.checkpoint_write_s(range(b[k], b[k + 1])) + GPT.checkpoint_read_s(range(b[k], b[k + 1]))
                for k in range(8))
    artifact_s = ArtifactCostModel("gpt-1.5b").checkpoint_ms() / 1000.0
    assert worst == pytest.approx(artifact_s, rel=0.05)


def test_coarsened_keeps_the_totals_and_maps_blocks_contiguously():
    c = GPT.coarsened(8)
    assert c.num_layers == 10
    assert sum(c.forward_ms) == pytest.approx(sum(GPT.forward_ms))
    assert sum(c.params) == pytest.approx(sum(GPT.params))
    assert c.forward_ms[0] == GPT.forward_ms[0] and c.backward_ms[-1] == GPT.backward_ms[-1]
    assert c.forward_ms[1] == pytest.approx(6 * 6.510)
    assert GPT.coarsened(48) == replace(GPT, name="gpt-1.5b/48")
    with pytest.raises(ConfigurationError, match="between 1 and 48"):
        GPT.coarsened(49)


def test_json_round_trip_and_clear_errors(tmp_path: Path):
    path = tmp_path / "w.json"
    GPT.to_json(str(path))
    assert EmulatedWorkload.from_json(str(path)) == GPT
    assert EmulatedWorkload.named(str(path), time_scale=10.0).time_scale == 10.0
    raw = json.loads(path.read_text())
    raw["bogus"] = 1
    path.write_text(json.dumps(raw))
    with pytest.raises(ConfigurationError, match="unknown keys \\['bogus'\\]"):
        EmulatedWorkload.from_json(str(path))
    with pytest.raises(ConfigurationError, match="differ in length"):
        EmulatedWorkload("bad", (1.0, 2.0), (1.0,), (1.0,), (1.0,), (1.0,))
    with pytest.raises(ConfigurationError, match="time_scale=0"):
        EmulatedWorkload.gpt_1_5b(time_scale=0)
    with pytest.raises(ConfigurationError, match="unknown emulated workload"):
        EmulatedWorkload.named("gpt-9b")
    with pytest.raises(ConfigurationError, match="does not split"):
        GPT.step_s(3, 8)


def test_modelled_link_charges_the_scaled_transfer_and_refuses_unknown_layers():
    w = EmulatedWorkload.gpt_1_5b(time_scale=30.0).coarsened(8)
    link = ModelledLink(w)
    assert link.charge([1, 2]) == pytest.approx(w.transfer_s([1, 2]))
    assert math.isclose(link.charge([]), 0.0)
    with pytest.raises(ConfigurationError, match="coarsened"):
        link.charge([10])


def test_modelled_link_charges_per_step_traffic_of_the_real_model_and_refuses_unknown_layers():
    """One micro-batch of 8 samples across a GPT-1.5B stage boundary: 8 x 3.28 MB at 1.25 GB/s + 0.15 ms; a ring
    all-reduce of two coarsened blocks' fp16 gradients (12 transformer layers) over 4 pipelines: 2 x 3/4 of the bytes."""
    w = EmulatedWorkload.gpt_1_5b(time_scale=30.0).coarsened(8)
    link = ModelledLink(w)
    assert link.boundary_s(3, 8) == pytest.approx((0.15e-3 + 8 * 1024 * 1600 * 2 / 1.25e9) / 30.0)
    grads = 2.0 * (w.params[3] + w.params[4])
    assert link.allreduce_s([3, 4], 4) == pytest.approx(1.5 * grads / 1.25e9 / 30.0)
    assert link.allreduce_s([3, 4], 1) == 0.0
    with pytest.raises(ConfigurationError, match="coarsened"):
        link.boundary_s(10, 8)
    with pytest.raises(ConfigurationError, match="coarsened"):
        link.allreduce_s([9, 10], 2)


@pytest.mark.parametrize("blocks", [4, 8])
def test_the_per_step_charges_add_up_to_the_network_part_of_the_simulated_step(blocks: int):
    """What the runtime sleeps per step on an emulated cluster is what ``step_s`` charges for the network: with one
    micro-batch at 1 x 2 the step is F0, send, F1, B1, send back, B0 -- two boundary messages of the whole batch; at
    2 x 1 it is the pipeline plus one ring all-reduce of every layer's gradients."""
    w = EmulatedWorkload.gpt_1_5b(time_scale=10.0).coarsened(blocks)
    free = replace(w, bandwidth_bytes_per_s=1e30, latency_ms=0.0)
    cut = w.partition(2)[1]
    assert w.step_s(1, 2, micro_batches=1) - free.step_s(1, 2, micro_batches=1) == pytest.approx(
        2 * w.boundary_s(cut - 1, w.global_batch))
    assert w.step_s(2, 1, micro_batches=1) - free.step_s(2, 1, micro_batches=1) == pytest.approx(
        w.allreduce_s(range(w.num_layers), 2))
