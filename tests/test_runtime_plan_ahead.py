"""Planning while the job trains (lightning_parcae.runtime.plan_ahead): the leader's interval decision on a thread.

The transparency test: a decision answered on the thread and published one step later is the decision the leader
takes at the boundary, with that later step. The contract's other clauses each have a test: no store on the
thread, a generation change drops the answer, a boundary that admits no one keeps it, the thread's exception
reaches the training thread; and the runtime's step boundary starts, joins and publishes it (or decides at the
boundary with ``plan_ahead=False``)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, Optional

import pytest
import torch.distributed as dist

from lightning_parcae.runtime.coordinator import Coordinator
from lightning_parcae.runtime.generation import GenerationRecords
from lightning_parcae.runtime.plan_ahead import PLAN_SWITCH_S, PlanAhead
from lightning_parcae.runtime.shape_choice import Question, ShapeChooser

from test_runtime_shape_choice import _config, _host, _state


class _MainThreadStore:
    """A store client that fails any call made off the thread that created it (the runtime's rule: a thread
    never shares the main thread's store connection)."""

    def __init__(self, inner: dist.Store) -> None:
        self._inner, self._owner, self.calls_off_thread = inner, threading.current_thread(), []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)

        def call(*args: Any, **kw: Any) -> Any:
            if threading.current_thread() is not self._owner:
                self.calls_off_thread.append(name)
                raise AssertionError(f"store.{name} called on {threading.current_thread().name}")
            return attr(*args, **kw)

        return call


def _leader(events: list, store: Any, faster: float = 0.3) -> ShapeChooser:
    """The leader of 1x4 on four members, 2x2 measured ``faster`` (so an interval's decision moves)."""
    host = _host([0.0116] + [0.048] * 8 + [0.03], max_stage_memory_bytes=2.5e5)
    state = _state(("a", "b", "c", "d"), (3, 3, 2, 2), 10)
    ch = ShapeChooser(host, state, _config(look_ahead=12, interval_s=2.0, max_instances=4),  # type: ignore[arg-type]
                      GenerationRecords(host, state), coord=Coordinator(store), store=store,  # type: ignore[arg-type]
                      event=lambda name, **kw: events.append((name, kw)), clock=lambda: 100.0)
    model = ch.model()
    assert model is not None
    for _ in range(10):
        model.record(1, 4, model.prior.step_ms(1, 4))
        model.record(2, 2, model.prior.step_ms(1, 4) / (1.0 + faster))
    return ch


def _without_time(rec: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    return None if rec is None else {k: v for k, v in rec.items() if k != "time"}


@pytest.mark.parametrize("faster", [0.3, 0.06, 0.01])
def test_a_decision_planned_ahead_is_the_boundarys_decision_published_one_step_later(faster: float) -> None:
    """Same inputs, same state: the record proposed from the thread's answer at step 8 equals the record the
    leader proposes when it decides at step 8's boundary -- a move (30 %, 6 % faster) or none (1 %)."""
    at_boundary: list = []
    sync = _leader(at_boundary, dist.HashStore(), faster)
    expected = sync.decide(SimpleNamespace(global_step=8), reason="interval", leaving=())

    ahead_events: list = []
    store = _MainThreadStore(dist.HashStore())
    ch = _leader(ahead_events, store, faster)
    plan = PlanAhead(ch, lambda name, **kw: ahead_events.append((name, kw)))
    plan.start(ch.gather("interval", ()), step=7)
    assert plan.running and plan.pending
    plan.join()
    question = plan.take(8, generation=0)
    assert question is not None and question.ahead_steps == 1 and question.spent_s > 0
    got = ch.publish(SimpleNamespace(global_step=8), question)
    assert store.calls_off_thread == []
    assert (expected is None) == (faster < 0.03), expected
    assert _without_time(got) == _without_time(expected)
    assert ch.coord is not None and ch.coord.history() == sync.coord.history() == [4]  # type: ignore[union-attr]
    names = [n for n, _ in ahead_events]
    assert names == [n for n, _ in at_boundary]
    if expected is not None:
        decision = dict(ahead_events)["decision"]
        assert decision["chosen"] == [expected["D"], expected["P"]] and decision["planned_ahead_steps"] == 1


def test_an_answer_asked_in_an_older_generation_is_dropped_with_an_event() -> None:
    """A notice or a loss changed the generation while the thread chose: its answer is for members that are
    gone and is never published."""
    events: list = []
    ch = _leader(events, dist.HashStore())
    plan = PlanAhead(ch, lambda name, **kw: events.append((name, kw)))
    plan.start(ch.gather("interval", ()), step=3)
    plan.join()
    assert plan.take(4, generation=1) is None and not plan.pending
    dropped = [kw for name, kw in events if name == "plan_dropped"]
    assert dropped == [{"reason": "interval", "asked_in": 0, "now": 1, "why": "the generation changed"}]


def test_a_question_whose_generation_changed_before_its_boundary_ended_is_never_answered() -> None:
    """A notice agreed at the boundary that asked: the switch happens before the thread would start."""
    events: list = []
    ch = _leader(events, dist.HashStore())
    plan = PlanAhead(ch, lambda name, **kw: events.append((name, kw)))
    plan.ask(ch.gather("interval", ()), step=3)
    plan.go(generation=1)
    assert not plan.running and not plan.pending
    assert [name for name, _ in events] == ["plan_dropped"]


def test_an_answer_kept_at_a_boundary_that_admits_no_one_counts_the_steps_until_published() -> None:
    events: list = []
    ch = _leader(events, dist.HashStore())
    plan = PlanAhead(ch, lambda name, **kw: events.append((name, kw)))
    plan.start(ch.gather("interval", ()), step=3)
    plan.join()
    q = plan.take(4, generation=0)
    assert q is not None
    plan.keep(q)  # a validation follows step 4
    assert plan.pending and not plan.running
    again = plan.take(6, generation=0)
    assert again is q and again.ahead_steps == 3
    plan.keep(again)
    with pytest.raises(RuntimeError, match="still pending"):
        plan.start(q, 6)  # one question at a time


def test_the_threads_exception_is_raised_at_the_join_on_the_training_thread() -> None:
    class Broken:
        def choose_for(self, question: Question) -> None:
            raise ValueError("planning bug")

    plan = PlanAhead(Broken(), lambda name, **kw: None)  # type: ignore[arg-type]
    plan.start(Question("interval", [], [], ["a"], 1, 0), step=1)
    with pytest.raises(ValueError, match="planning bug"):
        plan.join()
    assert not plan.pending and not plan.running


def test_the_switch_interval_is_short_while_the_thread_decides_and_restored_at_the_join() -> None:
    """Regression (stop 57, hl_15_25 at 10 Gbps): the decision holds the interpreter lock; at the default 5 ms
    switch interval the leader's training thread queued behind it at every op, and the job ran its shape 2-4 %
    slower than live-reactive's with the same moves."""
    import sys

    seen: list = []

    class Probe:
        def choose_for(self, question: Question) -> None:
            seen.append(sys.getswitchinterval())

    before = sys.getswitchinterval()
    assert before > PLAN_SWITCH_S
    plan = PlanAhead(Probe(), lambda name, **kw: None)  # type: ignore[arg-type]
    plan.start(Question("interval", [], [], ["a"], 1, 0), step=1)
    plan.join()
    assert seen == [pytest.approx(PLAN_SWITCH_S)] and sys.getswitchinterval() == pytest.approx(before)


def test_drop_joins_the_thread_and_forgets_the_question() -> None:
    release = threading.Event()
    answered: list = []

    class Slow:
        def choose_for(self, question: Question) -> None:
            release.wait(5)
            answered.append(question)

    events: list = []
    plan = PlanAhead(Slow(), lambda name, **kw: events.append((name, kw)))  # type: ignore[arg-type]
    plan.start(Question("interval", [], [], ["a"], 1, 0), step=1)
    threading.Timer(0.05, release.set).start()
    plan.drop("a preemption notice is decided at its boundary")
    assert answered and not plan.pending and not plan.running
    assert events == [("plan_dropped", {"reason": "interval", "asked_in": 0,
                                        "why": "a preemption notice is decided at its boundary"})]


# ------------------------------------------------------------------------------------------ the runtime's boundary
class _Recorder:
    """The chooser's three steps, recorded (what the runtime's step boundary calls, and when)."""

    def __init__(self, er: Any, choose_s: float = 0.0) -> None:
        self.calls: list = []
        self.choose_s = choose_s
        self.threads: list = []
        ch = er.chooser
        ch.gather = self.gather
        ch.choose_for = self.choose_for
        ch.publish = self.publish
        ch.decide = self.decide

    def gather(self, reason: str, leaving: Any, admit: bool = True) -> Question:
        self.calls.append(("gather", reason))
        return Question(reason, [], [], ["a", "b"], 2, 4)

    def choose_for(self, question: Question) -> None:
        self.threads.append(threading.current_thread().name)
        time.sleep(self.choose_s)
        question.shape = (2, 1)

    def publish(self, trainer: Any, question: Question) -> dict[str, Any]:
        self.calls.append(("publish", trainer.global_step, question.ahead_steps))
        return {"generation": 5}

    def decide(self, trainer: Any, reason: str, leaving: Any, admit: bool = True) -> dict[str, Any]:
        self.calls.append(("decide", trainer.global_step, reason))
        return {"generation": 5}


def _leading_runtime(plan_ahead: bool) -> Any:
    from dataclasses import replace

    from test_runtime_elastic_units import _runtime

    er = _runtime(dist.HashStore(), "a", ("a", "b"))
    er.config = replace(er.config, plan_ahead=plan_ahead)
    er._clock.interval_s, er._clock.interval_steps = 0.0, 1  # an interval is due at every step
    from lightning_parcae.runtime.lifecycle import Phase

    er.life.to(Phase.TRAINING)
    return er


@pytest.mark.parametrize("admit_next", [True, False])
def test_the_boundary_starts_the_decision_on_a_thread_and_publishes_it_at_the_next(admit_next: bool) -> None:
    """Step 7's boundary gathers and starts the thread and proposes nothing; step 8's joins it and proposes its
    answer with step 8 -- or, where step 8 admits no one, keeps it for step 9. No new interval is asked for
    while one is pending."""
    er = _leading_runtime(plan_ahead=True)
    rec = _Recorder(er, choose_s=0.05)
    assert er._plan(SimpleNamespace(global_step=7), 7, admit=True) == 0
    assert rec.calls == [("gather", "interval")] and er.ahead.pending and not er.ahead.running
    er.ahead.go(er.generation)  # the end of step 7's boundary, after its timing mark
    assert er.ahead.running
    er._join_plan()
    assert rec.threads == ["parcae-plan-ahead"] and er.ahead.waited_s > 0
    if admit_next:
        assert er._plan(SimpleNamespace(global_step=8), 8, admit=True) == 5
        assert rec.calls[1:] == [("publish", 8, 1)]
    else:
        assert er._plan(SimpleNamespace(global_step=8), 8, admit=False) == 0
        assert er._plan(SimpleNamespace(global_step=9), 9, admit=True) == 5
        assert rec.calls[1:] == [("publish", 9, 2)]
    assert not er.ahead.pending


def test_without_plan_ahead_the_boundary_decides_while_every_member_waits() -> None:
    er = _leading_runtime(plan_ahead=False)
    rec = _Recorder(er)
    assert er._plan(SimpleNamespace(global_step=7), 7, admit=True) == 5
    assert rec.calls == [("decide", 7, "interval")] and not er.ahead.pending and rec.threads == []


def test_a_recovery_drops_the_decision_planned_ahead() -> None:
    """The survivors' shape is chosen by the recovery, on the same chooser: the thread is joined and its answer
    (for the lost generation's members) forgotten before it."""
    from test_runtime_elastic_units import _FakeRecovery, _FakeSwitch, _Trainer

    er = _leading_runtime(plan_ahead=True)
    rec = _Recorder(er, choose_s=0.05)
    calls: list = []
    er.switching, er.recovery = _FakeSwitch(calls), _FakeRecovery(calls)
    er._plan(SimpleNamespace(global_step=7), 7, admit=True)
    er.ahead.go(er.generation)
    from lightning_parcae.runtime.lifecycle import Phase

    er.life.to(Phase.PLANNING)  # step 8's agreement failed (the real Recovery.begin moves to recovering)
    er.recover(_Trainer(8))
    assert not er.ahead.pending and not er.ahead.running and rec.threads == ["parcae-plan-ahead"]
    assert calls[0] == ("begin",)
