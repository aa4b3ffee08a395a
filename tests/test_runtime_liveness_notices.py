"""Preemption notices in the store: one signed format for every writer, and a worker that refuses any other.

Regression (issue 20): ``parcae agent`` wrote its notice as raw JSON (``store.set(key, json.dumps(rec))``) while
``parcae run``'s fleet signed its notices with the job token, contrary to ``contract.py`` ("only one module writes
and reads each record"). The worker's heartbeat thread did not even read the record: the *presence* of
``parcae/notice/<member>`` made it hand over and leave, so anyone who could reach the store could evict any member
of a token-protected job with one unsigned key. Now both writers build :func:`notice_record` and sign it with the
store's ``encode_record``, and the heartbeat thread accepts only a notice signed with the job token for its own
key: an unsigned, forged or copied one is logged (naming the key) and ignored.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Iterator

import pytest

from lightning_parcae.launch.agent import Agent, build_parser
from lightning_parcae.launch.job_store import JobStore
from lightning_parcae.runtime.liveness import (
    Liveness,
    decode_notice,
    encode_notice,
    notice_key,
    notice_record,
    read_notice,
    write_notice,
)
from lightning_parcae.runtime.store import TamperedRecordError, connect_store, encode_record, host_store, new_token

TOKEN = new_token()


@pytest.fixture
def url() -> Iterator[str]:
    server = host_store("tcp://127.0.0.1:0", token=TOKEN)
    yield f"tcp://127.0.0.1:{server.port}"


def _live(url: str, member: str) -> Liveness:
    return Liveness(lambda: connect_store(url, token=TOKEN), member, interval_s=0.05, dead_after_s=5.0, token=TOKEN)


def _client(url: str):  # type: ignore[no-untyped-def]
    return connect_store(url, token=TOKEN)


def test_a_signed_notice_makes_the_member_hand_over(url: str) -> None:
    live = _live(url, "i1").start()
    try:
        write_notice(_client(url), "i1", notice_record("i1", source="agent", why="SIGTERM"), TOKEN)
        assert live.noticed.wait(3.0)
    finally:
        live.stop()


def test_the_old_unsigned_raw_json_notice_of_the_agent_is_refused_with_a_warning(
        url: str, caplog: pytest.LogCaptureFixture) -> None:
    """What ``parcae agent`` used to write: its record as plain JSON, no signature."""
    live = _live(url, "i1").start()
    try:
        with caplog.at_level(logging.WARNING, logger="lightning_parcae.runtime.liveness"):
            raw = {"member": "i1", "kind": "preempt", "source": "agent", "why": "SIGTERM", "time": time.time()}
            _client(url).set(notice_key("i1"), json.dumps(raw))
            assert not live.noticed.wait(0.6)
        refusals = [r.getMessage() for r in caplog.records if "ignoring the notice" in r.getMessage()]
        assert len(refusals) == 1 and "parcae/notice/i1" in refusals[0]  # warned once, not at every beat
        # a real notice written afterwards still gets through
        write_notice(_client(url), "i1", notice_record("i1", source="agent"), TOKEN)
        assert live.noticed.wait(3.0)
    finally:
        live.stop()


def test_a_notice_forged_with_another_token_or_copied_from_another_member_is_refused(url: str) -> None:
    live = _live(url, "i1").start()
    try:
        store = _client(url)
        store.set(notice_key("i1"), encode_notice("i1", notice_record("i1", source="agent"), new_token()))
        assert not live.noticed.wait(0.5)
        # a validly signed notice of i2, replayed under i1's key
        store.set(notice_key("i1"), encode_record(notice_key("i2"), notice_record("i2", source="agent"), TOKEN))
        assert not live.noticed.wait(0.5)
    finally:
        live.stop()


def test_read_notice_verifies_and_names_the_key() -> None:
    store = host_store("tcp://127.0.0.1:0", token=TOKEN)
    assert read_notice(store, "i3", TOKEN) is None
    store.set(notice_key("i3"), b'{"kind": "preempt"}')
    with pytest.raises(TamperedRecordError, match="parcae/notice/i3"):
        read_notice(store, "i3", TOKEN)
    rec = notice_record("i3", source="replay", deadline=123.0)
    write_notice(store, "i3", rec, TOKEN)
    assert read_notice(store, "i3", TOKEN) == rec


def test_an_open_store_job_has_plain_json_notices_and_still_rejects_non_notices() -> None:
    rec = notice_record("a", source="agent")
    assert decode_notice("a", encode_notice("a", rec, None), None) == rec
    with pytest.raises(TamperedRecordError):
        decode_notice("a", b'{"kind": "shutdown"}', None)
    with pytest.raises(TamperedRecordError):
        decode_notice("a", json.dumps({**rec, "member": "b"}).encode(), None)
    with pytest.raises(ValueError, match="notice kind"):
        notice_record("a", source="agent", kind="bogus")


def test_the_agent_writes_its_notice_signed(url: str, tmp_path: Path) -> None:
    """Regression: this record used to go into the store as raw JSON."""
    token_file = tmp_path / "job.token"
    token_file.write_text(TOKEN + "\n")
    args = build_parser().parse_args(["--store", url, "--nodes", "1", "--member", "m0", "--token-file",
                                      str(token_file), "--", "true"])
    agent = Agent(args)
    agent._notice("SIGTERM to the agent")
    store = _client(url)
    rec = read_notice(store, "m0", TOKEN)
    assert rec is not None and rec["source"] == "agent" and rec["kind"] == "preempt"
    with pytest.raises(TamperedRecordError):  # signed, not plain JSON
        read_notice(store, "m0", None)


def test_the_launchers_notice_record_read_back_through_the_real_job_store() -> None:
    js = JobStore()
    js.open()
    try:
        js.publish(notice_key("i4"), notice_record("i4", source="replay", deadline=time.time() + 5))
        rec = read_notice(js.store, "i4", js.token)
        assert rec is not None and rec["source"] == "replay" and rec["deadline"] > time.time()
    finally:
        js.close()
