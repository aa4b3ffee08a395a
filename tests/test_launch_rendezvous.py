"""The agents' rendezvous (``lightning_parcae.launch.rendezvous``): several agents, one real TCPStore on loopback.

Each agent is a thread with its own store client, as on separate machines; the store is the only thing they share.
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Callable, Optional

import pytest

from lightning_parcae.launch import rendezvous as rz
from lightning_parcae.launch.rendezvous import Relaunch, Rendezvous, RendezvousTimeout, Seat, parse_nodes
from lightning_parcae.runtime.store import TamperedRecordError, connect_store, host_store, new_token, publish

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def job() -> Any:
    token = new_token()
    server = host_store("tcp://127.0.0.1:0", token=token)
    url = f"tcp://127.0.0.1:{server.port}"
    yield url, token, server


def _rdv(url: str, token: str, agent: str, lo: int, hi: int, **kw: Any) -> Rendezvous:
    kw.setdefault("settle_s", 0.3)
    kw.setdefault("poll_s", 0.05)
    return Rendezvous(connect_store(url, token=token), token, agent, min_nodes=lo, max_nodes=hi, **kw)


def _in_threads(fns: dict[str, Callable[[], Seat]]) -> dict[str, Any]:
    out: dict[str, Any] = {}

    def run(name: str, fn: Callable[[], Seat]) -> None:
        try:
            out[name] = fn()
        except BaseException as exc:  # noqa: BLE001 -- reported by the test
            out[name] = exc

    threads = [threading.Thread(target=run, args=(n, f), daemon=True) for n, f in fns.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_parse_nodes_takes_n_or_min_max_and_refuses_the_rest() -> None:
    assert parse_nodes("3") == (3, 3) and parse_nodes("2:8") == (2, 8)
    for bad in ("0", "3:2", "a", "1:2:3", ""):
        with pytest.raises(ValueError, match="MIN:MAX"):
            parse_nodes(bad)


def test_agents_that_arrive_together_agree_on_one_roster_in_arrival_order(job: Any) -> None:
    url, token, _ = job
    seats = _in_threads({a: (lambda a=a: _rdv(url, token, a, 2, 4).join(0)) for a in ("a", "b", "c", "d")})
    rosters = {s.roster for s in seats.values()}
    assert len(rosters) == 1, seats
    roster = rosters.pop()
    assert sorted(roster.members) == ["a", "b", "c", "d"] and roster.round == 0
    assert sorted(s.rank for s in seats.values()) == [0, 1, 2, 3]
    assert all(roster.members[s.rank] == a for a, s in seats.items())


def test_a_roster_starts_a_power_of_two_of_members_and_keeps_the_rest_as_standbys(job: Any) -> None:
    """As ``parcae run`` launches: D a power of two splits any usual global batch; 3 of 2:3 start 2 + 1 standby."""
    url, token, _ = job
    seats = _in_threads({a: (lambda a=a: _rdv(url, token, a, 2, 3).join(0)) for a in ("a", "b", "c")})
    roster = {s.roster for s in seats.values()}.pop()
    assert len(roster.members) == 2 and sum(s.standby for s in seats.values()) == 1
    three = _in_threads({a: (lambda a=a: _rdv(url, token, a, 3, 3).join(1)) for a in ("a", "b", "c")})
    assert len({s.roster for s in three.values()}.pop().members) == 3  # never fewer than MIN


def test_the_roster_forms_without_the_settle_time_once_max_agents_are_there(job: Any) -> None:
    url, token, _ = job
    t0 = time.monotonic()
    seats = _in_threads({a: (lambda a=a: _rdv(url, token, a, 1, 2, settle_s=30.0).join(0)) for a in ("a", "b")})
    assert time.monotonic() - t0 < 15.0
    assert {s.world for s in seats.values()} == {2} and {s.rank for s in seats.values()} == {0, 1}


def test_arrivals_past_max_and_after_the_roster_are_standbys(job: Any) -> None:
    url, token, _ = job
    seats = _in_threads({a: (lambda a=a: _rdv(url, token, a, 1, 2, settle_s=30.0).join(0))
                         for a in ("a", "b", "c")})
    assert len({s.roster for s in seats.values()}) == 1, seats
    assert sorted(s.rank for s in seats.values() if not s.standby) == [0, 1]
    assert [a for a, s in seats.items() if s.standby] == [a for a in seats if a not in seats["a"].roster.members]
    late = _rdv(url, token, "d", 1, 2).join(0)
    assert late.standby and late.roster == seats["a"].roster


def test_the_roster_waits_for_the_settle_time_for_more_agents_once_min_are_there(job: Any) -> None:
    url, token, _ = job

    def later() -> Seat:
        time.sleep(0.8)
        return _rdv(url, token, "b", 1, 4, settle_s=3.0).join(0)

    seats = _in_threads({"a": lambda: _rdv(url, token, "a", 1, 4, settle_s=3.0).join(0), "b": later})
    assert seats["a"].roster.members == ("a", "b") and seats["b"].rank == 1


def test_an_agent_waits_while_fewer_than_min_are_there_saying_so_and_times_out_with_a_clear_message(
        job: Any) -> None:
    url, token, _ = job
    said: list[str] = []
    rdv = _rdv(url, token, "a", 2, 3, timeout_s=1.5, report_every_s=0.3, say=said.append)
    with pytest.raises(RendezvousTimeout, match=r"only 1 of at least 2 agents arrived within 1.5 s"):
        rdv.join(0)
    assert said and all("1 of 2 agents there, waiting for 1 more" in line for line in said)


def test_a_first_arrival_that_dies_before_the_roster_is_written_is_left_out_and_does_not_block_the_round(
        job: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    url, token, _ = job
    monkeypatch.setattr(rz, "DEAD_AFTER_S", 1.0)
    dead = _rdv(url, token, "dead", 2, 3)
    slot = int(dead.store.add(dead.key(0, "count"), 1)) - 1  # what join() does first, then the agent is gone
    publish(dead.store, dead.key(0, "arrival", slot), {"agent": "dead", "slot": slot}, token)
    dead.store.add(dead.key(0, "beat", slot), 1)
    seats = _in_threads({a: (lambda a=a: _rdv(url, token, a, 2, 3).join(0)) for a in ("b", "c")})
    assert {s.roster.members for s in seats.values()} in ({("b", "c")}, {("c", "b")}), seats
    assert "dead" not in seats["b"].roster.members


def test_one_relaunch_is_declared_and_its_round_resumes_from_the_winners_checkpoint(job: Any) -> None:
    url, token, _ = job
    a, b = _rdv(url, token, "a", 2, 2), _rdv(url, token, "b", 2, 2)
    assert a.newest_round() == 0 and a.relaunch(1) is None
    won = a.declare(Relaunch(1, "/shared/ckpt-a", 8, 2, 2, reason="stage 1 lost", declared_by="a"))
    other = b.declare(Relaunch(1, "/shared/ckpt-b", 9, 2, 2, declared_by="b"))
    assert other == won and won.checkpoint == "/shared/ckpt-a" and b.newest_round() == 1
    seats = _in_threads({"a": lambda: a.join(1), "b": lambda: b.join(1)})
    assert {s.roster.checkpoint for s in seats.values()} == {"/shared/ckpt-a"}
    assert {s.round for s in seats.values()} == {1} and {s.rank for s in seats.values()} == {0, 1}


def test_a_relaunch_round_takes_min_and_max_from_its_record_and_round_0_from_the_job(job: Any) -> None:
    url, token, _ = job
    first, joiner = _rdv(url, token, "a", 2, 5), _rdv(url, token, "j", 1, 1 << 20)
    assert first.publish_bounds() == (2, 5) and _rdv(url, token, "b", 3, 3).publish_bounds() == (2, 5)
    assert joiner.bounds(0) == (2, 5, None)
    joiner.declare(Relaunch(1, None, None, 3, 4))
    assert joiner.bounds(1) == (3, 4, None)


def test_a_roster_written_without_the_job_token_is_refused(job: Any) -> None:
    url, token, server = job
    server.set(Rendezvous.key(0, "roster"), json.dumps({"round": 0, "members": ["evil"]}).encode())
    with pytest.raises(TamperedRecordError):
        _rdv(url, token, "a", 1, 1).join(0)


def test_without_a_token_the_records_are_plain_json(monkeypatch: pytest.MonkeyPatch) -> None:
    server = host_store("tcp://127.0.0.1:0")
    rdv = Rendezvous(connect_store(f"tcp://127.0.0.1:{server.port}", token=None), None, "a", min_nodes=1,
                     max_nodes=1, poll_s=0.05)
    seat = rdv.join(0)
    assert seat.rank == 0
    raw: Optional[bytes] = bytes(server.get(Rendezvous.key(0, "roster")))
    assert json.loads(raw.decode())["members"] == ["a"]


def test_an_agent_told_to_stop_leaves_the_rendezvous_before_the_roster(job: Any) -> None:
    url, token, _ = job
    t0 = time.monotonic()
    with pytest.raises(rz.RendezvousCancelled, match="round 0"):
        _rdv(url, token, "a", 2, 2).join(0, stop=lambda: time.monotonic() - t0 > 0.3)
    assert _rdv(url, token, "b", 1, 1).roster(0) is None
