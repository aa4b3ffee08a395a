"""The coordination store of one ``parcae run``: hosted on loopback or joined, its URL, the job token.

Problem: the launcher creates the job token, hosts the store the workers coordinate through (or joins one given
with ``--store``), gives both to every worker it starts, and writes signed notices into it when the trace removes
an instance. The parts that start workers or send notices (:mod:`.fleet`, :mod:`.relaunch`) need the URL, the
token and a way to publish -- not the launcher that opened the store. :class:`JobStore` is that one link; the parts
type it as the :class:`StoreLink` protocol (tests give them a fake).
"""

from __future__ import annotations

from typing import Any, Mapping, Optional, Protocol

__all__ = ["JobStore", "StoreLink"]


class StoreLink(Protocol):
    """What a part that starts workers or sends notices needs of the run's store."""

    url: str
    """The URL workers connect to (``PARCAE_STORE``)."""
    token: str
    """The job token (``PARCAE_JOB_TOKEN``)."""

    def publish(self, key: str, record: Mapping[str, Any]) -> None:
        """Write a record signed with the job token."""

    def current_layout(self) -> Optional[dict[str, Any]]:
        """The layout (``{"members", "partition"}``) of the newest started generation, or None (none yet, or
        the store does not answer)."""


class JobStore:
    """The run's store, its URL and the job token; owned by the :class:`~.run.Launcher`, which opens and closes it.

    Args:
        host: Address a hosted store binds to (loopback).
        url: An existing store to use instead of hosting one (``tcp://HOST:PORT`` or ``etcd://HOST:PORT/PREFIX``).
        timeout_s: Seconds to reach the store.
    """

    def __init__(self, host: str = "127.0.0.1", url: Optional[str] = None, timeout_s: float = 10.0) -> None:
        self._host, self._given, self._timeout_s = host, url, timeout_s
        self.store: Any = None
        """The store client (None until :meth:`open`, and after :meth:`close`)."""
        self.url = ""
        """The URL workers connect to (``PARCAE_STORE``)."""
        self.token = ""
        """The job token (``PARCAE_JOB_TOKEN``)."""

    def open(self) -> None:
        """Create the job token and host (or join and install the token into) the store.

        Raises:
            CoordinationError: The store could not be hosted or reached.
        """
        from lightning_parcae.runtime.store import host_store, new_token, parse_store_url  # noqa: PLC0415

        self.token = new_token()
        if self._given is None:
            self.store = host_store(f"tcp://{self._host}:0", token=self.token, timeout_s=self._timeout_s)
            self.url = f"tcp://{self._host}:{self.store.port}"
            return
        spec = parse_store_url(self._given)
        if spec.scheme == "tcp" and spec.port:
            from lightning_parcae.runtime.store import connect_store, install_token  # noqa: PLC0415

            self.store = connect_store(spec, token=None, timeout_s=self._timeout_s, op_timeout_s=30.0)
            install_token(self.store, self.token)
        else:
            self.store = host_store(spec, token=self.token, timeout_s=self._timeout_s)
            if spec.scheme == "tcp":
                spec = spec.with_port(self.store.port)
        self.url = spec.url

    def publish(self, key: str, record: Mapping[str, Any]) -> None:
        """Write ``record`` under ``key``, signed with the job token (errors are the store's)."""
        from lightning_parcae.runtime.store import publish  # noqa: PLC0415

        publish(self.store, key, record, self.token)

    def current_layout(self) -> Optional[dict[str, Any]]:
        """The layout (``{"members": [...], "partition": [...]}``, members in rank order ``replica * P + stage``)
        of the newest started generation, read from its signed record; None before the first generation, without
        a store, or when the store does not answer or the record does not verify (the caller then orders
        without it)."""
        from lightning_parcae.runtime.coordinator import Coordinator  # noqa: PLC0415

        if self.store is None:
            return None
        try:
            coord = Coordinator(self.store, self.token)
            g = coord.current()
            rec = coord.generation(g) if g >= 0 else None
        except Exception:  # noqa: BLE001 -- a store hiccup: the caller orders without the layout
            return None
        layout = rec.get("layout") if isinstance(rec, dict) else None
        return layout if isinstance(layout, dict) and layout.get("members") and layout.get("partition") else None

    def close(self) -> None:
        """Drop the store client (a hosted store stops with it)."""
        self.store = None
