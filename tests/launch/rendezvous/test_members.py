"""A store is a set of members: ``--rdzv-endpoint`` lists them, and the v3 client spreads its
calls, its lease's keep-alive and its watches over them, moving to the next member when one
refuses, errs or hangs (as etcd's clientv3 does: its balancer tests pin the same). Here the
members are embedded services in this process; tests/faults/test_store_faults.py loses real
etcd members under real jobs."""

from __future__ import annotations

import re
import socket
import threading
import time

import pytest
from elastic_launch.api import ConfigError
from elastic_launch.cancel import CancelToken
from elastic_launch.net import free_port
from elastic_launch.rendezvous.api import RendezvousParameters
from elastic_launch.rendezvous.embedded.server import EmbeddedServer
from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
from elastic_launch.rendezvous.etcd.v3_client import Client
from elastic_launch.rendezvous.etcd.v3_watch import EtcdWatch
from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.registry import check_parameters
from elastic_launch.rendezvous.store import endpoints
from elastic_launch.rendezvous.store.api import Inbox, StoreAccess, StoreError

# ---- the list ------------------------------------------------------------------------------


def test_every_item_of_the_list_is_a_member_in_its_order():
    listed = endpoints.split("10.0.0.1:2379, 10.0.0.2,[::1]:2380", "--rdzv-endpoint", 2379)
    assert listed == [("10.0.0.1", 2379), ("10.0.0.2", 2379), ("::1", 2380)]
    members = endpoints.resolve(listed)
    assert [m.target for m in members] == ["10.0.0.1:2379", "10.0.0.2:2379", "[::1]:2380"]


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("a:1,,b:2", "'a:1,,b:2': item 2 of 3 is empty (a stray comma?)"),
        ("a:1,", "'a:1,': item 2 of 2 is empty"),
        (",", "',' names no endpoint"),
        ("a:1,b:2,A:1", "'a:1,b:2,A:1' names A:1 twice: give each member once"),
        ("a,a:2379", "'a,a:2379' names a:2379 twice"),
        ("[::1]:5,[0:0::1]:5", "names [0:0::1]:5 twice"),  # one address, written two ways
    ],
)
def test_a_bad_list_is_an_error_that_quotes_it(value, said):
    with pytest.raises(ConfigError, match=re.escape(said)):
        endpoints.split(value, "--rdzv-endpoint", 2379)


@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_the_launcher_checks_the_list_before_it_starts(backend):
    def params(endpoint: str) -> RendezvousParameters:
        return RendezvousParameters(backend, endpoint, "job", 1, 2, 1)

    check_parameters(params("http://m0:2379,http://m1:2379"))
    for bad, said in (
        ("m0:2379,,m1:2379", "item 2 of 3 is empty"),
        ("m0:2379,m0:2379", "names m0:2379 twice"),
        ("http://m0:2379,https://m1:2379", "mixes http:// and https://"),
    ):
        with pytest.raises(ConfigError, match=said):
            check_parameters(params(bad))


def test_a_name_that_resolves_to_several_addresses_is_several_members(monkeypatch):
    def getaddrinfo(host, port, *args, **kwargs):
        assert host == "etcd.cluster"
        return [
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", (f"10.1.0.{i}", port)) for i in (1, 2, 3, 1)
        ]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    members = endpoints.resolve(endpoints.split("etcd.cluster:2379", "--rdzv-endpoint", 2379))
    assert [m.target for m in members] == ["10.1.0.1:2379", "10.1.0.2:2379", "10.1.0.3:2379"]
    assert {m.name for m in members} == {"etcd.cluster"}, "TLS checks the name, not the address"
    assert endpoints.written(members) == "etcd.cluster:2379"


def test_a_name_that_does_not_resolve_stays_a_member():
    members = endpoints.resolve([("no-such-host.invalid", 2379)])
    assert [m.target for m in members] == ["no-such-host.invalid:2379"]


# ---- calls move on -------------------------------------------------------------------------


class Silent:
    """A member that hangs: it accepts connections and never says a word (a stopped process,
    a partition that drops packets)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted.append(conn)

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


class Services:
    """Embedded services in this process, each a store of its own, by endpoint."""

    def __init__(self) -> None:
        self.at: dict[str, EmbeddedServer] = {}

    def __call__(self) -> str:
        server = EmbeddedServer("127.0.0.1", 0, token="t")
        endpoint = f"127.0.0.1:{server.port}"
        self.at[endpoint] = server
        return endpoint


@pytest.fixture
def services():
    made = Services()
    yield made
    for server in made.at.values():
        server.close(0)


def access(**kw) -> StoreAccess:
    return StoreAccess("the store", token="t", **{"retry_for": 10, "read_timeout": 2, **kw})


def test_a_call_moves_on_from_a_member_that_refuses(services):
    live = services()
    dead = f"127.0.0.1:{free_port()}"
    store = EtcdV3Store(f"{dead},{live}", access())
    try:
        assert store.put("/m/a", b"1")
        assert store.get("/m/a").value == b"1"
        assert store.client.failovers == 1
        assert store.client.current.member.target == live, "it stays on the member that works"
    finally:
        store.close()


def test_a_call_on_a_channel_another_thread_just_closed_goes_on(services):
    # Another thread left the member and closed its channel between this call's choice of
    # member and its start: gRPC says "Channel closed!" before anything is sent.
    store = EtcdV3Store(f"{services()},{services()}", access())
    try:
        conn = store.client.current
        stale = conn.channel
        conn.reset()  # what a fail-over does to the member it leaves
        real = conn.method

        def stale_once(name: str):
            conn.method = real
            return getattr(rpc_pb2_grpc.KVStub(stale), name.split(".")[1])

        conn.method = stale_once
        assert store.put("/m/raced", b"1")
        assert store.get("/m/raced").value == b"1"
    finally:
        store.close()
    with pytest.raises(StoreError, match="closed"):
        store.put("/m/after", b"1")  # a store that is closed says so


def test_a_call_moves_on_from_a_member_that_hangs(services):
    silent = Silent()
    live = services()
    store = EtcdV3Store(f"{silent.endpoint},{live}", access(read_timeout=0.5))
    try:
        assert store.put("/m/hung", b"1")
        assert store.client.failovers == 1
        assert silent.accepted, "the silent member was tried first"
    finally:
        store.close()
        silent.close()


def test_a_call_tries_every_member_then_waits_and_says_which_failed():
    dead = [f"127.0.0.1:{free_port()}" for _ in range(3)]
    store = EtcdV3Store(",".join(dead), access(retry_for=0.5, read_timeout=0.5))
    try:
        with pytest.raises(StoreError, match="the store is unreachable"):
            store.get("/m/x")
        assert store.client.failovers >= 3, "each member was tried"
    finally:
        store.close()


def test_members_of_two_clusters_are_an_error_naming_both(services):
    first, second = services(), services()
    store = EtcdV3Store(f"{first},{second}", access())
    try:
        store.put("/m/a", b"1")
        store.client.fail_over(store.client.current, "as if it failed")
        with pytest.raises(StoreError, match="belong to two different clusters") as e:
            store.get("/m/a")
        assert first in str(e.value) and second in str(e.value)
    finally:
        store.close()


def hang(server: EmbeddedServer, until: threading.Event) -> None:
    """Make `server` hang until `until` is set: its event loop is blocked (it answers
    nothing, as a stopped process does)."""
    server._loop.call_soon_threadsafe(until.wait, 60)


def test_a_lease_keep_alive_that_goes_unanswered_moves_the_client_on(services):
    a, b = services(), services()
    services.at[b].state.cluster_id = services.at[a].state.cluster_id  # as members of one
    store = EtcdV3Store(f"{a},{b}", access())
    lost, resume = threading.Event(), threading.Event()
    try:
        store.start_liveness(3.0, lost.set)  # requests every second, stale after two
        first = store.lease.id
        hang(services.at[a], resume)
        # The second service never saw this lease (it is another store, not a replica): the
        # keep-alive finds it gone there, and a new one is granted and the loss told.
        assert lost.wait(15), "the keep-alive did not move on"
        assert store.client.current.member.target == b
        assert store.lease.id != first and store.lease.id in store.lease.held
    finally:
        resume.set()
        store.close()


def test_a_watch_moves_on_and_resumes_after_the_last_revision_it_delivered(services):
    a = services()
    cancel = CancelToken()
    client = Client(f"{a},127.0.0.1:{free_port()}", access(), cancel, lambda: None)
    inbox = Inbox()
    try:
        put = rpc_pb2.PutRequest(key=b"/w/1", value=b"x")
        revision = client.call("kv.Put", put).header.revision
        watch = EtcdWatch(client, ["/w/"], revision - 1, inbox, from_now=False)
        got = inbox.next(5)
        assert [(c.key, c.value) for c in got] == [("/w/1", b"x")]
        # The member is left under the watch (as a hang found by the keep-alive would): the
        # stream goes to the next member, which refuses, and back to the first, from the
        # revision after the last delivered: nothing again, nothing lost.
        client.fail_over(client.current, "left on purpose")
        client.call("kv.Put", rpc_pb2.PutRequest(key=b"/w/2", value=b"y"))
        seen = []
        deadline = time.monotonic() + 10
        while not seen and time.monotonic() < deadline:
            seen += inbox.next(1) or []
        assert [(c.key, c.value) for c in seen] == [("/w/2", b"y")]
        watch.close()
    finally:
        client.close()


@pytest.mark.slow  # two real etcd clusters
@pytest.mark.parametrize("backend", ["etcd", "etcd-v2"])
def test_a_list_mixing_two_clusters_is_an_error_at_start_whatever_its_order(
    backend, etcd_v2, etcd_clusters
):
    # Two agents given the same two clusters in opposite orders formed two one-node jobs
    # under one run id: each checked only the member it used until a failover.
    from elastic_launch.rendezvous.registry import create_handler

    other = etcd_clusters(1)
    said = []
    for endpoint in (
        f"{etcd_v2.endpoint},{other.endpoint}",
        f"{other.endpoint},{etcd_v2.endpoint}",
    ):
        params = RendezvousParameters(backend, endpoint, "job", 1, 2, 1)
        with pytest.raises(StoreError, match="belong to two different clusters") as e:
            create_handler(params).shutdown()
        message = str(e.value)
        assert etcd_v2.endpoint in message and other.endpoint in message
        said.append(re.search(r"cluster ids (\S+) and (\S+)\)", message).groups())
    assert said[0] == said[1], "the same two clusters, whatever the order"
    # One cluster, every member named: no error.
    create_handler(RendezvousParameters(backend, other.endpoint, "job", 1, 2, 1)).shutdown()
