"""``parcae store init``: prepare a shared store for a multi-machine job -- the job token and its proof.

Problem: across machines there is no launcher to create the job token and install its proof in the store; the docs
asked for a ``python -c`` one-liner. This command does it, once, before the agents start: it creates a fresh token
(or takes ``$PARCAE_JOB_TOKEN``), installs a salted proof of it in the store (never the token itself), refuses a
store that already holds another job's proof, and writes the token to a file only its owner can read -- the file
each agent is given with ``--token-file`` (or whose content goes into the secret manager). The token is never
printed: a terminal's scroll-back and ``ps`` are not secret stores.

    parcae store init --store etcd://10.0.0.5:2379/parcae/job1 --token-file job1.token
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any, Optional, Sequence

from lightning_parcae.contract import JOB_TOKEN_ENV
from lightning_parcae.errors import ConfigurationError, ParcaeError

__all__ = ["build_parser", "main", "init_store", "install_proof", "read_token_file", "write_token_file",
           "multi_machine_spec"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``parcae store init``."""
    p = argparse.ArgumentParser(
        prog="parcae store init",
        description="Create a job token and install its proof in a shared store (etcd, or a TCPStore hosted on a "
        "stable host), before the agents of a multi-machine job start. The token is written to --token-file "
        "(mode 0600), never printed.",
        epilog="example: parcae store init --store etcd://10.0.0.5:2379/parcae/job1 --token-file job1.token",
    )
    p.add_argument("--store", required=True, help="etcd://HOST:PORT/PREFIX or tcp://HOST:PORT (an existing store)")
    p.add_argument("--token-file", required=True, help="where the token goes (created with mode 0600; must not "
                   "exist yet unless --reuse-token-file)")
    p.add_argument("--reuse-token-file", action="store_true", help="take the token from an existing --token-file "
                   "(e.g. to install its proof into a second store) instead of creating one")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to reach the store (default 10)")
    return p


def multi_machine_spec(store_url: str) -> Any:
    """The parsed ``store_url`` (a :class:`~lightning_parcae.runtime.store.StoreSpec`), if other machines can share it.

    Raises:
        ConfigurationError: Not ``etcd://HOST:PORT/PREFIX`` or ``tcp://HOST:PORT`` with a real port.
    """
    from lightning_parcae.runtime.store import parse_store_url  # noqa: PLC0415

    spec = parse_store_url(store_url)
    if spec.scheme not in ("etcd", "tcp") or (spec.scheme == "tcp" and not spec.port):
        raise ConfigurationError(f"--store {store_url!r}: a multi-machine job needs etcd://HOST:PORT/PREFIX or an "
                                 "existing tcp://HOST:PORT that outlives this command")
    return spec


def read_token_file(token_file: str) -> str:
    """The token kept in ``token_file`` (surrounding white space removed).

    Raises:
        ConfigurationError: It cannot be read, or is empty.
    """
    try:
        token = Path(token_file).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigurationError(f"--token-file {token_file!r} cannot be read: {exc}") from None
    if not token:
        raise ConfigurationError(f"--token-file {token_file!r} is empty: remove it to have a new token created")
    return token


def write_token_file(token_file: str, token: str) -> None:
    """Create ``token_file`` (mode 0600, only its owner can read it) holding ``token``; never replaces a file.

    Raises:
        ConfigurationError: It exists already or cannot be created.
    """
    try:
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigurationError(f"--token-file {token_file!r} exists: remove it, or pass --reuse-token-file to "
                                 "install the token it holds") from None
    except OSError as exc:
        raise ConfigurationError(f"--token-file {token_file!r} cannot be created: {exc}") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(token + "\n")


def install_proof(store_url: str, token: str, *, timeout_s: float = 10.0) -> str:
    """Install the proof of ``token`` in the store at ``store_url``; a proof of the same token already there is
    kept (installing twice -- e.g. a restarted ``parcae store start`` -- is no error).

    Returns:
        The store's URL in normal form (what the agents are given).

    Raises:
        ConfigurationError: Not a store other machines can share (:func:`multi_machine_spec`).
        CoordinationError: The store cannot be reached within ``timeout_s``.
        WrongTokenError: The store holds the proof of another token.
    """
    from lightning_parcae.runtime.store import WrongTokenError, connect_store, install_token  # noqa: PLC0415

    spec = multi_machine_spec(store_url)
    try:
        store = connect_store(spec, token=None, timeout_s=timeout_s, op_timeout_s=30.0)
    except WrongTokenError:  # a proof is there: this token's (installed before) or another job's
        try:
            connect_store(spec, token=token, timeout_s=timeout_s, op_timeout_s=30.0)
        except WrongTokenError as exc:
            raise WrongTokenError(
                f"{spec.url} already holds the proof of another job's token ({exc}); use that job's token file, "
                "or a fresh etcd prefix (or data directory) for a new job") from None
        return spec.url
    install_token(store, token)
    return spec.url


def init_store(store_url: str, token_file: str, *, reuse: bool = False, timeout_s: float = 10.0) -> str:
    """Install a token's proof in the store at ``store_url`` and keep the token in ``token_file``.

    The token is, in this order: ``token_file``'s content with ``reuse``, ``$PARCAE_JOB_TOKEN``, or a fresh one.

    Returns:
        The store's URL as the agents should be given it.

    Raises:
        ConfigurationError: ``token_file`` exists (and not ``reuse``), cannot be written, or is empty with ``reuse``;
            the URL is not a store another machine can reach (``file://``).
        CoordinationError: the store cannot be reached, or it holds another job's proof.
    """
    from lightning_parcae.runtime.store import new_token  # noqa: PLC0415

    multi_machine_spec(store_url)
    if reuse:
        token = read_token_file(token_file)
    else:
        if Path(token_file).exists():
            raise ConfigurationError(f"--token-file {token_file!r} exists: remove it, or pass --reuse-token-file to "
                                     "install the token it holds")
        token = os.environ.get(JOB_TOKEN_ENV) or new_token()
    url = install_proof(store_url, token, timeout_s=timeout_s)
    if not reuse:
        write_token_file(token_file, token)
    return url


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``parcae store init`` (exit 2 with a message on bad input or an unreachable store)."""
    args = build_parser().parse_args(argv)
    try:
        url = init_store(args.store, args.token_file, reuse=args.reuse_token_file, timeout_s=args.timeout)
    except ParcaeError as exc:
        print(f"parcae store init: error: {exc}", file=sys.stderr)
        return 2
    print(f"parcae store init: {url} holds the proof of the token in {args.token_file}; start each agent with "
          f"--store {url} --token-file <that file>")
    return 0
