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


def test_a_start_up_candidate_takes_its_rank_from_the_roster_and_a_left_out_one_takes_none() -> None:
    """Issue 20: a candidate of `parcae run` starts with RANK=0 / WORLD_SIZE=1 placeholders; the launch's roster
    makes it rank r of the first generation, or (not in it) leaves its ranks alone: it joins as a standby."""
    from lightning_parcae.runtime.startup import StartupRoster

    roster = StartupRoster(0, ("i0", "i2"), ("i1",))

    class _Env:
        def __init__(self) -> None:
            self.rank, self.world = 0, 1

        def set_global_rank(self, r: int) -> None:
            self.rank = r

        def set_world_size(self, w: int) -> None:
            self.world = w

    from lightning_utilities.core.rank_zero import rank_zero_only

    before = getattr(rank_zero_only, "rank", 0)
    reported: list[int] = []  # the P each candidate reports with its arrival (the agents' roster reads it)
    for member, want in (("i2", (1, 2)), ("i1", (0, 1))):
        er = types.SimpleNamespace(member=member, take_seat=lambda p: reported.append(p) or roster)
        options = types.SimpleNamespace(process_group_backend="gloo", timeout=timedelta(seconds=5),
                                        pipeline_stages=2)
        strategy = types.SimpleNamespace(elastic_runtime=er, cluster_environment=_Env(), options=options)
        setup = ProcessSetup(strategy, options, StageLayout(StageState(), options, strategy, None),  # type: ignore[arg-type]
                             "pytorch_lightning")
        setup._take_seat()
        assert (strategy.cluster_environment.rank, strategy.cluster_environment.world) == want
    assert rank_zero_only.rank == 1  # the member's rank-zero logging follows its roster rank
    assert reported == [2, 2]
    rank_zero_only.rank = before


def test_a_fixed_shape_strategy_refuses_to_run_as_a_start_up_candidate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under `parcae run --elastic` every worker's rank comes from the roster, which only the live-reconfiguration
    runtime reads: ParcaeStrategy(elastic=False) would train alone as RANK 0 of WORLD_SIZE 1. It says so instead."""
    from lightning_parcae.contract import ROSTER_ENV
    from lightning_parcae.errors import ConfigurationError

    monkeypatch.setenv(ROSTER_ENV, "parcae/startup/0/roster")
    options = types.SimpleNamespace(process_group_backend="gloo", timeout=timedelta(seconds=5), elastic=False)
    strategy = types.SimpleNamespace(elastic_runtime=None, cluster_environment=None, options=options)
    setup = ProcessSetup(strategy, options, StageLayout(StageState(), options, strategy, None),  # type: ignore[arg-type]
                         "pytorch_lightning")
    with pytest.raises(ConfigurationError, match=r"elastic=False\) under `parcae run --elastic`.*--restart-fallback"):
        setup.setup_environment()
