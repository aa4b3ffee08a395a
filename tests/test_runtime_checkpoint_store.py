"""Checkpoints anywhere fsspec reaches: complete-or-invisible, newest wins, pruned, bad locations refused at start.

The object-store cases run against a real S3 API server (moto's standalone server in its own process on loopback,
:class:`lightning_parcae.testing.s3_server.S3Server`), not a mock of the client: the same HTTP requests, the same
errors, and it can be frozen (silence) or killed (a store that goes away).

Regression (issue 20): the fallback's checkpoint was ``run_dir/ckpt/last.ckpt`` on whichever spot instance was rank
0; when that instance went, the job's only way back went with it.
"""

from __future__ import annotations

import io
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest
import torch

from lightning_parcae.errors import CheckpointStorageError
from lightning_parcae.runtime.checkpoint_store import CheckpointStore, SaveFailed
from lightning_parcae.testing.s3_server import CREDENTIALS, S3Server, moto_server_binary




def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4, 4), float(step)), "step": torch.tensor(step)}


def _writer(step: int):  # noqa: ANN202
    return lambda f: torch.save(_state(step), f)


def _load(store: CheckpointStore) -> dict[str, torch.Tensor]:
    ref = store.latest()
    assert ref is not None
    return torch.load(io.BytesIO(store.read(ref)), weights_only=True)


@pytest.fixture
def no_env_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS credentials anywhere botocore looks (and never the metadata service off this machine)."""
    for k in list(os.environ):
        if k.startswith("AWS_"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    pytest.importorskip("s3fs", reason="needs s3fs (the test extra)")
    if moto_server_binary() is None:
        pytest.skip("needs moto[server] (the test extra)")
    with S3Server() as server:
        yield server


# ---------------------------------------------------------------------------------------------------------- local
def test_local_store_resumes_the_newest_complete_checkpoint_and_keeps_only_the_newest(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ckpt"), keep=2)
    store.check()
    for step in (10, 20, 30):
        store.save(_writer(step), step, writer="m1")
    assert [r.step for r in store.complete()] == [20, 30]
    assert int(_load(store)["step"]) == 30
    assert sorted(p.suffix for p in (tmp_path / "ckpt").iterdir()) == [".ckpt", ".ckpt", ".json", ".json"]


def test_a_torn_write_is_never_the_one_resumed(tmp_path: Path) -> None:
    """A writer that dies mid-checkpoint leaves no manifest, so the one before stays the resume point."""
    store = CheckpointStore(str(tmp_path), attempts=1)
    store.save(_writer(5), 5)

    def torn(f: IO[bytes]) -> None:
        f.write(b"half a checkpoint")
        raise OSError("instance preempted mid-write")

    with pytest.raises(SaveFailed, match="previous complete checkpoint stays"):
        store.save(torn, 9)
    assert store.latest() is not None and store.latest().step == 5  # type: ignore[union-attr]
    assert int(_load(store)["step"]) == 5


def test_a_blob_whose_size_differs_from_its_manifest_is_skipped(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path), keep=5)
    store.save(_writer(1), 1)
    ref = store.save(_writer(2), 2)
    Path(ref.url).write_bytes(b"truncated")
    assert store.latest().step == 1  # type: ignore[union-attr]


def test_a_damaged_blob_of_the_right_size_is_refused_on_read(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path))
    ref = store.save(_writer(3), 3)
    data = bytearray(Path(ref.url).read_bytes())
    data[100] ^= 0xFF
    Path(ref.url).write_bytes(bytes(data))
    with pytest.raises(CheckpointStorageError, match="damaged"):
        store.read(store.latest())  # type: ignore[arg-type]


def test_newest_wins_whoever_wrote_it(tmp_path: Path) -> None:
    """Rank 0 moves with every migration: two members writing into one directory, the higher step is resumed."""
    a = CheckpointStore(str(tmp_path), keep=3)
    b = CheckpointStore(str(tmp_path), keep=3)
    a.save(_writer(4), 4, writer="i0")
    b.save(_writer(8), 8, writer="i3")
    a.save(_writer(6), 6, writer="i0")  # a late write of an older step does not hide the newer one
    ref = a.latest()
    assert ref is not None and ref.step == 8 and ref.manifest["writer"] == "i3"


def test_bad_options_are_refused_with_what_to_do() -> None:
    with pytest.raises(CheckpointStorageError, match="empty"):
        CheckpointStore("")
    with pytest.raises(CheckpointStorageError, match="keep=0"):
        CheckpointStore("/tmp/x", keep=0)
    with pytest.raises(CheckpointStorageError, match="s3://bucket/prefix"):
        CheckpointStore("nosuchscheme://bucket/x")


def test_a_scheme_without_its_backend_names_the_extra_to_install() -> None:
    try:
        import gcsfs  # noqa: F401

        pytest.skip("gcsfs is installed here")
    except ImportError:
        pass
    with pytest.raises(CheckpointStorageError, match=r"lightning-parcae\[gcs\]"):
        CheckpointStore("gs://bucket/prefix")


def test_an_unwritable_local_directory_is_refused_at_start(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(CheckpointStorageError, match="could not be written"):
        CheckpointStore(str(blocker / "ckpt")).check()


# ---------------------------------------------------------------------------------------------------------- S3
def test_s3_checkpoints_round_trip_prune_and_load_weights_only(s3: S3Server) -> None:
    s3.create_bucket("roundtrip")
    store = CheckpointStore("s3://roundtrip/job1", keep=2, storage_options=s3.storage_options())
    store.check()
    for step in (3, 6, 9):
        store.save(_writer(step), step, writer="i2", extra={"epoch": 0})
    assert [r.step for r in store.complete()] == [6, 9]
    assert torch.equal(_load(store)["w"], _state(9)["w"])
    ref = store.latest()
    assert ref is not None and ref.url.startswith("s3://roundtrip/job1/step-000000009-")
    local = store.fetch(ref, "/tmp/parcae-test-fetch")
    assert torch.load(local, weights_only=True)["step"] == 9


def test_s3_torn_upload_is_invisible_and_pruned_later(s3: S3Server) -> None:
    s3.create_bucket("torn")
    store = CheckpointStore("s3://torn/job", keep=1, attempts=1, storage_options=s3.storage_options())
    store.save(_writer(1), 1)

    def torn(f: IO[bytes]) -> None:
        f.write(os.urandom(1 << 20))
        raise OSError("preempted during the upload")

    with pytest.raises(SaveFailed):
        store.save(torn, 2)
    assert store.latest().step == 1  # type: ignore[union-attr]
    store.save(_writer(3), 3)
    names = sorted(n.rsplit("/", 1)[-1] for n in store.fs.ls("torn/job"))
    assert len(names) == 2 and all(n.startswith("step-000000003-") for n in names), names


def test_s3_missing_bucket_is_refused_at_start(s3: S3Server) -> None:
    with pytest.raises(CheckpointStorageError, match="does not exist: create it"):
        CheckpointStore("s3://no-such-bucket/job", storage_options=s3.storage_options()).check()


def test_s3_missing_credentials_are_refused_at_start(s3: S3Server, no_env_credentials: None) -> None:
    s3.create_bucket("nocreds")
    opts = {"client_kwargs": {"endpoint_url": s3.endpoint_url}}
    with pytest.raises(CheckpointStorageError, match="no credentials were found"):
        CheckpointStore("s3://nocreds/job", storage_options=opts, timeout_s=20).check()


def test_s3_endpoint_that_refuses_connections_is_refused_at_start() -> None:
    pytest.importorskip("s3fs")
    port = S3Server().port  # a free port nobody listens on
    opts = {"client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}"}, "key": "k", "secret": "s",
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    with pytest.raises(CheckpointStorageError, match="endpoint could not be reached"):
        CheckpointStore("s3://b-x-y/job", storage_options=opts, timeout_s=20).check()


class EndpointConnectionError(Exception):
    """Named like botocore's: the explanation goes by the error's text, type name included."""


def test_an_unreachable_endpoint_on_a_port_with_403_in_it_is_not_called_access_denied(tmp_path: Path) -> None:
    """Regression (a fresh-clone CI run, 2026-12-05): the free port picked for the refused-connection test was 44031,
    the error's text held "127.0.0.1:44031", and any "403" in it meant access denied -- the error told the user to
    give the credentials write access when the endpoint was down. A 403 counts only as a status of its own."""
    store = CheckpointStore(str(tmp_path / "ckpt"))
    down = EndpointConnectionError('Could not connect to the endpoint URL: "http://127.0.0.1:44031/b/job/.p-403a"')
    assert "endpoint could not be reached" in str(store._explain(down, "could not be written"))
    for denied in (PermissionError("Forbidden"),
                   OSError("An error occurred (403) when calling the PutObject operation: Forbidden"),
                   OSError("An error occurred (AccessDenied) when calling the PutObject operation")):
        assert "access denied" in str(store._explain(denied, "could not be written")), denied


def test_s3_silent_endpoint_is_an_error_within_the_bound_not_a_hang() -> None:
    pytest.importorskip("s3fs")
    with S3Server() as frozen:
        frozen.create_bucket("silent")
        frozen.freeze()
        t0 = time.monotonic()
        with pytest.raises(CheckpointStorageError, match="did not answer within 3 s"):
            CheckpointStore("s3://silent/job", storage_options=frozen.storage_options(), timeout_s=3).check()
        assert time.monotonic() - t0 < 6


def test_s3_store_that_goes_silent_mid_run_is_retried_and_the_run_is_told(s3: S3Server) -> None:
    """The store freezes during a save; the save reports the failed attempt, retries, and lands once it is back."""
    s3.create_bucket("flaky")
    said: list[str] = []
    store = CheckpointStore("s3://flaky/job", attempts=6, backoff_s=0.5, report=said.append, attempt_timeout_s=1.5,
                            storage_options=s3.storage_options(read_timeout=1, connect_timeout=1,
                                                               retries={"max_attempts": 1}))
    store.fs.retries = 1  # s3fs's own retry loop would otherwise absorb the silence before ours sees it
    store.save(_writer(1), 1)
    s3.freeze()
    threading.Timer(2.5, s3.thaw).start()
    try:
        ref = store.save(_writer(2), 2)
    finally:
        s3.thaw()
    assert ref.step == 2 and store.latest().step == 2  # type: ignore[union-attr]
    assert any("failed (attempt 1/6" in m and "retrying" in m for m in said), said
    assert any("saved to s3://flaky/job on attempt" in m for m in said), said


def test_s3_store_gone_for_good_fails_the_save_only(s3: S3Server) -> None:
    """Every attempt fails: SaveFailed says the previous checkpoint stays; nothing raises anything else."""
    with S3Server() as gone:
        gone.create_bucket("gone")
        store = CheckpointStore("s3://gone/job", attempts=2, backoff_s=0.1, report=lambda m: None, attempt_timeout_s=3,
                                storage_options=gone.storage_options(read_timeout=1, connect_timeout=1,
                                                                     retries={"max_attempts": 1}))
        store.fs.retries = 1
        store.save(_writer(1), 1)
        gone.stop()
        with pytest.raises(SaveFailed, match="in 2 attempts"):
            store.save(_writer(2), 2)


def test_credentials_from_the_environment_are_enough(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a user does on a cloud: no storage options, the standard variables (here pointed at the test server)."""
    for k, v in s3.env().items():
        monkeypatch.setenv(k, v)
    s3.create_bucket("envonly")
    store = CheckpointStore("s3://envonly/run")
    store.check()
    store.save(_writer(7), 7)
    assert int(_load(store)["step"]) == 7
    assert set(CREDENTIALS) <= set(s3.env())
