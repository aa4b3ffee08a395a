"""Where checkpoints live: any fsspec URL, complete-or-invisible, pruned, checked before training starts.

Problem: the fallback's checkpoint was written to ``run_dir/ckpt/last.ckpt`` on the disk of whichever member is
rank 0 now -- a spot instance, as preemptible as the rest. When every holder of a stage is gone the job needs that
file, and it can be gone with the instance that wrote it. Every cloud user has object storage (S3, GCS, Azure
Blob); this module puts checkpoints there, or on a shared mount, or on a local path, through fsspec.

Three rules make a checkpoint directory safe to resume from, whoever wrote into it and whenever they died:

* **A checkpoint is visible only once it is complete.** Each one is a blob ``step-<step>-<id>.ckpt`` followed by
  a small manifest ``step-<step>-<id>.json`` naming it, its size and its SHA-256. The manifest is written last,
  so a torn upload (a writer preempted mid-way, a multipart upload never completed) has no manifest and is never
  the one resumed. On a local or mounted file system the blob is also written under a temporary name and renamed.
* **The newest complete checkpoint wins** (:meth:`CheckpointStore.latest`): the highest step whose manifest names
  a blob of the right size -- not a ``last`` pointer that two writers could race on.
* **Old ones are pruned** (``keep`` newest complete ones stay), together with blobs that never got a manifest
  and are older than the newest complete checkpoint.

Bad input is found at start, before any training (:meth:`CheckpointStore.check`): a scheme with no installed
backend (naming the extra to install), missing credentials, a bucket that does not exist or cannot be written, an
endpoint that does not answer -- each a :class:`~lightning_parcae.errors.CheckpointStorageError` that says what
was given and how to fix it. A store that goes away mid-run does not stop training: :meth:`CheckpointStore.save`
retries with back-off and reports each failed attempt; when every attempt fails the previous complete checkpoint
stays the resume point.

Blobs are whatever the caller writes (``torch.save`` of a state dict); loads stay ``weights_only=True`` in the
caller. This module does not import torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Callable, Mapping, Optional, TypeVar, Union

from lightning_parcae.errors import CheckpointStorageError

__all__ = ["CheckpointRef", "CheckpointStore", "EXTRAS", "SaveFailed", "read_url", "checked_location", "resume_point"]

_HTTP_403 = re.compile(r"(?<![0-9a-z])403(?![0-9a-z])")
"""An HTTP 403 status in an error's text -- not the digits inside a port, an address or a probe object's name."""

EXTRAS: dict[str, tuple[str, str]] = {
    "s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"),
    "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs"),
    "az": ("adlfs", "azure"), "abfs": ("adlfs", "azure"), "abfss": ("adlfs", "azure"), "adl": ("adlfs", "azure"),
}
"""URL scheme -> (fsspec backend package, ``lightning-parcae`` extra that installs it)."""

FORMAT = 1
_NAME = re.compile(r"^step-(\d{9,})-([0-9a-f]{8})\.(ckpt|json)$")


class SaveFailed(CheckpointStorageError):
    """Every attempt to write one checkpoint failed; the previous complete checkpoint stays the resume point."""


@dataclass(frozen=True)
class CheckpointRef:
    """One complete checkpoint in a store.

    Attributes:
        url: The blob's full URL (``s3://bucket/job/step-000000120-1a2b3c4d.ckpt``, or a local path).
        step: The optimizer step it was written at.
        nbytes: The blob's size.
        sha256: The blob's SHA-256 (hex).
        manifest: What the writer recorded (``writer``, ``written_at``, ``extra``).
    """

    url: str
    step: int
    nbytes: int
    sha256: str
    manifest: Mapping[str, Any]


class _Hashing:
    """A write-only file wrapper that counts and hashes what passes through it."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.sha = hashlib.sha256()
        self.nbytes = 0

    def write(self, data: bytes) -> int:
        view = memoryview(data)
        self.sha.update(view)
        self.nbytes += view.nbytes
        self.f.write(data)
        return view.nbytes

    def flush(self) -> None:
        self.f.flush()


_T = TypeVar("_T")


def _bounded(fn: Callable[[], _T], timeout_s: float, what: str) -> _T:
    """``fn()`` in a helper thread, given up after ``timeout_s``: a storage endpoint that goes silent (a vanished
    machine sends no reset) must not hang the caller, whatever the backend's own timeouts do.

    Raises:
        TimeoutError: ``fn`` did not return in time (it is left running in a daemon thread).
        Exception: whatever ``fn`` raised.
    """
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 -- re-raised in the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=run, name=f"parcae-checkpoint-{what}", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise TimeoutError(f"checkpoint storage: {what} did not finish within {timeout_s:g} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


def checked_location(url: Optional[str]) -> Optional[str]:
    """``--checkpoint-dir`` proven writable before any worker starts, as its store names it (None stays None: the
    legacy local file).

    Raises:
        CheckpointStorageError: the location cannot be used (no backend for the scheme, no credentials, no such
            bucket, unwritable, no answer); the message says how to fix it.
    """
    if url is None:
        return None
    store = CheckpointStore(url)
    store.check()
    return store.url


def resume_point(checkpoint_dir: Optional[str], legacy: Union[str, os.PathLike[str], None],
                 say: Callable[[str], None]) -> tuple[Any, Optional[int]]:
    """What a relaunch resumes from: (path or URL, its step -- None when only the event log knows it), or
    (None, None) for a fresh start. With ``checkpoint_dir`` the newest complete checkpoint there, whoever wrote it
    (a store that cannot be listed now is reported through ``say`` and treated as empty); without one ``legacy``
    (``run_dir/ckpt/last.ckpt``) when that file exists."""
    if checkpoint_dir is None:
        return (legacy, None) if legacy is not None and os.path.isfile(legacy) else (None, None)
    try:
        ref = CheckpointStore(checkpoint_dir).latest()
    except Exception as exc:  # noqa: BLE001 -- a storage outage must not stop the relaunch
        say(f"could not list checkpoints in {checkpoint_dir} ({exc}); relaunching without one")
        return None, None
    return (ref.url, ref.step) if ref is not None else (None, None)


def read_url(url: str, *, storage_options: Optional[Mapping[str, Any]] = None) -> bytes:
    """The bytes of one checkpoint blob given by its URL (what a relaunch gets in ``PARCAE_RESUME_CKPT``).

    When the blob has its manifest beside it (a checkpoint this module wrote) the bytes are checked against the
    recorded size and SHA-256; any other URL is read as it is.

    Raises:
        CheckpointStorageError: no backend for the scheme, or the blob differs from its manifest.
        FileNotFoundError: there is no such blob.
    """
    directory, _, name = url.rstrip("/").rpartition("/")
    store = CheckpointStore(directory or ".", storage_options=storage_options)
    m = _NAME.match(name)
    if m is not None and m.group(3) == "ckpt":
        try:
            record = json.loads(store.fs.cat_file(f"{store.root}/{name[: -len('.ckpt')]}.json"))
            ref = CheckpointRef(url, int(record["step"]), int(record["bytes"]), str(record.get("sha256", "")), record)
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            ref = None
        if ref is not None:
            return store.read(ref)
    return bytes(store.fs.cat_file(f"{store.root}/{name}"))


def _scheme(url: str) -> str:
    m = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", url)
    return m.group(1).lower() if m else "file"


class CheckpointStore:
    """A checkpoint directory anywhere fsspec reaches.

    Args:
        url: A local path, a shared mount, or ``s3://bucket/prefix``, ``gs://bucket/prefix``, ``az://container/prefix``
            (any fsspec URL).
        keep: Complete checkpoints kept by :meth:`prune` (the newest ones); at least 1.
        attempts: Tries per :meth:`save` before it gives up (each failed try is reported).
        backoff_s: Wait before the second try; doubled for each later one.
        timeout_s: Bound on :meth:`check` and on listing, so an endpoint that never answers is an error, not a hang.
        attempt_timeout_s: Bound on one attempt of :meth:`save` (size it for the checkpoint: bytes / bandwidth).
        storage_options: Passed to the fsspec file system (e.g. ``{"client_kwargs": {"endpoint_url": ...}}``);
            credentials usually come from the cloud's own environment variables or instance role instead.
        report: Where retry and pruning messages go (default: stderr).

    Raises:
        CheckpointStorageError: ``url`` is empty, or its scheme has no fsspec backend installed (names the extra).
    """

    def __init__(self, url: str, *, keep: int = 2, attempts: int = 5, backoff_s: float = 1.0, timeout_s: float = 30.0,
                 attempt_timeout_s: float = 600.0,
                 storage_options: Optional[Mapping[str, Any]] = None,
                 report: Optional[Callable[[str], None]] = None) -> None:
        if not url or not str(url).strip():
            raise CheckpointStorageError("checkpoint directory is empty; give a local path or an fsspec URL such as "
                                         "s3://bucket/prefix")
        if keep < 1:
            raise CheckpointStorageError(f"keep={keep}: at least the newest complete checkpoint must be kept (>= 1)")
        if attempts < 1:
            raise CheckpointStorageError(f"attempts={attempts}: a save needs at least one attempt (>= 1)")
        self.url = str(url).rstrip("/") if _scheme(str(url)) != "file" else os.fspath(Path(url).expanduser())
        self.scheme = _scheme(self.url)
        self.keep = keep
        self.attempts = attempts
        self.backoff_s = backoff_s
        self.timeout_s = timeout_s
        self.attempt_timeout_s = attempt_timeout_s
        self.report = report or (lambda msg: print(msg, file=__import__("sys").stderr, flush=True))
        self.fs, self.root = self._filesystem(dict(storage_options or {}))
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    # ------------------------------------------------------------------------------------------------ set-up
    def _filesystem(self, options: dict[str, Any]) -> tuple[Any, str]:
        try:
            import fsspec  # noqa: PLC0415

            fsspec.get_filesystem_class(self.scheme)
            # a fresh client, never a cached one: a cached instance keeps the endpoint and credentials of the
            # environment it was made in (a long-lived launcher, a test with another server)
            fs, root = fsspec.core.url_to_fs(self.url, skip_instance_cache=True, **options)
        except ImportError as exc:
            pkg, extra = EXTRAS.get(self.scheme, (None, None))
            fix = (f"pip install 'lightning-parcae[{extra}]' (or pip install {pkg})" if pkg
                   else "install the fsspec backend for it")
            raise CheckpointStorageError(f"checkpoint directory {self.url!r}: no fsspec backend for the "
                                         f"{self.scheme}:// scheme is installed ({exc}); {fix}") from None
        except ValueError as exc:
            raise CheckpointStorageError(f"checkpoint directory {self.url!r}: {exc}; expected a local path or a URL "
                                         "such as s3://bucket/prefix, gs://bucket/prefix, az://container/prefix") \
                from None
        return fs, root.rstrip("/") or root

    def _path(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _url(self, name: str) -> str:
        return os.path.join(self.url, name) if self.scheme == "file" else f"{self.url}/{name}"

    def check(self) -> None:
        """Prove at start that checkpoints can be written, read back and removed here.

        Creates the directory on a file system (never a bucket), writes a small probe object, reads it back and
        deletes it, all within ``timeout_s``.

        Raises:
            CheckpointStorageError: what failed (no credentials, no such bucket, access denied, no answer) with
                what was given and how to fix it.
        """
        try:
            _bounded(self._probe, self.timeout_s, "check")
        except TimeoutError:
            raise CheckpointStorageError(
                f"checkpoint directory {self.url!r}: the storage did not answer within {self.timeout_s:g} s; check "
                "the endpoint (AWS_ENDPOINT_URL, network, firewall) or give a reachable location") from None
        except Exception as exc:  # noqa: BLE001 -- every backend raises its own kinds
            raise self._explain(exc, "could not be written") from None

    def _probe(self) -> None:
        if self.local:
            self.fs.makedirs(self.root, exist_ok=True)
        name = self._path(f".parcae-probe-{uuid.uuid4().hex[:12]}")
        payload = b"parcae checkpoint probe\n"
        self.fs.pipe_file(name, payload)
        try:
            if self.fs.cat_file(name) != payload:
                raise OSError("the probe object read back differs from what was written")
        finally:
            try:
                self.fs.rm_file(name)
            except FileNotFoundError:
                pass

    def _explain(self, exc: BaseException, what: str) -> CheckpointStorageError:
        text = f"{type(exc).__name__}: {exc}"
        low = text.lower()
        unreachable = "the endpoint could not be reached: check AWS_ENDPOINT_URL / the network"
        denied = "accessdenied" in low or isinstance(exc, PermissionError)  # by the error's own kind or code
        if "credential" in low or "nocredentials" in low or "unable to locate" in low:
            fix = ("no credentials were found: set the cloud's credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY "
                   "or an instance role; GOOGLE_APPLICATION_CREDENTIALS; AZURE_STORAGE_CONNECTION_STRING)")
        elif "nosuchbucket" in low or "does not exist" in low or isinstance(exc, FileNotFoundError):
            fix = "the bucket/container does not exist: create it first (the launcher never creates buckets)"
        elif not denied and (isinstance(exc, ConnectionError) or "connectionerror" in low or "connecttimeout" in low):
            fix = unreachable  # before the text's "forbidden" / 403: a refused connection's URL may hold either
        elif denied or "forbidden" in low or _HTTP_403.search(low):
            fix = "access denied: give these credentials write access to that location"
        elif "connect" in low or "endpoint" in low or "timed out" in low or "timeout" in low:
            fix = unreachable
        else:
            fix = "give a location this process can write"
        return CheckpointStorageError(f"checkpoint directory {self.url!r} {what} ({text}); {fix}")

    # ------------------------------------------------------------------------------------------------ writing
    def save(self, write: Callable[[IO[bytes]], None], step: int, *, writer: str = "",
             extra: Optional[Mapping[str, Any]] = None) -> CheckpointRef:
        """Write one checkpoint: the blob (``write`` fills a binary file), then its manifest; then prune.

        ``write`` may be called again for a retry, so it must write the whole checkpoint each time (``lambda f:
        torch.save(state, f)``).

        Args:
            write: Writes the checkpoint's bytes into the file it is given.
            step: The optimizer step (orders checkpoints).
            writer: Who wrote it (the member id), recorded in the manifest.
            extra: Small JSON-able facts recorded in the manifest (e.g. the epoch).

        Returns:
            The new checkpoint.

        Raises:
            SaveFailed: every attempt failed; each was reported, nothing incomplete is visible.
        """
        if step < 0:
            raise CheckpointStorageError(f"step={step}: a checkpoint's step is the optimizer step (>= 0)")
        last: Optional[BaseException] = None
        for attempt in range(1, self.attempts + 1):
            try:
                ref = _bounded(lambda: self._save_once(write, step, writer, dict(extra or {})),
                               self.attempt_timeout_s, "save")
                if attempt > 1:
                    self.report(f"[parcae] checkpoint of step {step} saved to {self.url} on attempt {attempt}")
                break
            except Exception as exc:  # noqa: BLE001 -- any storage failure is retried
                last = exc
                if attempt == self.attempts:
                    raise SaveFailed(f"checkpoint of step {step} could not be written to {self.url} in "
                                     f"{self.attempts} attempts ({type(exc).__name__}: {exc}); the previous complete "
                                     "checkpoint stays the resume point") from exc
                wait = self.backoff_s * 2 ** (attempt - 1)
                self.report(f"[parcae] checkpoint upload to {self.url} failed (attempt {attempt}/{self.attempts}: "
                            f"{type(exc).__name__}: {exc}); retrying in {wait:g} s, training goes on")
                time.sleep(wait)
        else:  # pragma: no cover -- the loop either breaks or raises
            raise SaveFailed(str(last))
        try:
            _bounded(self.prune, self.timeout_s, "prune")
        except Exception as exc:  # noqa: BLE001 -- pruning is housekeeping, never a reason to fail a save
            self.report(f"[parcae] pruning old checkpoints in {self.url} failed ({exc}); they stay")
        return ref

    def _save_once(self, write: Callable[[IO[bytes]], None], step: int, writer: str,
                   extra: dict[str, Any]) -> CheckpointRef:
        stem = f"step-{step:09d}-{uuid.uuid4().hex[:8]}"
        blob, manifest = self._path(stem + ".ckpt"), self._path(stem + ".json")
        target = blob + ".partial" if self.local else blob
        if self.local:
            self.fs.makedirs(self.root, exist_ok=True)
        f = self.fs.open(target, "wb")
        try:
            hashing = _Hashing(f)
            write(hashing)  # type: ignore[arg-type]
        except BaseException:
            discard = getattr(f, "discard", None)  # an object store's multipart upload: abort, never commit it
            if callable(discard):
                discard()
                f.closed = True  # fsspec's discard leaves the file "open": its __del__ would try to commit it
            else:
                f.close()
            if self.fs.exists(target):
                self.fs.rm_file(target)
            raise
        f.close()
        if self.local:
            self._fsync(target)
            self.fs.mv(target, blob)
        record = {"format": FORMAT, "blob": stem + ".ckpt", "step": step, "bytes": hashing.nbytes,
                  "sha256": hashing.sha.hexdigest(), "writer": writer, "written_at": time.time(), "extra": extra}
        data = json.dumps(record, sort_keys=True).encode()
        if self.local:
            self.fs.pipe_file(manifest + ".partial", data)
            self._fsync(manifest + ".partial")
            self.fs.mv(manifest + ".partial", manifest)
        else:
            self.fs.pipe_file(manifest, data)
        return CheckpointRef(self._url(stem + ".ckpt"), step, hashing.nbytes, record["sha256"], record)

    def _fsync(self, path: str) -> None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    # ------------------------------------------------------------------------------------------------ reading
    def _listing(self) -> dict[str, int]:
        """Name -> size of every checkpoint blob and manifest here (fresh, never a cached listing)."""
        try:
            self.fs.invalidate_cache(self.root)
        except Exception:  # noqa: BLE001 -- a backend without a cache
            pass
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return {}
        out = {}
        for e in entries:
            name = str(e["name"]).rstrip("/").rsplit("/", 1)[-1]
            if _NAME.match(name):
                out[name] = int(e.get("size") or 0)
        return out

    def complete(self) -> list[CheckpointRef]:
        """Every complete checkpoint here, oldest first (a manifest whose blob exists with the recorded size).

        Raises:
            TimeoutError: the storage did not answer within ``timeout_s``.
        """
        return _bounded(self._complete, self.timeout_s, "listing")

    def _complete(self) -> list[CheckpointRef]:
        listing = self._listing()
        refs = []
        for name in sorted(n for n in listing if n.endswith(".json")):
            try:
                record = json.loads(self.fs.cat_file(self._path(name)))
                blob, nbytes, step = str(record["blob"]), int(record["bytes"]), int(record["step"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # a manifest that cannot be read names nothing
            if listing.get(blob) != nbytes:
                continue  # blob missing or not the size its manifest says
            refs.append(CheckpointRef(self._url(blob), step, nbytes, str(record.get("sha256", "")), record))
        refs.sort(key=lambda r: (r.step, float(r.manifest.get("written_at", 0.0))))
        return refs

    def latest(self) -> Optional[CheckpointRef]:
        """The newest complete checkpoint, whoever wrote it (None when there is none)."""
        refs = self.complete()
        return refs[-1] if refs else None

    def read(self, ref: CheckpointRef) -> bytes:
        """The blob's bytes, checked against the manifest's size and SHA-256.

        Raises:
            CheckpointStorageError: the blob differs from what its manifest recorded.
        """
        data = self.fs.cat_file(self._path(ref.url.rsplit("/", 1)[-1]))
        digest = hashlib.sha256(data).hexdigest()
        if len(data) != ref.nbytes or (ref.sha256 and digest != ref.sha256):
            raise CheckpointStorageError(f"checkpoint {ref.url}: {len(data)} bytes with SHA-256 {digest[:12]}..., "
                                         f"its manifest says {ref.nbytes} bytes, {ref.sha256[:12]}...; it is damaged, "
                                         "delete it (and its .json) to resume from the one before")
        return data

    def fetch(self, ref: CheckpointRef, into: str | os.PathLike[str]) -> Path:
        """A local file with the checkpoint (the blob itself on a local store; else downloaded into ``into``)."""
        if self.local:
            return Path(self._path(ref.url.rsplit("/", 1)[-1]))
        target = Path(into) / ref.url.rsplit("/", 1)[-1]
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(".partial")
        tmp.write_bytes(self.read(ref))
        os.replace(tmp, target)
        return target

    # ------------------------------------------------------------------------------------------------ pruning
    def prune(self) -> list[str]:
        """Remove all but the ``keep`` newest complete checkpoints, and blobs with no manifest that are older than
        the newest complete one (torn uploads). Returns the names removed."""
        refs = self._complete()
        if not refs:
            return []
        kept = {r.url.rsplit("/", 1)[-1] for r in refs[-self.keep:]}
        newest = refs[-1].step
        removed = []
        for name in self._listing():
            m = _NAME.match(name)
            assert m is not None
            stem = name.rsplit(".", 1)[0]
            if stem + ".ckpt" in kept:
                continue
            complete = any(r.url.endswith("/" + stem + ".ckpt") or r.url.endswith(os.sep + stem + ".ckpt")
                           for r in refs)
            if complete or int(m.group(1)) < newest:
                try:
                    self.fs.rm_file(self._path(name))
                    removed.append(name)
                except FileNotFoundError:
                    pass
        return removed
