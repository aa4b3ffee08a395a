"""What every runtime part acts through (lightning_parcae.runtime.part.PartContext), and how ElasticRuntime hands
it to its parts."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from lightning_parcae.runtime.config import RuntimeConfig
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.elastic import ElasticRuntime
from lightning_parcae.runtime.lifecycle import Lifecycle
from lightning_parcae.runtime.liveness import Liveness
from lightning_parcae.runtime.part import PartContext


def _runtime(tmp_path: Any) -> ElasticRuntime:
    config = RuntimeConfig(store_url="unused", token=None, member="m0", interval_s=60.0, interval_steps=0,
                           look_ahead=12, predictor="persistence", heartbeat_s=0.2, dead_after_s=3.0,
                           stall_after_s=60.0, throughput="measured", run_dir=str(tmp_path))
    host = SimpleNamespace(layer_names=[], layer_times=[], stack_path="net", optimizer_state_factor=2.0,
                           full_stack=None)
    store = dist.HashStore()
    rt = ElasticRuntime(host, config)  # type: ignore[arg-type]
    rt.attach(store, Coordinator(store), Liveness(lambda: store, "m0"))
    return rt


def test_a_part_context_cannot_be_rewired_by_a_part() -> None:
    store = dist.HashStore()
    ctx = PartContext(member="m", store=store, coord=Coordinator(store), live=Liveness(lambda: store, "m"),
                      life=Lifecycle("m"), event=lambda name, **f: None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.member = "other"  # type: ignore[misc]


def test_every_part_acts_through_the_one_connection_of_its_runtime(tmp_path: Any) -> None:
    rt = _runtime(tmp_path)
    assert rt.switching is not None and rt.recovery is not None and rt.admission is not None
    ctx = rt.switching.ctx
    assert rt.recovery.ctx is ctx and rt.admission.ctx is ctx
    assert ctx.store is rt.store and ctx.coord is rt.coord and ctx.live is rt.live and ctx.life is rt.life
    assert rt.switching.state is rt.state and rt.recovery.state is rt.state and rt.admission.state is rt.state
    assert rt.chooser.coord is rt.coord and rt.recovery.shapes is rt.chooser


def test_a_parts_event_reaches_the_run_directory_with_the_member_and_generation(tmp_path: Any) -> None:
    rt = _runtime(tmp_path)
    assert rt.switching is not None
    rt.switching.ctx.event("something", value=1.5)
    lines = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert lines[-1]["event"] == "something" and lines[-1]["member"] == "m0" and lines[-1]["generation"] == -1
    assert lines[-1]["value"] == 1.5 and lines[-1]["source"] == "elastic"
