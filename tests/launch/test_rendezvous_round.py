"""One elastic rendezvous round, in process: several handlers (one per thread, each with its own
store connection) against the embedded service and a real etcd."""

from __future__ import annotations

import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from elastic_launch.rendezvous.api import RendezvousInfo, RendezvousParameters
from elastic_launch.rendezvous.elastic import ElasticRendezvous, Timeouts
from elastic_launch.rendezvous.etcd_v3 import EtcdV3Store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


TIMEOUTS = Timeouts(join=30.0, last_call=0.5, heartbeat=5.0, close=10.0, reconnect=5.0)


class CountingStore(EtcdV3Store):
    """Counts compare-and-swap writes, the state's only writes once it exists."""

    cas_calls = 0
    lock = threading.Lock()

    def cas(self, key: str, value: bytes, version: int) -> int:
        with CountingStore.lock:
            CountingStore.cas_calls += 1
        return super().cas(key, value, version)


@pytest.fixture(params=["embedded", "etcd"])
def endpoint(request):
    if request.param == "etcd":
        yield request.getfixturevalue("etcd").endpoint, None
        return
    from elastic_launch.rendezvous.embedded_server import EmbeddedServer

    port = free_port()
    server = EmbeddedServer("127.0.0.1", port, token="t")
    yield f"127.0.0.1:{port}", "t"
    server.close()


def handlers(endpoint: tuple[str, str | None], n: int, run_id: str) -> list[ElasticRendezvous]:
    address, token = endpoint
    params = RendezvousParameters("etcd", address, run_id, 2, n, 1, local_addr="127.0.0.1")
    return [
        ElasticRendezvous(
            params,
            CountingStore(address, "test store", token=token, retry_for=5),
            TIMEOUTS,
            "127.0.0.1",
        )
        for _ in range(n)
    ]


def form_round(members: list[ElasticRendezvous]) -> list[RendezvousInfo]:
    with ThreadPoolExecutor(len(members)) as pool:
        return list(pool.map(lambda h: h.next_rendezvous(), members, timeout=60))


def test_a_round_of_max_nodes_writes_the_state_twice(endpoint, request):
    members = handlers(endpoint, 4, f"round-{request.node.callspec.id}-{time.monotonic_ns()}")
    try:
        CountingStore.cas_calls = 0
        infos = form_round(members)
        assert sorted(i.group_rank for i in infos) == [0, 1, 2, 3]
        assert {(i.round, i.group_world_size, i.master_port) for i in infos} == {
            (infos[0].round, 4, infos[0].master_port)
        }
        # Freeze and final, once each: the leader goes on from what it wrote instead of
        # writing again until its watch brings the change back.
        assert CountingStore.cas_calls == 2
    finally:
        for h in members:
            h.shutdown()


def test_the_members_see_a_node_leave_after_the_round(endpoint, request):
    members = handlers(endpoint, 3, f"leave-{request.node.callspec.id}-{time.monotonic_ns()}")
    try:
        form_round(members)
        time.sleep(0.3)
        assert not any(h.membership_changed() for h in members)
        members[0].shutdown()  # its lease is revoked: its join key goes at once
        deadline = time.monotonic() + 10
        while not all(h.membership_changed() for h in members[1:]):
            assert time.monotonic() < deadline, "the others never noticed the node leave"
            time.sleep(0.05)
    finally:
        for h in members:
            h.shutdown()
