"""The embedded service with several endpoints: one service hosts, the others stand by with a
copy of its state, and one of them takes over when the host is lost, so that a client goes on
with its keys, its lease, its revisions and its watches. Services in this process; the real
jobs are in tests/faults/test_store_faults.py."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
import pytest
from elastic_launch.net import free_port
from elastic_launch.rendezvous.embedded.peers import Peer
from elastic_launch.rendezvous.embedded.roles import HOST, Seen, choose
from elastic_launch.rendezvous.embedded.server import EmbeddedServer
from elastic_launch.rendezvous.embedded.state import TERM_BITS, ServiceState
from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
from elastic_launch.rendezvous.etcdpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.store.api import HistoryLostError, StoreAccess, Watch
from elastic_launch.rendezvous.store.endpoints import StoreMember
from elastic_launch.rendezvous.store.wire import CLUSTER_KEY, HOST_KEY
from launch_fakes import embedded_login

TOKEN = "t" * 32

# ---- who hosts (pure) ------------------------------------------------------------------------


def s(index: int, host: bool = False, term: int = 1, revision: int = 10) -> Seen:
    return Seen(index, host, term, revision)


@pytest.mark.parametrize(
    ("me", "others", "grace_over", "expected"),
    [
        (s(0, term=0, revision=1), [], False, (HOST, None)),  # the first listed, alone
        (s(1, term=0, revision=1), [], False, ("wait", None)),  # the first may be coming
        (s(1, term=0, revision=1), [], True, (HOST, None)),  # it did not come
        (s(1, term=0, revision=1), [s(0, term=0, revision=1)], True, ("wait", None)),
        (s(0, term=0, revision=1), [s(1, host=True)], False, ("follow", 1)),  # a replacement
        (s(1), [s(2)], False, (HOST, None)),  # equal copies: the first listed takes over
        (s(2, revision=11), [s(1)], False, (HOST, None)),  # the newest copy takes over
        (s(1, term=1), [s(2, term=2, revision=1)], False, ("wait", None)),  # a newer term
        (s(0, host=True, term=1), [s(1, host=True, term=2)], False, ("follow", 1)),
        (s(1, host=True, term=2), [s(0, host=True, term=1)], False, (HOST, None)),
        (s(0, host=True), [s(1, host=True)], False, (HOST, None)),  # a tie: the first listed
    ],
)
def test_who_hosts(me, others, grace_over, expected):
    assert choose(me, others, grace_over) == expected


# ---- the state, copied ------------------------------------------------------------------------


def test_a_standby_that_applies_every_change_holds_what_the_host_holds():
    host, standby = ServiceState(), ServiceState()
    host.take_over(1)
    changes = []
    host.send = lambda change, deliver: (changes.append(change), deliver())
    host.grant(7, 5, "c1")
    for i in range(3):
        host.revision += 1
        host.put(f"/k/{i}".encode(), b"v", 7 if i else 0)
        host.commit()
    host.revision += 1
    host.delete(b"/k/0")
    host.commit()
    host.renew(7)  # kept: told once
    host.revoke(7)  # its keys go in a revision of their own
    for change in changes:
        standby.apply(change)
    assert standby.data == host.data and standby.keys == host.keys
    assert standby.revision == host.revision and standby.leases.keys() == host.leases.keys()
    assert list(standby.history) == list(host.history)
    assert standby.data_bytes == host.data_bytes


def test_a_snapshot_in_parts_is_the_whole_state():
    host = ServiceState()
    host.take_over(3)
    host.grant(9, 30, "c")
    for i in range(50):
        host.revision += 1
        host.put(f"/big/{i}".encode(), b"x" * 1000, 9)
        host.commit()
    parts = list(host.snapshot(part_bytes=10_000))
    assert len(parts) > 3 and parts[-1].done and not any(p.done for p in parts[:-1])
    standby = ServiceState()
    standby.load(parts)
    assert standby.data == host.data and list(standby.history) == list(host.history)
    assert standby.term == 3 and standby.cluster_id == host.cluster_id
    assert standby.leases[9].keys == host.leases[9].keys


def test_a_new_term_refreshes_every_lease_and_starts_its_own_revisions():
    state = ServiceState()
    state.take_over(1)
    state.grant(1, 5, "c")
    state.leases[1].expires = 0.0  # as it stood on the standby: the host kept it alive
    state.revision = 42
    state.take_over(2)
    assert state.leases[1].expires > time.monotonic()
    assert state.revision == 1 << TERM_BITS and state.fork == 42
    assert state.unknown_past(44), "revisions after 42 are another host's"
    assert not state.unknown_past(43), "from the fork on is this one's"
    assert not state.unknown_past((1 << TERM_BITS) + 1)


# ---- services --------------------------------------------------------------------------------


class Services:
    """The job's services at `n` endpoints of this host, started by index."""

    def __init__(self, n: int) -> None:
        self.members = [StoreMember("127.0.0.1", free_port()) for _ in range(n)]
        self.at: dict[int, EmbeddedServer] = {}

    @property
    def endpoint(self) -> str:
        return ",".join(m.target for m in self.members)

    def start(self, i: int) -> EmbeddedServer:
        m = self.members[i]
        self.at[i] = EmbeddedServer(m.host, m.port, TOKEN, None, self.members, i)
        return self.at[i]

    def kill(self, i: int) -> None:
        self.at.pop(i).close(0)

    def host(self, timeout: float = 10) -> int:
        """The index of the service that hosts (waits for one)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            hosting = [i for i, server in self.at.items() if server.hosting]
            if len(hosting) == 1:
                return hosting[0]
            time.sleep(0.01)
        raise AssertionError("no single service hosts")

    def in_sync(self, i: int, timeout: float = 10) -> None:
        """Wait until service `i` follows the host and holds its state (as of its revision)."""
        deadline = time.monotonic() + timeout
        host = self.at[self.host()].state
        mine = self.at[i].state
        while (mine.cluster_id, mine.term, mine.revision) != (
            host.cluster_id,
            host.term,
            host.revision,
        ):
            assert time.monotonic() < deadline, f"service {i} did not catch up"
            time.sleep(0.01)

    def close(self) -> None:
        for server in self.at.values():
            server.close(0)


@pytest.fixture
def services():
    made: list[Services] = []

    def make(n: int = 2) -> Services:
        made.append(Services(n))
        return made[-1]

    yield make
    for s_ in made:
        s_.close()


def client(svc: Services) -> EtcdV3Store:
    access = StoreAccess("the job's service", token=TOKEN, retry_for=10, read_timeout=2)
    return EtcdV3Store(svc.endpoint, access, watch_from_now=False)


def test_the_first_service_hosts_and_a_standby_refuses_clients_naming_the_host(services):
    svc = services(2)
    svc.start(0)
    svc.start(1)
    assert svc.host() == 0
    svc.in_sync(1)
    with grpc.insecure_channel(svc.members[1].target) as channel:
        credential = embedded_login(channel, TOKEN, svc.members[1].target)
        with pytest.raises(grpc.RpcError) as e:
            rpc_pb2_grpc.KVStub(channel).Range(rpc_pb2.RangeRequest(key=b"/x"), metadata=credential)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert f"a standby of the host at {svc.members[0].target}" in e.value.details()
    said = dict(e.value.trailing_metadata())
    assert said[HOST_KEY] == svc.members[0].target
    assert said[CLUSTER_KEY] == f"{svc.at[0].state.cluster_id:x}"
    # A client given only the standby goes on with the host it names.
    access = StoreAccess("the standby", token=TOKEN, retry_for=5, read_timeout=2)
    standby = EtcdV3Store(svc.members[1].target, access)
    try:
        standby.put("/x", b"1")
        assert svc.at[0].state.data[b"/x"].value == b"1"
        assert [c.member.target for c in standby.client.connections if c.learned] == [
            svc.members[0].target
        ]
    finally:
        standby.close()


def a_lease_a_key_and_a_watch(store: EtcdV3Store) -> Watch:
    """A client's lease, a key of it and a watch of the job's keys: what a standby that
    takes over keeps."""
    store.start_liveness(5.0)
    before = store.put("/job/a", b"1")
    assert store.create("/job/mine", b"me", ephemeral=True)
    watch = store.watch("/job/", before)
    assert [c.key for c in watch.next(5) or []] == ["/job/mine"]
    return watch


def kept(store: EtcdV3Store, watch: Watch, by: EmbeddedServer) -> None:
    """The host was lost: through whoever hosts now (`by`), the keys are there, the watch
    goes on, and the lease is the same."""
    store.put("/job/b", b"2")
    assert store.get("/job/a").value == b"1" and store.get("/job/mine").value == b"me"
    assert [(c.key, c.value) for c in watch.next(5) or []] == [("/job/b", b"2")]
    assert store.lease.id in by.state.leases, "the same lease, kept alive"
    assert by.hosting and by.state.term == 2


def test_a_standby_takes_over_with_the_keys_the_lease_and_the_watch(services):
    svc = services(3)
    for i in range(3):
        svc.start(i)
    store = client(svc)
    try:
        watch = a_lease_a_key_and_a_watch(store)
        svc.in_sync(1)
        svc.in_sync(2)
        svc.kill(0)
        kept(store, watch, svc.at[1])  # the first listed of the equal copies
        svc.in_sync(2)
        assert svc.at[2].state.data == svc.at[1].state.data, "the other standby follows it"
        watch.close()
    finally:
        store.close()


def test_a_replacement_at_the_lost_hosts_address_follows_the_new_host(services):
    svc = services(2)
    svc.start(0)
    svc.start(1)
    store = client(svc)
    try:
        store.put("/job/a", b"1")
        svc.in_sync(1)
        svc.kill(0)
        store.put("/job/b", b"2")
        again = svc.start(0)
        svc.in_sync(0)
        assert svc.host() == 1 and not again.hosting
        assert again.state.data.keys() == {b"/job/a", b"/job/b"}
    finally:
        store.close()


def test_a_watch_from_another_hosts_history_is_told_to_read_again(services):
    svc = services(2)
    server = svc.start(0)
    store = client(svc)
    try:
        store.put("/job/a", b"1")
        state = server.state
        # As if this service had taken over after a host that went on alone for a while:
        # revisions after its fork are another history's.
        server._loop.call_soon_threadsafe(state.take_over, 5)
        deadline = time.monotonic() + 5
        while state.term != 5:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        watch = store.watch("/job/", state.fork + 3)
        with pytest.raises(HistoryLostError):
            watch.next(5)
        watch.close()
    finally:
        store.close()


def test_a_host_that_finds_a_newer_host_steps_down_and_its_clients_move_on(services):
    svc = services(2)
    old = svc.start(0)
    new = svc.start(1)
    store = client(svc)
    try:
        store.put("/job/a", b"1")
        svc.in_sync(1)
        hosting = threading.Event()

        def take_over() -> None:  # what a partition that healed leaves: two hosts
            roles = new._service.roles
            new.state.take_over(7)
            roles.role, roles.host = HOST, 1
            hosting.set()

        new._loop.call_soon_threadsafe(take_over)
        assert hosting.wait(5)
        deadline = time.monotonic() + 10
        while old.hosting:
            assert time.monotonic() < deadline, "the older host did not step down"
            time.sleep(0.01)
        store.put("/job/b", b"2")
        assert svc.host() == 1 and new.state.data[b"/job/b"].value == b"2"
        svc.in_sync(0)
        assert old.state.term == 7, "it follows the newer host"
    finally:
        store.close()


def test_a_standby_that_does_not_acknowledge_is_dropped_and_the_host_goes_on(services):
    svc = services(2)
    svc.start(0)
    slow = svc.start(1)
    store = client(svc)
    resume = threading.Event()
    try:
        store.put("/job/a", b"1")
        svc.in_sync(1)
        slow._loop.call_soon_threadsafe(resume.wait, 30)  # it hangs
        started = time.monotonic()
        store.put("/job/b", b"2")
        assert not svc.at[0]._service.replicas.standbys, "dropped"
        assert time.monotonic() - started < 30, "answered without it"
    finally:
        resume.set()
        store.close()
    svc.in_sync(1)  # it follows again, from a new copy


def test_a_host_of_a_moment_that_stepped_down_is_not_another_cluster(services, monkeypatch):
    # Two listed services start while neither's look at the other is answered (a busy
    # machine): each hosts a term of its own, and a client's first answer comes from the
    # second. Then their looks are answered: the second steps down into the first's store,
    # which the client takes from then on, not "two different clusters".
    blind = threading.Event()
    blind.set()
    looked = Peer.status

    async def status(self: Peer) -> Any:
        return None if blind.is_set() else await looked(self)

    monkeypatch.setattr(Peer, "status", status)
    svc = services(2)
    first, second = svc.start(0), svc.start(1)
    wait = time.monotonic() + 10
    while not (first.hosting and second.hosting):
        assert time.monotonic() < wait, "both should host, each alone"
        time.sleep(0.01)
    access = StoreAccess("the job's service", token=TOKEN, retry_for=10, read_timeout=2)
    store = EtcdV3Store(f"{svc.members[1].target},{svc.members[0].target}", access)
    try:
        store.put("/job/a", b"1")  # on the second, hosting its moment
        blind.clear()
        svc.in_sync(1)  # the two hosts find each other: the second follows the first
        # The client leaves the second (as after a call that went unanswered there): the
        # first answers for a cluster the client never saw from it.
        assert store.client.fail_over(store.client.current, "a call timed out")
        store.put("/job/b", b"2")
        assert first.state.data[b"/job/b"].value == b"2"
        assert store.client.epoch == 1, "the store it knew was replaced by the job's"
    finally:
        store.close()


def test_every_service_holds_the_same_cluster_id(services):
    svc = services(2)
    svc.start(0)
    svc.start(1)
    svc.in_sync(1)
    assert svc.at[0].state.cluster_id == svc.at[1].state.cluster_id


def test_a_put_event_is_the_same_on_both(services):
    svc = services(2)
    svc.start(0)
    svc.start(1)
    store = client(svc)
    try:
        store.put("/job/x", b"1")
        svc.in_sync(1)
        a, b = (svc.at[i].state.history[-1][1] for i in (0, 1))
        assert a == b and a.type == kv_pb2.Event.PUT
    finally:
        store.close()
