"""The etcd v3 store's parts, each alone against the embedded service (which speaks etcd's v3
subset): the connection's calls, the lease and its keep-alive, a watch. The store's own tests
(test_store.py) run all three together, on etcd as well."""

from __future__ import annotations

import threading
import time

import pytest
from elastic_launch.cancel import CancelToken
from elastic_launch.rendezvous.etcd.v3_client import Client
from elastic_launch.rendezvous.etcd.v3_lease import Lease
from elastic_launch.rendezvous.etcd.v3_watch import EtcdWatch, prefix_end
from elastic_launch.rendezvous.etcdpb import rpc_pb2
from elastic_launch.rendezvous.store.api import Inbox, StoreAccess, StoreError


class Counter:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


@pytest.fixture
def client(embedded):
    endpoint, token = embedded
    access = StoreAccess("the service", token=token, retry_for=5, read_timeout=5)
    counted = Counter()
    c = Client(endpoint, access, CancelToken(), counted)
    c.counted = counted
    yield c
    c.close()


def put(c: Client, key: str, value: bytes, lease: int = 0) -> int:
    request = rpc_pb2.PutRequest(key=key.encode(), value=value, lease=lease)
    return int(c.call("kv.Put", request).header.revision)


def get(c: Client, key: str) -> list:
    return list(c.call("kv.Range", rpc_pb2.RangeRequest(key=key.encode())).kvs)


def test_a_client_logs_in_calls_and_counts_its_requests(client):
    revision = put(client, "/parts/a", b"1")
    assert revision > 0
    assert [kv.value for kv in get(client, "/parts/a")] == [b"1"]
    assert client.counted.n >= 2, "every request is counted"


def test_a_client_of_a_store_that_is_not_there_says_so_within_its_retry_time():
    from elastic_launch.net import free_port

    access = StoreAccess("the store at nowhere", retry_for=0.3, read_timeout=0.3)
    c = Client(f"127.0.0.1:{free_port()}", access, CancelToken(), Counter())
    try:
        with pytest.raises(StoreError, match="the store at nowhere is unreachable"):
            get(c, "/x")
    finally:
        c.close()


def test_a_lease_keeps_its_keys_until_it_is_closed(client, embedded):
    lease = Lease(client)
    lease.start(5.0)
    try:
        assert lease.held == {lease.id}
        put(client, "/parts/ephemeral", b"1", lease.id)
        assert get(client, "/parts/ephemeral")
    finally:
        lease.close()
    assert not get(client, "/parts/ephemeral"), "revoked at close: the key went at once"


def test_a_lease_found_expired_is_replaced_and_the_loss_told(client):
    lost = threading.Event()
    lease = Lease(client)
    lease.start(5.0, lost.set)
    try:
        old = lease.id
        client.call("lease.LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=old))
        lease.replace(old)
        assert lost.is_set() and lease.id not in (0, old)
        lease.replace(old)  # a second finder of the same expiry changes nothing
        assert lease.id != old
    finally:
        lease.close()


def test_a_watch_delivers_what_changes_under_its_prefixes_in_order(client):
    revision = put(client, "/parts/w/before", b"0")
    inbox = Inbox()
    watch = EtcdWatch(client, ["/parts/w/"], revision, inbox, from_now=False)
    try:
        put(client, "/parts/w/x", b"1")
        put(client, "/parts/other", b"not watched")
        put(client, "/parts/w/y", b"2")
        seen: list = []
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            seen += inbox.next(1.0) or []
        assert [(c.key, c.value) for c in seen] == [("/parts/w/x", b"1"), ("/parts/w/y", b"2")]
    finally:
        watch.close()


def test_prefix_end_is_the_first_key_after_every_key_of_the_prefix():
    assert prefix_end(b"/a/") == b"/a0"
    assert prefix_end(b"a\xff") == b"b"
    assert prefix_end(b"\xff\xff") == b"\0"


@pytest.mark.timeout(60)
def test_the_retry_time_the_rendezvous_sets_on_the_store_is_the_one_its_calls_use():
    """Once the job runs, the rendezvous shortens the store's retries to its reconnect
    timeout: every call through the connection obeys it (a call retrying for the old 600 s
    would outlive this test's limit)."""
    from elastic_launch.net import free_port
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

    access = StoreAccess("the store at nowhere", retry_for=600, read_timeout=0.2)
    store = EtcdV3Store(f"127.0.0.1:{free_port()}", access)
    try:
        store.retry_for = 0.3
        assert store.client.retry_for == 0.3
        with pytest.raises(StoreError, match="unreachable"):
            store.get("/x")
    finally:
        store.close()
