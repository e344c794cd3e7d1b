"""The embedded service with one endpoint, as torchrun users write it: the agents choose a
successor that keeps a copy of the host's state and takes over when the host is lost; a host
started again at its address is told by the one that hosts now, and follows it; with no copy
anywhere, the clients fill the store started again with what they know. Services and handlers
in this process; the real jobs are in tests/faults/test_store_faults.py."""

from __future__ import annotations

import contextlib
import copy
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from elastic_launch.cancel import CancelToken
from elastic_launch.net import free_port
from elastic_launch.rendezvous.api import CloseReason, RendezvousParameters, RestartReason
from elastic_launch.rendezvous.backends import SUCCESSOR_BASE, EmbeddedRendezvous
from elastic_launch.rendezvous.embedded import replicas as embedded_replicas
from elastic_launch.rendezvous.embedded import roles as embedded_roles
from elastic_launch.rendezvous.embedded.server import EmbeddedServer
from elastic_launch.rendezvous.embedded.succession import parse, value_of
from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
from elastic_launch.rendezvous.etcd.v3_client import MAX_LEARNED
from elastic_launch.rendezvous.etcdpb import replica_pb2, replica_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.round.known import Known, rank
from elastic_launch.rendezvous.round.state import RoundState, Status
from elastic_launch.rendezvous.store.api import HistoryLostError, StoreAccess, StoreError, Watch
from elastic_launch.rendezvous.store.endpoints import StoreMember
from elastic_launch.rendezvous.store.identity import Answered, Verdict, judge
from elastic_launch.rendezvous.store.wire import CLUSTER_KEY, HOST_KEY, SUCCESSOR_KEY
from launch_fakes import embedded_login
from test_elastic import form_round
from test_embedded_standby import a_lease_a_key_and_a_watch, kept

TOKEN = "s" * 32


def wait_for(condition: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


# ---- which store an answer comes from (pure) ------------------------------------------------


@pytest.mark.parametrize(
    ("ours", "before", "cluster", "revision", "floor", "expected"),
    [
        (None, None, 7, 3, 0, Verdict.FIRST),
        (7, Answered(7, 10), 7, 12, 10, Verdict.SAME),
        (7, Answered(7, 10), 7, None, 10, Verdict.SAME),  # not a read: not judged
        (7, Answered(7, 10), 7, 3, 10, Verdict.CHANGED),  # etcd that lost its data: same id
        # A read sent before revision 10 was seen (calls under way together): its answer
        # may come back after 10's, older, and the store kept its data.
        (7, Answered(7, 10), 7, 9, 8, Verdict.SAME),
        (7, Answered(7, 10), 9, 3, 10, Verdict.CHANGED),  # started again empty, a new id
        (7, None, 9, 3, 0, Verdict.FOREIGN),  # never answered for ours: another cluster
        (7, Answered(9, 1), 9, 3, 0, Verdict.FOREIGN),
        (7, None, 7, 1, 0, Verdict.SAME),  # another member of ours, behind: not a regression
    ],
)
def test_which_store_an_answer_comes_from(ours, before, cluster, revision, floor, expected):
    assert judge(ours, before, cluster, revision, floor) == expected


def test_answers_to_calls_under_way_together_are_no_sign_of_a_lost_store(job):
    # Reads and writes from many threads at once: their answers come back in any order, an
    # older revision after a newer one. None of them is taken for a store that lost its data.
    job.host()
    store = client(job.endpoint.target)
    try:

        def work(i: int) -> None:
            for k in range(30):
                store.put(f"/job/{i}", str(k).encode())
                store.get(f"/job/{(i + 1) % 8}")

        with ThreadPoolExecutor(8) as pool:
            list(pool.map(work, range(8)))
        assert store.client.epoch == 0, "never replaced"
    finally:
        store.close()


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (b"x" * 2000, "bytes"),
        (b"not json", "JSON"),
        (b'["a"]', "object"),
        (b'{"node": "n", "address": 5}', "text"),
        (b'{"node": "n", "address": "host-without-port"}', "port"),
    ],
)
def test_a_successor_key_that_is_not_ours_is_refused_with_what_is_wrong(value, problem):
    with pytest.raises(ValueError, match=problem):
        parse(value)
    assert parse(value_of("n", "127.0.0.1:5")) == ("n", StoreMember("127.0.0.1", 5))
    assert parse(value_of("n")) == ("n", None)


# ---- services ---------------------------------------------------------------------------------


class Job:
    """One endpoint and the services at it or chosen by the agents, in this process."""

    def __init__(self) -> None:
        self.endpoint = StoreMember("127.0.0.1", free_port())
        self.servers: list[EmbeddedServer] = []

    def host(self) -> EmbeddedServer:
        m = self.endpoint
        return self.serve(EmbeddedServer(m.host, m.port, TOKEN, None, [m], 0))

    def successor(self, n: int = 1) -> EmbeddedServer:
        return self.serve(
            EmbeddedServer("127.0.0.1", 0, TOKEN, None, [self.endpoint], SUCCESSOR_BASE + n)
        )

    def serve(self, server: EmbeddedServer) -> EmbeddedServer:
        self.servers.append(server)
        return server

    def kill(self, server: EmbeddedServer) -> None:
        server.close(0)
        self.servers.remove(server)

    def close(self) -> None:
        for server in self.servers:
            server.close(0)


@pytest.fixture
def job() -> Iterator[Job]:
    made = Job()
    yield made
    made.close()


def client(where: str, retry_for: float = 10) -> EtcdV3Store:
    access = StoreAccess("the job's service", token=TOKEN, retry_for=retry_for, read_timeout=2)
    return EtcdV3Store(where, access, watch_from_now=False)


def in_sync(standby: EmbeddedServer, host: EmbeddedServer) -> None:
    def same() -> bool:
        a, b = standby.state, host.state
        return (a.cluster_id, a.term, a.revision) == (b.cluster_id, b.term, b.revision)

    wait_for(same, "the standby did not catch up")


def address(server: EmbeddedServer) -> StoreMember:
    return StoreMember(server.host, server.port)


def test_a_successor_follows_the_host_and_takes_over_with_keys_lease_and_watch(job):
    host = job.host()
    successor = job.successor()
    store = client(job.endpoint.target)
    try:
        watch = a_lease_a_key_and_a_watch(store)
        in_sync(successor, host)
        assert not successor.hosting
        store.client.learn(address(successor))  # as the successor key tells every agent
        job.kill(host)
        kept(store, watch, successor)
        assert store.client.epoch == 0, "the same store: nothing to fill again"
        watch.close()
    finally:
        store.close()


def standing_by(job: Job) -> tuple[EmbeddedServer, EmbeddedServer, EtcdV3Store]:
    """The host, a successor in sync with it, and a client that knows both, with a key."""
    host = job.host()
    successor = job.successor()
    store = client(job.endpoint.target)
    store.put("/job/a", b"1")
    in_sync(successor, host)
    store.client.learn(address(successor))
    return host, successor, store


def test_a_successor_with_no_copy_never_hosts(job, monkeypatch):
    monkeypatch.setattr(embedded_roles, "START_GRACE", 0.0)  # a listed service would host
    successor = job.successor()  # the host is not up: it has nothing to copy
    roles = successor._service.roles
    wait_for(lambda: roles.looks >= 5, "it did not look for the host")
    assert not successor.hosting and successor.state.term == 0


def test_a_host_started_again_at_its_address_is_told_and_follows_the_successor(job):
    host, successor, store = standing_by(job)
    try:
        job.kill(host)
        store.put("/job/b", b"2")
        again = job.host()  # the same command at the same address: a new, empty service
        wait_for(lambda: not again.hosting and again.state.term == 2, "it did not step down")
        in_sync(again, successor)
        assert again.state.data.keys() == {b"/job/a", b"/job/b"}
        assert successor.hosting
        # A client that knows only the endpoint goes on with the host its standby names.
        late = client(job.endpoint.target)
        try:
            assert late.get("/job/b").value == b"2"
        finally:
            late.close()
    finally:
        store.close()


def test_a_client_of_the_empty_host_moves_to_the_jobs_store_with_its_lease(job):
    # A replacement node's agent reached its own new service before the successor told it:
    # its lease and keys are in a store that steps down. It moves to the job's store, whose
    # state it does not overwrite, with its lease (granted again there, under its id).
    host, successor, old = standing_by(job)
    try:
        job.kill(host)
        old.put("/job/b", b"2")
    finally:
        old.close()
    again = job.host()
    replacement = client(job.endpoint.target)
    filled: list[int] = []
    replacement.on_replaced = lambda: filled.append(replacement.client.epoch)
    try:
        replacement.start_liveness(5.0)
        wait_for(lambda: not again.hosting, "it did not step down")
        assert replacement.get("/job/a").value == b"1", "the job's store"
        assert filled == [1], "filled once, by this node's hook"
        assert replacement.lease.id in successor.state.leases, "its lease, under its id"
        assert replacement.get("/job/b").value == b"2"
    finally:
        replacement.close()


def test_a_host_started_again_with_no_copy_is_filled_by_its_clients(job):
    host = job.host()
    store = client(job.endpoint.target, retry_for=30)
    epochs: list[int] = []

    def fill() -> None:  # what the rendezvous puts back, here one key
        epochs.append(store.client.epoch)
        store.put("/job/state", b"known")

    store.on_replaced = fill
    try:
        store.start_liveness(5.0)
        lease = store.lease.id
        revision = store.put("/job/state", b"known")
        for i in range(5):
            store.put(f"/job/noise/{i}", b"x")
        watch = store.watch("/job/", revision)
        job.kill(host)
        again = job.host()  # no copy anywhere: it starts empty
        assert store.get("/job/state").value == b"known", "filled again before the read"
        assert epochs == [1]
        assert lease in again.state.leases, "the lease granted again, under its id"
        with pytest.raises(HistoryLostError):  # its revisions were another store's
            drain(watch)
        watch.close()
    finally:
        store.close()


def drain(watch: Watch) -> None:
    """Read a watch until it ends with an error (or 10 s pass without any)."""
    while watch.next(10) is not None:
        pass


def test_a_member_of_another_cluster_named_with_ours_stays_an_error(job):
    host = job.host()
    other = job.serve(EmbeddedServer("127.0.0.1", 0, TOKEN))  # another job's service
    access = StoreAccess("two", token=TOKEN, retry_for=5, read_timeout=2)
    store = EtcdV3Store(f"{job.endpoint.target},127.0.0.1:{other.port}", access)
    try:
        store.put("/a", b"1")
        job.kill(host)
        with pytest.raises(StoreError, match="two different clusters"):
            store.put("/b", b"2")
    finally:
        store.close()


# ---- hostile peers ----------------------------------------------------------------------------


def announce(target: str, term: int, credential: bool = True) -> grpc.RpcError | None:
    with grpc.insecure_channel(target) as channel:
        metadata = []
        if credential:
            metadata = embedded_login(channel, TOKEN, target)
        request = replica_pb2.Announcement(term=term, index=9, address="127.0.0.1:9")
        try:
            replica_pb2_grpc.ReplicaStub(channel).Announce(request, metadata=metadata, timeout=5)
        except grpc.RpcError as e:
            return e
    return None


def test_an_announcement_without_the_token_or_not_newer_is_refused(job):
    host = job.host()
    refused = announce(job.endpoint.target, 5, credential=False)
    assert refused is not None and refused.code() == grpc.StatusCode.UNAUTHENTICATED
    refused = announce(job.endpoint.target, host.state.term)
    assert refused is not None and refused.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not older" in refused.details()
    assert host.hosting, "it hosts on"


def test_a_forged_announcement_of_a_host_that_is_not_there_changes_nothing(job):
    host = job.host()
    assert announce(job.endpoint.target, 50) is None  # a token holder's word, but no host
    roles = host._service.roles
    assert 9 in roles.peers
    looked = roles.looks
    wait_for(lambda: roles.looks >= looked + 2, "it did not look at the announced host")
    assert host.hosting and host.state.term == 1


def test_sustained_announcements_of_hosts_that_are_not_there_are_bounded(job):
    # A token holder announces a new, absent host again and again while a client works: the
    # service keeps at most MAX_ANNOUNCED of them, hosts on, and answers every request.
    host = job.host()
    store = client(job.endpoint.target)
    stop = threading.Event()
    sent = [0]

    def flood() -> None:
        with grpc.insecure_channel(job.endpoint.target) as channel:
            metadata = embedded_login(channel, TOKEN, job.endpoint.target)
            replica = replica_pb2_grpc.ReplicaStub(channel)
            while not stop.is_set():
                sent[0] += 1
                request = replica_pb2.Announcement(
                    term=100 + sent[0], index=1000 + sent[0], address=f"127.0.0.1:{sent[0] % 9 + 1}"
                )
                with contextlib.suppress(grpc.RpcError):
                    replica.Announce(request, metadata=metadata, timeout=5)

    flooder = threading.Thread(target=flood, daemon=True)
    flooder.start()
    try:
        roles = host._service.roles
        for i in range(200):  # the client's work, through the flood
            store.put(f"/job/{i % 10}", str(i).encode())
        looked = roles.looks
        flooding = lambda: sent[0] >= 100 and roles.looks >= looked + 3  # noqa: E731
        wait_for(flooding, "the flood did not go on through three looks", timeout=90)
        assert len(roles.peers) <= embedded_roles.MAX_ANNOUNCED
        assert host.hosting and host.state.term == 1
        assert store.get("/job/9").value == b"199"
    finally:
        stop.set()
        flooder.join(10)
        store.close()


def test_a_successor_key_rewritten_again_and_again_keeps_the_members_bounded(job):
    job.host()
    store = client(job.endpoint.target)
    try:
        for i in range(40):  # a token holder names a new successor each time
            store.put(SUCCESSOR_KEY, value_of(f"n{i}", f"127.0.0.1:{20000 + i}"))
            kv = store.get(SUCCESSOR_KEY)
            assert kv is not None
            _, where = parse(kv.value)
            assert where is not None
            store.client.learn(where)
        assert len(store.client.connections) <= 1 + MAX_LEARNED
        assert store.client.current.member == job.endpoint, "still on the host"
        assert store.get("/nothing") is None
    finally:
        store.close()


def test_an_impostor_at_a_named_members_address_costs_a_member_not_the_job(job):
    # A process without the token holds an address the store named (the port of a successor
    # whose node is gone, taken since): it cannot log this node in, so it is left, and the
    # client goes on with the successor that hosts now.
    host, successor, store = standing_by(job)
    impostor = job.serve(EmbeddedServer("127.0.0.1", 0, "i" * 32))
    try:
        store.start_liveness(5.0)
        store.client.learn(StoreMember("127.0.0.1", impostor.port), prefer=True)
        watch = store.watch("/job/", store.put("/job/b", b"2"))
        job.kill(host)
        store.put("/job/c", b"3")
        assert store.client.current.member == address(successor)
        assert [c.key for c in watch.next(5) or []] == ["/job/c"], "the watch goes on"
        assert store.lease.id in successor.state.leases
        watch.close()
    finally:
        store.close()


def test_a_stopped_successor_is_dropped_and_the_host_answers_without_it(job):
    host, successor, store = standing_by(job)
    resume = threading.Event()
    try:
        successor._loop.call_soon_threadsafe(resume.wait, 30)  # it hangs, as if SIGSTOPped
        store.put("/job/b", b"2")
        assert not host._service.replicas.standbys, "dropped"
        assert store.get("/job/b").value == b"2", "answered without it"
    finally:
        resume.set()
        store.close()
    in_sync(successor, host)  # once it goes on, it follows again from a new copy


# ---- the agents choose the successor ------------------------------------------------------------


def handler(port: int, run_id: str, token: str = TOKEN, **conf: str) -> EmbeddedRendezvous:
    config = {
        "token": token,
        "join_timeout": "30",
        "last_call_timeout": "5",
        "reconnect_timeout": "10",
        **conf,
    }
    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", run_id, 1, 2, 1, config, max_restarts=3
    )
    return EmbeddedRendezvous(params)


def successor_of(h: EmbeddedRendezvous) -> str | None:
    """The node named the successor, once its service listens (None: none yet)."""
    kv = h.store.get(SUCCESSOR_KEY)
    if kv is None:
        return None
    node, where = parse(kv.value)
    return node if where is not None else None


def stopped() -> CancelToken:
    cancel = CancelToken()
    cancel.cancel()
    return cancel


@pytest.fixture
def nodes(request) -> Iterator[Callable[..., EmbeddedRendezvous]]:
    port = free_port()
    run_id = f"one-{request.node.name}-{time.monotonic_ns()}"
    made: list[EmbeddedRendezvous] = []

    def make(**conf: str) -> EmbeddedRendezvous:
        made.append(handler(port, run_id, **conf))
        return made[-1]

    yield make
    for h in reversed(made):
        h.shutdown(stopped())


def test_the_agents_choose_a_successor_that_takes_over_when_the_host_is_lost(nodes):
    a = nodes()
    b = nodes()
    assert a.hosting and not b.hosting
    form_round([a, b])
    wait_for(lambda: successor_of(a) == b.node, "b was not chosen")
    standby = b._succession.server
    assert standby is not None
    in_sync(standby, a.server)
    wait_for(lambda: len(a.store.client.connections) == 2, "a did not learn the successor")
    a.server.close(0)  # the host's node is lost (its agent with it)
    state, _ = b.job.read()
    assert state is not None and state.version == 1
    assert b.hosting, "b's copy hosts now"
    wait_for(lambda: successor_of(b) is None, "it hosts: the successor key is free again")


def test_an_agent_without_the_token_can_never_become_the_successor(nodes):
    a = nodes()
    b = nodes()
    form_round([a, b])
    wait_for(lambda: successor_of(a) == b.node, "b was not chosen")
    with pytest.raises(StoreError, match="invalid rendezvous token"):
        nodes(token="x" * 32)
    # Nor can anything without the credential write the key or follow the host.
    with grpc.insecure_channel(f"127.0.0.1:{a.server.port}") as channel:
        put = rpc_pb2.PutRequest(key=SUCCESSOR_KEY.encode(), value=value_of("impostor", "x:1"))
        with pytest.raises(grpc.RpcError) as e:
            rpc_pb2_grpc.KVStub(channel).Put(put, timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        follow = replica_pb2_grpc.ReplicaStub(channel).Follow(
            iter([replica_pb2.Ack(member=SUCCESSOR_BASE + 5)]), timeout=5
        )
        with pytest.raises(grpc.RpcError) as e:
            next(follow)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert successor_of(a) == b.node


def test_an_agent_told_not_to_host_never_stands_by(nodes):
    a = nodes()
    b = nodes(is_host="false")
    form_round([a, b])
    assert not b._may_stand_by() and b._succession._stand_by is None
    assert successor_of(a) is None and b._succession.server is None


def test_survivors_fill_a_host_started_again_with_no_copy(nodes):
    a = nodes()
    b = nodes(is_host="false")  # no successor: nothing keeps a copy
    form_round([a, b])
    form_round([a, b], RestartReason.FAILURE)  # a restart spent: the count to keep
    before, _ = b.job.read()
    assert before is not None and before.restarts > 0
    a.server.close(0)  # the host's node is lost ...
    port = b._members[0].port
    again = EmbeddedServer("127.0.0.1", port, TOKEN)  # ... and started again, empty
    try:
        state, _ = b.job.read()  # b finds it, fills it, reads what it put back
        assert state is not None
        assert (state.version, state.status, state.restarts) == (
            before.version,
            before.status,
            before.restarts,
        )
        keys = set(again.state.data)
        assert f"{b.job.keys.join(before.version)}{b.node}".encode() in keys, "its join key"
        assert any(k.startswith(b.job.keys.members(before.version).encode()) for k in keys)
        assert b.store.lease.id in again.state.leases
    finally:
        again.close(0)


def test_fill_puts_back_a_state_only_over_an_older_one(nodes):
    a = nodes()
    b = nodes()
    form_round([a, b])
    assert b.job.known.state is not None and b.job.known.state.version == 1
    stale = copy.deepcopy(b.job.known)  # what b knew before the job was closed
    a.set_closed(CloseReason.FAILED, "a worker failed")
    stale.put_back(b.store, b.job.keys.state)
    after, _ = b.job.read()
    assert after is not None and after.closed is not None, "the newer state stands"
    b.store.delete(b.job.keys.state)
    b.job.known.put_back(b.store, b.job.keys.state)  # b knows it closed now
    back, _ = b.job.read()
    assert back is not None and back.closed is not None, "the closed mark, put back"


def test_a_store_started_again_under_a_running_round_costs_no_member(nodes):
    # Only the service is started again (both agents live): each puts back its keys. The
    # round's leader reads the new store before the other node has put its own back (held
    # here until it has), and waits for them instead of reopening the round.
    a = nodes()
    b = nodes(is_host="false")
    form_round([a, b])
    leader, other = (a, b) if a._round.leader == a.node else (b, a)
    held = threading.Event()
    put_back = other.store.on_replaced
    other.store.on_replaced = lambda: (held.wait(30), put_back())
    port = b._members[0].port
    a.server.close(0)
    again = EmbeddedServer("127.0.0.1", port, TOKEN)
    try:
        follower = leader._follower
        wait_for(lambda: follower._awaited == {other.node}, "the leader did not await it")
        held.set()
        mine = {f"{h.job.keys.join(1)}{h.node}".encode() for h in (a, b)}
        wait_for(lambda: mine <= set(again.state.data), "not both put their keys back")
        wait_for(lambda: not follower._awaited, "the leader did not see it back")
        assert follower._grace_left() > 0, "seen back within the grace, not at its end"
        assert not a.round_broken() and not b.round_broken(), "no member lost"
    finally:
        held.set()
        again.close(0)


class FirstWordStore(EtcdV3Store):
    """Between a put-back's read and its swap of the state, another node writes first (a
    replacement's first round, restarts 0): the swap is lost once."""

    raced = False

    def cas(self, key: str, value: bytes, version: int, ttl: float | None = None) -> int:
        if not self.raced:
            self.raced = True
            super().put(key, RoundState(1, Status.JOINABLE).to_json())
        return super().cas(key, value, version, ttl)


def test_a_put_back_that_loses_its_swap_to_an_older_state_reads_again(job):
    job.host()
    store = FirstWordStore(job.endpoint.target, StoreAccess("s", token=TOKEN, retry_for=5))
    try:
        known = Known()
        mine = RoundState(7, Status.FINAL, restarts=3)
        known.saw(mine, mine.to_json())
        known.put_back(store, "/elasticrun/j/state")
        assert store.raced
        kv = store.get("/elasticrun/j/state")
        assert kv is not None and RoundState.from_json(kv.value).restarts == 3
    finally:
        store.close()


def test_the_newest_state_a_node_saw_is_the_one_it_knows():
    known = Known()
    for version, status, restarts in [
        (2, Status.FINAL, 1),
        (3, Status.JOINABLE, 1),
        (2, Status.FINAL, 1),
    ]:
        state = RoundState(version, status, restarts=restarts)
        known.saw(state, state.to_json())
    assert known.state is not None and (known.state.version, known.state.status) == (
        3,
        Status.JOINABLE,
    )
    closed = RoundState(3, Status.CLOSED, restarts=1)
    known.saw(closed, closed.to_json())
    assert known.state.status == Status.CLOSED
    assert rank(RoundState(3, Status.FINAL, restarts=2)) > rank(
        RoundState(3, Status.FINAL, restarts=1)
    )


def test_a_failing_member_is_left_for_the_successor_named_now_first():
    # Older successors may be gone (a machine that vanished costs a whole read timeout): the
    # one the key names now is tried first, then the others in turn.
    from elastic_launch.cancel import NEVER
    from elastic_launch.rendezvous.etcd.v3_client import Client

    c = Client("127.0.0.1:1", StoreAccess("s", retry_for=1), NEVER, lambda: None)
    try:
        old = c.learn(StoreMember("127.0.0.1", 2), prefer=True)
        now = c.learn(StoreMember("127.0.0.1", 3), prefer=True)
        assert old is not None and now is not None
        assert c.fail_over(c.connections[0], "refused")
        assert c.current is now
        assert c.fail_over(now, "refused")
        assert c.current is c.connections[0], "then the others, in turn"
    finally:
        c.close()


# ---- found by review: the host lost twice, a stale copy, an orphan standby, a flood -------------


def handler3(port: int, run_id: str, **conf: str) -> EmbeddedRendezvous:
    """A node of a job of up to three."""
    config = {"token": TOKEN, "join_timeout": "30", "last_call_timeout": "5", **conf}
    params = RendezvousParameters(
        "c10d", f"127.0.0.1:{port}", run_id, 1, 3, 1, config, max_restarts=3
    )
    return EmbeddedRendezvous(params)


def named_and_in_sync(h: EmbeddedRendezvous, host: EmbeddedServer) -> EmbeddedServer:
    """The successor `h` stands by with, once it holds `host`'s copy."""
    wait_for(lambda: successor_of(h) == h.node, "it was not chosen")
    standby = h._succession.server
    assert standby is not None
    in_sync(standby, host)
    return standby


def test_the_host_lost_twice_each_time_a_successor_takes_over():
    port, run_id = free_port(), f"twice-{time.monotonic_ns()}"
    a, b, c = (handler3(port, run_id) for _ in range(3))
    try:
        form_round([a, b, c])
        wait_for(lambda: successor_of(a) in (b.node, c.node), "no successor was chosen")
        first, second = (b, c) if successor_of(a) == b.node else (c, b)
        s1 = named_and_in_sync(first, a.server)
        a.server.close(0)  # the host's node is lost
        wait_for(lambda: s1.hosting, "the first successor did not take over")
        s2 = named_and_in_sync(second, s1)  # another stands by, following the new host
        s1.close(0)  # lost again
        wait_for(lambda: s2.hosting, "the second successor did not take over")
        state, _ = second.job.read()
        assert state is not None and state.version == 1, "the job's state, through the second"
    finally:
        for h in (c, b, a):
            h.shutdown(stopped())


def test_a_copy_that_fell_behind_and_took_over_is_filled_by_the_client(job, monkeypatch):
    # The host drops a successor that stalls, too far behind to send it the change (it
    # answers on without it), then is lost before the successor follows again: the successor
    # takes over with a copy short of what the client saw. The client finds its copy ends
    # before that (its status), and puts back what it knows.
    host, successor, store = standing_by(job)
    filled: list[int] = []

    def fill() -> None:
        filled.append(store.client.epoch)
        store.put("/job/a", b"3")

    store.on_replaced = fill
    resume = threading.Event()
    try:
        store.put("/job/a", b"2")
        in_sync(successor, host)
        successor._loop.call_soon_threadsafe(resume.wait, 30)  # it stalls
        monkeypatch.setattr(embedded_replicas, "QUEUE_BYTES", 1)  # ... too far behind
        store.put("/job/a", b"3")  # answered without it: the host dropped it
        assert not host._service.replicas.standbys
        job.kill(host)
        resume.set()
        wait_for(lambda: successor.hosting, "the successor did not take over")
        assert successor.state.data[b"/job/a"].value == b"2", "its copy is short"
        assert store.get("/job/a").value == b"3", "put back before the read"
        assert filled == [1]
    finally:
        resume.set()
        store.close()


def test_a_successor_no_longer_named_stops_and_one_named_without_its_address_says_it(nodes):
    a = nodes()
    b = nodes()
    form_round([a, b])
    standby = named_and_in_sync(b, a.server)
    a.store.put(SUCCESSOR_KEY, value_of(b.node))  # its address lost
    wait_for(
        lambda: (
            (parse(a.store.get(SUCCESSOR_KEY).value)[1] or StoreMember("", 0)).port == standby.port
        ),
        "it did not say where it listens again",
    )
    a.store.put(SUCCESSOR_KEY, value_of("another-node", "127.0.0.1:9"))  # another named
    wait_for(lambda: b._succession.server is None, "it kept standing by, unnamed")


def test_announcements_to_a_standby_keep_its_peers_bounded(job):
    _, successor, store = standing_by(job)
    store.close()
    target = f"127.0.0.1:{successor.port}"
    for i in range(3 * embedded_roles.MAX_ANNOUNCED):
        with grpc.insecure_channel(target) as channel:
            metadata = embedded_login(channel, TOKEN, target)
            request = replica_pb2.Announcement(term=50 + i, index=2000 + i, address="127.0.0.1:9")
            replica_pb2_grpc.ReplicaStub(channel).Announce(request, metadata=metadata, timeout=5)
    roles = successor._service.roles
    assert len(roles.peers) <= 1 + embedded_roles.MAX_ANNOUNCED + 1  # the endpoint, its host
    assert len(roles._retired) == 0, "closed at once: no look runs while it follows"


def test_a_state_that_is_not_one_is_replaced_by_a_put_back(job):
    job.host()
    store = client(job.endpoint.target)
    try:
        store.put("/elasticrun/j/state", b"not a state")
        known = Known()
        mine = RoundState(4, Status.FINAL, restarts=2)
        known.saw(mine, mine.to_json())
        known.put_back(store, "/elasticrun/j/state")
        assert RoundState.from_json(store.get("/elasticrun/j/state").value).restarts == 2
    finally:
        store.close()


def test_a_standby_with_no_copy_names_no_cluster_in_its_refusal():
    from elastic_launch.rendezvous.embedded.peering import standby_refusal
    from elastic_launch.rendezvous.embedded.state import ServiceState

    class Roles:
        serving = False

        def host_address(self) -> str:
            return "127.0.0.1:9"

    state = ServiceState()
    refusal = standby_refusal(Roles(), state)  # type: ignore[arg-type]
    assert refusal is not None and dict(refusal.metadata) == {HOST_KEY: "127.0.0.1:9"}
    state.take_over(1)
    refusal = standby_refusal(Roles(), state)  # type: ignore[arg-type]
    assert refusal is not None and CLUSTER_KEY in dict(refusal.metadata)
