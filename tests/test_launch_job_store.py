"""The run's store link (``lightning_parcae.launch.job_store``): hosted on loopback, signed notices, closed."""

from __future__ import annotations

from lightning_parcae.launch.job_store import JobStore


def test_a_hosted_store_has_a_loopback_url_a_token_and_takes_signed_records() -> None:
    from lightning_parcae.runtime.store import read

    js = JobStore("127.0.0.1", None, timeout_s=10.0)
    assert js.store is None and js.url == ""
    js.open()
    try:
        assert js.url.startswith("tcp://127.0.0.1:") and not js.url.endswith(":0") and len(js.token) >= 16
        js.publish("parcae/notice/i1", {"member": "i1", "kind": "preempt"})
        assert read(js.store, "parcae/notice/i1", js.token) == {"member": "i1", "kind": "preempt"}
    finally:
        js.close()
    assert js.store is None
