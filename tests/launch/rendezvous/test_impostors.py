"""A process without the job's token at a standby's endpoint (:mod:`relay_impostor`): it passes
logins on to the host, replays what it is sent, claims a newer term. Nothing it does gains it a
credential, a key, the host's term or an agent: a proof names the endpoint dialed and who asks,
and what a host acts on (a status, a stream) is proven call by call. Without a token, a service
on another user's port is never followed, whatever it claims."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from elastic_launch.net import free_port
from elastic_launch.rendezvous.embedded.peers import Peer
from elastic_launch.rendezvous.embedded.server import EmbeddedServer
from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
from elastic_launch.rendezvous.etcdpb import rpc_pb2_grpc
from elastic_launch.rendezvous.store.api import StoreAccess
from elastic_launch.rendezvous.store.endpoints import StoreMember
from elastic_launch.rendezvous.store.wire import CLUSTER_KEY, HOST_KEY
from relay_impostor import Impostor

TOKEN = "the-job-token"
LOOKS = 6  # a host's looks at the others: several probes of the impostor


def wait_for(what: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def two_members() -> list[StoreMember]:
    return [StoreMember("127.0.0.1", free_port()), StoreMember("127.0.0.1", free_port())]


def agent(members: list[StoreMember], token: str | None = TOKEN) -> EtcdV3Store:
    access = StoreAccess("the job's service", token=token, retry_for=10, read_timeout=2)
    return EtcdV3Store(",".join(m.target for m in members), access)


def looked(host: EmbeddedServer, times: int) -> Callable[[], bool]:
    roles = host._service.roles
    assert roles is not None
    start = roles.looks
    return lambda: roles.looks >= start + times


def assert_untouched(host: EmbeddedServer, store: EtcdV3Store) -> None:
    """The host still hosts its first term, and holds no key the impostor wrote; the agent,
    sent to the impostor, comes back to the host."""
    assert host.hosting and host.state.term == 1
    store.client.fail_over(store.client.current, "a test moved it")
    assert store.get("/k") is not None and store.get("/k").value == b"1"
    assert store.get("/impostor") is None
    assert store.client.current.member.port == host.port


@pytest.mark.parametrize("rewrite", [False, True], ids=["as-it-came", "host-address-put-in"])
def test_a_relaying_impostor_at_the_standbys_endpoint_gets_no_credential(rewrite, caplog):
    members = two_members()
    impostor = Impostor(members[1].port, members[0].target, rewrite)  # before the standby
    host = EmbeddedServer("127.0.0.1", members[0].port, TOKEN, None, members, 0)
    store = agent(members)
    try:
        store.put("/k", b"1")
        wait_for(looked(host, LOOKS))
        wait_for(lambda: impostor.logins >= 2)
        assert impostor.credentials == set(), "nothing derived from the token was sent to it"
        if rewrite:
            assert impostor.host_answered, "the host answered the login it passed on..."
        else:
            assert impostor.host_answered == 0, "the host refused a login for another address"
        assert_untouched(host, store)
        assert impostor.credentials == set(), "the agent sent it nothing either"
        assert "did not prove" in caplog.text or "is reached at" in caplog.text
    finally:
        store.close()
        host.close(0)
        impostor.close()


def test_an_impostor_that_takes_a_lost_standbys_port_cannot_use_what_it_is_sent(caplog):
    members = two_members()
    host = EmbeddedServer("127.0.0.1", members[0].port, TOKEN, None, members, 0)
    standby = EmbeddedServer("127.0.0.1", members[1].port, TOKEN, None, members, 1)
    store = agent(members)
    impostor = None
    try:
        store.put("/k", b"1")
        wait_for(lambda: standby.state.revision == host.state.revision and not standby.hosting)
        roles = host._service.roles
        assert roles is not None
        wait_for(lambda: bool(roles.peers[1].metadata))  # the host probed the standby
        sniffed = list(roles.peers[1].metadata)  # what it sends there (read off the wire)
        standby.close(0)
        impostor = Impostor(members[1].port, members[0].target)
        impostor.credentials.add(sniffed[0][1])
        impostor.try_credentials()
        assert impostor.accepted == 0
        assert impostor.refused and all("which is not this service" in r for r in impostor.refused)

        # A peer that still holds that credential, on a connection that now reaches the
        # impostor: its answers, made up or the host's own to another call, are not believed.
        async def ask() -> tuple[object, str]:
            peer = Peer(members[1], 1, TOKEN, None)
            peer.metadata = sniffed
            try:
                status = await peer.status()
                try:
                    await peer.follow(_nothing())
                    followed = "followed"
                except ValueError as e:
                    followed = str(e)
                return status, followed
            finally:
                await peer.close()

        status, followed = asyncio.run(ask())
        assert status is None and "did not prove" in followed
        assert "answers without proving that it holds the job's token" in caplog.text
        wait_for(looked(host, LOOKS))
        assert_untouched(host, store)
    finally:
        store.close()
        host.close(0)
        if impostor is not None:
            impostor.close()


async def _nothing() -> AsyncIterator[object]:
    return
    yield


@pytest.mark.slow  # a process of its own, as user nobody
def test_without_a_token_a_service_on_another_users_port_is_never_followed(caplog):
    if os.getuid() != 0:
        pytest.skip("needs root, to run a process as another user")
    members = two_members()
    script = Path(__file__).with_name("relay_impostor.py")
    env = {**os.environ, "PYTHONPATH": str(script.parent)}
    impostor = subprocess.Popen(
        [sys.executable, str(script), str(members[1].port), members[0].target, "--as-nobody"],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    host = store = None
    try:
        assert impostor.stdout is not None and impostor.stdout.readline().strip() == "listening"
        host = EmbeddedServer("127.0.0.1", members[0].port, None, None, members, 0)
        store = agent(members, token=None)
        store.put("/k", b"1")
        wait_for(looked(host, LOOKS))
        assert "is held by another user (uid 65534)" in caplog.text
        assert_untouched(host, store)
    finally:
        if store is not None:
            store.close()
        if host is not None:
            host.close(0)
        impostor.kill()
        impostor.wait(10)


class Forger(rpc_pb2_grpc.AuthServicer, rpc_pb2_grpc.KVServicer):
    """A process without the token that answers every call, the login included, with a
    standby's refusal naming a host and a cluster of its choosing."""

    def __init__(self, port: int, host: str) -> None:
        self.said = ((HOST_KEY, host), (CLUSTER_KEY, "dead"))
        self.server = grpc.server(futures.ThreadPoolExecutor(4))
        rpc_pb2_grpc.add_AuthServicer_to_server(self, self.server)
        rpc_pb2_grpc.add_KVServicer_to_server(self, self.server)
        self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    def Authenticate(self, request, context):  # noqa: N802
        context.set_trailing_metadata(self.said)
        context.abort(grpc.StatusCode.UNAVAILABLE, "this rendezvous service is a standby")

    Range = Put = Txn = Authenticate


@pytest.mark.parametrize("first", [True, False], ids=["listed-first", "moved-to"])
def test_a_forged_standby_refusal_sends_no_agent_anywhere(first):
    # Found by review: an unproven refusal's cluster was judged, and the agent ended with
    # "two different clusters" (the impostor's made-up one and the job's).
    members = two_members()
    host_i, forger_i = (1, 0) if first else (0, 1)
    forger = Forger(members[forger_i].port, members[host_i].target)
    host = EmbeddedServer("127.0.0.1", members[host_i].port, TOKEN, None, members, host_i)
    store = agent(members)
    try:
        wait_for(lambda: host.hosting)
        store.put("/k", b"1")
        store.client.fail_over(store.client.current, "a test moved it")
        store.put("/k", b"2")
        assert store.get("/k").value == b"2"
        assert store.client.current.member.port == host.port
        assert store.client.identity.cluster == host.state.cluster_id
    finally:
        store.close()
        host.close(0)
        forger.server.stop(0).wait(5)
