"""Shared test fixtures: paths to the bundled reference data, and one real etcd for the tests that need it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lightning_parcae.testing.etcd_server import EtcdServer, etcd_binary

try:
    import etcd as _python_etcd  # noqa: F401

    HAVE_PYTHON_ETCD = True
except ImportError:
    HAVE_PYTHON_ETCD = False

DATA = Path(__file__).resolve().parent.parent / "lightning_parcae" / "data"


@pytest.fixture
def data_dir() -> Path:
    """The package's bundled data folder (p3 trace, throughput tables, 1-hour segments)."""
    return DATA


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    """One real etcd for a test module's etcd tests (about 0.5 s to start); skips, saying why, without etcd."""
    if etcd_binary() is None or not HAVE_PYTHON_ETCD:
        pytest.skip("needs the etcd binary (apt-get install etcd-server) and python-etcd (pip install python-etcd)")
    server = EtcdServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


def record_client_calls(store: object, names: tuple[str, ...] = ("get", "watch")) -> list[str]:
    """Record, in order, every call of the named methods of an etcd store's python-etcd client (the requests a
    store operation makes: ``get``/``watch``, or ``read``/``write``/``delete``, which every request goes through)."""
    calls: list[str] = []
    client = store.client  # type: ignore[attr-defined]
    for name in names:
        real = getattr(client, name)
        setattr(client, name, lambda *a, _n=name, _r=real, **kw: (calls.append(_n), _r(*a, **kw))[1])
    return calls
