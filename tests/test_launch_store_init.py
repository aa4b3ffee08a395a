"""``parcae store init``: the token's proof goes into the shared store, the token into a 0600 file, never stdout.

Regression (issue 20): a multi-machine job's set-up was a ``python -c`` one-liner that printed the token.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from lightning_parcae.launch.cli import main as parcae
from lightning_parcae.runtime.store import connect_store, host_store
from lightning_parcae.errors import CoordinationError
from lightning_parcae.testing.etcd_server import EtcdServer


def test_store_init_installs_a_proof_agents_can_check_and_keeps_the_token_secret(
        tmp_path: Path, etcd_server: EtcdServer, capsys: pytest.CaptureFixture[str]) -> None:
    url = etcd_server.store_url("/parcae/init-test")
    token_file = tmp_path / "job.token"
    assert parcae(["store", "init", "--store", url, "--token-file", str(token_file)]) == 0
    token = token_file.read_text().strip()
    out = capsys.readouterr().out
    assert token and token not in out and "--token-file" in out
    assert stat.S_IMODE(os.stat(token_file).st_mode) == 0o600
    connect_store(url, token=token, timeout_s=5.0)  # an agent with the token is let in
    with pytest.raises(CoordinationError):
        connect_store(url, token="not-the-token", timeout_s=5.0)
    # a second init with a new token must not take over the job's store
    assert parcae(["store", "init", "--store", url, "--token-file", str(tmp_path / "other.token")]) == 2
    assert "token" in capsys.readouterr().err


def test_store_init_refuses_to_overwrite_a_token_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hosted = host_store("tcp://127.0.0.1:0")
    token_file = tmp_path / "job.token"
    token_file.write_text("old\n")
    rc = parcae(["store", "init", "--store", f"tcp://127.0.0.1:{hosted.port}", "--token-file", str(token_file)])
    assert rc == 2 and "exists" in capsys.readouterr().err and token_file.read_text() == "old\n"


def test_store_init_refuses_a_store_other_machines_cannot_reach(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    rc = parcae(["store", "init", "--store", f"file://{tmp_path}/s", "--token-file", str(tmp_path / "t")])
    assert rc == 2 and "multi-machine job needs etcd://" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_parcae_store_without_init_says_what_exists(capsys: pytest.CaptureFixture[str]) -> None:
    assert parcae(["store"]) == 2 and "parcae store init" in capsys.readouterr().err
