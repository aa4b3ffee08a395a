"""Entering the next generation in place (lightning_parcae.runtime.switching.Switch), over typed fakes: the training
host, the transition world and the transfer are replaced, the runtime's state objects are real."""

from __future__ import annotations

import types
from datetime import timedelta
from typing import Any, Optional

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_parcae.contract import RELEASED_EXIT
from lightning_parcae.planning.migration_plan import Layout, plan_migration
from lightning_parcae.runtime import switching
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.generation import GenerationRecords, GenerationState
from lightning_parcae.runtime.lifecycle import Lifecycle, Phase
from lightning_parcae.runtime.liveness import Liveness
from lightning_parcae.runtime.part import PartContext
from lightning_parcae.runtime.switching import GenerationNotEntered, Moved, Switch


class _Exit(Exception):
    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


class _Groups:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def destroy(self) -> None:
        self.calls.append("destroy")

    def abandon(self) -> list[Any]:
        self.calls.append("abandon")
        return ["old groups"]


class _Host:
    """The training side as the switch uses it: a two-layer stack ``net.0``, ``net.1`` and the layout it installs."""

    def __init__(self) -> None:
        self.lightning_module = nn.Module()
        self.lightning_module.net = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
        self.optimizers = [torch.optim.SGD(self.lightning_module.parameters(), lr=0.1)]
        self.groups: Optional[_Groups] = _Groups()
        self.layer_names = ["0", "1"]
        self.layer_times = [1.0, 1.0]
        self.stack_path = "net"
        self.optimizer_state_factor = 2.0
        self.full_stack = self.lightning_module.net
        self.applied: list[tuple[Any, ...]] = []
        self.eval_resets = 0
        self.fail_apply: Optional[str] = None

    def torch_optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.optimizers)

    def layer_key(self, name: str) -> str:
        return f"net.{name}"

    def outside_keys_of(self, index: int) -> list[str]:
        return []  # nothing outside the stack

    def apply_layout(self, trainer: Any, layout: Layout, generation: int, received: Any, group_of: Any) -> None:
        if self.fail_apply:
            if self.fail_apply.startswith("lost:"):  # a peer lost while the new groups were built
                from lightning_parcae.errors import PeerLostError

                raise PeerLostError(self.fail_apply)
            raise RuntimeError(self.fail_apply)
        self.applied.append((layout, generation, dict(received), group_of))

    def reset_eval_loaders(self, trainer: Any) -> None:
        self.eval_resets += 1


class _World:
    """The transition world and the transfer: records what was sent, hands out what was 'received'."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, inbox: Optional[dict[int, Any]] = None,
                 fail_meet: Optional[str] = None) -> None:
        self.met: list[tuple[str, int]] = []
        self.sent: dict[int, Any] = {}
        self.received_from: list[int] = []
        self.destroyed = 0
        self.inbox = inbox or {}

        def meet(store: Any, rec: dict[str, Any], member: str, bound: Any, aborted: Any) -> None:
            if fail_meet:
                raise RuntimeError(fail_meet)
            self.met.append((member, int(rec["generation"])))

        def exchange(sends: dict[int, Any], srcs: list[int], what: str) -> dict[int, Any]:
            self.sent, self.received_from = dict(sends), list(srcs)
            return self.inbox

        def destroy() -> None:
            self.destroyed += 1

        monkeypatch.setattr(switching, "meet_transition", meet)
        monkeypatch.setattr(switching, "exchange", exchange)
        monkeypatch.setattr(switching, "dist", types.SimpleNamespace(destroy_process_group=destroy))
        monkeypatch.setattr(switching, "exit_now", lambda code: (_ for _ in ()).throw(_Exit(code)))
        monkeypatch.setattr(switching, "exit_without_destructors_at_shutdown", lambda: None)


def _setup(member: str, old: Layout, events: list) -> tuple[Switch, _Host, GenerationState, PartContext]:
    store = dist.HashStore()
    state = GenerationState(member=member)
    state.enter({"generation": 3, "layout": old.to_json(), "layer_bytes": [100, 100]})
    state.group_of = [{"net.0.weight": 0}]
    ctx = PartContext(member=member, store=store, coord=Coordinator(store), live=Liveness(lambda: store, member),
                      life=Lifecycle(member), event=lambda name, **f: events.append((name, f)))
    ctx.life.to(Phase.MIGRATING)  # the runtime enters MIGRATING before it calls the switch
    host = _Host()
    return Switch(ctx, host, state, timedelta(seconds=5)), host, state, ctx  # type: ignore[arg-type]


def _rec(host: _Host, state: GenerationState, avail: list[str], shape: tuple[int, int]) -> dict[str, Any]:
    assert state.layout is not None
    records = GenerationRecords(host, state)  # type: ignore[arg-type]
    plan = plan_migration(state.layout, avail, shape, [2] if shape[1] == 1 else [1, 1], records.layer_bytes(),
                          senders=list(state.layout.members))
    return records.record(4, plan.new, plan, plan.kind.value, 9, reason="test")


def test_the_old_groups_are_destroyed_after_a_plan_and_abandoned_after_a_failure(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _World(monkeypatch)
    sw, host, _, ctx = _setup("a", Layout(("a",), (2,)), [])
    groups = host.groups
    assert groups is not None
    sw.teardown_groups()
    sw.teardown_groups(failed=True)
    assert groups.calls == ["destroy", "abandon"]
    host.groups = None
    sw.teardown_groups(failed=True)  # nothing to leave: no error
    assert groups.calls == ["destroy", "abandon"]


def test_the_leader_sends_the_joiners_layers_and_the_loop_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """a holds both layers and admits j at 2x1: it sends j every layer and the loop state, receives nothing,
    installs the new layout with the agreed parameter-group map and rebuilds the validation loader."""
    world = _World(monkeypatch)
    sw, host, state, ctx = _setup("a", Layout(("a",), (2,)), [])
    rec = _rec(host, state, ["a", "j"], (2, 1))
    assert rec["transition"] == rec["movers"] == ["a", "j"] and sw.hands_loop_state(rec)
    moved = sw.switch(types.SimpleNamespace(global_step=9), rec, loop={"epoch": 0})
    assert world.met == [("a", 4)] and world.destroyed == 1
    assert set(world.sent) == {1} and world.sent[1]["loop"] == {"epoch": 0}
    assert sorted(world.sent[1]["layers"]) == [0, 1]
    assert set(world.sent[1]["layers"][0]["tensors"]) == {"net.0.weight", "net.0.bias"}
    assert world.received_from == []
    (layout, generation, received, group_of), = host.applied
    assert layout.members == ("a", "j") and generation == 4 and received == {} and group_of == state.group_of
    assert host.eval_resets == 1
    assert isinstance(moved, Moved) and moved.joiners == ["j"] and moved.bytes_received == 0
    report = moved.report(rec, 0.5, 9)
    assert report["D"] == 2 and report["N"] == 2 and report["joiners"] == ["j"] and report["duration_s"] == 0.5
    # the switch reads the generation; entering the new one is the runtime's
    assert state.generation == 3


def test_a_process_that_is_not_loop_from_sends_no_loop_state(monkeypatch: pytest.MonkeyPatch) -> None:
    _World(monkeypatch)
    sw, host, state, _ = _setup("b", Layout(("a", "b"), (2,)), [])
    rec = _rec(host, state, ["a", "b", "j"], (3, 1))
    assert rec["loop_from"] == "a" and not sw.hands_loop_state(rec)


@pytest.mark.parametrize("noticed, code", [(True, 0), (False, RELEASED_EXIT)])
def test_a_member_the_new_generation_leaves_out_exits_after_sending(monkeypatch: pytest.MonkeyPatch, noticed: bool,
                                                                    code: int) -> None:
    world = _World(monkeypatch)
    events: list = []
    sw, host, state, ctx = _setup("b", Layout(("a", "b"), (2,)), events)
    if noticed:
        ctx.live.noticed.set()
    rec = _rec(host, state, ["a"], (1, 1))
    with pytest.raises(_Exit) as exc:
        sw.switch(types.SimpleNamespace(global_step=9), rec, loop=None)
    # a holds every layer already: b has nothing to send and leaves without meeting a transition world
    assert rec["transition"] == ["a", "b"] and rec["movers"] == [] and world.met == []
    assert exc.value.code == code and world.destroyed == 0 and host.applied == []
    assert events[-1][0] == "left" and events[-1][1]["reason"] == ("notice" if noticed else "released")
    assert ctx.life.phase == Phase.FENCED


def test_a_leaver_that_holds_a_stage_sends_it_before_it_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    """b holds layer 1 of a 1x2 job and leaves for 1x1 on a: it meets the transition world, sends layer 1 to a,
    and only then exits; a meets it and receives from it."""
    world = _World(monkeypatch)
    sw, host, state, ctx = _setup("b", Layout(("a", "b"), (1, 1)), [])
    ctx.live.noticed.set()
    rec = _rec(host, state, ["a"], (1, 1))
    assert rec["movers"] == ["a", "b"]
    with pytest.raises(_Exit):
        sw.switch(types.SimpleNamespace(global_step=9), rec, loop=None)
    assert world.met == [("b", 4)] and world.destroyed == 1 and sorted(world.sent[0]["layers"]) == [1]


def test_an_intra_stage_change_that_moves_nothing_meets_no_transition_world(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 21, bench_scale N=16): a notice to one member of an 8x2 job meant a transition world of
    all 16 old members, the leaver included, for a change that moves 0 bytes; the leaver's grace ran out before
    four late members arrived, and the job fell back to a restart. The members that stay rebuild their groups
    directly, watching the new generation's members meanwhile."""
    world = _World(monkeypatch)
    sw, host, state, ctx = _setup("a", Layout(("a", "b", "c"), (2,)), [])
    rec = _rec(host, state, ["a", "b"], (2, 1))
    assert rec["transition"] == ["a", "b", "c"] and rec["movers"] == [] and rec["loop_from"] is None
    assert rec["bytes_moved"] == 0
    sw.switch(types.SimpleNamespace(global_step=9), rec, loop=None)
    assert world.met == [] and world.destroyed == 0
    (layout, generation, received, _), = host.applied
    assert layout.members == ("a", "b") and generation == 4 and received == {}
    assert ctx.live.generation == 4 and "b" in ctx.live._watch


@pytest.mark.parametrize("where, intact", [("rendezvous", True), ("apply", False), ("apply-lost", True)])
def test_a_generation_that_cannot_form_raises_saying_whether_the_old_state_is_intact(
        monkeypatch: pytest.MonkeyPatch, where: str, intact: bool) -> None:
    """A failed transition world or rebuild is not the job's end: the switch says so, and whether this process
    still holds exactly its old state -- a lost peer while the processes met, or while the new groups were built,
    leaves it intact (an old member then recovers with the survivors); any other failure of the rebuild may have
    installed part of the new layout (the runtime falls back to the checkpoint)."""
    _World(monkeypatch, fail_meet="Connection closed by peer" if where == "rendezvous" else None)
    events: list = []
    sw, host, state, _ = _setup("a", Layout(("a",), (2,)), events)
    if where == "apply":
        host.fail_apply = "new_group timed out"
    elif where == "apply-lost":
        host.fail_apply = "lost: j missed heartbeats for 3.1 s"
    rec = _rec(host, state, ["a", "j"], (2, 1))
    with pytest.raises(GenerationNotEntered) as exc:
        sw.switch(types.SimpleNamespace(global_step=9), rec, loop=None)
    assert "process groups of generation 4 could not be built" in exc.value.reason
    assert exc.value.intact is intact
    assert events == [("rendezvous_failed", {"reason": exc.value.reason, "intact": intact})]
