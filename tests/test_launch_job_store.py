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


def test_current_layout_is_the_newest_started_generations_and_none_before_or_if_forged() -> None:
    from lightning_parcae.runtime.coordinator import Coordinator, genrec_key

    js = JobStore("127.0.0.1", None, timeout_s=10.0)
    js.open()
    try:
        assert js.current_layout() is None  # no generation yet
        coord = Coordinator(js.store, js.token)
        layout = {"members": ["i0", "i1", "i2", "i3"], "partition": [5, 6]}
        coord.put(genrec_key(0), {"generation": 0, "layout": {"members": ["i0", "i1"], "partition": [11]}})
        coord.put(genrec_key(1), {"generation": 1, "layout": layout})
        coord.set_current(0)
        assert js.current_layout() == {"members": ["i0", "i1"], "partition": [11]}
        coord.set_current(1)
        assert js.current_layout() == layout
        js.store.set(genrec_key(1), b'{"generation": 1, "layout": {"members": ["x"], "partition": [11]}}')
        assert js.current_layout() is None  # not signed with the job token: not read
    finally:
        js.close()
    assert js.current_layout() is None
