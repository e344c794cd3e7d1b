"""The store interface, one behaviour for every implementation: the embedded service, etcd's v3
API and etcd's v2 API (real etcd servers)."""

from __future__ import annotations

import time

import pytest
from elastic_launch.net import free_port
from elastic_launch.rendezvous.store import Store, StoreError

SLOW = pytest.mark.slow  # a real etcd server


@pytest.fixture(
    params=["embedded", pytest.param("etcd", marks=SLOW), pytest.param("etcd-v2", marks=SLOW)]
)
def store(request):
    if request.param == "embedded":
        from elastic_launch.rendezvous.etcd_v3 import EtcdV3Store

        endpoint, token = request.getfixturevalue("embedded")
        s: Store = EtcdV3Store(endpoint, "embedded", token=token, retry_for=5)
    elif request.param == "etcd":
        from elastic_launch.rendezvous.etcd_v3 import EtcdV3Store

        etcd = request.getfixturevalue("etcd")
        s = EtcdV3Store(etcd.endpoint, "etcd", retry_for=5)
    else:
        from elastic_launch.rendezvous.etcd_v2 import EtcdV2Store

        etcd = request.getfixturevalue("etcd_v2")
        host, port = etcd.endpoint.split(":")
        s = EtcdV2Store(host, int(port), "etcd", retry_for=5)
    yield s
    s.close()


def test_get_put_create_cas_delete(store):
    assert store.get("/t/a") is None
    created = store.create("/t/a", b"1")
    assert created
    assert not store.create("/t/a", b"2"), "create only if absent"
    kv = store.get("/t/a")
    assert kv is not None and kv.value == b"1" and kv.version == created
    new_version = store.cas("/t/a", b"3", kv.version)
    assert new_version > kv.version
    assert not store.cas("/t/a", b"4", kv.version), "the version moved on"
    assert store.get("/t/a").value == b"3" and store.get("/t/a").version == new_version
    assert store.cas("/t/a", b"5", new_version), "the returned version is the CAS token"
    store.put("/t/b/c", b"x")
    store.put("/t/b/d", b"y")
    kvs, revision = store.range("/t/b/")
    assert sorted(k.key for k in kvs) == ["/t/b/c", "/t/b/d"] and revision > 0
    store.delete("/t/b/", prefix=True)
    assert store.range("/t/b/")[0] == []
    store.delete("/t/a")
    assert store.get("/t/a") is None
    assert store.requests > 0


def test_watch_delivers_changes_after_a_revision_in_order(store):
    _, revision = store.range("/w/")
    watch = store.watch("/w/", revision)
    try:
        store.put("/w/1", b"a")
        store.put("/w/2", b"b")
        store.delete("/w/1")
        seen = []
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            seen += watch.next(1.0) or []
        assert [(c.key, c.value) for c in seen] == [("/w/1", b"a"), ("/w/2", b"b"), ("/w/1", None)]
        assert seen[0].revision < seen[1].revision < seen[2].revision
        assert watch.next(0.1) is None
    finally:
        watch.close()


def test_closing_a_watch_wakes_its_reader_and_ends_its_thread(store):
    import threading

    def watch_threads() -> int:
        return sum(t.name == "elasticrun-watch" and t.is_alive() for t in threading.enumerate())

    before = watch_threads()
    store.watch("/c/", store.range("/c/")[1]).close()  # closed before its stream is up
    watch = store.watch("/c/", store.range("/c/")[1])
    got: list[object] = []
    reader = threading.Thread(target=lambda: got.append(watch.next(30.0)))
    reader.start()
    time.sleep(0.2)
    watch.close()
    reader.join(timeout=10)
    assert not reader.is_alive(), "a reader waiting on a closed watch sat out its timeout"
    assert got == [[]]
    from elastic_launch.rendezvous.etcd_v3 import EtcdV3Store

    if isinstance(store, EtcdV3Store):  # v2's reader ends with its pending long poll
        assert watch_threads() == before, "a closed watch left its thread running"


@pytest.mark.slow  # it outlives a lease's TTL
@pytest.mark.timeout(60)
def test_ephemeral_keys_live_with_the_lease(store):
    store.start_liveness(2.0)
    store.put("/e/alive", b"1", ephemeral=True)
    time.sleep(3.0)  # longer than the TTL: renewals keep it
    assert store.get("/e/alive") is not None
    store.close()  # revoked: the key goes at once


def test_unreachable_store_is_a_clear_error():
    from elastic_launch.rendezvous.etcd_v3 import EtcdV3Store

    dead = EtcdV3Store(f"127.0.0.1:{free_port()}", "etcd at nowhere", retry_for=0.5)
    with pytest.raises(StoreError, match="etcd at nowhere is unreachable"):
        dead.get("/x")
    dead.close()
