"""The agent that hosts the embedded service keeps it up, once the job has ended there, until
every other node has left: their last requests (done, closing the job, reading how it ended)
go through it. Two handlers in process, the host and a client, over a real service."""

from __future__ import annotations

import socket
import threading
import time

import grpc
import pytest
from elastic_launch.cancel import CancelToken
from elastic_launch.rendezvous.api import RendezvousParameters
from elastic_launch.rendezvous.backends import EmbeddedRendezvous
from elastic_launch.rendezvous.embedded.server import EmbeddedServer
from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.store.api import StoreAccess
from test_elastic import form_round


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def pair(request):
    """(host, client): two nodes of one job on a fresh port; both shut down at the end."""
    port = free_port()
    run_id = f"host-{request.node.name}-{time.monotonic_ns()}"

    def node(is_host: bool) -> EmbeddedRendezvous:
        conf = {
            "is_host": str(is_host).lower(),
            "join_timeout": "30",
            "last_call_timeout": "5",
            "reconnect_timeout": "5",
        }
        return EmbeddedRendezvous(
            RendezvousParameters("c10d", f"127.0.0.1:{port}", run_id, 2, 2, 1, conf)
        )

    host = node(True)
    client = node(False)
    yield host, client
    client.shutdown(stopped())
    host.shutdown(stopped())


def stopped() -> CancelToken:
    cancel = CancelToken()
    cancel.cancel()
    return cancel


def shut_down_in_background(host: EmbeddedRendezvous) -> threading.Thread:
    t = threading.Thread(target=host.shutdown, daemon=True)
    t.start()
    return t


def test_the_host_that_closed_the_job_serves_until_the_other_node_left(pair):
    """The race this closes: the other node wrote its done key and is about to read how the
    job ended when the host, finishing last, closes the job and would stop serving."""
    host, client = pair
    form_round([host, client])
    client.store.put(f"{client.job.keys.done}{client.node}", b"1")  # mid-way through mark_done
    assert host.mark_done(), "both are done: the host closes the job"
    stopping = shut_down_in_background(host)
    stopping.join(1.0)
    assert stopping.is_alive(), "the host stopped serving while the other node was there"
    assert client.mark_done(), "the other node reads that the job has finished"
    client.shutdown()
    stopping.join(10.0)
    assert not stopping.is_alive(), "the host went on waiting after the other node left"


def test_the_host_that_finished_first_serves_until_the_other_node_closed_the_job(pair):
    host, client = pair
    form_round([host, client])
    assert not host.mark_done(), "the other node still runs"
    stopping = shut_down_in_background(host)
    stopping.join(1.0)
    assert stopping.is_alive()
    assert client.mark_done(), "the last to finish closes the job, through the host"
    client.shutdown()
    stopping.join(10.0)
    assert not stopping.is_alive()


def test_a_host_whose_job_goes_on_without_it_stops_at_once(pair):
    """Neither closed nor finished there (its node failed alone): nothing to serve."""
    host, client = pair
    form_round([host, client])
    t0 = time.monotonic()
    host.shutdown()
    assert time.monotonic() - t0 < 5.0


def test_a_stopped_host_does_not_wait(pair):
    host, client = pair
    form_round([host, client])
    assert not host.mark_done()
    t0 = time.monotonic()
    host.shutdown(stopped())
    assert time.monotonic() - t0 < 5.0


# ---- the service's part ------------------------------------------------------------------------


@pytest.fixture
def server():
    port = free_port()
    s = EmbeddedServer("127.0.0.1", port, token=None)
    yield s, f"127.0.0.1:{port}"
    s.close()


def renewing(service: EmbeddedServer, own: set[int]) -> bool:
    """Whether, within 5 s, a lease other than `own` is kept alive (its first renewal came)."""
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        if not service.wait_for_clients(own, 0.05):
            return True
    return False


def test_waiting_for_clients_ends_when_their_leases_end(server):
    service, endpoint = server
    own, other = (EtcdV3Store(endpoint, StoreAccess("test", retry_for=5)) for _ in range(2))
    try:
        own.start_liveness(10.0, lambda: None)
        other.start_liveness(10.0, lambda: None)
        assert renewing(service, own.leases), "another client keeps a lease alive"
        assert service.wait_for_clients(own.leases | other.leases, 0.3), "only ours are left"
        threading.Timer(0.3, other.close).start()  # revokes its lease
        assert service.wait_for_clients(own.leases, 10.0)
    finally:
        own.close()
        other.close()


def test_waiting_for_clients_ends_when_a_lease_expires(server):
    """A node that died: its lease, renewed once and then no more, expires."""
    service, endpoint = server
    with grpc.insecure_channel(endpoint) as channel:
        stub = rpc_pb2_grpc.LeaseStub(channel)
        lease = stub.LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=1), timeout=5).ID
        renewals = stub.LeaseKeepAlive(iter([rpc_pb2.LeaseKeepAliveRequest(ID=lease)]), timeout=5)
        assert [r.TTL for r in renewals] == [1]
    assert not service.wait_for_clients(set(), 0.2)
    assert service.wait_for_clients(set(), 10.0)


def test_a_lease_never_renewed_is_no_client(server):
    """A key's own expiry (the closed job's state keeps its for minutes) is not a node."""
    service, endpoint = server
    with grpc.insecure_channel(endpoint) as channel:
        rpc_pb2_grpc.LeaseStub(channel).LeaseGrant(rpc_pb2.LeaseGrantRequest(TTL=600), timeout=5)
    assert service.wait_for_clients(set(), 0.2)


def test_waiting_for_clients_ends_at_a_cancellation(server):
    service, endpoint = server
    other = EtcdV3Store(endpoint, StoreAccess("test", retry_for=5))
    try:
        other.start_liveness(10.0, lambda: None)
        assert renewing(service, set())
        cancel = CancelToken()
        threading.Timer(0.3, cancel.cancel).start()
        t0 = time.monotonic()
        assert not service.wait_for_clients(set(), 30.0, cancel)
        assert time.monotonic() - t0 < 10.0
    finally:
        other.close()


def test_a_task_that_ignores_cancellation_does_not_hold_up_the_stop():
    """A stop cancels what runs on the service's loop and gives it a moment: one task that
    will not end (a stream stuck in a handler) must not keep the service's thread, and with
    it the launcher's exit, waiting."""
    import asyncio
    import contextlib

    server = EmbeddedServer("127.0.0.1", 0, token=None)
    release = threading.Event()

    async def stubborn() -> None:
        while not release.is_set():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(3600)

    asyncio.run_coroutine_threadsafe(stubborn(), server._loop)
    try:
        server.close(grace=0)
        assert not server._thread.is_alive(), "the service's thread still waits for the task"
    finally:
        release.set()


def test_an_agent_that_does_not_host_waits_for_its_host_past_its_join_timeout():
    """upstream's test_launch_elastic_multiple_agents gives a 5 s join timeout, and a loaded
    machine's hosting launcher may take longer to serve: an agent that does not host waits for
    the service's first answer as torch's agents wait for their store, and its join timeout
    counts from then."""
    port = free_port()
    conf = {"is_host": "false", "join_timeout": "1", "last_call_timeout": "1"}
    client = EmbeddedRendezvous(
        RendezvousParameters("c10d", f"127.0.0.1:{port}", "late-host", 1, 1, 1, conf)
    )
    outcome: list[object] = []
    joiner = threading.Thread(target=lambda: outcome.append(_next(client)), daemon=True)
    joiner.start()
    server = None
    try:
        # Retries back off from 50 ms to 1 s: seven of them outlast the 1 s join timeout.
        deadline = time.monotonic() + 60
        while client.store.requests < 7 and not outcome:
            assert time.monotonic() < deadline, "the agent never tried the service"
            time.sleep(0.05)
        assert not outcome, f"it gave up before its host served: {outcome}"
        server = EmbeddedServer("127.0.0.1", port, None)
        joiner.join(60)
        assert outcome and getattr(outcome[0], "world_size", None) == 1, outcome
    finally:
        client.shutdown(stopped())
        if server is not None:
            server.close()


def _next(handler: EmbeddedRendezvous) -> object:
    try:
        return handler.next_rendezvous()
    except Exception as e:  # the test reports what ended the wait
        return e


def test_a_taken_port_is_refused_without_grpc_logging_an_error(server, capfd):
    """Every agent that does not host tries the port first: the normal case prints no error
    line (gRPC's own failed bind logs "Failed to add port to server" from its C core)."""
    service, _ = server
    with pytest.raises(OSError, match="another process listens there"):
        EmbeddedServer("127.0.0.1", service.port, token=None)
    captured = capfd.readouterr()
    assert "add_port" not in captured.err and "Failed to add port" not in captured.err
