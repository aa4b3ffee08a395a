"""A joiner whose admitting generation cannot form leaves as "released", never with exit 1."""

from __future__ import annotations

import types
from datetime import timedelta
from typing import Any

import pytest

from lightning_parcae.contract import RELEASED_EXIT
from lightning_parcae.runtime import joining
from lightning_parcae.runtime.joining import Admission
from lightning_parcae.runtime.lifecycle import Phase
from lightning_parcae.training.layout import StageLayout
from lightning_parcae.training.process_setup import ProcessSetup
from lightning_parcae.training.stage_state import StageState


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _Life:
    def __init__(self) -> None:
        self.phases: list[Phase] = []

    def to(self, phase: Phase, **info: Any) -> None:
        self.phases.append(phase)


def test_joiner_leaves_released_if_the_admitting_generations_groups_cannot_be_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (chaos seed 60): a member was killed while a standby was being admitted; the members fell back,
    and the joiner -- past its state transfer, building the new generation's process groups -- timed out in
    ``new_group`` and exited 1, which failed the whole job. It now leaves as "released" (the launcher starts a
    fresh standby), as it already did when the transfer itself failed."""
    monkeypatch.setattr(joining, "exit_now", lambda code: (_ for _ in ()).throw(_Exit(code)))
    events: list[tuple[str, dict[str, Any]]] = []
    rt = types.SimpleNamespace(member="i3.1", life=_Life(), event=lambda name, **f: events.append((name, f)))
    layout = types.SimpleNamespace(members=["i0", "i3.1"], partition=[0, 2], data_parallel=1, pipeline_stages=2)
    er = types.SimpleNamespace(join_wait=lambda: {"generation": 7, "stack_path": "net", "layer_names": ["0", "1"]},
                               layout=layout, member="i3.1")
    er.admission = Admission(rt, None, None, timedelta(seconds=5))  # type: ignore[arg-type]  # give_up: ctx only
    options = types.SimpleNamespace(process_group_backend="gloo", timeout=timedelta(seconds=5))
    strategy = types.SimpleNamespace(elastic_runtime=er, cluster_environment=None, options=options)
    layout = StageLayout(StageState(), options, strategy, profiler=None)  # type: ignore[arg-type]
    setup = ProcessSetup(strategy, options, layout, "pytorch_lightning")  # type: ignore[arg-type]

    def build_groups(*args: Any) -> None:
        raise RuntimeError("Socket Timeout: waitForInput timed out after 15000ms")

    monkeypatch.setattr(setup, "build_groups", build_groups)
    with pytest.raises(_Exit) as exc:
        setup._join()
    assert exc.value.code == RELEASED_EXIT
    assert rt.life.phases == [Phase.FENCED]
    assert events and events[0][0] == "join_failed" and "could not join generation 7" in events[0][1]["reason"]


def test_a_joiner_takes_the_admitted_layout_and_groups_into_the_one_stage_state(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The join path hands the admitting generation's layout and groups to the layout's stage state (no copy
    of its own, no write into the strategy)."""
    layout_rec = types.SimpleNamespace(members=["i0", "i3.1"], partition=[1, 1], data_parallel=1, pipeline_stages=2)
    er = types.SimpleNamespace(join_wait=lambda: {"generation": 7, "stack_path": "", "layer_names": ["a", "b"],
                                                  "layer_times": [0.5, 0.5]},
                               layout=layout_rec, member="i3.1")
    options = types.SimpleNamespace(process_group_backend="gloo", timeout=timedelta(seconds=5))
    strategy = types.SimpleNamespace(elastic_runtime=er, cluster_environment=None, options=options)
    state = StageState()
    setup = ProcessSetup(strategy, options, StageLayout(state, options, strategy, None),  # type: ignore[arg-type]
                         "pytorch_lightning")
    timeouts: list[timedelta] = []
    groups = types.SimpleNamespace(set_op_timeout=timeouts.append)
    built: list[tuple[Any, ...]] = []
    monkeypatch.setattr(setup, "build_groups", lambda *a: built.append(a) or groups)
    setup._join()
    assert built == [(7, 1, 2, 1, 2)]
    assert state.groups is groups and state.partition == [1, 1] and state.whole_model
    assert state.layer_names == ["a", "b"] and state.layer_times == [0.5, 0.5]
    setup.use_timeout(timedelta(seconds=3))
    assert setup.timeout == timedelta(seconds=3) and timeouts == [timedelta(seconds=3)]
