"""The generation one process is in (lightning_parcae.runtime.generation): the state the runtime owns and the
records that describe a generation."""

from __future__ import annotations

from types import SimpleNamespace

from torch import nn

from lightning_parcae.planning.migration_plan import Layout, plan_migration
from lightning_parcae.runtime.generation import GenerationRecords, GenerationState


def test_entering_a_record_sets_the_number_the_layout_and_the_record_together() -> None:
    state = GenerationState(member="b")
    assert state.generation == -1 and state.layout is None and not state.is_leader
    rec = {"generation": 7, "layout": Layout(("a", "b", "c", "d"), (2, 2)).to_json()}
    state.enter(rec)
    assert state.generation == 7 and state.record is rec and state.layout == Layout(("a", "b", "c", "d"), (2, 2))
    assert state.rank == 1 and not state.is_leader


def test_the_leader_watches_every_member_and_the_others_watch_the_leader() -> None:
    layout = Layout(("a", "b", "c"), (3,)).to_json()
    leader, other = GenerationState(member="a"), GenerationState(member="c")
    leader.enter({"generation": 0, "layout": layout})
    other.enter({"generation": 0, "layout": layout})
    assert leader.is_leader and leader.watch() == ["a", "b", "c"]
    assert other.watch() == ["a"]


def _stack() -> SimpleNamespace:
    full = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 3))  # 6 and 9 float32 parameters
    return SimpleNamespace(stack_path="net", layer_names=["0", "1"], layer_times=[0.5, 1.5],
                           optimizer_state_factor=2.0, full_stack=full)


def test_layers_are_priced_by_the_record_when_it_has_them_else_by_the_stack() -> None:
    """Every process prices moves by the sizes the record agreed (a joiner has not built its stack alike)."""
    stack = _stack()
    state = GenerationState(member="a")
    records = GenerationRecords(stack, state)  # type: ignore[arg-type]
    assert records.layer_bytes() == [3 * 6 * 4, 3 * 9 * 4]  # parameters + 2x optimizer state, float32
    state.enter({"generation": 0, "layout": Layout(("a",), (2,)).to_json(), "layer_bytes": [10, 20]})
    assert records.layer_bytes() == [10, 20]


def test_a_record_after_a_loss_names_only_the_survivors_in_its_transition() -> None:
    stack = _stack()
    state = GenerationState(member="a")
    old = Layout(("a", "b", "c"), (2,))
    state.enter({"generation": 2, "layout": old.to_json(), "layer_bytes": [10, 20]})
    records = GenerationRecords(stack, state)  # type: ignore[arg-type]
    plan = plan_migration(old, ["a", "c", "j"], (3, 1), [2], records.layer_bytes(), senders=["a", "c"])
    rec = records.record(3, plan.new, plan, plan.kind.value, 11, alive=["a", "c"], reason="recovery")
    assert rec["transition"] == ["a", "c", "j"] and rec["loop_from"] == "a" and rec["step"] == 11
    assert rec["layer_names"] == ["0", "1"] and rec["layer_times"] == [0.5, 1.5] and rec["layer_bytes"] == [10, 20]
    assert rec["D"] == 3 and rec["P"] == 1 and rec["reason"] == "recovery" and "plan" in rec
    first = records.record(0, old, None, "start", 0)
    assert "transition" not in first and first["kind"] == "start"


def test_a_fallback_record_keeps_the_current_layout_and_says_whether_to_save() -> None:
    state = GenerationState(member="a")
    state.enter({"generation": 4, "layout": Layout(("a", "b"), (1, 1)).to_json()})
    rec = GenerationRecords(_stack(), state).fallback(5, 30, "stage lost", checkpoint=True)  # type: ignore[arg-type]
    assert rec["generation"] == 5 and rec["kind"] == "fallback" and rec["checkpoint"] is True
    assert Layout.from_json(rec["layout"]) == state.layout


def test_the_embedding_and_head_are_priced_with_the_first_and_last_layer_they_ride_with() -> None:
    """Issue 22: the parts outside the stack move with layer 0 and the last layer, so the migration planner must
    price them there -- before, a repartition that moved the head (50k x 1.6k in GPT-1.5B) looked free."""
    module = nn.Module()
    module.emb = nn.Embedding(10, 2)  # 20 parameters
    module.head = nn.Linear(2, 5)  # 15 parameters
    stack = _stack()
    stack.lightning_module = module
    stack.outside_keys_of = lambda i: {0: ["emb.weight"], 1: ["head.weight", "head.bias", "emb.weight"]}[i]
    records = GenerationRecords(stack, GenerationState(member="a"))  # type: ignore[arg-type]
    assert records.layer_bytes() == [3 * (6 + 20) * 4, 3 * (9 + 15 + 20) * 4]  # a tied weight rides with both
