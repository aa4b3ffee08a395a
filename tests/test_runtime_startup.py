"""A start-up candidate's side of the roster (``lightning_parcae.runtime.startup``, ``ElasticRuntime.take_seat``).

Problem it guards (issue 20): a candidate must take its rank from its launch's roster -- the signed record the
launcher writes once the candidates arrived -- or, left out of it, become a standby that takes the join path; and a
notice while it waits ends it at once (it holds no state), instead of a SIGKILL at the end of its grace.
"""

from __future__ import annotations

import pytest

from lightning_parcae.runtime.startup import RosterTimeout, StartupRoster, await_roster, roster_key


class _Records:
    """Records that appear after ``after`` reads."""

    def __init__(self, rec: dict | None, after: int = 0) -> None:
        self.rec, self.after, self.reads = rec, after, 0

    def get(self, key: str, timeout_s: float | None = 0.0) -> dict | None:
        self.reads += 1
        return self.rec if self.rec is not None and self.reads > self.after else None


def _roster() -> StartupRoster:
    return StartupRoster(2, ("i0", "i3"), ("i1",), ("i2",), 1, "every live candidate arrived (3)")


def test_the_roster_record_round_trips_and_gives_ranks() -> None:
    r = _roster()
    assert StartupRoster.from_record(r.record()) == r
    assert (r.rank_of("i3"), r.rank_of("i1"), r.world) == (1, None, 2)
    assert roster_key(2) == "parcae/startup/2/roster"


def test_a_candidate_waits_for_the_roster_and_a_notice_ends_the_wait() -> None:
    records = _Records(_roster().record(), after=3)
    got = await_roster(records, roster_key(2), noticed=lambda: False, sleep=lambda s: None)
    assert got == _roster() and records.reads == 4
    noticed = iter([False, False, True])
    assert await_roster(_Records(None), roster_key(2), noticed=lambda: next(noticed), sleep=lambda s: None) is None


def test_a_candidate_gives_up_with_a_named_error_when_no_roster_comes() -> None:
    t = iter(float(x) for x in range(100))
    with pytest.raises(RosterTimeout, match="no start-up roster under 'parcae/startup/2/roster' within 5 s"):
        await_roster(_Records(None), roster_key(2), noticed=lambda: False, timeout_s=5.0, clock=lambda: next(t),
                     sleep=lambda s: None)


class _Waiting:
    """No roster; the launch's waiting record says the latest of ``renewals`` (clock times) that has passed."""

    def __init__(self, renewals: list[float]) -> None:
        self.renewals, self.now = renewals, 0.0

    def clock(self) -> float:
        self.now += 1.0
        return self.now

    def get(self, key: str, timeout_s: float | None = 0.0) -> dict | None:
        if not key.endswith("/waiting"):
            return None
        passed = [r for r in self.renewals if r <= self.now]
        return {"need": 6, "t": max(passed)} if passed else None


def test_a_candidate_of_a_launch_that_waits_for_instances_waits_as_long_as_the_launcher_renews_the_wait() -> None:
    """A relaunch started early during a pause (``parcae run``: the trace has fewer instances than the model fits
    on) may wait longer than ``ROSTER_WAIT_S``: each renewal of the launch's waiting record restarts the candidate's
    wait; once the launcher stops renewing it, the candidate gives up as before."""
    plain = _Waiting([])
    with pytest.raises(RosterTimeout):
        await_roster(plain, roster_key(2), noticed=lambda: False, timeout_s=5.0, clock=plain.clock,
                     sleep=lambda s: None)
    renewed = _Waiting([3.0, 8.0])
    with pytest.raises(RosterTimeout):
        await_roster(renewed, roster_key(2), noticed=lambda: False, timeout_s=5.0, clock=renewed.clock,
                     sleep=lambda s: None)
    assert plain.now <= 7 and renewed.now >= 15, (plain.now, renewed.now)  # two renewals: three waits of 5 s


def _runtime(store, member: str):  # noqa: ANN001, ANN202
    from lightning_parcae.runtime.config import RuntimeConfig
    from lightning_parcae.runtime.coordinator import Coordinator
    from lightning_parcae.runtime.elastic import ElasticRuntime
    from lightning_parcae.runtime.liveness import Liveness
    from lightning_parcae.training.strategy import ParcaeStrategy

    options = ParcaeStrategy(elastic=False).elastic_options
    config = RuntimeConfig(store_url="unused", token="job-token", member=member, roster_key=roster_key(2), **options)
    er = ElasticRuntime(object(), config)  # type: ignore[arg-type]
    er.attach(store, Coordinator(store, "job-token"), Liveness(lambda: store, member, poll_s=0.01))
    return er


def test_take_seat_reads_the_launchers_signed_roster_and_a_left_out_candidate_becomes_a_standby() -> None:
    import torch.distributed as dist

    from lightning_parcae.runtime.store import install_token, publish

    store = dist.HashStore()
    install_token(store, "job-token")
    publish(store, roster_key(2), _roster().record(), "job-token")  # as the launcher writes it
    member, late = _runtime(store, "i3"), _runtime(store, "i1")
    assert member.take_seat().rank_of("i3") == 1 and not member.joining and member.admitted
    assert late.take_seat().rank_of("i1") is None and late.joining and not late.admitted


def test_take_seat_leaves_at_once_on_a_notice(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed as dist

    from lightning_parcae.runtime import elastic

    class _Exit(Exception):
        pass

    codes: list[int] = []
    monkeypatch.setattr(elastic, "exit_now", lambda code: codes.append(code) or (_ for _ in ()).throw(_Exit()))
    er = _runtime(dist.HashStore(), "i2")
    er.live.noticed.set()  # SIGTERM while waiting: no roster written yet
    with pytest.raises(_Exit):
        er.take_seat()
    assert codes == [0] and er.life.phase.value == "stopped"
