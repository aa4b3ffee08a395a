"""Admission of a new process (lightning_parcae.runtime.joining.Admission) over typed fakes: the transition world
and the transfer are replaced; the store, coordinator, liveness, lifecycle and generation state are real."""

from __future__ import annotations

import types
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_parcae.errors import ConfigurationError
from lightning_parcae.planning.migration_plan import Layout, plan_migration
from lightning_parcae.runtime import joining
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.generation import GenerationState
from lightning_parcae.runtime.joining import Admission, Admitted
from lightning_parcae.runtime.lifecycle import Lifecycle, Phase
from lightning_parcae.runtime.liveness import Liveness, activate
from lightning_parcae.runtime.part import PartContext


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _Host:
    """What admission uses of the training side: the loop checkpoint, stage keys, the data cursor, eval loaders."""

    def __init__(self) -> None:
        self.eval_resets = 0

    def loop_checkpoint(self, trainer: Any) -> dict[str, Any]:
        return {"global_step": 9, "state_dict": {"net.0.weight": torch.ones(1), "head.weight": torch.zeros(1)},
                "optimizer_states": [{"state": {"net.0.weight": {"m": 1}, "head.weight": {"m": 2}}}]}

    def stage_key_set(self) -> set[str]:
        return {"net.0.weight"}

    def is_stage_key(self, key: str) -> bool:
        return key.startswith("net.")

    def data_state(self) -> dict[str, Any]:
        return {"epoch": 0, "consumed": 96}

    def reset_eval_loaders(self, trainer: Any) -> None:
        self.eval_resets += 1


@pytest.fixture
def fake_world(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    seen: dict[str, Any] = {"inbox": {0: {"layers": {1: {"tensors": {"net.1.weight": torch.ones(1)},
                                                         "optim": [{"net.1.weight": {"m": 3}}]}},
                                          "loop": {"global_step": 9, "state_dict": {"head.weight": torch.zeros(1)},
                                                   "optimizer_states": [{"state": {"head.weight": {"m": 2}}}]}}}}

    def meet(store: Any, rec: dict[str, Any], member: str, bound: Any, aborted: Any) -> None:
        seen["met"] = (member, int(rec["generation"]))

    def exchange(sends: dict[int, Any], srcs: list[int], what: str) -> dict[int, Any]:
        seen["srcs"] = list(srcs)
        return seen["inbox"]

    monkeypatch.setattr(joining, "meet_transition", meet)
    monkeypatch.setattr(joining, "exchange", exchange)
    monkeypatch.setattr(joining, "dist", types.SimpleNamespace(destroy_process_group=lambda: None))
    monkeypatch.setattr(joining, "exit_now", lambda code: (_ for _ in ()).throw(_Exit(code)))
    yield seen
    activate(None)


def _admission(member: str, events: list) -> tuple[Admission, PartContext, _Host, GenerationState]:
    store = dist.HashStore()
    live = Liveness(lambda: store, member, interval_s=0.05)
    ctx = PartContext(member=member, store=store, coord=Coordinator(store), live=live, life=Lifecycle(member),
                      event=lambda name, **f: events.append((name, f)))
    state, host = GenerationState(member=member), _Host()
    return Admission(ctx, state, host, timedelta(seconds=5)), ctx, host, state  # type: ignore[arg-type]


def _admitting_record(coord: Coordinator) -> dict[str, Any]:
    old = Layout(("a",), (2,))
    plan = plan_migration(old, ["a", "j"], (1, 2), [1, 1], [10, 10], senders=["a"])
    rec = {"generation": 5, "kind": plan.kind.value, "layout": plan.new.to_json(), "plan": plan.to_json(),
           "transition": ["a", "j"], "loop_from": "a"}
    coord.propose(rec)
    coord.set_current(4)
    coord.put("parcae/pgroups", {"map": [{"net.0.weight": 0}]})
    return rec


def test_a_standby_returns_the_generation_that_admits_it_and_keeps_what_it_received(
        fake_world: dict[str, Any]) -> None:
    events: list = []
    adm, ctx, _, state = _admission("j", events)
    rec = _admitting_record(ctx.coord)
    try:
        admitted = adm.join_wait()
    finally:
        ctx.live.stop()
    assert isinstance(admitted, Admitted) and admitted.record == rec
    assert admitted.group_of == [{"net.0.weight": 0}] and admitted.transfer_s >= 0.0
    assert fake_world["met"] == ("j", 5) and fake_world["srcs"] == [0]  # layers and loop state from a
    assert ctx.coord.standbys() == ["j"] and ctx.life.phase == Phase.MIGRATING
    assert state.generation == -1  # the runtime enters the generation, not the part
    ckpt = adm.joiner_checkpoint()
    assert set(ckpt["state_dict"]) == {"head.weight", "net.1.weight"}
    assert ckpt["optimizer_states"][0]["state"] == {"head.weight": {"m": 2}, "net.1.weight": {"m": 3}}


@pytest.mark.parametrize("why", ["notice", "job finished"])
def test_a_standby_leaves_with_status_0_if_noticed_or_the_job_finished(fake_world: dict[str, Any], why: str) -> None:
    events: list = []
    adm, ctx, _, _ = _admission("j", events)
    if why == "notice":
        ctx.live.noticed.set()
    else:
        ctx.store.set("parcae/finished", "3")
    with pytest.raises(_Exit) as exc:
        adm.join_wait()
    assert exc.value.code == 0 and ctx.life.phase == Phase.STOPPED
    assert ("standby_exit", {"reason": why}) in events


def test_a_joiner_without_loop_state_refuses_to_restore() -> None:
    adm, _, _, _ = _admission("j", [])
    adm.inbox = {0: {"layers": {}}}
    with pytest.raises(ConfigurationError, match="no loop state"):
        adm.joiner_checkpoint()


def test_the_loop_state_leaves_out_every_layer_of_the_stack() -> None:
    """The joiner receives its layers from their holders; the loop state carries only what is replicated."""
    adm, _, _, _ = _admission("a", [])
    loop = adm.loop_state(types.SimpleNamespace(global_step=9))
    assert set(loop["state_dict"]) == {"head.weight"}
    assert loop["optimizer_states"][0]["state"] == {"head.weight": {"m": 2}}
    assert loop["parcae"]["data"] == {"epoch": 0, "consumed": 96}


def test_a_joined_process_watches_its_leader_and_rebuilds_its_eval_loaders(fake_world: dict[str, Any]) -> None:
    events: list = []
    adm, ctx, host, state = _admission("j", events)
    state.enter({"generation": 5, "layout": Layout(("a", "j"), (1, 1)).to_json()})
    ctx.life.to(Phase.MIGRATING)
    adm.joined(types.SimpleNamespace(global_step=9), transfer_s=0.25)
    assert ctx.life.phase == Phase.TRAINING and host.eval_resets == 1
    assert ("joined", {"step": 9, "D": 1, "P": 2, "transfer_s": 0.25}) in events


def test_a_standby_takes_only_a_generation_that_makes_it_a_member_not_one_it_left() -> None:
    """Regression (issue 20's network-namespace test): ``parcae agent`` restarted a released worker as a standby
    under the same member id; the standby found that id in the transition of the generation that had released it
    (it sent its layers there before leaving), took it for its admission and crashed on ``loop_from`` (exit 1)."""
    released = {"generation": 3, "transition": ["a", "b", "c"], "loop_from": None,
                "layout": Layout(("a", "b"), (2,)).to_json()}
    assert not joining.admits(released, "c")
    admitted = {"generation": 4, "transition": ["a", "b", "c"], "loop_from": "a",
                "layout": Layout(("a", "b", "c"), (2,)).to_json()}
    assert joining.admits(admitted, "c") and not joining.admits(admitted, "d")
    assert not joining.admits({"generation": 5, "kind": "fallback", "reason": "stage lost"}, "c")
