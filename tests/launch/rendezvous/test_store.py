"""The store interface, one behaviour for every implementation: the embedded service, etcd's v3
API and etcd's v2 API (real etcd servers)."""

from __future__ import annotations

import time

import pytest
from elastic_launch.net import free_port
from elastic_launch.rendezvous.store.api import Store, StoreAccess, StoreError
from launch_fakes import embedded_login

SLOW = pytest.mark.slow  # a real etcd server


@pytest.fixture(
    params=[
        "embedded",
        pytest.param("etcd", marks=SLOW),
        pytest.param("etcd-cluster", marks=SLOW),
        pytest.param("etcd-v2", marks=SLOW),
    ]
)
def store(request):
    if request.param == "embedded":
        from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

        endpoint, token = request.getfixturevalue("embedded")
        s: Store = EtcdV3Store(endpoint, StoreAccess("embedded", token=token, retry_for=5))
    elif request.param in ("etcd", "etcd-cluster"):
        from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

        shared = request.param == "etcd-cluster"  # one cluster, its keys removed after each
        etcd = request.getfixturevalue("etcd_cluster_shared" if shared else "etcd")
        s = EtcdV3Store(etcd.endpoint, StoreAccess("etcd", retry_for=5))
    else:
        from elastic_launch.rendezvous.etcd.v2 import EtcdV2Store

        etcd = request.getfixturevalue("etcd_v2")
        s = EtcdV2Store(etcd.endpoint, StoreAccess("etcd", retry_for=5))
    yield s
    s.close()
    if request.param == "etcd-cluster":  # the next test of the module finds the cluster empty
        from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

        cleaner = EtcdV3Store(etcd.endpoint, StoreAccess("etcd", retry_for=5))
        cleaner.delete("/", prefix=True)
        cleaner.close()


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


def test_an_ephemeral_create_that_finds_its_own_key_is_the_creator(store):
    """A create whose answer was lost and that was retried finds the key it wrote: with this
    very value (and this store's lease) it is this store's, and create says so."""
    store.start_liveness(5.0)
    key = f"/own/{time.monotonic_ns()}"
    created = store.create(key, b"node-a", ephemeral=True)
    assert created
    assert store.create(key, b"node-a", ephemeral=True) == store.get(key).version
    assert not store.create(key, b"node-b", ephemeral=True), "another value: another's key"
    store.put(key + "-plain", b"v")
    assert not store.create(key + "-plain", b"v"), "not ephemeral: create only if absent"


def test_a_put_with_a_read_and_a_cas_with_other_writes(store):
    store.start_liveness(5.0)
    store.put("/pg/shard", b"members")
    found = store.put_get("/pg/confirm", b"1", "/pg/shard", ephemeral=True)
    assert found is not None and found.value == b"members"
    assert store.get("/pg/confirm").value == b"1"
    assert store.put_get("/pg/other", b"2", "/pg/absent") is None
    version = store.create("/pg/state", b"joinable")
    assert store.cas_with("/pg/state", b"frozen", version, {"/pg/m/0": b"a", "/pg/m/1": b"b"})
    assert store.get("/pg/state").value == b"frozen"
    assert sorted(kv.value for kv in store.range("/pg/m/")[0]) == [b"a", b"b"]
    # A cas that loses writes nothing where the store has transactions (etcd v3).
    assert not store.cas_with("/pg/state", b"late", version, {"/pg/m/2": b"c"})
    assert store.get("/pg/state").value == b"frozen"
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

    if isinstance(store, EtcdV3Store):
        assert store.get("/pg/m/2") is None
    store.close()  # revoked: the ephemeral confirmation goes with the lease


def test_watch_delivers_changes_after_a_revision_in_order(store):
    _, revision = store.range("/w/")
    watch = store.watch("/w/", revision)
    try:
        store.put("/w/1", b"a")
        store.put("/w/2", b"b")
        store.delete("/w/1")
        seen: list = []
        net: dict[str, bytes | None] = {}
        deadline = time.monotonic() + 10
        while net != {"/w/1": None, "/w/2": b"b"} and time.monotonic() < deadline:
            for change in watch.next(1.0) or []:
                seen.append(change)
                net[change.key] = change.value
        # Every change, in order; except that an etcd v3 stream starts at the server's current
        # revision and delivers what came before it as the difference of two reads (a stream
        # slow to start can see /w/1 come and go as nothing): the net result is the same.
        assert net in ({"/w/1": None, "/w/2": b"b"}, {"/w/2": b"b"}), seen
        revisions = [c.revision for c in seen]
        assert revisions == sorted(revisions), seen
        if len(seen) == 3:
            assert [(c.key, c.value) for c in seen] == [
                ("/w/1", b"a"),
                ("/w/2", b"b"),
                ("/w/1", None),
            ]
        assert watch.next(0.1) is None
    finally:
        watch.close()


def _collect(inbox, count: int) -> list:
    seen: list = []
    deadline = time.monotonic() + 10
    while len(seen) < count and time.monotonic() < deadline:
        seen += inbox.next(1.0) or []
    return seen


def test_a_watch_that_starts_in_the_past_gets_the_changes_in_between(store):
    # A rendezvous reads, then watches from its read: others may write in between. (etcd
    # serves such a watch late, by up to 100 ms: ours starts at the server's revision and
    # reads the gap instead; the result must be the same changes.)
    from elastic_launch.rendezvous.store.api import Inbox

    store.put("/g/gone", b"0")
    store.put("/g/kept", b"0")
    _, revision = store.range("/g/")
    store.put("/g/new", b"1")  # in the gap
    store.delete("/g/gone")  # in the gap
    inbox = Inbox()
    watches = store.watch_many(["/g/", "/h/"], revision, inbox)
    try:
        store.put("/h/later", b"2")
        seen = [(c.key, c.value) for c in _collect(inbox, 3)]
        # In order within a prefix (v2 polls each prefix apart: no order across them).
        assert [c for c in seen if c[0].startswith("/g/")] == [("/g/new", b"1"), ("/g/gone", None)]
        assert [c for c in seen if c[0].startswith("/h/")] == [("/h/later", b"2")]
        assert inbox.next(0.1) is None, "nothing twice"
    finally:
        for w in watches:
            w.close()


def test_etcd_v3_serves_several_prefixes_on_one_stream(store):
    import threading

    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
    from elastic_launch.rendezvous.store.api import Inbox

    if not isinstance(store, EtcdV3Store):
        pytest.skip("etcd's v2 API has one long poll per key")

    def watch_threads() -> int:
        return sum(t.name == "elasticrun-watch" and t.is_alive() for t in threading.enumerate())

    before = watch_threads()
    inbox = Inbox()
    watches = store.watch_many(["/m1/", "/m2/", "/m3"], store.range("/m")[1], inbox)
    try:
        assert len(watches) == 1 and watch_threads() == before + 1, "one stream, one thread"
        for key in ("/m3", "/m2/b", "/m1/a", "/m2/c"):
            store.put(key, b"x")
        # The watches are created one after the other while the puts run, and a watch created
        # late catches up from the history: in order within a prefix, not across prefixes
        # (etcd's own catch-up loop behaves the same).
        seen = [c.key for c in _collect(inbox, 4)]
        assert sorted(seen) == ["/m1/a", "/m2/b", "/m2/c", "/m3"]
        assert seen.index("/m2/b") < seen.index("/m2/c")
        assert inbox.next(0.1) is None, "nothing twice"
    finally:
        for w in watches:
            w.close()


def test_the_embedded_service_refuses_to_read_a_past_revision(embedded):
    import grpc
    from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc

    endpoint, token = embedded
    with grpc.insecure_channel(endpoint) as channel:
        kv = rpc_pb2_grpc.KVStub(channel)
        metadata = embedded_login(channel, token, endpoint)
        put = kv.Put(rpc_pb2.PutRequest(key=b"/p", value=b"1"), metadata=metadata, timeout=5)
        request = rpc_pb2.RangeRequest(key=b"/p", revision=put.header.revision - 1)
        with pytest.raises(grpc.RpcError) as e:
            kv.Range(request, metadata=metadata, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert "reads only the current revision" in e.value.details()


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
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

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


def test_a_write_that_finds_its_lease_expired_takes_a_new_one_and_says_so(store):
    # A node cut off longer than its lease's TTL (a network partition that heals) writes
    # with the lease the store has dropped: the write is made with a new lease, and the
    # session hears once that its ephemeral keys were lost.
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
    from elastic_launch.rendezvous.etcdpb import rpc_pb2

    if not isinstance(store, EtcdV3Store):
        pytest.skip("etcd's v2 API has no leases: a TTL key is written anew")
    lost = []
    store.start_liveness(30.0, lambda: lost.append(1))  # the keeper will not tick meanwhile
    old = store.lease.id
    store.client.call("lease.LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=old))  # as expiry does
    assert store.create("/gone/a", b"1", ephemeral=True)
    assert lost == [1] and store.lease.id != old
    store.put("/gone/b", b"2", ephemeral=True)
    assert lost == [1], "told once"
    for key in ("/gone/a", "/gone/b"):
        assert store.get(key) is not None
    assert _ttl(store, store.lease.id) > 0


def test_unreachable_store_is_a_clear_error():
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

    dead = EtcdV3Store(f"127.0.0.1:{free_port()}", StoreAccess("etcd at nowhere", retry_for=0.5))
    with pytest.raises(StoreError, match="etcd at nowhere is unreachable"):
        dead.get("/x")
    dead.close()


def test_a_request_the_server_cancelled_is_retried():
    """A server whose request's deadline ran out before it answered resets the stream, which
    the client sees as CANCELLED: retried, as DEADLINE_EXCEEDED is."""
    from concurrent import futures

    import grpc
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
    from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc

    calls = []

    class KV(rpc_pb2_grpc.KVServicer):
        def Range(self, request, context):  # noqa: N802 - gRPC's name
            calls.append(request.key)
            if len(calls) == 1:
                context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")
            return rpc_pb2.RangeResponse(header=rpc_pb2.ResponseHeader(revision=7))

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    rpc_pb2_grpc.add_KVServicer_to_server(KV(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    store = EtcdV3Store(f"127.0.0.1:{port}", StoreAccess("the test server", retry_for=5))
    try:
        assert store.get("/x") is None  # answered the second time
        assert calls == [b"/x", b"/x"]
    finally:
        store.close()
        server.stop(0)


def _v3(embedded, **kw):
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

    endpoint, token = embedded
    return EtcdV3Store(endpoint, StoreAccess("embedded", token=token, retry_for=5, **kw))


def _ttl(store, lease: int) -> int:
    from elastic_launch.rendezvous.etcdpb import rpc_pb2

    request = rpc_pb2.LeaseTimeToLiveRequest(ID=lease)
    return store.client.call("lease.LeaseTimeToLive", request).TTL


def test_a_lease_asked_for_early_is_the_one_used(embedded):
    store = _v3(embedded)
    grants: list[str] = []  # counted by kind: the keep-alive stream counts in store.requests
    original = store.client.current.lease.LeaseGrant

    class Counting:
        def __call__(self, *args, **kwargs):
            grants.append("call")
            return original(*args, **kwargs)

        def future(self, *args, **kwargs):
            grants.append("future")
            return original.future(*args, **kwargs)

    store.client.current.lease.LeaseGrant = Counting()
    try:
        store.request_lease(5.0)  # returns at once
        store.start_liveness(5.0)
        assert grants == ["future"], "no second grant: the early one is used"
        assert store.create("/early/key", b"1", ephemeral=True)
        assert _ttl(store, store.lease.id) > 0
    finally:
        store.close()


def test_an_early_lease_of_another_ttl_or_too_old_is_given_back(embedded, monkeypatch):
    import elastic_launch.rendezvous.etcd.v3_lease as etcd_v3_lease

    store = _v3(embedded)
    observer = _v3(embedded)
    try:
        store.request_lease(5.0)
        early = store.lease._early[2].result().ID
        clock = time.monotonic()
        monkeypatch.setattr(etcd_v3_lease.time, "monotonic", lambda: clock + 60)  # a minute later
        store.start_liveness(5.0)
        monkeypatch.undo()
        assert store.lease.id != early, "a fresh lease: the early one may be near expiry"
        assert _ttl(observer, early) <= 0, "the unused one was revoked"
        assert store.create("/old/key", b"1", ephemeral=True)
    finally:
        store.close()
        observer.close()


def test_closing_before_using_an_early_lease_revokes_it(embedded):
    store = _v3(embedded)
    observer = _v3(embedded)
    try:
        store.request_lease(5.0)
        early = store.lease._early[2].result().ID
        assert _ttl(observer, early) > 0
        store.close()
        assert _ttl(observer, early) <= 0
    finally:
        observer.close()


def test_an_early_lease_request_that_fails_is_asked_again_with_retries():
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

    store = EtcdV3Store(
        f"127.0.0.1:{free_port()}", StoreAccess("nothing", retry_for=0.5, read_timeout=0.5)
    )
    try:
        store.request_lease(5.0)
        with pytest.raises(StoreError, match="nothing is unreachable"):
            store.start_liveness(5.0)
    finally:
        store.close()


def test_a_v2_watch_whose_index_was_cleared_catches_up_from_a_read(store, request):
    """etcd v2 keeps its last 1,000 events: a watch that starts (or falls) behind them reads
    the keys again and goes on, instead of failing the rendezvous."""
    from elastic_launch.rendezvous.etcd.v2 import EtcdV2Store

    if not isinstance(store, EtcdV2Store):
        pytest.skip("etcd v2 only: the v3 stores keep their history (or compact it less often)")
    base = f"/cleared-{time.monotonic_ns()}"
    _, start = store.range(base + "/x/")
    store.put(f"{base}/x/a", b"1")
    for i in range(1100):  # pushes the event of /x/a out of etcd's window
        store.put(f"{base}/y/{i % 10}", b"churn")
    watch = store.watch(base + "/x/", start)
    try:
        batch = watch.next(30.0)
        assert batch is not None, "the watch failed or heard nothing"
        assert [(c.key, c.value) for c in batch] == [(f"{base}/x/a", b"1")]
        store.put(f"{base}/x/b", b"2")  # and it watches on
        assert [c.key for c in watch.next(30.0) or []] == [f"{base}/x/b"]
    finally:
        watch.close()


def test_a_v2_write_etcd_could_not_commit_in_time_is_retried():
    """etcd v2 answers a write its raft did not commit in time with "request timed out": a
    busy store, retried as an unreachable one is, not a failure of the rendezvous."""
    import etcd
    from elastic_launch.rendezvous.etcd.v2 import EtcdV2Store

    store = EtcdV2Store(f"127.0.0.1:{free_port()}", StoreAccess("etcd at nowhere", retry_for=5))
    answers = [etcd.EtcdException("Raft Internal Error : etcdserver: request timed out"), "done"]

    def request(client):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    try:
        assert store._call(request) == "done"
        answers[:] = [etcd.EtcdException("Raft Internal Error : something else")]
        with pytest.raises(StoreError, match="something else"):
            store._call(request)
    finally:
        store.close()


def test_a_v3_create_of_the_same_value_under_another_lease_is_not_ours(embedded):
    first, second = _v3(embedded), _v3(embedded)
    try:
        for s in (first, second):
            s.start_liveness(5.0)
        assert first.create("/same/key", b"x", ephemeral=True)
        assert not second.create("/same/key", b"x", ephemeral=True)
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("api", ["v3", "v2"])
def test_a_store_goes_on_when_the_member_it_uses_is_killed(etcd_cluster, api):
    """Every member of a 3-member cluster given: the member in use SIGKILLed (the leader, or
    not: both happen), the writes, the node's ephemeral keys (its lease, or v2's TTL keys,
    refreshed within a tick even through an election) and a watch go on through the next, and
    the watch hears every change once, in order (as etcd's clientv3 balancer does)."""
    from elastic_launch.rendezvous.etcd.v2 import EtcdV2Store
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

    kind = EtcdV3Store if api == "v3" else EtcdV2Store
    store: Store = kind(etcd_cluster.endpoint, StoreAccess("etcd", retry_for=10))
    try:
        store.start_liveness(3.0)
        assert store.create("/fo/mine", b"me", ephemeral=True)
        revision = store.put("/fo/a", b"1")
        watch = store.watch("/fo/", revision)
        etcd_cluster.members[0].kill()
        for i in range(3):
            store.put(f"/fo/after-{i}", str(i).encode())
        seen: list = []
        deadline = time.monotonic() + 20
        while len(seen) < 3 and time.monotonic() < deadline:
            seen += watch.next(1.0) or []
        assert [(c.key, c.value) for c in seen] == [
            (f"/fo/after-{i}", str(i).encode()) for i in range(3)
        ], "each change once, in order"
        # The renewals moved on too: past a whole TTL from now, the key lives only if they
        # did (a key not renewed is gone after its TTL).
        moved = time.monotonic()
        time.sleep(3.5)
        assert time.monotonic() - moved >= 3.0
        assert store.get("/fo/mine") is not None, "the ephemeral key outlived its member"
        watch.close()
    finally:
        store.close()
