"""Planning while the job trains: the leader's interval decision, taken off the step boundary.

Problem: every member waits in the step boundary's agreement while the leader decides. At 32 instances one decision
takes the leader 0.06-1 s (the liveput DP over the forecast's scenarios, the migration price of every candidate);
in the GPT-1.5B replay of hh_55_65 (issue 21, stop 56) the leader's 42 planning phases summed 6.2 s, each a stall of
the whole job -- and live-reactive, which runs no DP, paid almost none of it: a handicap of the policy that plans.

A planning interval's decision needs nothing that the next step changes. Who is there is read at the boundary
(:meth:`~.shape_choice.ShapeChooser.gather`: heartbeats, history -- the store); the choice reads and writes only the
chooser's own planning state (:meth:`~.shape_choice.ShapeChooser.choose_for`); the proposal is written at the next
boundary (:meth:`~.shape_choice.ShapeChooser.publish`), with that boundary's step. So the choice runs on a thread
during the next step, and the job stalls only for what is left of it when that step ends.

Contract (:class:`PlanAhead`):

- Only a planning interval's or an arrival's decision runs ahead. A notice's is taken at its boundary (its leavers
  go soon), a loss's in recovery, the batch split before the first step.
- The thread touches no store client and no process group (the main thread's store connection is not shared, as
  the heartbeat thread's is not: :mod:`.liveness`); it writes events, one ``write`` each.
- The thread starts at the end of its boundary, after the boundary's own work on the chooser (the next step's
  timing mark), and the next step boundary joins it before anything reads or changes the chooser's state: the
  step that just ended is timed before the join and recorded after it. The chooser is never used by two threads.
- Its answer is published at the first boundary that admits standbys, in the generation it was asked in. A
  generation change meanwhile (a notice, a loss) drops it (event ``plan_dropped``); the next interval asks again.
  A standby lost between the question and the switch is a joiner lost in the switch, as when the leader decides at
  the boundary.
- The answer is one step late: a shape the decision chose starts one step later than a decision at the boundary
  would start it. That step runs in the old shape, which the sync path stalls instead.
- While the thread decides, the interpreter's switch interval is :data:`PLAN_SWITCH_S` (0.5 ms): the decision
  holds the interpreter lock, and at the default 5 ms the training thread queued behind it at every op.
- An exception on the thread (the choice catches planning failures itself: this would be a bug) is raised at the
  join, on the training thread.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Callable, Optional

from lightning_parcae.runtime.part import EventSink
from lightning_parcae.runtime.shape_choice import Question, ShapeChooser

__all__ = ["PlanAhead", "PLAN_SWITCH_S"]

PLAN_SWITCH_S = 0.0005
"""The interpreter's switch interval while the thread decides (restored at the join). The decision is pure Python
and holds the interpreter lock; at the default 5 ms every small op or wait of the training thread queued behind it
for up to 5 ms, and a step-like loop ran 6.3x slower beside a decision thread (``benchmarks/bench_plan_thread.py``,
stop 57; 1.03x at 0.5 ms, the decision 1.15x slower). Regression: in stop 57's hl_15_25 replay parcae's job trained
4x7 at 41.3-42.5 samples/s against live-reactive's 43.1-43.3, with the same moves -- the leader, stage 0 of every
step, slowed by its own planning thread."""


class PlanAhead:
    """The leader's decision on a thread while the job trains one step (see the module's contract).

    Args:
        chooser: The leader's chooser (its :meth:`~.shape_choice.ShapeChooser.choose_for` runs on the thread).
        event: The event log.
        clock: Monotonic seconds (a test passes its own).

    Attributes:
        waited_s: Seconds step boundaries waited for the thread so far (each choice's own time is its
            question's ``spent_s``, in the ``decision`` event).
    """

    def __init__(self, chooser: ShapeChooser, event: EventSink, clock: Callable[[], float] = time.monotonic) -> None:
        self.chooser = chooser
        self.event = event
        self._clock = clock
        self._thread: Optional[threading.Thread] = None
        self._question: Optional[Question] = None
        self._step = 0
        self._error: Optional[BaseException] = None
        self._asked = False  # the question waits for go()
        self._switch = sys.getswitchinterval()  # the interpreter's, restored at the join
        self.waited_s = 0.0

    @property
    def pending(self) -> bool:
        """A question is being answered, or answered and not published yet."""
        return self._question is not None

    @property
    def running(self) -> bool:
        """The thread runs (or ran and was not joined yet)."""
        return self._thread is not None

    def ask(self, question: Question, step: int) -> None:
        """Record ``question`` (gathered at step boundary ``step``); :meth:`go` starts answering it once the
        boundary's own work on the chooser is done.

        Raises:
            RuntimeError: (internal) if a question is still pending.
        """
        if self._question is not None:
            raise RuntimeError("internal: a planning-ahead question is still pending")
        self._question, self._step, self._error, self._asked = question, int(step), None, True

    def go(self, generation: int) -> None:
        """Start the thread on the question asked at this boundary, if it was asked in ``generation`` (the one the
        boundary ends in; one that changed meanwhile drops it); the caller goes on training."""
        q = self._question
        if q is None or not self._asked:
            return
        self._asked = False
        if q.generation != generation:
            self._question = None
            self.event("plan_dropped", reason=q.reason, asked_in=q.generation, now=generation,
                       why="the generation changed")
            return
        self._switch = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch, PLAN_SWITCH_S))  # the training thread waits less for the lock
        self._thread = threading.Thread(target=self._answer, args=(q,), name="parcae-plan-ahead", daemon=True)
        self._thread.start()

    def start(self, question: Question, step: int) -> None:
        """:meth:`ask` and :meth:`go` at once (nothing else of the boundary touches the chooser)."""
        self.ask(question, step)
        self.go(question.generation)

    def _answer(self, question: Question) -> None:
        try:
            self.chooser.choose_for(question)
        except BaseException as exc:  # noqa: BLE001 -- raised at the join, on the training thread
            self._error = exc

    def join(self) -> float:
        """Wait for the thread, if one runs (at a step boundary, before the chooser's state is read); returns
        the seconds waited.

        Raises:
            BaseException: What the thread raised (the pending question is dropped first).
        """
        thread, self._thread = self._thread, None
        if thread is None:
            return 0.0
        t = self._clock()
        try:
            thread.join()
        finally:
            sys.setswitchinterval(self._switch)
        waited = max(0.0, self._clock() - t)
        self.waited_s += waited
        if self._error is not None:
            err, self._error, self._question = self._error, None, None
            raise err
        return waited

    def take(self, step: int, generation: int) -> Optional[Question]:
        """The answered question, to publish at step boundary ``step`` (None: none pending). One asked in another
        generation than ``generation`` is dropped.

        Raises:
            RuntimeError: (internal) if the thread was not joined first.
        """
        if self._thread is not None or self._asked:
            raise RuntimeError("internal: take() before go() and join()")
        q, self._question = self._question, None
        if q is None:
            return None
        if q.generation != generation:
            self.event("plan_dropped", reason=q.reason, asked_in=q.generation, now=generation,
                       why="the generation changed")
            return None
        q.ahead_steps = max(1, int(step) - self._step)
        return q

    def keep(self, question: Question) -> None:
        """Put an answered question back: this boundary admits no one (it is published at the next that does)."""
        if self._question is not None or self._thread is not None:
            raise RuntimeError("internal: a planning-ahead question is already pending")
        self._question = question

    def drop(self, why: str) -> None:
        """Forget the pending question (joined first): a notice or a loss is decided at its own boundary."""
        try:
            self.join()
        finally:
            q, self._question, self._asked = self._question, None, False
            if q is not None:
                self.event("plan_dropped", reason=q.reason, asked_in=q.generation, why=why)
