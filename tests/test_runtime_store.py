"""Coordination stores: URLs, loopback-only hosting, fast failure, job tokens, signed records, etcd.

The etcd tests start a real etcd (Debian package ``etcd-server``) on 127.0.0.1 and skip, saying so, when the
binary is not installed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from lightning_parcae.errors import ConfigurationError, CoordinationError
from lightning_parcae.testing.etcd_server import EtcdBinaryMissingError, EtcdServer, etcd_binary
from lightning_parcae.runtime.store import (
    StoreSpec,
    TamperedRecordError,
    TokenStore,
    WrongTokenError,
    check_token,
    count_in,
    connect_store,
    host_store,
    parse_store_url,
    publish,
    read,
    read_if_present,
    scoped,
)

from conftest import HAVE_PYTHON_ETCD, record_client_calls

needs_etcd = pytest.mark.skipif(
    etcd_binary() is None or not HAVE_PYTHON_ETCD,
    reason="needs the etcd binary (apt-get install etcd-server) and python-etcd (pip install python-etcd)",
)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def tcp_store() -> Iterator[dist.Store]:
    """A TCPStore hosted on loopback with job token 'tok'."""
    store = host_store("tcp://127.0.0.1:0", token="tok", timeout_s=5)
    try:
        yield store
    finally:
        del store


# ---------------------------------------------------------------------------------------------------------------
# URLs
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "url, spec",
    [
        ("tcp://127.0.0.1:29500", StoreSpec("tcp", "127.0.0.1", 29500)),
        ("tcp://[::1]:0", StoreSpec("tcp", "::1", 0)),
        ("etcd://10.0.0.5:2379/parcae/job1/", StoreSpec("etcd", "10.0.0.5", 2379, "/parcae/job1")),
        ("etcd://etcd.internal", StoreSpec("etcd", "etcd.internal", 2379, "/parcae")),
        ("file:///tmp/x.store", StoreSpec("file", path="/tmp/x.store")),
    ],
)
def test_parse_store_url_returns_spec_if_well_formed(url: str, spec: StoreSpec) -> None:
    assert parse_store_url(url) == spec
    assert parse_store_url(spec.url) == spec


@pytest.mark.parametrize(
    "url",
    [
        "127.0.0.1:29500",
        "http://127.0.0.1:29500",
        "tcp://127.0.0.1",
        "tcp://127.0.0.1:notaport",
        "tcp://:29500",
        "tcp://h:1/path",
        "etcd://h:2379/bad prefix",
        "etcd://h:2379/p?x=1",
        "file://relative/x",
        "file:///tmp/dir/",
    ],
)
def test_parse_store_url_raises_configuration_error_if_malformed(url: str) -> None:
    with pytest.raises(ConfigurationError, match="expected e.g. tcp://127.0.0.1:29500"):
        parse_store_url(url)


# ---------------------------------------------------------------------------------------------------------------
# Hosting and connecting over TCP
# ---------------------------------------------------------------------------------------------------------------
def test_host_store_serves_clients_if_tcp_on_loopback(tcp_store: dist.Store) -> None:
    client = connect_store(f"tcp://127.0.0.1:{tcp_store.port}", token="tok", timeout_s=5)
    client.set("k", "v")
    assert tcp_store.get("k") == b"v"
    assert client.add("n", 2) == 2 and tcp_store.add("n", 3) == 5


def _listening_addresses(port: int) -> set[str]:
    """Local addresses of the sockets listening on ``port`` (from /proc/net/tcp{,6})."""
    found = set()
    for name in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A = LISTEN
                found.add(addr)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from Linux /proc/net/tcp")
def test_host_store_listens_on_loopback_only_if_remote_not_allowed(tcp_store: dist.Store) -> None:
    # torch's own TCPStore(host_name="127.0.0.1", is_master=True) would listen on every interface ("*").
    assert _listening_addresses(tcp_store.port) == {"0100007F"}  # 127.0.0.1, little-endian hex


@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "10.1.2.3", "example.com"])
def test_host_store_refuses_non_loopback_if_remote_not_allowed(host: str) -> None:
    with pytest.raises(ConfigurationError, match="allow_remote=True"):
        host_store(f"tcp://{host}:0")


def test_connect_store_fails_fast_if_nothing_listens() -> None:
    port = _free_port()
    start = time.monotonic()
    with pytest.raises(CoordinationError, match="is the launcher running"):
        connect_store(f"tcp://127.0.0.1:{port}", token="tok", timeout_s=1.0)
    assert time.monotonic() - start < 5.0


def test_connect_store_raises_wrong_token_if_token_differs(tcp_store: dist.Store) -> None:
    with pytest.raises(WrongTokenError, match="wrong job token"):
        connect_store(f"tcp://127.0.0.1:{tcp_store.port}", token="not-the-token", timeout_s=5)


def test_connect_store_raises_wrong_token_if_token_missing(tcp_store: dist.Store) -> None:
    with pytest.raises(WrongTokenError, match="none was given"):
        connect_store(f"tcp://127.0.0.1:{tcp_store.port}", token=None, timeout_s=5)


def test_connect_store_accepts_no_token_if_store_is_open() -> None:
    store = host_store("tcp://127.0.0.1:0")
    client = connect_store(f"tcp://127.0.0.1:{store.port}", token=None, timeout_s=5)
    with pytest.raises(WrongTokenError, match="holds no token proof"):
        check_token(client, "tok")


def test_connect_store_raises_configuration_error_if_port_zero() -> None:
    with pytest.raises(ConfigurationError, match="port 0"):
        connect_store("tcp://127.0.0.1:0", token=None)


def test_host_store_replaces_stale_file_if_file_store(tmp_path: Path) -> None:
    path = tmp_path / "job.store"
    path.write_bytes(b"stale bytes from an earlier job")
    store = host_store(f"file://{path}", token="tok")
    client = connect_store(f"file://{path}", token="tok", timeout_s=2)
    publish(client, "plan", {"gen": 1}, "tok")
    assert read(store, "plan", "tok") == {"gen": 1}


def test_connect_store_fails_fast_if_file_store_absent(tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(CoordinationError, match="does not exist"):
        connect_store(f"file://{tmp_path / 'none.store'}", token=None, timeout_s=0.3)
    assert time.monotonic() - start < 2.0


# ---------------------------------------------------------------------------------------------------------------
# Signed records
# ---------------------------------------------------------------------------------------------------------------
def test_publish_round_trips_json_if_token_right(tcp_store: dist.Store) -> None:
    record = {"generation": 3, "members": ["a", "b"], "shape": [2, 4], "ratio": 0.5}
    publish(tcp_store, "gen/3/plan", record, "tok")
    assert read(tcp_store, "gen/3/plan", "tok") == record
    ts = TokenStore(tcp_store, "tok")
    ts.publish("members/a", {"alive": True})
    assert ts.read("members/a", timeout_s=1) == {"alive": True}


def test_publish_raises_wrong_token_if_token_differs(tcp_store: dist.Store) -> None:
    with pytest.raises(WrongTokenError):
        publish(tcp_store, "plan", {"x": 1}, "attacker")
    with pytest.raises(WrongTokenError):
        TokenStore(tcp_store, "attacker")
    assert not tcp_store.check(["plan"])


def test_read_rejects_record_if_signed_with_other_token(tcp_store: dist.Store) -> None:
    forged = TokenStore(tcp_store, "attacker", check=False)  # skips the proof check, as an attacker would
    forged.publish("plan", {"D": 1, "P": 8})
    with pytest.raises(TamperedRecordError, match="failed verification"):
        read(tcp_store, "plan", "tok")


def test_read_rejects_record_if_payload_tampered(tcp_store: dist.Store) -> None:
    publish(tcp_store, "plan", {"D": 2, "P": 4}, "tok")
    envelope = json.loads(tcp_store.get("plan"))
    envelope["payload"] = envelope["payload"].replace('"D":2', '"D":9')
    tcp_store.set("plan", json.dumps(envelope))
    with pytest.raises(TamperedRecordError, match="failed verification"):
        read(tcp_store, "plan", "tok")


def test_read_rejects_record_if_copied_to_other_key(tcp_store: dist.Store) -> None:
    publish(tcp_store, "members/a", {"alive": True}, "tok")
    tcp_store.set("members/b", tcp_store.get("members/a"))
    with pytest.raises(TamperedRecordError):
        read(tcp_store, "members/b", "tok")


@pytest.mark.parametrize("raw", [b"\x80\x04\x95pickle", b"[1, 2]", b'{"v": 1, "payload": 5, "sig": "00"}'])
def test_read_rejects_record_if_not_signed_json(tcp_store: dist.Store, raw: bytes) -> None:
    tcp_store.set("plan", raw)
    with pytest.raises(TamperedRecordError, match="not a signed JSON record"):
        read(tcp_store, "plan", "tok")


def test_read_raises_key_error_if_key_absent(tcp_store: dist.Store) -> None:
    with pytest.raises(KeyError):
        read(tcp_store, "nothing", "tok", timeout_s=0)
    start = time.monotonic()
    with pytest.raises(KeyError):
        read(tcp_store, "nothing", "tok", timeout_s=0.2)
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("value", [[1, 2], {"x": float("nan")}, {"x": object()}])
def test_publish_raises_type_error_if_not_json_object(tcp_store: dist.Store, value: object) -> None:
    with pytest.raises(TypeError):
        publish(tcp_store, "plan", value, "tok")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------------------
# etcd
# ---------------------------------------------------------------------------------------------------------------
def test_etcd_server_raises_clear_error_if_binary_missing() -> None:
    with pytest.raises(EtcdBinaryMissingError, match="apt-get install etcd-server"):
        EtcdServer(binary="parcae-no-such-etcd-binary").start()


@needs_etcd
def test_etcd_server_removes_temp_dir_if_stopped() -> None:
    server = EtcdServer()
    try:
        server.start()
        data = server._tmp_dir
        assert server.running and data is not None and data.exists()
    finally:
        server.stop()
    assert not server.running and not data.exists()


@needs_etcd
def test_etcd_store_sets_gets_adds_and_waits_if_server_running(etcd_server: EtcdServer) -> None:
    url = etcd_server.store_url("/parcae/t-basic")
    host_store(url, token="tok")
    a = connect_store(url, token="tok")
    b = connect_store(url, token="tok", op_timeout_s=2)
    a.set("key10?", "v")  # standard base64 of this key contains '/', which torch's EtcdStore never finds again
    assert b.get("key10?") == b"v"
    assert a.add("n", 2) == 2 and b.add("n", 3) == 5
    assert b.compare_set("leader", "", "a") == b"a" and a.compare_set("leader", "", "b") == b"a"
    b.wait(["key10?"], timedelta(seconds=1))
    with pytest.raises(LookupError):
        b.wait(["never"], timedelta(seconds=0.2))
    publish(a, "plan", {"gen": 1}, "tok")
    assert read(b, "plan", "tok") == {"gen": 1}


def _job_store(etcd_server: EtcdServer, prefix: str) -> Any:
    """A job's etcd store under ``prefix`` (token ``tok``), with a short operation timeout for missing keys."""
    url = etcd_server.store_url(prefix)
    host_store(url, token="tok")
    return connect_store(url, token="tok", op_timeout_s=0.5)


@needs_etcd
def test_etcd_multi_get_reads_the_job_directory_once_for_all_keys(etcd_server: EtcdServer) -> None:
    """Regression (issue 21): torch's EtcdStore reads the job's whole directory for every ``get``, and its inherited
    ``multi_get`` is one ``get`` per key -- the leader's read of 32 heartbeats was 32 directory reads (29 ms on
    loopback). Now one read, values in the order asked (a key asked twice too), and a missing key still waits and
    fails like ``get``."""
    store = _job_store(etcd_server, "/parcae/t-multi")
    for k in range(8):
        store.set(f"parcae/hb/i{k}", f"beat {k}")
    reads: list[str] = []
    real_get = store.client.get
    store.client.get = lambda key, **kw: (reads.append(key), real_get(key, **kw))[1]
    keys = [f"parcae/hb/i{k}" for k in (3, 0, 7, 3)]
    assert store.multi_get(keys) == [b"beat 3", b"beat 0", b"beat 7", b"beat 3"]
    assert len(reads) == 1
    with pytest.raises(LookupError, match="not all found"):
        store.multi_get(["parcae/hb/i1", "parcae/hb/never"])


@needs_etcd
def test_etcd_store_isolates_jobs_if_prefixes_differ(etcd_server: EtcdServer) -> None:
    one = host_store(etcd_server.store_url("/parcae/job-one"), token="tok1")
    two = host_store(etcd_server.store_url("/parcae/job-two"), token="tok2")
    one.set("x", "1")
    assert not two.check(["x"])
    with pytest.raises(WrongTokenError, match="another job's token"):
        host_store(etcd_server.store_url("/parcae/job-one"), token="tok2")
    with pytest.raises(WrongTokenError):
        connect_store(etcd_server.store_url("/parcae/job-two"), token="tok1")


@pytest.mark.skipif(not HAVE_PYTHON_ETCD, reason="needs python-etcd (pip install python-etcd)")
def test_connect_store_fails_fast_if_etcd_unreachable() -> None:
    start = time.monotonic()
    with pytest.raises(CoordinationError, match="is the launcher running"):
        connect_store(f"etcd://127.0.0.1:{_free_port()}/parcae/x", token=None, timeout_s=1.0)
    assert time.monotonic() - start < 5.0


_AGENT = r"""
import datetime, json, os, sys
import torch, torch.distributed as dist
from lightning_parcae.runtime.store import TokenStore, connect_store

url, token, rank, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
store = connect_store(url, token=token, timeout_s=10)
ts = TokenStore(store, token)
ts.publish(f"members/{rank}", {"rank": rank, "pid": os.getpid()})
dist.init_process_group("gloo", store=dist.PrefixStore("gen/0/", store), rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=20))
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
members = [ts.read(f"members/{r}", timeout_s=10)["rank"] for r in range(world)]
dist.destroy_process_group()
print(json.dumps({"rank": rank, "sum": t.item(), "members": members}))
"""


@needs_etcd
@pytest.mark.multiprocess
def test_etcd_store_rendezvous_three_agents_if_token_shared(etcd_server: EtcdServer) -> None:
    url, token, world = etcd_server.store_url("/parcae/t-rdzv"), "job-secret", 3
    host_store(url, token=token)
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _AGENT, url, token, str(rank), str(world)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(world)
    ]
    try:
        outs = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    results = sorted((json.loads(out.strip().splitlines()[-1]) for out, _ in outs), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1, 2]
    assert all(r["sum"] == 6.0 and r["members"] == [0, 1, 2] for r in results)


def test_a_record_encoded_for_one_key_decodes_only_there_and_only_with_the_token() -> None:
    """The signed envelope ``compare_set`` writers (coordinator, agent rendezvous) build with the public helpers."""
    from lightning_parcae.runtime.store import TamperedRecordError, decode_record, encode_record

    raw = encode_record("parcae/x", {"round": 1}, "tok")
    assert decode_record("parcae/x", raw, "tok") == {"round": 1}
    with pytest.raises(TamperedRecordError, match="copied from another key"):
        decode_record("parcae/y", raw, "tok")
    with pytest.raises(TamperedRecordError, match="without this job's token"):
        decode_record("parcae/x", raw, "other")


@needs_etcd
def test_etcd_reads_of_present_keys_cost_one_key_not_the_job_directory(etcd_server: EtcdServer) -> None:
    """Regression (issue 21): torch's EtcdStore answered every ``get``, ``check`` and ``wait`` by reading the job's
    whole directory, so each request grew with every key the job had ever written (gloo's rendezvous keys of every
    generation stay: 7.4 ms a get at 3,000 keys against 0.4 ms at 10), and a group build's N x (N - 1) address reads
    paid it each. A present key is now read alone; a missing one still waits for it (and times out) as before."""
    store = _job_store(etcd_server, "/parcae/t-direct")
    for k in range(50):
        store.set(f"gen/0/rank_{k}", "addr")
    reads: list[str] = []
    real_get = store.client.get
    store.client.get = lambda key, **kw: (reads.append(key), real_get(key, **kw))[1]
    directory = store.prefix
    assert store.get("gen/0/rank_7") == b"addr"
    assert store.check(["gen/0/rank_8"]) and not store.check(["gen/0/rank_99"])
    store.wait(["gen/0/rank_1", "gen/0/rank_2"])
    assert reads and directory not in reads  # every read above named its key
    with pytest.raises(LookupError):
        store.get("gen/0/never")  # waits for the op timeout, then fails like torch's get
    store.set("late", "v")
    assert store.get("late") == b"v"


@needs_etcd
def test_etcd_scope_keeps_a_rendezvous_out_of_the_job_directory_and_drops_as_one(etcd_server: EtcdServer) -> None:
    """Regression (issue 21): every generation's gloo rendezvous keys stayed in the job's etcd directory, so each
    listing of it (every wait for a key not there yet, the leader's batched heartbeat reads) grew with the job's age.
    A scope is a subdirectory: the job's listing shows it as one entry, and it is deleted with one request."""
    from lightning_parcae.runtime.store import drop_scopes, scoped

    store = _job_store(etcd_server, "/parcae/t-scope")
    for g in range(3):
        gen = scoped(store, f"gen/{g}")
        for r in range(20):
            gen.set(f"rank_{r}", f"addr {g}")
    store.set("parcae/hb/i0", "beat")
    assert scoped(store, "gen/1").get("rank_7") == b"addr 1"
    assert scoped(store, "gen/1/").check(["rank_19"]) and not scoped(store, "gen/1").check(["rank_20"])
    listing = store.client.get(key=store.prefix)
    assert len(list(listing.children)) == 1 + 3 + 1  # the token proof, three scopes, one heartbeat
    assert sorted(store.scope_names()) == ["gen/0", "gen/1", "gen/2"]
    assert drop_scopes(store, lambda name: name != "gen/2") in (["gen/0", "gen/1"], ["gen/1", "gen/0"])
    assert store.scope_names() == ["gen/2"]
    assert not scoped(store, "gen/0").check(["rank_7"])
    assert store.get("parcae/hb/i0") == b"beat" and scoped(store, "gen/2").get("rank_0") == b"addr 2"
    with pytest.raises(LookupError):  # a key of a dropped scope waits and fails like any missing key
        scoped(store, "gen/1").get("rank_7")


def test_scope_is_a_prefix_on_stores_that_cannot_list_and_rejects_unsafe_names() -> None:
    from lightning_parcae.runtime.store import drop_scopes, scoped

    base = dist.HashStore()
    base.set_timeout(timedelta(seconds=1))
    scoped(base, "gen/4").set("rank_0", "a")
    assert dist.PrefixStore("gen/4/", base).get("rank_0") == b"a"  # the keys the groups always used
    assert drop_scopes(base, lambda name: True) == []  # nothing listed, nothing removed
    assert scoped(base, "gen/4").get("rank_0") == b"a"
    for bad in ("", "/", "gen/../x", "gen 4", "gen/4.5"):
        with pytest.raises(ValueError, match="scope name"):
            scoped(base, bad)


@needs_etcd
def test_etcd_check_of_several_keys_is_one_read_and_no_watch(etcd_server: EtcdServer) -> None:
    """A generation's arrival barrier checks all N ranks' keys at each poll; torch's ``check`` of several keys also
    posts a watch (with a 1 us timeout) whenever one is missing -- a second request per poll, an error path per
    poll. Now one directory read, present or not."""
    store = _job_store(etcd_server, "/parcae/t-check")
    for r in range(4):
        store.set(f"arrived/{r}", "1")
    calls = record_client_calls(store)
    assert store.check([f"arrived/{r}" for r in range(4)])
    assert not store.check([f"arrived/{r}" for r in range(5)])
    assert calls == ["get", "get"]


@needs_etcd
def test_etcd_wait_for_wakes_on_the_key_alone_and_times_out_without_error(etcd_server: EtcdServer) -> None:
    """Regression (issue 21): a member waiting for its step's commit decision polled the key every 20 ms -- up to 50
    requests a second per waiting member, each a round trip on a cluster. ``wait_for`` reads once and then watches
    that key alone: other keys written meanwhile (heartbeats) do not wake it, the key's write does, at once."""
    store = _job_store(etcd_server, "/parcae/t-waitfor")
    store.set("there", "1")
    calls = record_client_calls(store)
    assert store.wait_for("there", 1.0) and calls == ["get"]  # present: one read, no watch

    calls.clear()
    writer = connect_store(etcd_server.store_url("/parcae/t-waitfor"), token="tok")
    stop = [False]

    def heartbeats() -> None:  # another key written 100 times a second while the waiter waits
        c = 0
        while not stop[0]:
            writer.set("parcae/hb/x", str(c))
            c += 1
            time.sleep(0.01)

    beat = threading.Thread(target=heartbeats, daemon=True)
    beat.start()
    t0 = time.monotonic()
    assert not store.wait_for("decision", 0.4)  # never written: False after the slice, no exception
    assert 0.35 <= time.monotonic() - t0 < 2.0
    assert calls == ["get", "watch"], calls  # the heartbeats did not wake the watch

    written_at = [0.0]

    def decide() -> None:
        time.sleep(0.3)
        written_at[0] = time.monotonic()
        writer.set("decision", "apply")

    threading.Thread(target=decide, daemon=True).start()
    calls.clear()
    assert store.wait_for("decision", 5.0)
    woke_after = time.monotonic() - written_at[0]
    stop[0] = True
    beat.join(2)
    assert calls == ["get", "watch"], calls
    assert woke_after < 0.1, f"woke {woke_after:.3f} s after the write"
    writer.delete_key("decision")
    assert not store.wait_for("decision", 0.05)


@needs_etcd
def test_etcd_wait_for_all_returns_at_the_next_write_under_the_scope(etcd_server: EtcdServer) -> None:
    """A rendezvous's arrival barrier on etcd waits in a watch of its scope: one read and one watch per arrival, the
    watch ended by the arrival's write, not by a timer; a scope with nothing written yet is waited on too."""
    store = _job_store(etcd_server, "/parcae/t-waitall")
    scope = scoped(store, "gen/3")
    calls = record_client_calls(scope)
    keys = [f"arrived/{r}" for r in range(3)]
    t0 = time.monotonic()
    assert not scope.wait_for_all(keys, 0.3)  # an empty scope: a watch until the slice ends
    assert 0.25 <= time.monotonic() - t0 < 2.0 and calls == ["get", "watch"]
    other = scoped(_job_store(etcd_server, "/parcae/t-waitall"), "gen/3")
    arrivals = iter(keys)
    writes: list[float] = []

    def arrive() -> None:
        writes.append(time.monotonic())
        other.set(next(arrivals), "1")

    for delay in (0.1, 0.2, 0.3):
        threading.Timer(delay, arrive).start()
    calls.clear()
    wakes = []
    while not scope.wait_for_all(keys, 5.0):
        wakes.append(time.monotonic())
    assert len(wakes) <= 3 and len(writes) == 3  # woken by arrivals (two or three), never by the 5 s slice
    assert all(w - writes[i] < 0.1 for i, w in enumerate(wakes)), (wakes, writes)
    assert calls.count("watch") == len(wakes) and calls.count("get") == len(wakes) + 1


@needs_etcd
def test_read_if_present_is_one_request_on_etcd_and_never_waits(etcd_server: EtcdServer) -> None:
    """A present key is read with one request, an absent one is None at once (``get`` would wait for it); other
    stores answer the same through ``check`` and ``get``."""
    store = _job_store(etcd_server, "/parcae/t-present")
    store.set("k", "v")
    calls = record_client_calls(store)
    t0 = time.monotonic()
    assert read_if_present(store, "k") == b"v" and read_if_present(store, "missing") is None
    assert calls == ["get", "get"] and time.monotonic() - t0 < 0.4  # the store's op timeout is 0.5 s
    hashed = dist.HashStore()
    hashed.set("k", "v")
    assert read_if_present(hashed, "k") == b"v" and read_if_present(hashed, "missing") is None


@needs_etcd
def test_count_in_tallies_each_participant_once_with_two_requests(etcd_server: EtcdServer) -> None:
    store = _job_store(etcd_server, "/parcae/t-tally")
    assert [count_in(store, "commit/1/2", m) for m in ("a", "b", "a")] == [1, 2, 2]
    assert count_in(dist.HashStore(), "commit/1/2", "a") is None  # other stores: the caller's atomic add


@needs_etcd
def test_etcd_keeps_heartbeats_and_signals_out_of_the_job_directory_under_their_own_names(
        etcd_server: EtcdServer) -> None:
    """Heartbeat keys live in ``beats/``, abort and notice keys in ``signals/`` (``KEY_DIRECTORIES``), so that a
    leader lists N beats and a watcher watches rare writes; every store operation still finds them by name."""
    store = _job_store(etcd_server, "/parcae/t-dirs")
    for k in range(4):
        store.set(f"parcae/hb/i{k}", f"beat {k}")
    store.set("parcae/abort/3", "i2 missed heartbeats")
    store.set("parcae/notice/i1", "notice")
    store.set("parcae/plan/3", "plan")
    names = {c.key.rsplit("/", 1)[-1] for c in store.client.get(key=store.prefix).children}
    assert {"beats", "signals"} <= names and len(names) == 4  # the auth proof, the plan and two directories
    assert store.get("parcae/hb/i2") == b"beat 2" and store.check(["parcae/abort/3", "parcae/notice/i1"])
    assert store.check(["parcae/hb/i0", "parcae/plan/3"]) and not store.check(["parcae/hb/i0", "parcae/hb/i9"])
    assert store.multi_get(["parcae/hb/i3", "parcae/plan/3"]) == [b"beat 3", b"plan"]
    store.wait(["parcae/abort/3", "parcae/plan/3"])
    assert store.compare_set("parcae/abort/4", "", "first") == b"first"
    assert store.compare_set("parcae/abort/4", "", "second") == b"first"
    assert read_if_present(store, "parcae/notice/i1") == b"notice" and read_if_present(store, "parcae/notice/i0") is None
    assert store.scope_names() == []  # the directories are not scopes (retire_scopes never drops them)
    with pytest.raises(ValueError, match="not a counter"):
        store.add("parcae/hb/i0", 1)
    with pytest.raises(ValueError, match="waits on one directory"):
        store.wait_for_all(["parcae/hb/i0", "parcae/plan/3"], 0.1)
    threading.Timer(0.2, lambda: _job_store(etcd_server, "/parcae/t-dirs").set("parcae/hb/late", "b")).start()
    assert store.get("parcae/hb/late") == b"b"  # a get waits for a key of a directory too
    with pytest.raises(LookupError, match="not found"):
        store.get("parcae/notice/never")
    assert store.delete_key("parcae/notice/i1") and not store.check(["parcae/notice/i1"])
    calls = record_client_calls(store)
    assert store.read_present([f"parcae/hb/i{k}" for k in range(6)]) == {f"parcae/hb/i{k}": f"beat {k}".encode()
                                                                         for k in range(4)}
    assert calls == ["get"]  # one listing of beats/, present or not


@needs_etcd
def test_etcd_snapshot_and_await_change_see_signals_and_sleep_through_heartbeats(etcd_server: EtcdServer) -> None:
    store = _job_store(etcd_server, "/parcae/t-signals")
    writer = _job_store(etcd_server, "/parcae/t-signals")
    assert store.snapshot("signals")[0] == {}  # nothing written there yet
    writer.set("parcae/notice/i0", "n")
    values, index = store.snapshot("signals")
    assert values == {"parcae/notice/i0": b"n"}
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.02):
            writer.set("parcae/hb/i0", str(time.time()))

    threading.Thread(target=beat, daemon=True).start()
    t0 = time.monotonic()
    assert not store.await_change("signals", index, 0.5)  # 25 heartbeat writes meanwhile: none wakes it
    assert time.monotonic() - t0 >= 0.45
    threading.Timer(0.2, lambda: writer.set("parcae/abort/7", "why")).start()
    t0 = time.monotonic()
    assert store.await_change("signals", store.snapshot("signals")[1], 5.0)
    assert time.monotonic() - t0 < 1.0
    stop.set()
    assert store.snapshot("signals")[0]["parcae/abort/7"] == b"why"
