"""Single-process pieces of live reconfiguration: data re-slicing, the runtime's throughput model and its two-phase
step commit."""

from __future__ import annotations

import torch
from torch.utils.data import SequentialSampler

from lightning_parcae.runtime.data import GlobalBatchSampler
from lightning_parcae.planning.measured import PipelineThroughput


def _sampler(replicas: int, replica: int) -> GlobalBatchSampler:
    return GlobalBatchSampler(SequentialSampler(range(32)), 8, replicas, replica, replicas * 2, False, True)


def test_sampler_records_each_batch_with_the_shape_it_was_cut_for_if_resharded_midway() -> None:
    s = _sampler(2, 1)
    it = iter(s)
    assert next(it) == [4, 5, 6, 7]
    s.reshard(4, 3, 8)  # the job went from D=2 to D=4 between two steps
    assert next(it) == [14, 15]
    assert [r[:2] for r in s.records] == [(2, 1), (4, 3)]
    d, replica, chunk = s.records[0]
    assert chunk == list(range(8))
    # a batch prefetched for D=2 is re-cut for the new shape from its recorded global batch
    assert s.slice_of(chunk, 4, 3) == [6, 7]


def test_runtime_throughput_forbids_shapes_if_d_does_not_split_the_global_batch() -> None:
    thr = PipelineThroughput([1.0] * 4, global_batch=16, micro_batches=2)
    assert thr.throughput(3, 1) == 0.0  # 16 samples cannot be split over 3 pipelines x 2 micro-batches
    assert thr.throughput(2, 1) > thr.throughput(1, 2) > 0.0
    assert thr.throughput(1, 5) == 0.0  # more stages than layers
    assert thr.candidates(3) == [(1, 2), (1, 3), (2, 1)]


class _Owner:
    """Just enough of a training host for ElasticRuntime's commit logic."""

    layer_names: list[str] = []


def _runtime(store, member: str, members: tuple[str, ...]):  # noqa: ANN001, ANN202
    from lightning_parcae.planning.migration_plan import Layout
    from lightning_parcae.runtime.config import RuntimeConfig
    from lightning_parcae.runtime.coordinator import Coordinator
    from lightning_parcae.runtime.elastic import ElasticRuntime
    from lightning_parcae.runtime.liveness import Liveness

    from lightning_parcae.training.strategy import ParcaeStrategy

    options = ParcaeStrategy(elastic=False).elastic_options  # the planning options at the strategy's defaults
    config = RuntimeConfig(store_url="unused", token=None, member=member, **options)
    er = ElasticRuntime(_Owner(), config)  # type: ignore[arg-type]
    live = Liveness(lambda: store, member, poll_s=0.01)
    er.attach(store, Coordinator(store), live)
    live.set_generation(4, [])
    er.state.enter({"generation": 4, "layout": Layout(members, (1,)).to_json()})
    return er


def test_commit_applies_the_step_everywhere_if_every_member_counted_in() -> None:
    import torch.distributed as dist

    store = dist.HashStore()
    a, b = _runtime(store, "a", ("a", "b")), _runtime(store, "b", ("a", "b"))
    import threading

    t = threading.Thread(target=a.commit, args=(9,))
    t.start()
    b.commit(9)  # the last to arrive decides "apply"; the waiter sees it
    t.join(5)
    assert not t.is_alive()
    # a failure discovered *after* everyone counted in cannot turn the step into a discard
    assert a.decide_commit(9) is True


def test_commit_discards_the_step_for_everyone_if_a_member_never_counted_in() -> None:
    import pytest
    import torch.distributed as dist

    from lightning_parcae.errors import PeerLostError

    store = dist.HashStore()
    a, b = _runtime(store, "a", ("a", "b", "c")), _runtime(store, "b", ("a", "b", "c"))
    a.live.abort("c died")  # what the heartbeat thread would do
    with pytest.raises(PeerLostError):
        a.commit(3)  # counted in, then the generation was aborted while waiting for c
    assert a.decide_commit(3) is False  # 2 of 3 counted in: discard
    # b arrives late (it was slow, not dead): it must obey the decision already taken, not apply the step
    with pytest.raises(PeerLostError, match="discarded"):
        b.commit(3)
    assert b.decide_commit(3) is False


def test_sampler_epoch_has_the_same_steps_at_every_d_if_elastic() -> None:
    """Regression (issue 9, repro 1): the README job with ``--batch-size 48`` stalled for 290 s after a warm
    standby was admitted into D = 3. 2048 samples leave a trailing partial batch of 32, which splits over D = 4 x
    M = 2 (the members sized the loader at D = 4: 43 batches) but not over D = 3 x 2 (the joiner, sized at D = 3:
    42). The members then ended each epoch with one extra loop iteration (a ``StopIteration``) that the joiner
    did not run, and its collectives no longer matched. Under live reconfiguration the partial batch is now
    dropped at every D, so every member sizes and ends an epoch alike."""
    base = SequentialSampler(range(44))  # 3 full global batches of 12 + 8 samples (splits over 2x2, not 3x2)
    static = [GlobalBatchSampler(base, 12, d, 0, d * 2, False, True) for d in (2, 3)]
    assert [len(s) for s in static] == [4, 3]  # a static job keeps the partial batch where it splits
    for d_start in (1, 2, 3, 6):
        members = GlobalBatchSampler(base, 12, d_start, 0, d_start * 2, False, True, fixed_epoch=True)
        it = iter(members)
        got = [next(it)]
        members.reshard(3, 0, 6)  # the job changed shape after the first step
        got += list(it)
        joiner = GlobalBatchSampler(base, 12, 3, 0, 6, False, True, fixed_epoch=True)
        joiner.start_at(0, 12)  # admitted after one step
        assert len(members) == len(joiner) == 3
        assert len(got) == 1 + len(list(joiner)) == 3
        assert [r[2] for r in members.records][-1] == list(range(24, 36))  # the 8 trailing samples are dropped


def _loader(seed: int = 11):
    from torch.utils.data import DataLoader

    from lightning_parcae.runtime.data import reshard_dataloader

    data = list(range(32))
    user = DataLoader(data, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(seed))
    return reshard_dataloader(user, 1, 0, 1, True, fixed_epoch=True)


def _epoch(loader, sampler, epoch: int) -> list[int]:
    sampler.set_epoch(epoch)
    return [int(i) for batch in loader for i in batch]


def test_sampler_resumes_the_next_epochs_order_if_saved_at_an_epochs_last_step() -> None:
    """Regression (issue 9, found by the chaos harness, seed 4): a joiner admitted at the last step of an epoch
    trained on another order than the members: Lightning resumed it straight into the next epoch, where the
    sampler (a) still started at the saved epoch's cursor -- the whole epoch was skipped -- and (b) had not
    replayed the generator draws the members had made since (the DataLoader takes one seed per iterator from
    the shuffle generator). Samples were repeated and others skipped. The resumed process now continues from the
    saving process's generator state (``rng_now``) and starts the new epoch at its first sample."""
    loader, sampler = _loader()
    seen = [_epoch(loader, sampler, e) for e in range(3)]
    state = {"rng": sampler.rng_state, "now": sampler.rng_now}
    expected = [_epoch(loader, sampler, e) for e in (3, 4)]
    for skip_saved_epoch in (True, False):  # Lightning goes on to epoch 3, or first re-enters the finished epoch 2
        joiner_loader, joiner = _loader()
        joiner.start_at(2, 32, state["rng"], state["now"])
        if not skip_saved_epoch:
            assert _epoch(joiner_loader, joiner, 2) == []
        got = [_epoch(joiner_loader, joiner, e) for e in (3, 4)]
        assert got == expected
        assert sorted(got[0]) == list(range(32)) and got[0] != seen[2]


def test_sampler_resumes_mid_epoch_with_the_same_order_and_next_epochs() -> None:
    loader, sampler = _loader()
    _epoch(loader, sampler, 0)
    sampler.set_epoch(1)
    it = iter(loader)
    first = [int(i) for i in next(it)]
    state = {"rng": sampler.rng_state, "now": sampler.rng_now}
    rest = [int(i) for batch in it for i in batch]
    nxt = _epoch(loader, sampler, 2)
    joiner_loader, joiner = _loader()
    joiner.start_at(1, 8, state["rng"], state["now"])
    assert _epoch(joiner_loader, joiner, 1) == rest and len(first + rest) == 32
    assert _epoch(joiner_loader, joiner, 2) == nxt


class _Trainer:
    def __init__(self, step: int) -> None:
        self.global_step = step


class _FakeSwitch:
    """The switching part: records calls, moves nothing, or fails like a rendezvous that cannot form."""

    def __init__(self, calls: list, fail: str = "") -> None:
        self.calls, self.fail = calls, fail

    def hands_loop_state(self, rec):  # noqa: ANN001, ANN201
        return rec.get("loop_from") == "a"

    def teardown_groups(self, failed: bool = False) -> None:
        self.calls.append(("teardown", failed))

    def switch(self, trainer, rec, loop):  # noqa: ANN001, ANN201
        from lightning_parcae.planning.migration_plan import Layout, plan_migration
        from lightning_parcae.runtime.switching import GenerationNotEntered, Moved

        self.calls.append(("switch", rec["generation"], loop))
        if self.fail:
            intact = self.fail.startswith("intact:")
            self.fail = "" if intact else self.fail  # the survivors' generation then forms
            raise GenerationNotEntered(rec.get("reason", "") or "failed", intact=intact) if intact else \
                GenerationNotEntered(self.fail)
        plan = plan_migration(Layout(("a", "b"), (2,)), ["a", "b"], (1, 2), [1, 1], [1, 1], senders=["a", "b"])
        return Moved(plan=plan, joiners=[], t_groups=0.0, t_transfer=0.0, bytes_received=0)


class _Fallback(Exception):
    pass


class _FakeRecovery:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def fallback(self, trainer, rec):  # noqa: ANN001, ANN201
        self.calls.append(("fallback", rec.get("reason")))
        raise _Fallback(rec.get("reason"))  # the real one exits the process

    def begin(self):  # noqa: ANN201
        from lightning_parcae.runtime.recovery import Loss

        self.calls.append(("begin",))
        return Loss(reason="b died", since=0.0)

    def survivors_record(self, loss, step):  # noqa: ANN001, ANN201
        from lightning_parcae.planning.migration_plan import Layout

        self.calls.append(("survivors", loss.reason, step))
        return {"generation": 5, "kind": "repartition", "layout": Layout(("a", "b"), (1, 1)).to_json()}


class _FakeAdmission:
    def __init__(self, calls: list) -> None:
        self.calls = calls

    def loop_state(self, trainer):  # noqa: ANN001, ANN201
        self.calls.append(("loop_state",))
        return {"loop": True}


def _orchestrated(fail: str = ""):  # noqa: ANN202
    import torch.distributed as dist

    from lightning_parcae.runtime.lifecycle import Phase

    er = _runtime(dist.HashStore(), "a", ("a", "b"))
    calls: list = []
    er.switching, er.recovery, er.admission = _FakeSwitch(calls, fail), _FakeRecovery(calls), _FakeAdmission(calls)
    er.life.to(Phase.TRAINING)
    er.life.to(Phase.PLANNING)  # the members agreed on a next generation
    return er, calls


def test_the_runtime_enters_the_generation_its_switch_moved_into() -> None:
    """Only the runtime changes the generation: after the switch returns, it enters the record, publishes it as
    current (it leads), logs the migration and trains again."""
    from lightning_parcae.planning.migration_plan import Layout
    from lightning_parcae.runtime.lifecycle import Phase

    er, calls = _orchestrated()
    rec = {"generation": 5, "kind": "repartition", "loop_from": "a", "reason": "interval",
           "layout": Layout(("a", "b"), (1, 1)).to_json()}
    er.switch(_Trainer(9), rec)
    assert calls == [("loop_state",), ("switch", 5, {"loop": True})]
    assert er.generation == 5 and er.state.record is rec and er.layout == Layout(("a", "b"), (1, 1))
    assert er.coord.current() == 5 and er.life.phase == Phase.TRAINING
    assert er.migrations[-1]["kind"] == "repartition" and er.migrations[-1]["step"] == 9
    assert "recovery_s" not in er.migrations[-1]


def test_the_runtime_falls_back_if_the_generation_cannot_be_entered() -> None:
    import pytest

    er, calls = _orchestrated(fail="process groups of generation 5 could not be built: timeout")
    with pytest.raises(_Fallback):
        er.switch(_Trainer(9), {"generation": 5, "kind": "intra-stage", "layout": {}})
    assert calls[-1] == ("fallback", "process groups of generation 5 could not be built: timeout")
    assert er.generation == 4  # nothing of the new generation was entered


def test_an_old_member_recovers_with_the_survivors_if_a_lost_joiner_kept_the_generation_from_forming() -> None:
    """Regression (the README's main job, slow suite): a standby admitted by generation 5 was stopped as it was
    admitted; the transition world waited for it, declared it dead, and every old member fell back to the
    checkpoint, although none had applied anything. An old member whose state is intact now recovers: it leaves
    the groups, the survivors agree on their generation, and it switches to that one."""
    er, calls = _orchestrated(fail="intact:")
    er.switch(_Trainer(9), {"generation": 5, "kind": "repartition", "reason": "interval", "layout": {}})
    assert ("fallback", "failed") not in calls and not any(c[0] == "fallback" for c in calls)
    assert calls[-4:] == [("begin",), ("teardown", True), ("survivors", "b died", 9), ("switch", 5, None)]
    assert er.generation == 5 and "recovery_s" in er.migrations[-1]


def test_a_fallback_record_stops_before_anything_moves() -> None:
    import pytest

    er, calls = _orchestrated()
    with pytest.raises(_Fallback):
        er.switch(_Trainer(9), {"generation": 5, "kind": "fallback", "reason": "stage lost"})
    assert calls == [("fallback", "stage lost")]


def test_a_recovery_leaves_the_old_groups_abandoned_then_switches_to_the_survivors_record() -> None:
    er, calls = _orchestrated()
    er.recover(_Trainer(12))
    assert calls == [("begin",), ("teardown", True), ("survivors", "b died", 12), ("switch", 5, None)]
    assert er.generation == 5 and "recovery_s" in er.migrations[-1]


def test_the_planning_interval_is_due_by_steps_or_seconds_and_restarts_for_a_joiner() -> None:
    from lightning_parcae.runtime.elastic import PlanningClock

    clock = PlanningClock(interval_s=0.0, interval_steps=3)
    assert [clock.due(s) for s in (1, 2, 3, 4, 5, 6)] == [False, False, True, False, False, True]
    clock.restart(10)
    assert not clock.due(12) and clock.due(13)
    assert PlanningClock(interval_s=1e-9, interval_steps=0).due(0)


def test_the_leader_plans_when_a_standby_becomes_ready_without_waiting_for_the_interval() -> None:
    """Regression (issue 21, N = 32 replay of hh_55_65): two instances ready 13 s after launch waited for the next
    planning interval, 21 s later in one run and none in the other -- the ratio between two policies decided by the
    phase of a clock. A standby that became ready since the last decision is planned at the next step boundary
    that admits; not on a member that does not lead, not where the step admits no one."""
    import torch.distributed as dist

    store = dist.HashStore()
    er = _runtime(store, "a", ("a", "b"))
    er._clock.interval_s, er._clock.interval_steps = 1e9, 0  # the interval is never due here
    er._clock.last_t = __import__("time").monotonic()
    assert er._plan_reason(7, admit=True) is None
    er.chooser._arrived = ["c", "d"]  # what note_standbys found at a step boundary
    assert er._plan_reason(7, admit=True) == "standbys ready: c, d"
    assert er._plan_reason(7, admit=False) is None  # a validation follows: no one is admitted here
    follower = _runtime(store, "b", ("a", "b"))
    follower.chooser._arrived = ["c"]
    assert follower._plan_reason(7, admit=True) is None
    er._clock.interval_s = 1e-9  # an interval due at the same boundary plans once, as an interval
    assert er._plan_reason(8, admit=True) == "interval"
