"""Preemption notices: learn that an instance is about to disappear, from whatever can tell us.

Problem: Parcae acts *before* a spot instance vanishes -- it migrates the stages that instance holds -- so it needs
the short warning each cloud gives (AWS ~2 min, GCP ~30 s, Azure >= 30 s), or at least the SIGTERM a
scheduler sends. Each cloud speaks its own metadata protocol, and a metadata endpoint can be slow, down, or answer
garbage; none of that may hang or kill training. This module turns every source into one small interface:
``poll()`` returns the *new* :class:`Notice` objects since the last poll, and :class:`NoticeWatcher` polls sources
from a background thread and calls back once per notice.

Sources and the kinds they produce:

=========  ==================================================================  ==================================
source     reads                                                               kinds
=========  ==================================================================  ==================================
aws        IMDSv2 ``spot/instance-action`` and ``events/recommendations/        ``preempt`` (terminate, stop,
           rebalance`` (token from ``PUT /latest/api/token``)                  hibernate), ``rebalance``
gcp        ``instance/preempted`` (and optionally ``maintenance-event``)        ``preempt``, ``terminate``
azure      Scheduled Events (``/metadata/scheduledevents``)                    ``preempt`` (Preempt),
                                                                               ``terminate`` (Terminate, Reboot,
                                                                               Redeploy); Freeze is ignored
sigterm    POSIX signals sent to this process (SIGTERM by default)              ``terminate``
replay     a list of (time, instance) removals and a clock (traces, tests)      ``preempt``
=========  ==================================================================  ==================================

Rules for bad input (the same for every HTTP source):

* Nothing received is unpickled or evaluated: bodies are size-limited (64 KiB), decoded as UTF-8 text or JSON.
* Requests use a short timeout (1 s by default), no HTTP proxy (metadata must never leave the host) and no
  redirects.
* **Unreachable, timed out, an unexpected HTTP status, a malformed body or wrong field types** make ``poll()`` raise
  :class:`~lightning_parcae.errors.NoticeSourceError` naming the URL -- never an empty list, because "no notice"
  and "cannot know" must stay distinguishable. :class:`NoticeWatcher` logs and counts these and keeps polling.
* The one exception: a notice that *is* there but whose time field cannot be parsed is still emitted (a missed
  preemption costs more than an early one), with the source's default grace and ``detail["time_unparsed"] = True``.

``deadline_s`` is an absolute ``time.time()`` (or the injected clock's) value at which the instance is expected to
be gone; advisory notices with no known deadline (AWS rebalance) carry ``math.inf``.
"""

from __future__ import annotations

import abc
import email.utils
import http.client
import inspect
import json
import logging
import math
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from types import FrameType, TracebackType
from typing import Any

from lightning_parcae.errors import ConfigurationError, NoticeSourceError, build_by_name

__all__ = [
    "Notice",
    "NoticeSource",
    "AwsNoticeSource",
    "GcpNoticeSource",
    "AzureNoticeSource",
    "SignalNoticeSource",
    "ReplayNoticeSource",
    "NoticeWatcher",
    "make_notice_source",
    "detect_cloud",
]

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024
AWS_METADATA_URL = "http://169.254.169.254"
GCP_METADATA_URL = "http://metadata.google.internal"
AZURE_METADATA_URL = "http://169.254.169.254"
KINDS = ("preempt", "rebalance", "terminate")


@dataclass(frozen=True)
class Notice:
    """One warning that an instance is going away.

    Attributes:
        instance: Instance / node id the notice is about.
        kind: ``"preempt"``, ``"rebalance"`` (advisory) or ``"terminate"``.
        deadline_s: Absolute time (``time.time()`` base, or the source's clock) at which the instance is expected
            gone; ``math.inf`` when unknown (advisory notices).
        source: ``"aws"``, ``"gcp"``, ``"azure"``, ``"sigterm"`` or ``"replay"``.
        detail: Raw fields from the source, JSON-safe values only.
    """

    instance: str
    kind: str
    deadline_s: float
    source: str
    detail: dict[str, Any] = field(default_factory=dict)

    def key(self) -> tuple[str, str, str, str]:
        """Identity used for de-duplication: (source, instance, kind, detail as canonical JSON)."""
        return (self.source, self.instance, self.kind, json.dumps(self.detail, sort_keys=True, default=str))


class NoticeSource(abc.ABC):
    """A source of preemption notices. Subclasses implement :meth:`_poll_all`; :meth:`poll` de-duplicates."""

    name: str = "?"

    def __init__(self) -> None:
        self._seen: set[tuple[str, str, str, str]] = set()
        self._lock = threading.Lock()

    def poll(self) -> list[Notice]:
        """Return the notices not returned by an earlier poll (non-blocking beyond a short HTTP timeout).

        Raises:
            NoticeSourceError: The source cannot be read or answered something malformed (see the module rules).
        """
        with self._lock:
            fresh = []
            for notice in self._poll_all():
                k = self._dedup_key(notice)
                if k not in self._seen:
                    self._seen.add(k)
                    fresh.append(notice)
            return fresh

    def _dedup_key(self, notice: Notice) -> tuple[str, str, str, str]:
        return notice.key()

    @abc.abstractmethod
    def _poll_all(self) -> list[Notice]:
        """Every notice currently visible (duplicates of earlier polls allowed)."""

    def close(self) -> None:
        """Release what the source holds (signal handlers, ...). Idempotent."""

    def __enter__(self) -> NoticeSource:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


# ---------------------------------------------------------------------------------------------------------------
# HTTP plumbing shared by the cloud sources
# ---------------------------------------------------------------------------------------------------------------
class _NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirect())


@dataclass(frozen=True)
class _Response:
    status: int
    body: bytes
    headers: Mapping[str, str]


def _read_limited(resp: Any, url: str, deadline: float) -> bytes:
    chunks: list[bytes] = []
    total = 0
    while True:
        if time.monotonic() > deadline:
            raise NoticeSourceError(f"{url} is answering too slowly (gave up reading the body)")
        chunk = resp.read(8192)
        if not chunk:
            return b"".join(chunks)
        total += len(chunk)
        if total > MAX_BODY_BYTES:
            raise NoticeSourceError(f"{url} answered more than {MAX_BODY_BYTES} bytes; refusing to read it")
        chunks.append(chunk)


def _http(
    method: str, url: str, *, headers: Mapping[str, str], timeout_s: float, data: bytes | None = None
) -> _Response:
    """One HTTP exchange with a size- and time-limited body. Transport failures raise NoticeSourceError."""
    req = urllib.request.Request(url, data=data, headers=dict(headers), method=method)
    deadline = time.monotonic() + 2 * timeout_s
    try:
        try:
            with _OPENER.open(req, timeout=timeout_s) as resp:
                return _Response(resp.status, _read_limited(resp, url, deadline), dict(resp.headers))
        except urllib.error.HTTPError as exc:
            with exc:
                body = _read_limited(exc, url, deadline) if exc.fp is not None else b""
            return _Response(exc.code, body, dict(exc.headers or {}))
    except NoticeSourceError:
        raise
    except (urllib.error.URLError, OSError, http.client.HTTPException, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        raise NoticeSourceError(f"cannot reach {url}: {reason}") from None


def _text(resp: _Response, url: str) -> str:
    try:
        return resp.body.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise NoticeSourceError(f"{url} answered a body that is not UTF-8 text") from None


def _json_object(resp: _Response, url: str) -> dict[str, Any]:
    try:
        doc = json.loads(_text(resp, url))
    except ValueError:
        raise NoticeSourceError(f"{url} answered malformed JSON: {resp.body[:80]!r}") from None
    if not isinstance(doc, dict):
        raise NoticeSourceError(f"{url} answered JSON that is not an object: {type(doc).__name__}")
    return doc


def _unexpected(resp: _Response, url: str) -> NoticeSourceError:
    return NoticeSourceError(f"{url} answered HTTP {resp.status}: {resp.body[:120]!r}")


def _parse_iso(text: str) -> float:
    dt = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return dt.timestamp()


def _check_timeout(timeout_s: float) -> float:
    if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= 30):
        raise ConfigurationError(f"timeout_s must be in (0, 30] seconds, got {timeout_s!r}")
    return float(timeout_s)


# ---------------------------------------------------------------------------------------------------------------
# AWS
# ---------------------------------------------------------------------------------------------------------------
class AwsNoticeSource(NoticeSource):
    """EC2 spot interruption and rebalance notices through IMDSv2.

    A session token is fetched with ``PUT /latest/api/token`` and renewed shortly before its TTL runs out; a 401
    renews it once and retries. In containers, the instance's metadata hop limit must be >= 2 or the token request
    times out (see ``docs/cloud.md``).

    Args:
        base_url: Metadata service root (tests pass a local server).
        timeout_s: Per-request timeout.
        token_ttl_s: Requested token lifetime, 1..21600 s.
        instance: Instance id to report; None reads ``/latest/meta-data/instance-id`` once.
        default_grace_s: Deadline offset used when the notice's ``time`` cannot be parsed.
        watch_rebalance: Also report rebalance recommendations (advisory, ``deadline_s = inf``).
        clock: Wall clock for fallback deadlines.
        monotonic: Clock for token expiry (injectable for tests).
    """

    name = "aws"

    def __init__(
        self,
        base_url: str = AWS_METADATA_URL,
        *,
        timeout_s: float = 1.0,
        token_ttl_s: int = 21600,
        instance: str | None = None,
        default_grace_s: float = 120.0,
        watch_rebalance: bool = True,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        if not (isinstance(token_ttl_s, int) and 1 <= token_ttl_s <= 21600):
            raise ConfigurationError(f"token_ttl_s must be an integer in 1..21600, got {token_ttl_s!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = _check_timeout(timeout_s)
        self.token_ttl_s = token_ttl_s
        self.instance = instance
        self.default_grace_s = float(default_grace_s)
        self.watch_rebalance = watch_rebalance
        self._clock = clock
        self._monotonic = monotonic
        self._token: str | None = None
        self._token_expiry = -math.inf
        self.token_fetches = 0

    def _refresh_token(self) -> str:
        url = f"{self.base_url}/latest/api/token"
        resp = _http(
            "PUT",
            url,
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)},
            timeout_s=self.timeout_s,
            data=b"",
        )
        if resp.status != 200:
            raise NoticeSourceError(
                f"IMDSv2 token request to {url} answered HTTP {resp.status} (is IMDS enabled on this instance?)"
            )
        token = _text(resp, url)
        if not token or len(token) > 4096 or not token.isprintable():
            raise NoticeSourceError(f"IMDSv2 token request to {url} answered a malformed token")
        self.token_fetches += 1
        self._token = token
        margin = min(60.0, self.token_ttl_s * 0.2)
        self._token_expiry = self._monotonic() + self.token_ttl_s - margin
        return token

    def _get(self, path: str) -> _Response:
        url = f"{self.base_url}{path}"
        token = self._token if self._token is not None and self._monotonic() < self._token_expiry else None
        if token is None:
            token = self._refresh_token()
        resp = _http("GET", url, headers={"X-aws-ec2-metadata-token": token}, timeout_s=self.timeout_s)
        if resp.status == 401:
            token = self._refresh_token()
            resp = _http("GET", url, headers={"X-aws-ec2-metadata-token": token}, timeout_s=self.timeout_s)
            if resp.status == 401:
                raise NoticeSourceError(f"IMDSv2 rejected a freshly issued token at {url} (HTTP 401)")
        return resp

    def _instance_id(self) -> str:
        if self.instance is None:
            path = "/latest/meta-data/instance-id"
            resp = self._get(path)
            if resp.status != 200:
                raise _unexpected(resp, self.base_url + path)
            ident = _text(resp, self.base_url + path)
            if not ident or len(ident) > 256:
                raise NoticeSourceError(f"{self.base_url}{path} answered a malformed instance id")
            self.instance = ident
        return self.instance

    def _poll_all(self) -> list[Notice]:
        instance = self._instance_id()
        out: list[Notice] = []
        path = "/latest/meta-data/spot/instance-action"
        resp = self._get(path)
        if resp.status == 200:
            doc = _json_object(resp, self.base_url + path)
            action, when = doc.get("action"), doc.get("time")
            if not isinstance(action, str) or not isinstance(when, str):
                raise NoticeSourceError(f"{self.base_url}{path} answered {doc!r}: expected string 'action' and 'time'")
            detail: dict[str, Any] = {"action": action, "time": when}
            try:
                deadline = _parse_iso(when)
            except ValueError:
                deadline = self._clock() + self.default_grace_s
                detail["time_unparsed"] = True
            out.append(Notice(instance, "preempt", deadline, "aws", detail))
        elif resp.status != 404:
            raise _unexpected(resp, self.base_url + path)
        if self.watch_rebalance:
            try:
                out.extend(self._rebalance(instance))
            except NoticeSourceError as exc:
                if not out:
                    raise
                # never hold back a preemption notice because the advisory endpoint misbehaves
                log.warning("ignoring a failed rebalance check while a preemption is pending: %s", exc)
        return out

    def _rebalance(self, instance: str) -> list[Notice]:
        out: list[Notice] = []
        path = "/latest/meta-data/events/recommendations/rebalance"
        resp = self._get(path)
        if resp.status == 200:
            doc = _json_object(resp, self.base_url + path)
            when = doc.get("noticeTime")
            if not isinstance(when, str):
                raise NoticeSourceError(f"{self.base_url}{path} answered {doc!r}: expected string 'noticeTime'")
            out.append(Notice(instance, "rebalance", math.inf, "aws", {"noticeTime": when}))
        elif resp.status != 404:
            raise _unexpected(resp, self.base_url + path)
        return out

    def __repr__(self) -> str:
        return f"AwsNoticeSource({self.base_url!r})"


# ---------------------------------------------------------------------------------------------------------------
# GCP
# ---------------------------------------------------------------------------------------------------------------
class GcpNoticeSource(NoticeSource):
    """GCE spot/preemptible notices from the metadata server (``instance/preempted`` = ``TRUE``).

    GCE gives about 30 s between the flag turning ``TRUE`` and the stop; the deadline is the first poll that saw
    it plus ``grace_s``. With ``watch_maintenance``, ``instance/maintenance-event`` =
    ``TERMINATE_ON_HOST_MAINTENANCE`` gives a ``terminate`` notice (``MIGRATE_ON_HOST_MAINTENANCE`` is a live
    migration: the instance stays, so no notice).

    Args:
        base_url: Metadata server root (tests pass a local server).
        timeout_s: Per-request timeout.
        grace_s: Seconds from the first ``TRUE`` to the expected stop.
        maintenance_grace_s: Seconds from a terminate maintenance event to the expected stop.
        instance: Instance name to report; None reads ``instance/name`` once.
        watch_maintenance: Also watch host-maintenance events.
        clock: Wall clock for deadlines.
    """

    name = "gcp"
    _PREFIX = "/computeMetadata/v1/instance"
    _HEADERS = {"Metadata-Flavor": "Google"}

    def __init__(
        self,
        base_url: str = GCP_METADATA_URL,
        *,
        timeout_s: float = 1.0,
        grace_s: float = 30.0,
        maintenance_grace_s: float = 60.0,
        instance: str | None = None,
        watch_maintenance: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        self.timeout_s = _check_timeout(timeout_s)
        self.grace_s = float(grace_s)
        self.maintenance_grace_s = float(maintenance_grace_s)
        self.instance = instance
        self.watch_maintenance = watch_maintenance
        self._clock = clock
        self._preempted_at: float | None = None
        self._maintenance: tuple[str, float] | None = None

    def _get_text(self, leaf: str) -> str:
        url = f"{self.base_url}{self._PREFIX}/{leaf}"
        resp = _http("GET", url, headers=self._HEADERS, timeout_s=self.timeout_s)
        if resp.status != 200:
            raise _unexpected(resp, url)
        return _text(resp, url)

    def _poll_all(self) -> list[Notice]:
        if self.instance is None:
            name = self._get_text("name")
            if not name or len(name) > 256:
                raise NoticeSourceError(f"{self.base_url}{self._PREFIX}/name answered a malformed instance name")
            self.instance = name
        out: list[Notice] = []
        flag = self._get_text("preempted").upper()
        if flag == "TRUE":
            if self._preempted_at is None:
                self._preempted_at = self._clock()
            out.append(
                Notice(self.instance, "preempt", self._preempted_at + self.grace_s, "gcp", {"preempted": "TRUE"})
            )
        elif flag != "FALSE":
            raise NoticeSourceError(f"{self.base_url}{self._PREFIX}/preempted answered {flag[:40]!r}, not TRUE/FALSE")
        if self.watch_maintenance:
            try:
                out.extend(self._maintenance_notices(self.instance))
            except NoticeSourceError as exc:
                if not out:
                    raise
                log.warning("ignoring a failed maintenance check while a preemption is pending: %s", exc)
        return out

    def _maintenance_notices(self, instance: str) -> list[Notice]:
        out: list[Notice] = []
        event = self._get_text("maintenance-event")
        if not event or len(event) > 64 or not all(c.isupper() or c == "_" for c in event):
            raise NoticeSourceError(f"{self.base_url}{self._PREFIX}/maintenance-event answered {event[:40]!r}")
        if event.startswith("TERMINATE"):
            if self._maintenance is None or self._maintenance[0] != event:
                self._maintenance = (event, self._clock())
            deadline = self._maintenance[1] + self.maintenance_grace_s
            detail = {"maintenance_event": event, "seen_s": self._maintenance[1]}
            out.append(Notice(instance, "terminate", deadline, "gcp", detail))
        else:
            self._maintenance = None
        return out

    def __repr__(self) -> str:
        return f"GcpNoticeSource({self.base_url!r})"


# ---------------------------------------------------------------------------------------------------------------
# Azure
# ---------------------------------------------------------------------------------------------------------------
_AZURE_KINDS = {"Preempt": "preempt", "Terminate": "terminate", "Reboot": "terminate", "Redeploy": "terminate"}


class AzureNoticeSource(NoticeSource):
    """Azure Spot eviction and other disruptive events from Scheduled Events.

    One notice per (event, affected VM): Scheduled Events also lists events of the other VMs of an availability or
    scale set, and the coordinator wants those too. ``Freeze`` (a pause of seconds) produces no notice.

    Acknowledging an event (POST ``StartRequests``) lets Azure proceed *at once*, so it is opt-in and requires
    ``instance``: only events that affect this VM are acknowledged. A failed acknowledgement is logged and counted
    (``ack_failures``), never raised: the notice itself was delivered.

    Args:
        base_url: IMDS root (tests pass a local server).
        timeout_s: Per-request timeout.
        api_version: Scheduled Events API version.
        instance: This VM's name; when given, only notices about it are returned.
        acknowledge: Approve this VM's new events right after they are reported.
        event_types: Event types that produce notices.
        default_grace_s: Deadline offset when ``NotBefore`` is empty (event already started) or unparsable.
        clock: Wall clock for fallback deadlines.
    """

    name = "azure"

    def __init__(
        self,
        base_url: str = AZURE_METADATA_URL,
        *,
        timeout_s: float = 1.0,
        api_version: str = "2020-07-01",
        instance: str | None = None,
        acknowledge: bool = False,
        event_types: Iterable[str] = ("Preempt", "Terminate", "Reboot", "Redeploy"),
        default_grace_s: float = 0.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        self.event_types = frozenset(event_types)
        unknown = self.event_types - set(_AZURE_KINDS)
        if unknown:
            raise ConfigurationError(f"unknown Azure event types {sorted(unknown)}; known: {sorted(_AZURE_KINDS)}")
        if acknowledge and not instance:
            raise ConfigurationError(
                "acknowledge=True needs instance=<this VM's name>: acknowledging another VM's event would let Azure "
                "evict it early"
            )
        self.base_url = base_url.rstrip("/")
        self.timeout_s = _check_timeout(timeout_s)
        self.url = f"{self.base_url}/metadata/scheduledevents?api-version={api_version}"
        self.instance = instance
        self.acknowledge = acknowledge
        self.default_grace_s = float(default_grace_s)
        self._clock = clock
        self.ack_failures = 0
        self.acknowledged: list[str] = []

    def _poll_all(self) -> list[Notice]:
        resp = _http("GET", self.url, headers={"Metadata": "true"}, timeout_s=self.timeout_s)
        if resp.status != 200:
            raise _unexpected(resp, self.url)
        doc = _json_object(resp, self.url)
        events = doc.get("Events")
        if not isinstance(events, list):
            raise NoticeSourceError(f"{self.url} answered no 'Events' list")
        out: list[Notice] = []
        for ev in events:
            if not isinstance(ev, dict):
                raise NoticeSourceError(f"{self.url} answered an event that is not an object: {ev!r:.80}")
            event_id, event_type, resources = ev.get("EventId"), ev.get("EventType"), ev.get("Resources")
            not_before = ev.get("NotBefore", "")
            if (
                not isinstance(event_id, str)
                or not isinstance(event_type, str)
                or not isinstance(resources, list)
                or not all(isinstance(r, str) for r in resources)
                or not isinstance(not_before, str)
            ):
                raise NoticeSourceError(f"{self.url} answered a malformed event: {ev!r:.200}")
            if event_type not in self.event_types:
                continue
            detail: dict[str, Any] = {
                "EventId": event_id,
                "EventType": event_type,
                "EventStatus": str(ev.get("EventStatus", "")),
                "NotBefore": not_before,
            }
            if not_before:
                try:
                    deadline = email.utils.parsedate_to_datetime(not_before).timestamp()
                except (TypeError, ValueError):
                    deadline = self._clock() + self.default_grace_s
                    detail["time_unparsed"] = True
            else:
                deadline = self._clock() + self.default_grace_s
            for resource in resources:
                if self.instance is None or resource == self.instance:
                    out.append(Notice(resource, _AZURE_KINDS[event_type], deadline, "azure", dict(detail)))
        return out

    def _dedup_key(self, notice: Notice) -> tuple[str, str, str, str]:
        # EventStatus and NotBefore change while an event progresses: one notice per (event, VM).
        return ("azure", notice.instance, notice.kind, str(notice.detail["EventId"]))

    def poll(self) -> list[Notice]:
        fresh = super().poll()
        if self.acknowledge:
            ids = sorted({str(n.detail["EventId"]) for n in fresh if n.instance == self.instance})
            if ids:
                self._ack(ids)
        return fresh

    def _ack(self, event_ids: Sequence[str]) -> None:
        body = json.dumps({"StartRequests": [{"EventId": i} for i in event_ids]}).encode()
        try:
            resp = _http(
                "POST",
                self.url,
                headers={"Metadata": "true", "Content-Type": "application/json"},
                timeout_s=self.timeout_s,
                data=body,
            )
            if resp.status != 200:
                raise _unexpected(resp, self.url)
            self.acknowledged.extend(event_ids)
        except NoticeSourceError as exc:
            self.ack_failures += 1
            log.warning("could not acknowledge Azure scheduled events %s: %s", list(event_ids), exc)

    def __repr__(self) -> str:
        return f"AzureNoticeSource({self.base_url!r})"


# ---------------------------------------------------------------------------------------------------------------
# Signals
# ---------------------------------------------------------------------------------------------------------------
class SignalNoticeSource(NoticeSource):
    """A notice when this process receives SIGTERM (or other configured signals).

    The first delivered signal yields one ``terminate`` notice for this host with ``deadline = received + grace_s``;
    later signals add nothing. The handler is installed at construction (main thread only, a Python rule) and the
    previous handlers are restored by :meth:`close`. While installed, SIGTERM no longer ends the process: whoever
    consumes the notice must shut down by the deadline.

    Note: a Lightning ``Trainer`` installs its own SIGTERM handler during ``fit``; create this source after that,
    or let the strategy route the signal.

    Args:
        signals: Signals to catch.
        grace_s: Seconds from the signal to the expected kill (e.g. Kubernetes' terminationGracePeriodSeconds).
        instance: Name to report; defaults to the host name.
        clock: Wall clock for deadlines.

    Raises:
        NoticeSourceError: Constructed outside the main thread.
    """

    name = "sigterm"

    def __init__(
        self,
        signals: Iterable[int] = (signal.SIGTERM,),
        *,
        grace_s: float = 30.0,
        instance: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        super().__init__()
        if threading.current_thread() is not threading.main_thread():
            raise NoticeSourceError("SignalNoticeSource must be created in the main thread (Python signal rule)")
        self.signals = tuple(signal.Signals(s) for s in signals)
        if not self.signals:
            raise ConfigurationError("SignalNoticeSource needs at least one signal")
        self.grace_s = float(grace_s)
        self.instance = instance or socket.gethostname()
        self._clock = clock
        self._received: list[tuple[int, float]] = []
        self._previous: dict[signal.Signals, Any] = {}
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except (ValueError, OSError) as exc:
            self.close()
            raise NoticeSourceError(f"cannot install a handler for {sig.name}: {exc}") from None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self._received.append((signum, self._clock()))

    def _poll_all(self) -> list[Notice]:
        if not self._received:
            return []
        signum, at = self._received[0]
        detail = {"signal": signal.Signals(signum).name, "received_s": at}
        return [Notice(self.instance, "terminate", at + self.grace_s, "sigterm", detail)]

    @property
    def received(self) -> int:
        """How many signals were caught."""
        return len(self._received)

    def close(self) -> None:
        """Restore the handlers that were there before (main thread only). Idempotent."""
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)

    def __repr__(self) -> str:
        return f"SignalNoticeSource({[s.name for s in self.signals]})"


# ---------------------------------------------------------------------------------------------------------------
# Replay
# ---------------------------------------------------------------------------------------------------------------
class ReplayNoticeSource(NoticeSource):
    """Notices from a list of removals, for trace replay and tests.

    Each event ``(time_s, instance)`` says the instance disappears at ``origin_s + time_s``; its ``preempt`` notice
    becomes visible ``grace_s`` earlier. Everything is measured on ``clock``.

    Args:
        events: ``(time_s, instance)`` pairs, any order.
        grace_s: How long before the removal the notice appears.
        clock: The clock (inject a fake one in tests).
        origin_s: Time that event times are relative to; None: ``clock()`` at construction.
    """

    name = "replay"

    def __init__(
        self,
        events: Iterable[tuple[float, str]],
        *,
        grace_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        origin_s: float | None = None,
    ) -> None:
        super().__init__()
        parsed: list[tuple[float, str]] = []
        for item in events:
            try:
                t, inst = item
                t = float(t)
            except (TypeError, ValueError):
                raise ConfigurationError(f"replay events are (time_s, instance) pairs, got {item!r}") from None
            if not math.isfinite(t) or not isinstance(inst, str) or not inst:
                raise ConfigurationError(f"replay events are (finite time_s, instance name) pairs, got {item!r}")
            parsed.append((t, inst))
        if not (grace_s >= 0 and math.isfinite(grace_s)):
            raise ConfigurationError(f"grace_s must be a finite number >= 0, got {grace_s!r}")
        self.grace_s = float(grace_s)
        self._clock = clock
        self.origin_s = clock() if origin_s is None else float(origin_s)
        self._events = sorted(enumerate(parsed), key=lambda e: (e[1][0], e[0]))
        self._next = 0

    def _poll_all(self) -> list[Notice]:
        now = self._clock()
        out = []
        while self._next < len(self._events):
            index, (t, inst) = self._events[self._next]
            deadline = self.origin_s + t
            if deadline - self.grace_s > now:
                break
            out.append(Notice(inst, "preempt", deadline, "replay", {"event_index": index, "time_s": t}))
            self._next += 1
        return out

    @property
    def remaining(self) -> int:
        """Events not yet announced."""
        return len(self._events) - self._next


# ---------------------------------------------------------------------------------------------------------------
# Factory and cloud detection
# ---------------------------------------------------------------------------------------------------------------
_SOURCES: dict[str, type[NoticeSource]] = {
    "aws": AwsNoticeSource,
    "gcp": GcpNoticeSource,
    "azure": AzureNoticeSource,
    "sigterm": SignalNoticeSource,
    "replay": ReplayNoticeSource,
}
_DEFAULT_URLS = {"aws": AWS_METADATA_URL, "gcp": GCP_METADATA_URL, "azure": AZURE_METADATA_URL}


def _probe(cloud: str, base_url: str, timeout_s: float) -> bool:
    base = base_url.rstrip("/")
    try:
        if cloud == "aws":
            resp = _http(
                "PUT",
                f"{base}/latest/api/token",
                headers={"X-aws-ec2-metadata-token-ttl-seconds": "60"},
                timeout_s=timeout_s,
                data=b"",
            )
            return resp.status == 200 and bool(resp.body.strip())
        if cloud == "gcp":
            resp = _http(
                "GET", f"{base}/computeMetadata/v1/instance/id", headers={"Metadata-Flavor": "Google"},
                timeout_s=timeout_s,
            )  # fmt: skip
            flavor = {k.lower(): v for k, v in resp.headers.items()}.get("metadata-flavor")
            return resp.status == 200 and flavor == "Google"
        resp = _http(
            "GET", f"{base}/metadata/scheduledevents?api-version=2020-07-01", headers={"Metadata": "true"},
            timeout_s=timeout_s,
        )  # fmt: skip
        return resp.status == 200 and isinstance(json.loads(resp.body.decode("utf-8")).get("Events"), list)
    except (NoticeSourceError, ValueError, AttributeError, UnicodeDecodeError):
        return False


def detect_cloud(base_urls: Mapping[str, str] | None = None, *, timeout_s: float = 0.5) -> str | None:
    """Probe the clouds' metadata endpoints in parallel and return the first that answers (aws, gcp, azure order).

    Args:
        base_urls: Override of the metadata roots per cloud (tests pass local servers; a cloud missing from a
            given mapping is not probed).
        timeout_s: Overall probe budget.

    Returns:
        ``"aws"``, ``"gcp"``, ``"azure"`` or None.
    """
    urls = dict(_DEFAULT_URLS if base_urls is None else base_urls)
    unknown = set(urls) - set(_DEFAULT_URLS)
    if unknown:
        raise ConfigurationError(f"unknown clouds in base_urls: {sorted(unknown)}; known: aws, gcp, azure")
    results: dict[str, bool] = {}

    def run(cloud: str, url: str) -> None:
        results[cloud] = _probe(cloud, url, timeout_s)

    threads = [
        threading.Thread(target=run, args=item, daemon=True, name=f"parcae-probe-{item[0]}") for item in urls.items()
    ]
    for th in threads:
        th.start()
    deadline = time.monotonic() + timeout_s * 2 + 0.1
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))  # a DNS lookup may outlive the budget: abandon it
    for cloud in ("aws", "gcp", "azure"):
        if results.get(cloud):
            return cloud
    return None


def make_notice_source(spec: str, **kw: Any) -> NoticeSource:
    """Build a notice source by name.

    Args:
        spec: ``"aws"``, ``"gcp"``, ``"azure"``, ``"sigterm"``, ``"replay"`` or ``"auto"``. ``auto`` probes the
            metadata endpoints (:func:`detect_cloud`; keywords ``base_urls`` and ``probe_timeout_s``) and falls back
            to ``sigterm``; the chosen source gets ``base_url`` from ``base_urls`` and those remaining keywords its
            constructor accepts.
        **kw: Constructor keywords of the named source.

    Raises:
        ConfigurationError: Unknown name (the message lists the known ones) or keywords the source does not take.
    """
    name = spec.strip().lower() if isinstance(spec, str) else spec
    if name == "auto":
        base_urls = kw.pop("base_urls", None)
        probe_timeout_s = kw.pop("probe_timeout_s", 0.5)
        cloud = detect_cloud(base_urls, timeout_s=probe_timeout_s)
        chosen = cloud or "sigterm"
        if cloud is not None:
            kw["base_url"] = dict(_DEFAULT_URLS if base_urls is None else base_urls)[cloud]
        params = inspect.signature(_SOURCES[chosen]).parameters
        kw = {k: v for k, v in kw.items() if k in params}
        log.info("notice source: auto-detected %s", chosen)
        return _SOURCES[chosen](**kw)
    return build_by_name(_SOURCES, name, kw,
                         unknown=f"unknown notice source {spec!r}; known: {', '.join([*_SOURCES, 'auto'])}",
                         bad=f"bad options for the {name!r} notice source")


# ---------------------------------------------------------------------------------------------------------------
# Watcher
# ---------------------------------------------------------------------------------------------------------------
class NoticeWatcher:
    """Poll sources from a background thread and call ``callback(notice)`` once per notice.

    A source that raises is logged (first occurrence of each message at WARNING, repeats at DEBUG) and counted in
    :attr:`errors`; a callback that raises is logged and counted in :attr:`callback_errors`. Neither stops the
    thread. Notices are also de-duplicated across sources and polls.

    Args:
        sources: One source or several.
        callback: Called from the watcher thread with each new notice.
        interval_s: Pause between polling rounds.
        close_sources: Close the sources on :meth:`stop` (signal sources must then be stopped from the main thread).
        name: Thread name.
    """

    def __init__(
        self,
        sources: NoticeSource | Sequence[NoticeSource],
        callback: Callable[[Notice], None],
        *,
        interval_s: float = 1.0,
        close_sources: bool = False,
        name: str = "parcae-notice-watcher",
    ) -> None:
        self.sources: list[NoticeSource] = [sources] if isinstance(sources, NoticeSource) else list(sources)
        if not self.sources:
            raise ConfigurationError("NoticeWatcher needs at least one source")
        if not interval_s > 0:
            raise ConfigurationError(f"interval_s must be > 0, got {interval_s!r}")
        self.callback = callback
        self.interval_s = float(interval_s)
        self.close_sources = close_sources
        self.name = name
        self.errors = 0
        self.callback_errors = 0
        self.delivered = 0
        self.rounds = 0
        self.error_counts: dict[str, int] = {}
        self.last_error: BaseException | None = None
        self._seen: set[tuple[str, str, str, str]] = set()
        self._logged: set[str] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> NoticeWatcher:
        """Start the polling thread (polls at once, then every ``interval_s``). Returns self."""
        if self._thread is not None:
            raise RuntimeError("NoticeWatcher already started")
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()
        return self

    def poll_once(self) -> list[Notice]:
        """One polling round in the calling thread; returns the notices delivered."""
        delivered = []
        for source in self.sources:
            try:
                notices = source.poll()
            except Exception as exc:  # noqa: BLE001 - a broken source must never kill the watcher
                self._record_error(source, exc)
                continue
            for notice in notices:
                k = notice.key()
                if k in self._seen:
                    continue
                self._seen.add(k)
                try:
                    self.callback(notice)
                except Exception:  # noqa: BLE001
                    self.callback_errors += 1
                    log.exception("notice callback failed for %s", notice)
                self.delivered += 1
                delivered.append(notice)
        self.rounds += 1
        return delivered

    def _record_error(self, source: NoticeSource, exc: BaseException) -> None:
        self.errors += 1
        self.last_error = exc
        label = repr(source)
        self.error_counts[label] = self.error_counts.get(label, 0) + 1
        message = f"{label}: {exc}"
        if message not in self._logged:
            self._logged.add(message)
            log.warning("notice source failed (will keep polling): %s", message)
        else:
            log.debug("notice source failed again: %s", message)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll_once()
            self._wake.wait(self.interval_s)
            self._wake.clear()

    def stop(self, timeout_s: float | None = 10.0) -> None:
        """Stop and join the thread (a poll in flight finishes first: at most a few HTTP timeouts). Idempotent."""
        self._stop.set()
        self._wake.set()
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout_s)
        if self.close_sources:
            for source in self.sources:
                source.close()

    @property
    def alive(self) -> bool:
        """Whether the polling thread is running."""
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> NoticeWatcher:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
