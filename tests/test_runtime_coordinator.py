"""The job's records in the store: first proposal wins, signed records, standbys, two-phase commit counters."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_parcae.runtime.coordinator import Coordinator, genrec_key
from lightning_parcae.runtime.store import TamperedRecordError, install_token, new_token

from conftest import record_client_calls


@pytest.fixture
def store() -> dist.Store:
    return dist.HashStore()


def test_coordinator_returns_the_first_proposal_if_two_survivors_propose_the_same_generation(store) -> None:
    c = Coordinator(store)
    a = c.propose({"generation": 5, "members": ["m0", "m2"]})
    b = c.propose({"generation": 5, "members": ["m2"]})
    assert a == b == {"generation": 5, "members": ["m0", "m2"]}
    assert c.generation(5) == a and c.generation(6) is None


def test_coordinator_rejects_a_generation_record_if_it_was_forged_without_the_token(store) -> None:
    token = new_token()
    install_token(store, token)
    c = Coordinator(store, token)
    store.set(genrec_key(1), b'{"generation": 1, "members": ["intruder"]}')
    with pytest.raises(TamperedRecordError):
        c.generation(1)


def test_coordinator_lists_standbys_in_arrival_order_if_several_register(store) -> None:
    c = Coordinator(store)
    assert [c.register_standby(m) for m in ("x", "y", "z")] == [0, 1, 2]
    assert c.standbys() == ["x", "y", "z"]


def test_coordinator_reports_the_last_arrival_if_every_member_counted_in(store) -> None:
    c = Coordinator(store)
    assert [c.commit_arrive(3, 7, 3) for _ in range(3)] == [False, False, True]
    assert c.commit_count(3, 7) == 3
    assert c.commit_count(3, 8) == 0


def test_coordinator_never_moves_current_back_if_an_older_generation_starts_late(store) -> None:
    c = Coordinator(store)
    assert c.current() == -1
    c.set_current(4)
    c.set_current(2)
    assert c.current() == 4


def test_coordinator_keeps_the_availability_history_if_appended(store) -> None:
    c = Coordinator(store)
    for n in (4, 3, 5):
        c.append_history(n)
    assert c.history() == [4, 3, 5]


def test_coordinator_lists_no_standbys_before_any_registers(store) -> None:
    assert Coordinator(store).standbys() == []


def test_coordinator_reads_the_standbys_on_etcd_with_one_request_each(etcd_server) -> None:
    """Regression (issue 21): the leader reads the standby list at every step; the count was an ``add(0)`` -- three
    requests on etcd (a create that fails, a read, a compare-and-swap write) -- and each standby a check and a get.
    Now one read for the count and one per standby."""
    from lightning_parcae.runtime.store import connect_store, host_store

    url = etcd_server.store_url("/parcae/t-standbys")
    host_store(url, token=None)
    store = connect_store(url, token=None)
    c = Coordinator(store)
    assert c.standbys() == []
    for m in ("x", "y"):
        c.register_standby(m)
    calls = record_client_calls(store, ("read", "write"))  # what get, test_and_set and every request go through
    assert c.standbys() == ["x", "y"]
    assert calls == ["read"] * 3, calls


def test_commit_arrivals_on_etcd_are_two_requests_each_without_retries_if_all_arrive_at_once(etcd_server) -> None:
    """Regression (issue 21): on etcd the commit counter was torch's ``EtcdStore.add`` -- a compare-and-swap loop
    that sleeps a random 0-100 ms after each lost race -- and every member of a step adds at about the same time:
    the last of N = 4-32 concurrent adds took 78-217 ms (median of 10), on every step's path. Now each member writes
    its own arrival key and counts the tally: two requests, no race to lose. Someone sees the full count; the
    count after a failure (``commit_count``) and the deletion of a passed step's tally work the same way."""
    import threading

    from lightning_parcae.runtime.store import connect_store, host_store

    url = etcd_server.store_url("/parcae/t-commit")
    host_store(url, token=None)
    n = 12
    coords = [Coordinator(connect_store(url, token=None)) for _ in range(n)]
    requests = [0] * n
    for i, c in enumerate(coords):
        for name in ("read", "write", "delete"):
            real = getattr(c.store.client, name)
            setattr(c.store.client, name,
                    lambda *a, _r=real, _i=i, **kw: (requests.__setitem__(_i, requests[_i] + 1), _r(*a, **kw))[1])
    barrier, full = threading.Barrier(n), []

    def arrive(i: int) -> None:
        barrier.wait()
        if coords[i].commit_arrive(4, 17, n, f"m{i}"):
            full.append(i)

    threads = [threading.Thread(target=arrive, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert requests == [2] * n, requests
    assert full, "no member saw every arrival"
    assert coords[0].commit_count(4, 17) == n and coords[0].commit_count(4, 18) == 0
    assert not coords[0].commit_arrive(4, 17, n + 1, "m0")  # counted once however often it arrives
    coords[0].forget_commit(4, 17)
    assert coords[0].commit_count(4, 17) == 0
    assert "commit/4/17" not in coords[0].store.scope_names()


def test_commit_arrivals_without_a_member_or_on_other_stores_use_the_atomic_counter(store) -> None:
    c = Coordinator(store)
    assert [c.commit_arrive(2, 3, 2, m) for m in ("a", "b")] == [False, True]
    assert c.commit_count(2, 3) == 2
    c.forget_commit(2, 3)
    assert c.commit_count(2, 3) == 0
