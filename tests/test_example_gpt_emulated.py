"""The GPT example as an emulated GPT-1.5B cluster (examples/gpt, ``model.emulate``): its layers sleep the
profile's per-layer times, scaled, its memory budget reproduces the modelled depth rule, and its migrations pay
the modelled network time."""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples" / "gpt"))

from gpt import GPT  # noqa: E402

from lightning_parcae.planning.measured import min_stages_for_memory  # noqa: E402
from lightning_parcae.runtime import migration  # noqa: E402
from lightning_parcae.runtime.partition import layer_memory_bytes  # noqa: E402
from lightning_parcae.testing.emulated_cluster import EmulatedWorkload  # noqa: E402

EMULATED = yaml.safe_load((ROOT / "examples" / "gpt" / "emulated_gpt15b.yaml").read_text())
SMALL = dict(n_blocks=8, d_model=16, n_heads=2, seq_len=8)


def test_layers_sleep_the_profile_per_layer_times_scaled():
    """Embedding and head are the profile's first and last entries; each of 8 blocks stands for 6 of GPT-1.5B's
    48 (their summed forward and backward times); everything divided by time_scale."""
    model = GPT(**SMALL, emulate="gpt-1.5b", time_scale=20.0)
    fwd = [layer.device_ms for layer in model.layers]
    bwd = [layer.device_backward_ms for layer in model.layers]
    assert fwd[0] == pytest.approx(0.752 / 20) and bwd[0] == pytest.approx(0.798 / 20)
    assert fwd[-1] == pytest.approx(11.238 / 20) and bwd[-1] == pytest.approx(23.762 / 20)
    assert fwd[1:-1] == pytest.approx([6 * 6.510 / 20] * 8) and bwd[1:-1] == pytest.approx([6 * 13.448 / 20] * 8)
    one_to_one = GPT(n_blocks=48, d_model=8, n_heads=2, seq_len=8, emulate="gpt-1.5b", time_scale=1.0)
    assert [layer.device_ms for layer in one_to_one.layers] == pytest.approx(
        list(EmulatedWorkload.gpt_1_5b().forward_ms))


def test_a_block_forward_and_backward_take_the_profiled_time():
    model = GPT(**SMALL, emulate="gpt-1.5b", time_scale=100.0)
    block = model.layers[1]
    x = torch.randn(10, 8, 16, requires_grad=True)
    t0 = time.perf_counter()
    y = block(x)
    t1 = time.perf_counter()
    y.sum().backward()
    t2 = time.perf_counter()
    assert t1 - t0 >= 10 * 6 * 6.510 / 100 / 1000  # 10 samples x 6 blocks' forward, scaled
    assert t2 - t1 >= 10 * 6 * 13.448 / 100 / 1000  # the profiled backward, not 2x the forward


def test_emulate_and_a_flat_device_time_are_exclusive_and_unknown_workloads_clear():
    with pytest.raises(ValueError, match="give one of them"):
        GPT(**SMALL, emulate="gpt-1.5b", device_ms_per_sample=0.3)
    with pytest.raises(ValueError, match="unknown emulated workload"):
        GPT(**SMALL, emulate="gpt-9b")
    assert all(layer.device_backward_ms is None for layer in GPT(**SMALL).layers)  # default: unchanged


def test_state_gbps_slows_the_modelled_migrations_and_needs_a_workload():
    """``model.state_gbps`` (bench_replay.py --state-gbps): the workload's state link, in Gbit/s."""
    slow = GPT(**SMALL, emulate="gpt-1.5b", state_gbps=0.25)
    plain = GPT(**SMALL, emulate="gpt-1.5b")
    assert slow.workload is not None and plain.workload is not None
    assert slow.workload.state_bandwidth_bytes_per_s == pytest.approx(0.25e9 / 8)
    assert slow.workload.transfer_s([1, 2]) > 35 * plain.workload.transfer_s([1, 2])
    for bad in ({"state_gbps": 0.25}, {"emulate": "gpt-1.5b", "state_gbps": 0.0}):
        with pytest.raises(ValueError, match="state_gbps=.* needs emulate"):
            GPT(**SMALL, **bad)


def test_config_memory_budget_needs_the_modelled_minimum_depth():
    """The strategy checks memory on the real layers; the YAML's budget must make them need the same P as the
    modelled 16 GB rule (P >= 6 for GPT-1.5B at 24 blocks)."""
    model = GPT(**EMULATED["model"])
    budget = EMULATED["trainer"]["strategy"]["init_args"]["max_stage_memory_bytes"]
    real = min_stages_for_memory([layer_memory_bytes(layer) for layer in model.layers], budget)
    assert model.workload is not None and real == model.workload.min_stages() == 6


def test_setup_installs_the_modelled_link_and_teardown_removes_it():
    model = GPT(**SMALL, emulate="gpt-1.5b", time_scale=30.0)
    before = migration.set_modelled_link(None)
    try:
        model.setup("fit")
        link = migration.set_modelled_link(None)
        assert link is not None and link.charge([1]) == pytest.approx(model.workload.transfer_s([1]))
        migration.set_modelled_link(link)
        model.teardown("fit")
        assert migration.set_modelled_link(None) is None
    finally:
        migration.set_modelled_link(before)


def test_restore_reads_the_held_layers_at_the_modelled_checkpoint_bandwidth():
    """A detached model holds every layer: restoring it sleeps the whole model's state at the read bandwidth."""
    model = GPT(**SMALL, emulate="gpt-1.5b", time_scale=2000.0)
    assert model.held_layers() == list(range(10))
    want = model.workload.checkpoint_read_s(range(10))
    assert want == pytest.approx(12 * 1639811200 / 450e6 / 2000.0)
    t0 = time.perf_counter()
    model.on_load_checkpoint({})
    assert want <= time.perf_counter() - t0 < want + 0.1



def test_a_joiner_restoring_from_live_peers_reads_no_checkpoint(monkeypatch: pytest.MonkeyPatch):
    """Regression (found reading the restore path): a joiner 'resumes' through Lightning's restore from the state
    its peers sent (LIVE_CHECKPOINT); charging it a checkpoint read would bill the same state twice."""
    from lightning_parcae.runtime.elastic import LIVE_CHECKPOINT  # noqa: PLC0415

    model = GPT(**SMALL, emulate="gpt-1.5b", time_scale=1.0)  # a full read would take ~44 s
    monkeypatch.setattr(GPT, "trainer", property(lambda self: type("T", (), {"ckpt_path": LIVE_CHECKPOINT})()))
    t0 = time.perf_counter()
    model.on_load_checkpoint({})
    assert time.perf_counter() - t0 < 0.5


def test_a_joiner_boots_for_the_modelled_boot_time(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    import train  # noqa: PLC0415  (examples/gpt/train.py)

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"emulate": "gpt-1.5b", "time_scale": 10.0}}))
    slept: list[float] = []
    monkeypatch.setattr(train.time, "sleep", slept.append)
    monkeypatch.setenv("PARCAE_JOIN", "1")
    train._boot_emulated_instance(["--config", str(cfg), "--model.time_scale", "20"])
    assert slept == [pytest.approx(EmulatedWorkload.gpt_1_5b().boot_s / 20.0)]
    monkeypatch.setenv("PARCAE_JOIN", "0")
    train._boot_emulated_instance(["--config", str(cfg)])  # a first member: no boot charged
    monkeypatch.setenv("PARCAE_JOIN", "1")
    train._boot_emulated_instance(["--model.time_scale", "20"])  # no emulate: no boot
    assert len(slept) == 1


def test_the_link_is_installed_before_fit_so_a_joiner_pays_for_the_stage_it_receives():
    """Regression (issue 21, stop 50): a standby is admitted -- and receives its stage -- while the strategy sets
    up its environment, before ``LightningModule.setup`` installs the modelled link, so in the 0.25 Gbps GPT-1.5B
    replays a joiner received three layers in 0.43 s (the link takes 23.6 s) while its senders paid for theirs.
    ``train.py`` now installs the link before ``fit`` (``GPT.install_link``, which ``setup`` also calls); a model
    without ``emulate`` installs none."""
    import train  # noqa: PLC0415  (examples/gpt/train.py)

    assert "cli.model.install_link()" in inspect.getsource(train.main)
    before = migration.set_modelled_link(None)
    try:
        model = GPT(**SMALL, emulate="gpt-1.5b", time_scale=30.0, state_gbps=0.25)
        model.install_link()
        link = migration.set_modelled_link(None)
        assert link is not None and link.charge([1, 2, 3]) == pytest.approx(model.workload.transfer_s([1, 2, 3]))
        GPT(**SMALL).install_link()
        assert migration.set_modelled_link(None) is None
    finally:
        migration.set_modelled_link(before)
