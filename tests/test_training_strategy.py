"""The strategy as the owner of its parts: the stage state is read-only on it (the layout writes it), derived
facts follow that state, and a new layout is applied in one order (ranks and groups, stage, data) -- no processes."""

from __future__ import annotations

import types
from typing import Any

import pytest

from lightning_parcae.training.strategy import ParcaeStrategy


def test_the_stage_facts_are_read_only_views_of_the_layouts_state() -> None:
    s = ParcaeStrategy(pipeline_stages=1)
    s.layout.adopt_admitted([1, 2], "net", ["0", "1", "2"], [0.1, 0.2, 0.3])
    assert (s.partition, s.stack_path, s.layer_names, s.layer_times) == ([1, 2], "net", ["0", "1", "2"],
                                                                          [0.1, 0.2, 0.3])
    assert s.layer_key("1") == "net.1" and s.is_stage_key("net.0.weight")
    for name in ("groups", "partition", "stack_path", "layer_names", "layer_times", "full_stack"):
        with pytest.raises(AttributeError):
            setattr(s, name, None)


def test_a_model_without_a_cuttable_stack_pins_the_deepest_pipeline_to_one() -> None:
    s = ParcaeStrategy(pipeline_stages=1, max_pipeline_stages=4)
    assert s.max_pipeline_stages == 4
    s.layout.adopt_admitted([2], "", ["a", "b"], [])  # a joiner of such a job
    assert s.whole_model and s.max_pipeline_stages == 1


def test_apply_layout_builds_ranks_and_groups_then_the_stage_then_the_data_slice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    s = ParcaeStrategy(pipeline_stages=1)
    s.stage_state.full_stack = object()  # type: ignore[assignment]
    s.elastic_runtime = types.SimpleNamespace(member="m1")
    calls: list[Any] = []
    groups = types.SimpleNamespace(coords=types.SimpleNamespace(replica=1))
    monkeypatch.setattr(s.process, "set_ranks", lambda rank, world: calls.append(("ranks", rank, world)))
    monkeypatch.setattr(s.process, "build_groups", lambda *a: calls.append(("groups", *a)) or groups)
    monkeypatch.setattr(s.layout, "apply", lambda *a: calls.append(("stage", *a)))
    monkeypatch.setattr(s.data, "reshard", lambda d, replica: calls.append(("data", d, replica)))
    layout = types.SimpleNamespace(members=["m0", "m1", "m2", "m3"], data_parallel=2, pipeline_stages=2,
                                   partition=(3, 2))
    s.apply_layout(None, layout, 7, {}, [])  # type: ignore[arg-type]
    assert calls == [("ranks", 1, 4), ("groups", 7, 1, 4, 2, 2), ("stage", [3, 2], groups, {}, []), ("data", 2, 1)]
