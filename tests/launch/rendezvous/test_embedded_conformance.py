"""The embedded service answers the etcd v3 gRPC subset as etcd does: each case runs the same
raw requests against it and against a real etcd server, and expects the same behaviour."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

import grpc
import pytest
from elastic_launch.net import free_port
from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc
from launch_fakes import embedded_login

TIMEOUT = 10.0


class Client:
    def __init__(self, endpoint: str) -> None:
        self.channel = grpc.insecure_channel(endpoint)
        self.kv = rpc_pb2_grpc.KVStub(self.channel)
        self.lease = rpc_pb2_grpc.LeaseStub(self.channel)
        self.watch = rpc_pb2_grpc.WatchStub(self.channel)

    def revision(self) -> int:
        reply = self.kv.Range(rpc_pb2.RangeRequest(key=b"\0"), timeout=TIMEOUT)
        return int(reply.header.revision)

    def watch_responses(self, key: bytes, start: int) -> tuple[queue.Queue, threading.Event]:
        """Start a prefix watch; its responses arrive on the queue until the event is set."""
        out: queue.Queue = queue.Queue()
        stop = threading.Event()
        end = key[:-1] + bytes([key[-1] + 1])

        def requests() -> Iterator[rpc_pb2.WatchRequest]:
            create = rpc_pb2.WatchCreateRequest(key=key, range_end=end, start_revision=start)
            yield rpc_pb2.WatchRequest(create_request=create)
            stop.wait(TIMEOUT)

        call = self.watch.Watch(requests(), timeout=TIMEOUT)

        def read() -> None:
            try:
                for reply in call:
                    out.put(reply)
            except grpc.RpcError:
                pass

        threading.Thread(target=read, daemon=True).start()
        stop_all = threading.Event()

        def closer() -> None:
            stop_all.wait(TIMEOUT)
            stop.set()
            call.cancel()

        threading.Thread(target=closer, daemon=True).start()
        return out, stop_all


SLOW = pytest.mark.slow  # a real etcd server


@pytest.fixture(params=["embedded", pytest.param("etcd", marks=SLOW)])
def client(request):
    if request.param == "embedded":
        from elastic_launch.rendezvous.embedded.server import EmbeddedServer

        port = free_port()
        server = EmbeddedServer("127.0.0.1", port, token=None)
        c = Client(f"127.0.0.1:{port}")
        yield c
        c.channel.close()
        server.close()
    else:
        c = Client(request.getfixturevalue("etcd").endpoint)
        yield c
        c.channel.close()


def test_a_put_with_an_unknown_lease_is_refused_without_a_new_revision(client):
    before = client.revision()
    with pytest.raises(grpc.RpcError) as info:
        client.kv.Put(rpc_pb2.PutRequest(key=b"/c/a", value=b"1", lease=12345), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "requested lease not found" in (info.value.details() or "")
    assert client.revision() == before


def test_granting_an_existing_lease_id_again_is_refused(client):
    # Follows etcd (lessor's ErrLeaseExists): a second grant of the same ID would replace the
    # lease, and the keys attached to it would never expire.
    lease_id = 0x5EED0000 + int(time.monotonic_ns() % 100_000)
    first = client.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=5, ID=lease_id), timeout=TIMEOUT)
    assert first.ID == lease_id
    with pytest.raises(grpc.RpcError) as info:
        client.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=5, ID=lease_id), timeout=TIMEOUT)
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "lease already exists" in (info.value.details() or "")
    client.lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=lease_id), timeout=TIMEOUT)


def test_a_value_compare_on_a_missing_key_is_false(client):
    for result in (rpc_pb2.Compare.EQUAL, rpc_pb2.Compare.NOT_EQUAL):
        compare = rpc_pb2.Compare(
            key=b"/c/missing", target=rpc_pb2.Compare.VALUE, result=result, value=b"x"
        )
        reply = client.kv.Txn(rpc_pb2.TxnRequest(compare=[compare]), timeout=TIMEOUT)
        assert not reply.succeeded


def test_the_events_of_one_revision_arrive_in_one_response(client):
    grant = client.lease.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=30), timeout=TIMEOUT)
    for key in (b"/c/b/1", b"/c/b/2"):
        client.kv.Put(rpc_pb2.PutRequest(key=key, value=b"v", lease=grant.ID), timeout=TIMEOUT)
    out, stop = client.watch_responses(b"/c/b/", client.revision() + 1)
    try:
        assert out.get(timeout=TIMEOUT).created
        client.lease.LeaseRevoke(rpc_pb2.LeaseRevokeRequest(ID=grant.ID), timeout=TIMEOUT)
        reply = out.get(timeout=TIMEOUT)
        assert [e.kv.key for e in reply.events] == [b"/c/b/1", b"/c/b/2"]
        assert len({e.kv.mod_revision for e in reply.events}) == 1
    finally:
        stop.set()


def test_a_watch_from_the_past_replays_the_history(client):
    start = client.revision() + 1
    client.kv.Put(rpc_pb2.PutRequest(key=b"/c/h/1", value=b"a"), timeout=TIMEOUT)
    client.kv.DeleteRange(rpc_pb2.DeleteRangeRequest(key=b"/c/h/1"), timeout=TIMEOUT)
    out, stop = client.watch_responses(b"/c/h/", 1)  # before anything was written: no gap
    try:
        first = out.get(timeout=TIMEOUT)
        assert first.created and not first.canceled
        events = []
        while len(events) < 2:
            events += out.get(timeout=TIMEOUT).events
        assert [(e.type, e.kv.key) for e in events] == [(0, b"/c/h/1"), (1, b"/c/h/1")]
        assert events[0].kv.mod_revision >= start
    finally:
        stop.set()


def test_the_embedded_service_refuses_calls_and_streams_without_the_job_token():
    from elastic_launch.rendezvous.embedded.server import EmbeddedServer

    port = free_port()
    server = EmbeddedServer("127.0.0.1", port, token="right")
    c = Client(f"127.0.0.1:{port}")
    try:
        wrong = [("token", "wrong")]
        with pytest.raises(grpc.RpcError) as unary:
            c.kv.Range(rpc_pb2.RangeRequest(key=b"/a"), timeout=TIMEOUT, metadata=wrong)
        watch = c.watch.Watch(iter([rpc_pb2.WatchRequest()]), timeout=TIMEOUT, metadata=wrong)
        with pytest.raises(grpc.RpcError) as stream:
            list(watch)
        keep = c.lease.LeaseKeepAlive(iter([]), timeout=TIMEOUT)  # no token at all
        with pytest.raises(grpc.RpcError) as keepalive:
            list(keep)
        raw = [("token", "right")]  # the token itself is no credential: it is never sent
        with pytest.raises(grpc.RpcError) as sent_raw:
            c.kv.Range(rpc_pb2.RangeRequest(key=b"/a"), timeout=TIMEOUT, metadata=raw)
        for info in (unary, stream, keepalive, sent_raw):
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "invalid rendezvous token" in (info.value.details() or "")
        with pytest.raises(ValueError, match="proof does not match"):
            embedded_login(c.channel, "wrong", f"127.0.0.1:{port}")
        right = embedded_login(c.channel, "right", f"127.0.0.1:{port}")
        reply = c.kv.Range(rpc_pb2.RangeRequest(key=b"/a"), timeout=TIMEOUT, metadata=right)
        assert reply.header.revision >= 1
    finally:
        c.channel.close()
        server.close()
