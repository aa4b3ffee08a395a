"""Preemption-notice sources against local servers that speak each cloud's metadata protocol.

Every HTTP test talks to a ``http.server`` bound to 127.0.0.1 on a random port; the real metadata addresses are
never contacted (each source gets ``base_url`` of the local server, ``auto`` gets injected URLs).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from email.utils import format_datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pytest

from lightning_parcae.signals.notices import (
    AwsNoticeSource,
    AzureNoticeSource,
    GcpNoticeSource,
    Notice,
    NoticeSource,
    NoticeWatcher,
    ReplayNoticeSource,
    SignalNoticeSource,
    detect_cloud,
    make_notice_source,
)
from lightning_parcae.errors import ConfigurationError, NoticeSourceError


# ---------------------------------------------------------------------------------------------------------------
# A local metadata server speaking the AWS IMDSv2, GCP and Azure Scheduled Events protocols
# ---------------------------------------------------------------------------------------------------------------
@dataclass
class FakeMetadata:
    """State of the fake metadata server; tests mutate it between polls."""

    # AWS
    tokens: dict[str, float] = field(default_factory=dict)  # token -> expiry (time.monotonic)
    token_puts: int = 0
    unauthorized: int = 0
    reject_all_tokens: bool = False
    instance_id: str = "i-0123456789abcdef0"
    instance_action: Any = None  # dict -> JSON, bytes -> raw body, None -> 404
    rebalance: Any = None
    # GCP
    gcp_flavor: str = "Google"  # header value the server requires
    gcp_name: str = "gce-node-1"
    preempted: str = "FALSE"
    maintenance: str = "NONE"
    # Azure
    azure_header: str = "true"  # value of the Metadata header the server requires
    azure_doc: Any = field(default_factory=lambda: {"DocumentIncarnation": 0, "Events": []})
    acks: list[Any] = field(default_factory=list)
    # What each path answered with
    requests: list[tuple[str, str]] = field(default_factory=list)


def _make_handler(state: FakeMetadata) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # keep test output clean
            pass

        def _send(
            self, code: int, body: bytes | str | dict[str, Any] = b"", headers: dict[str, str] | None = None
        ) -> None:
            if isinstance(body, dict):
                body = json.dumps(body)
            if isinstance(body, str):
                body = body.encode()
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def _body(self) -> bytes:
            n = int(self.headers.get("Content-Length") or 0)
            return self.rfile.read(n) if n else b""

        def do_PUT(self) -> None:
            state.requests.append(("PUT", self.path))
            self._body()
            if self.path != "/latest/api/token":
                return self._send(404)
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            if ttl is None or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return self._send(400)
            token = secrets.token_urlsafe(16)
            state.tokens[token] = time.monotonic() + int(ttl)
            state.token_puts += 1
            self._send(200, token, {"X-aws-ec2-metadata-token-ttl-seconds": ttl})

        def do_GET(self) -> None:
            state.requests.append(("GET", self.path))
            path = urlsplit(self.path).path
            if path.startswith("/latest/"):
                return self._aws(path)
            if path.startswith("/computeMetadata/"):
                return self._gcp(path)
            if path == "/metadata/scheduledevents":
                if self.headers.get("Metadata") != state.azure_header:
                    return self._send(400, {"error": "Bad request. Required metadata header not specified"})
                doc = state.azure_doc
                return self._send(200, doc if isinstance(doc, (dict, bytes)) else json.dumps(doc))
            self._send(404)

        def do_POST(self) -> None:
            state.requests.append(("POST", self.path))
            body = self._body()
            if urlsplit(self.path).path != "/metadata/scheduledevents" or self.headers.get("Metadata") != "true":
                return self._send(400)
            state.acks.append(json.loads(body))
            self._send(200)

        def _aws(self, path: str) -> None:
            token = self.headers.get("X-aws-ec2-metadata-token")
            expiry = state.tokens.get(token or "")
            if state.reject_all_tokens or expiry is None or expiry < time.monotonic():
                state.unauthorized += 1
                return self._send(401)
            answers = {
                "/latest/meta-data/instance-id": state.instance_id,
                "/latest/meta-data/spot/instance-action": state.instance_action,
                "/latest/meta-data/events/recommendations/rebalance": state.rebalance,
            }
            value = answers.get(path)
            self._send(404, "Not Found") if value is None else self._send(200, value)

        def _gcp(self, path: str) -> None:
            if self.headers.get("Metadata-Flavor") != state.gcp_flavor:
                return self._send(403, "Missing required header: Metadata-Flavor")
            answers = {
                "/computeMetadata/v1/instance/id": "4520031799277581759",
                "/computeMetadata/v1/instance/name": state.gcp_name,
                "/computeMetadata/v1/instance/preempted": state.preempted,
                "/computeMetadata/v1/instance/maintenance-event": state.maintenance,
            }
            value = answers.get(path)
            if value is None:
                return self._send(404)
            self._send(200, value, {"Metadata-Flavor": "Google", "Content-Type": "application/text"})

    return Handler


@pytest.fixture
def metadata() -> Iterator[tuple[FakeMetadata, str]]:
    """A fake metadata server on 127.0.0.1 (random port), stopped after the test."""
    state = FakeMetadata()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _make_handler(state))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def dead_url() -> str:
    """A loopback URL on which nothing listens (the port was just released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------------------------------------------------------
# AWS
# ---------------------------------------------------------------------------------------------------------------
def test_aws_source_returns_nothing_if_no_interruption_scheduled(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    src = AwsNoticeSource(url)
    assert src.poll() == []
    assert src.instance == state.instance_id
    assert state.unauthorized == 0 and state.token_puts == 1


def test_aws_source_reports_preempt_once_if_instance_action_present(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    when = time.time() + 120
    state.instance_action = {"action": "terminate", "time": _iso(when)}
    src = AwsNoticeSource(url)
    [notice] = src.poll()
    assert notice.instance == state.instance_id and notice.kind == "preempt" and notice.source == "aws"
    assert notice.deadline_s == pytest.approx(int(when), abs=1)
    assert notice.detail == {"action": "terminate", "time": _iso(when)}
    assert src.poll() == []  # deduplicated
    assert state.token_puts == 1  # the token is reused between polls


def test_aws_source_reports_rebalance_as_advisory_if_recommended(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    state.rebalance = {"noticeTime": "2026-01-05T18:02:00Z"}
    [notice] = AwsNoticeSource(url).poll()
    assert notice.kind == "rebalance" and math.isinf(notice.deadline_s)


def test_aws_source_refreshes_token_if_ttl_nearly_over(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    mono = FakeClock(0.0)
    src = AwsNoticeSource(url, token_ttl_s=100, monotonic=mono)
    src.poll()
    mono.t = 50.0
    src.poll()
    assert state.token_puts == 1
    mono.t = 81.0  # past ttl - 20 % margin: renew before the server would refuse it
    src.poll()
    assert state.token_puts == 2 and state.unauthorized == 0


def test_aws_source_refreshes_token_once_if_server_answers_401(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    src = AwsNoticeSource(url)
    src.poll()
    state.tokens.clear()  # the server forgot every token (e.g. IMDS restarted)
    state.instance_action = {"action": "stop", "time": _iso(time.time() + 100)}
    [notice] = src.poll()
    assert notice.detail["action"] == "stop"
    assert state.token_puts == 2 and state.unauthorized == 1


def test_aws_source_raises_if_fresh_token_rejected(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    state.reject_all_tokens = True
    with pytest.raises(NoticeSourceError, match="rejected a freshly issued token"):
        AwsNoticeSource(url).poll()
    assert state.token_puts == 2  # one refresh, not a loop


@pytest.mark.parametrize(
    "body, match",
    [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "not an object"),
        (b'{"action": 5, "time": "2026-01-01T00:00:00Z"}', "expected string"),
        (b"\xff\xfe", "not UTF-8"),
    ],
)
def test_aws_source_raises_notice_source_error_if_body_malformed(
    metadata: tuple[FakeMetadata, str], body: bytes, match: str
) -> None:
    state, url = metadata
    state.instance_action = body
    with pytest.raises(NoticeSourceError, match=match):
        AwsNoticeSource(url).poll()


def test_aws_source_uses_default_grace_if_time_unparsable(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    state.instance_action = {"action": "terminate", "time": "soon"}
    [notice] = AwsNoticeSource(url, default_grace_s=120, clock=FakeClock(500.0)).poll()
    assert notice.deadline_s == 620.0 and notice.detail["time_unparsed"] is True


def test_aws_source_still_reports_preempt_if_rebalance_endpoint_broken(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    state.rebalance = b"{garbage"
    with pytest.raises(NoticeSourceError, match="malformed JSON"):
        AwsNoticeSource(url).poll()  # nothing pending: the error is reported
    state.instance_action = {"action": "terminate", "time": _iso(time.time() + 120)}
    [notice] = AwsNoticeSource(url).poll()  # a pending preemption is never held back by the advisory endpoint
    assert notice.kind == "preempt"


def test_aws_source_refuses_body_if_oversized(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    state.instance_action = b"x" * (200 * 1024)
    with pytest.raises(NoticeSourceError, match="more than"):
        AwsNoticeSource(url).poll()


def test_aws_source_raises_fast_if_server_down(dead_url: str) -> None:
    start = time.monotonic()
    with pytest.raises(NoticeSourceError, match="cannot reach"):
        AwsNoticeSource(dead_url, timeout_s=0.5).poll()
    assert time.monotonic() - start < 2.0


def test_aws_source_raises_configuration_error_if_ttl_out_of_range() -> None:
    with pytest.raises(ConfigurationError, match="token_ttl_s"):
        AwsNoticeSource("http://127.0.0.1:9", token_ttl_s=0)


# ---------------------------------------------------------------------------------------------------------------
# GCP
# ---------------------------------------------------------------------------------------------------------------
def test_gcp_source_returns_nothing_if_not_preempted(metadata: tuple[FakeMetadata, str]) -> None:
    _, url = metadata
    src = GcpNoticeSource(url)
    assert src.poll() == []
    assert src.instance == "gce-node-1"


def test_gcp_source_reports_preempt_once_if_flag_true(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    clock = FakeClock(1000.0)
    src = GcpNoticeSource(url, grace_s=30, clock=clock)
    src.poll()
    state.preempted = "TRUE"
    clock.t = 1005.0
    [notice] = src.poll()
    assert (notice.instance, notice.kind, notice.source, notice.deadline_s) == ("gce-node-1", "preempt", "gcp", 1035.0)
    clock.t = 1010.0
    assert src.poll() == []


def test_gcp_source_raises_if_metadata_header_refused(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    state.gcp_flavor = "SomethingElse"  # the server now refuses our Metadata-Flavor: Google with 403
    with pytest.raises(NoticeSourceError, match="403"):
        GcpNoticeSource(url).poll()


def test_gcp_source_raises_if_flag_not_true_or_false(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    state.preempted = "MAYBE"
    with pytest.raises(NoticeSourceError, match="not TRUE/FALSE"):
        GcpNoticeSource(url).poll()


def test_gcp_source_reports_terminate_if_host_maintenance_terminates(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    src = GcpNoticeSource(url, watch_maintenance=True, clock=FakeClock(0.0))
    state.maintenance = "MIGRATE_ON_HOST_MAINTENANCE"
    assert src.poll() == []  # live migration: the instance stays
    state.maintenance = "TERMINATE_ON_HOST_MAINTENANCE"
    [notice] = src.poll()
    assert notice.kind == "terminate" and notice.deadline_s == 60.0
    assert src.poll() == []


# ---------------------------------------------------------------------------------------------------------------
# Azure
# ---------------------------------------------------------------------------------------------------------------
def _azure_event(
    event_id: str, kind: str, resources: list[str], not_before: float | None, status: str = "Scheduled"
) -> dict[str, Any]:
    return {
        "EventId": event_id,
        "EventType": kind,
        "ResourceType": "VirtualMachine",
        "Resources": resources,
        "EventStatus": status,
        "NotBefore": format_datetime(datetime.fromtimestamp(not_before, tz=timezone.utc), usegmt=True)
        if not_before is not None
        else "",
        "Description": "",
        "EventSource": "Platform",
        "DurationInSeconds": -1,
    }


def test_azure_source_returns_nothing_if_no_events(metadata: tuple[FakeMetadata, str]) -> None:
    _, url = metadata
    assert AzureNoticeSource(url).poll() == []


def test_azure_source_reports_each_vm_once_if_preempt_scheduled(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    when = float(int(time.time()) + 30)
    state.azure_doc = {"DocumentIncarnation": 1, "Events": [_azure_event("E1", "Preempt", ["vm1", "vm2"], when)]}
    src = AzureNoticeSource(url)
    notices = src.poll()
    assert sorted(n.instance for n in notices) == ["vm1", "vm2"]
    assert all(n.kind == "preempt" and n.deadline_s == when and n.detail["EventId"] == "E1" for n in notices)
    started = _azure_event("E1", "Preempt", ["vm1", "vm2"], None, "Started")
    state.azure_doc = {"DocumentIncarnation": 2, "Events": [started]}
    assert src.poll() == []  # status change of the same event is not a new notice
    assert state.acks == []  # acknowledging is opt-in


def test_azure_source_ignores_freeze_and_other_vms_if_instance_given(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    state.azure_doc = {
        "DocumentIncarnation": 3,
        "Events": [
            _azure_event("F1", "Freeze", ["vm1"], time.time() + 15),
            _azure_event("T1", "Terminate", ["vm2"], time.time() + 300),
            _azure_event("P1", "Preempt", ["vm1"], time.time() + 30),
        ],
    }
    [notice] = AzureNoticeSource(url, instance="vm1").poll()
    assert (notice.instance, notice.kind, notice.detail["EventId"]) == ("vm1", "preempt", "P1")


def test_azure_source_acknowledges_own_event_if_opted_in(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    state.azure_doc = {"DocumentIncarnation": 1, "Events": [_azure_event("P9", "Preempt", ["vm1"], time.time() + 30)]}
    src = AzureNoticeSource(url, instance="vm1", acknowledge=True)
    assert len(src.poll()) == 1
    assert state.acks == [{"StartRequests": [{"EventId": "P9"}]}]
    src.poll()
    assert len(state.acks) == 1 and src.ack_failures == 0


def test_azure_source_refuses_acknowledge_if_instance_unknown() -> None:
    with pytest.raises(ConfigurationError, match="instance"):
        AzureNoticeSource("http://127.0.0.1:9", acknowledge=True)


def test_azure_source_raises_if_metadata_header_refused(metadata: tuple[FakeMetadata, str]) -> None:
    state, url = metadata
    state.azure_header = "yes-please"  # the server refuses our "Metadata: true" with 400
    with pytest.raises(NoticeSourceError, match="400"):
        AzureNoticeSource(url).poll()


@pytest.mark.parametrize(
    "doc, match",
    [
        (b"<html>", "malformed JSON"),
        ({"Events": "none"}, "no 'Events' list"),
        ({"Events": [{"EventId": 1, "EventType": "Preempt", "Resources": ["vm1"]}]}, "malformed event"),
        ({"Events": [{"EventId": "E", "EventType": "Preempt", "Resources": "vm1"}]}, "malformed event"),
    ],
)
def test_azure_source_raises_notice_source_error_if_document_malformed(
    metadata: tuple[FakeMetadata, str], doc: Any, match: str
) -> None:
    state, url = metadata
    state.azure_doc = doc
    with pytest.raises(NoticeSourceError, match=match):
        AzureNoticeSource(url).poll()


# ---------------------------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------------------------
def test_signal_source_reports_once_if_sigterm_delivered() -> None:
    before = signal.getsignal(signal.SIGTERM)
    src = SignalNoticeSource(grace_s=25, instance="me", clock=FakeClock(100.0))
    try:
        assert src.poll() == []
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        [notice] = src.poll()
        assert (notice.instance, notice.kind, notice.source, notice.deadline_s) == ("me", "terminate", "sigterm", 125.0)
        assert notice.detail["signal"] == "SIGTERM" and src.received == 2
        assert src.poll() == []
    finally:
        src.close()
    assert signal.getsignal(signal.SIGTERM) is before


def test_signal_source_catches_configured_signal_if_not_sigterm() -> None:
    src = SignalNoticeSource([signal.SIGUSR1], grace_s=1)
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        [notice] = src.poll()
        assert notice.detail["signal"] == "SIGUSR1"
    finally:
        src.close()


def test_signal_source_raises_if_created_off_main_thread() -> None:
    errors: list[BaseException] = []

    def create() -> None:
        try:
            SignalNoticeSource().close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    th = threading.Thread(target=create)
    th.start()
    th.join(5)
    assert len(errors) == 1 and isinstance(errors[0], NoticeSourceError)


# ---------------------------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------------------------
def test_replay_source_announces_grace_before_removal_if_clock_advances() -> None:
    clock = FakeClock(0.0)
    src = ReplayNoticeSource([(100.0, "a"), (50.0, "b")], grace_s=30, clock=clock, origin_s=0.0)
    assert src.poll() == []
    clock.t = 20.0
    assert [(n.instance, n.deadline_s) for n in src.poll()] == [("b", 50.0)]
    clock.t = 69.9
    assert src.poll() == []
    clock.t = 200.0
    assert [(n.instance, n.deadline_s, n.kind) for n in src.poll()] == [("a", 100.0, "preempt")]
    assert src.poll() == [] and src.remaining == 0


@pytest.mark.parametrize("events", [[(1.0,)], [("x", "a")], [(math.nan, "a")], [(1.0, "")]])
def test_replay_source_raises_configuration_error_if_event_malformed(events: list[Any]) -> None:
    with pytest.raises(ConfigurationError):
        ReplayNoticeSource(events)


# ---------------------------------------------------------------------------------------------------------------
# Factory and auto-detection
# ---------------------------------------------------------------------------------------------------------------
def test_make_notice_source_lists_names_if_unknown() -> None:
    with pytest.raises(ConfigurationError, match="aws, gcp, azure, sigterm, replay, auto"):
        make_notice_source("oracle")


def test_make_notice_source_raises_configuration_error_if_option_unknown() -> None:
    with pytest.raises(ConfigurationError, match="bad options"):
        make_notice_source("replay", events=[], nonsense=1)


def test_make_notice_source_picks_gcp_if_only_gcp_answers(metadata: tuple[FakeMetadata, str], dead_url: str) -> None:
    _, url = metadata
    urls = {"aws": dead_url, "gcp": url, "azure": dead_url}
    src = make_notice_source("auto", base_urls=urls, probe_timeout_s=0.5, grace_s=12.0, token_ttl_s=60)
    assert isinstance(src, GcpNoticeSource) and src.base_url == url and src.grace_s == 12.0


def test_detect_cloud_finds_aws_if_token_endpoint_answers(metadata: tuple[FakeMetadata, str], dead_url: str) -> None:
    state, url = metadata
    state.gcp_flavor = "nobody"
    state.azure_header = "nobody"
    assert detect_cloud({"aws": url, "gcp": url, "azure": url}, timeout_s=0.5) == "aws"


def test_make_notice_source_falls_back_to_sigterm_if_nothing_answers(dead_url: str) -> None:
    start = time.monotonic()
    src = make_notice_source("auto", base_urls={"aws": dead_url, "gcp": dead_url, "azure": dead_url}, grace_s=5.0)
    try:
        assert isinstance(src, SignalNoticeSource) and src.grace_s == 5.0
        assert time.monotonic() - start < 2.0
    finally:
        src.close()


# ---------------------------------------------------------------------------------------------------------------
# Watcher
# ---------------------------------------------------------------------------------------------------------------
class _BrokenSource(NoticeSource):
    name = "broken"

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _poll_all(self) -> list[Notice]:
        self.calls += 1
        raise NoticeSourceError("metadata answered nonsense")


@pytest.fixture
def watchers() -> Iterator[list[NoticeWatcher]]:
    """Collects watchers a test starts and stops them whatever happens."""
    started: list[NoticeWatcher] = []
    try:
        yield started
    finally:
        for w in started:
            w.stop()


def _wait_until(cond: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_notice_watcher_calls_back_once_if_notice_seen_repeatedly(watchers: list[NoticeWatcher]) -> None:
    clock = FakeClock(0.0)
    src = ReplayNoticeSource([(10.0, "a")], grace_s=5, clock=clock, origin_s=0.0)
    got: list[Notice] = []
    watcher = NoticeWatcher(src, got.append, interval_s=0.005)
    watchers.append(watcher.start())
    _wait_until(lambda: watcher.rounds >= 2)
    assert got == []
    clock.t = 6.0
    _wait_until(lambda: len(got) == 1)
    rounds = watcher.rounds
    _wait_until(lambda: watcher.rounds >= rounds + 3)
    assert [n.instance for n in got] == ["a"] and watcher.delivered == 1
    watcher.stop()
    assert not watcher.alive


def test_notice_watcher_keeps_polling_if_source_or_callback_raises(watchers: list[NoticeWatcher]) -> None:
    broken = _BrokenSource()
    good = ReplayNoticeSource([(0.0, "a"), (0.0, "b")], grace_s=0, clock=FakeClock(1.0), origin_s=0.0)
    got: list[str] = []

    def callback(notice: Notice) -> None:
        got.append(notice.instance)
        if notice.instance == "a":
            raise RuntimeError("consumer bug")

    watcher = NoticeWatcher([broken, good], callback, interval_s=0.005)
    watchers.append(watcher.start())
    _wait_until(lambda: broken.calls >= 3)
    assert watcher.alive
    assert sorted(got) == ["a", "b"] and watcher.callback_errors == 1
    assert watcher.errors >= 3 and isinstance(watcher.last_error, NoticeSourceError)
