"""One endpoint, and a successor for its host.

With one endpoint in ``--rdzv-endpoint`` (torchrun's habit, and what Kubeflow's elastic
``PyTorchJob`` gives the c10d backend), the node that hosts the embedded service would take the
job with it. So the agents choose a successor among themselves: the first agent that may serve
and finds none named, once it is in the job, writes :data:`~.wire.SUCCESSOR_KEY` (with its
lease: the key goes with the agent), starts a service of its own on its address that follows
the host as a listed standby does (a synchronous copy), and writes where it listens there.
Every agent, and every worker of the train loop, watches the key and adds the address to its
store's members: when the host is lost, they all move to the successor as to a listed standby.

A successor that takes over gives the key up (it hosts now), and another agent stands by in
its place. A successor whose agent leaves or dies loses the key with its lease; another stands
by. A value in the key is input from the network: checked, and a bad one is said and left.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from elastic_launch.api import Cancelled, ConfigError
from elastic_launch.cancel import join
from elastic_launch.net import host_port, parse_endpoint
from elastic_launch.rendezvous.etcd.v3_client import AskAgainError
from elastic_launch.rendezvous.etcdpb import rpc_pb2
from elastic_launch.rendezvous.store.api import HistoryLostError, Inbox, KeyValue, StoreError
from elastic_launch.rendezvous.store.endpoints import StoreMember
from elastic_launch.rendezvous.store.wire import SUCCESSOR_KEY

if TYPE_CHECKING:
    from elastic_launch.rendezvous.embedded.server import EmbeddedServer
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store

logger = logging.getLogger(__name__)

#: The successor key's value is a little JSON; anything longer is not ours.
MAX_VALUE = 1024
_AGAIN = 1.0  # seconds before a read that failed is tried again


def value_of(node: str, address: str = "") -> bytes:
    """The successor key's value: who stands by, and where its service listens."""
    return json.dumps({"node": node, "address": address}, separators=(",", ":")).encode()


def parse(value: bytes) -> tuple[str, StoreMember | None]:
    """(node, where its service listens, or None while it starts) of a successor key's value;
    ValueError naming what is wrong with one that is not ours."""
    if len(value) > MAX_VALUE:
        raise ValueError(f"{len(value)} bytes, more than {MAX_VALUE}")
    try:
        raw = json.loads(value)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(raw, dict) or not isinstance(raw.get("node"), str):
        raise ValueError("not an object with a node")
    address = raw.get("address", "")
    if not isinstance(address, str):
        raise ValueError(f"address {address!r} is not text")
    if not address:
        return raw["node"], None
    try:
        host, port = parse_endpoint(address, "the successor's address")
    except ConfigError as e:
        raise ValueError(str(e)) from None
    return raw["node"], StoreMember(host, port)


def successor_of(store: EtcdV3Store, in_sync: bool = False) -> StoreMember | None:
    """Where the successor named in `store` listens (None: none is named yet; with
    `in_sync`, also None while its service holds no copy of the host's state). For tools
    and tests that watch a job from outside; `store`'s client learns the successor."""
    kv = store.get(SUCCESSOR_KEY)
    where = parse(kv.value)[1] if kv is not None else None
    if where is None or not in_sync:
        return where
    conn = store.client.learn(where)
    if conn is None:
        return None
    try:
        store.client.log_in(conn)
        status = conn.maintenance.Status(
            rpc_pb2.StatusRequest(), timeout=store.read_timeout, metadata=conn.metadata
        )
    except (grpc.RpcError, AskAgainError):
        return None
    return where if status.raftTerm >= 1 and status.isLearner else None


def standing_by(endpoint: str, token: str | None = None) -> bool:
    """Whether the job whose one embedded endpoint is `endpoint` has a successor whose service
    holds a copy of the host's state (False while the service does not answer): for tools,
    benchmarks and tests that wait for it from outside."""
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
    from elastic_launch.rendezvous.store.api import StoreAccess

    access = StoreAccess("the job's service", token=token, retry_for=2, read_timeout=2)
    store = EtcdV3Store(endpoint, access, watch_from_now=False)
    try:
        return successor_of(store, in_sync=True) is not None
    except StoreError:
        return False
    finally:
        store.close()


class Succession:
    """This node's part in the succession of the service at `store`'s one endpoint: it
    learns every successor named, and (with `stand_by`, which starts this node's service or
    returns None) stands by itself once :meth:`may_stand_by` is called and none is named."""

    def __init__(
        self,
        store: EtcdV3Store,
        node: str,
        stand_by: Callable[[], EmbeddedServer | None] | None = None,
    ) -> None:
        self.store = store
        self.node = node
        self._stand_by = stand_by
        self.server: EmbeddedServer | None = None  # this node's, while it stands by or hosts
        self._campaign = threading.Event()
        self._stop = threading.Event()
        self._inbox: Inbox | None = None
        self._said_bad = b""
        self._started = False
        self._delay = 0.0
        self._thread = threading.Thread(target=self._run, name="elasticrun-succession", daemon=True)

    def start(self, delay: float = 0.0) -> None:
        """Follow the key from a thread, beginning after `delay` seconds (once; again is
        nothing)."""
        if self._started:
            return
        self._started = True
        self._delay = delay
        self._thread.start()

    def may_stand_by(self) -> None:
        """This node is in the job: it may stand by if no other does."""
        if self._stand_by is not None and not self._campaign.is_set():
            self._campaign.set()
            self._wake()

    def _wake(self) -> None:
        inbox = self._inbox
        if inbox is not None:
            inbox.wake()

    def _run(self) -> None:
        if self._stop.wait(self._delay):
            return
        while not self._stop.is_set():
            try:
                self._step()
            except HistoryLostError:
                continue  # the store was started again: read it again
            except (Cancelled, StoreError) as e:
                if self._stop.is_set() or self.store.client.closed.is_set():
                    return
                logger.debug("the rendezvous succession: %s", e)
                if self._stop.wait(_AGAIN):
                    return

    def _step(self) -> None:
        """Read the key, act on it, and wait on a watch until it changes (or this node may
        now stand by, or its service took over)."""
        kvs, revision = self.store.range(SUCCESSOR_KEY)
        found = next((kv for kv in kvs if kv.key == SUCCESSOR_KEY), None)
        named = self._learn(found)
        if not self._act(named, found.value if found is not None else b""):
            self._wait(revision, named)

    def _act(self, named: str | None, value: bytes) -> bool:
        """Change the key, or this node's service, if this node should (True: read the key
        again). Only the node named keeps a service standing by: two standbys that do not
        know each other would both take over when the host is lost."""
        server = self.server
        if server is None:
            if named is None and self._may_stand_up():
                self._stand_up()
                return True
            return False
        if server.hosting:
            if named == self.node:
                self.store.delete(SUCCESSOR_KEY)  # it hosts now: another node stands by
            return named == self.node
        return self._keep_named(server, named, value)

    def _keep_named(self, server: EmbeddedServer, named: str | None, value: bytes) -> bool:
        """This node's service stands by: keep the key naming it where it listens (True:
        read the key again), or stop it if another node was named meanwhile."""
        mine = self._value(server)
        if named is None:  # the key went (the store was started again): name it again
            self.store.create(SUCCESSOR_KEY, mine, ephemeral=True)
        elif named != self.node:  # another was named meanwhile (this node's lease lapsed)
            logger.info("another node stands by for the rendezvous service: this one stops")
            server.close(0.0)
            self.server = None
        elif value != mine:  # named, but not where its service listens
            self.store.put(SUCCESSOR_KEY, mine, ephemeral=True)
        else:
            return False
        return True

    def _wait(self, revision: int, named: str | None) -> None:
        """Until the key changes after `revision`, or this node has something to do."""
        with Inbox() as inbox:
            self.store.watch(SUCCESSOR_KEY, revision, inbox)
            self._inbox = inbox
            try:
                while not self._stop.is_set() and not self._due(named):
                    if inbox.next(float("inf")):
                        return  # the key changed: read it again
            finally:
                self._inbox = None

    def _due(self, named: str | None) -> bool:
        return (named is None and self._may_stand_up()) or self._hosting_named(named)

    def _may_stand_up(self) -> bool:
        return self._campaign.is_set() and self._stand_by is not None and self.server is None

    def _hosting_named(self, named: str | None) -> bool:
        return named == self.node and self.server is not None and self.server.hosting

    def _value(self, server: EmbeddedServer) -> bytes:
        return value_of(self.node, host_port(server.host, server.port))

    def _learn(self, kv: KeyValue | None) -> str | None:
        """The node named in the key (None: none), its service learned by the store's client."""
        if kv is None:
            return None
        try:
            node, member = parse(kv.value)
        except ValueError as e:
            if kv.value != self._said_bad:
                self._said_bad = kv.value
                logger.warning("the rendezvous successor key holds no successor (%s): left", e)
            return None
        if member is not None:
            self.store.client.learn(member, prefer=True)
        return node

    def _stand_up(self) -> None:
        """Name this node the successor (if no other was first), start its service, and say
        where it listens."""
        assert self._stand_by is not None
        if not self.store.create(SUCCESSOR_KEY, value_of(self.node), ephemeral=True):
            return  # another node was first
        server = self._stand_by()
        if server is None:
            self._stand_by = None  # it cannot: another node will
            with contextlib.suppress(StoreError):
                self.store.delete(SUCCESSOR_KEY)
            return
        self.server = server
        server.on_hosting = self._wake
        self.store.put(SUCCESSOR_KEY, self._value(server), ephemeral=True)
        logger.info(
            "this node stands by for the rendezvous service: its copy at %s takes over if the "
            "host at %s is lost",
            host_port(server.host, server.port),
            self.store.client.target,
        )

    def stop(self) -> None:
        """Stop learning and standing by (this node's service is its owner's to stop)."""
        self._stop.set()
        self._wake()

    def join(self) -> None:
        """Wait for the thread, once the store is closed (its calls then end at once)."""
        if self._thread.is_alive():
            join(self._thread, 5, "the rendezvous succession thread")
