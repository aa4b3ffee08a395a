"""Recovery's choice of the survivors' generation when a loss overtakes a planned one."""

from __future__ import annotations

import types
from typing import Any

import torch.distributed as dist

from lightning_parcae.planning.migration_plan import Layout
from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.recovery import Recovery

OLD = ("i0", "i1", "i2", "i3", "i4", "i5")


def _recovery(store: dist.Store, events: list[tuple[str, dict[str, Any]]]) -> Recovery:
    """A Recovery over just enough of a runtime: generation 0 of six members at 2x3, the shape chooser fixed."""
    layout = Layout(OLD, (2, 2, 2))

    def record(generation: int, layout: Layout, plan: Any, kind: str, step: int, alive: Any = None,
               **extra: Any) -> dict[str, Any]:
        transition = [m for m in OLD if alive is None or m in alive]
        transition += [m for m in layout.members if m not in transition]
        return {"generation": generation, "kind": kind, "step": step, "transition": transition,
                "layout": layout.to_json(), **extra}

    chooser = types.SimpleNamespace(choose=lambda n_old, n_alive, observe: (1, 3),
                                    partition_for=lambda p: (2, 2, 2))
    rt = types.SimpleNamespace(store=store, coord=Coordinator(store), layout=layout, generation=0, member="i0",
                               chooser=chooser, _record=record, _layer_bytes=lambda: [1] * 6,
                               event=lambda name, **f: events.append((name, f)))
    return Recovery(rt)


def _planned(coord: Coordinator, members: list[str]) -> dict[str, Any]:
    """The leader's interval decision for generation 1 (no ``dead`` field: it was not made by survivors)."""
    return coord.propose({"generation": 1, "kind": "repartition", "step": 4, "transition": members,
                          "reason": "interval"})


def test_survivors_skip_a_planned_generation_that_names_a_dead_member() -> None:
    """Regression (chaos seed 44): i1 was SIGKILLed at the step where the leader had just proposed the interval's
    generation 1 with all six members in it. The five survivors adopted that record, waited 15 s for i1's
    process-group key and fell back to the checkpoint although every stage had a live replica. The planned record
    is now abandoned (one verdict in the store) and the survivors' generation takes number 2."""
    store = dist.HashStore()
    events: list[tuple[str, dict[str, Any]]] = []
    rec_a, rec_b = _recovery(store, events), _recovery(store, events)
    _planned(rec_a.rt.coord, list(OLD))
    alive, dead = ["i0", "i2", "i3", "i4", "i5"], ["i1"]
    first = rec_a._survivors_generation(1, 4, alive, dead, "peer lost")
    assert first["generation"] == 1 and "dead" not in first  # the planned record is what generation 1 holds
    assert rec_a.abandoned(first, dead)
    ours = rec_a._survivors_generation(2, 4, alive, dead, "peer lost")
    assert ours["generation"] == 2 and ours["transition"] == alive and ours["dead"] == dead
    # a second survivor reaches the same verdict and the same generation 2
    assert rec_b.abandoned(rec_b._survivors_generation(1, 4, alive, dead, "peer lost"), dead)
    assert rec_b._survivors_generation(2, 4, alive, dead, "peer lost") == ours


def test_survivors_obey_the_first_verdict_if_their_views_of_the_dead_differ() -> None:
    """One survivor waited out a silent member (i3, SIGSTOPped) that another then saw announce itself: the first
    verdict in the store holds for both, so they never enter different generations."""
    store = dist.HashStore()
    events: list[tuple[str, dict[str, Any]]] = []
    keeper, waiter = _recovery(store, events), _recovery(store, events)
    planned = _planned(keeper.rt.coord, list(OLD))
    assert not keeper.abandoned(planned, dead=[])  # saw everyone in the planned record alive: "keep"
    assert not waiter.abandoned(planned, dead=["i3"])  # would abandon, but the verdict is taken


def test_survivors_adopt_a_record_made_by_survivors_or_a_fallback_as_it_is() -> None:
    """Only a planned record can be abandoned: a survivors' record (it names the dead) and a fallback bind all."""
    store = dist.HashStore()
    rec = _recovery(store, [])
    survivors = {"generation": 1, "kind": "intra-stage", "transition": ["i0", "i2"], "dead": ["i1"]}
    fallback = {"generation": 1, "kind": "fallback", "reason": "stage lost"}
    assert not rec.abandoned(survivors, dead=["i1", "i2"])
    assert not rec.abandoned(fallback, dead=["i1"])
    assert not store.check([Coordinator.verdict_key(1)])  # no verdict was needed


def test_survivors_propose_a_fallback_at_the_target_generation_if_no_shape_fits() -> None:
    store = dist.HashStore()
    rec = _recovery(store, [])
    rec.rt.chooser.choose = lambda n_old, n_alive, observe: None
    out = rec._survivors_generation(2, 4, ["i0"], ["i1", "i2", "i3", "i4", "i5"], "peer lost")
    assert out["generation"] == 2 and out["kind"] == "fallback" and "no shape fits 1" in out["reason"]
