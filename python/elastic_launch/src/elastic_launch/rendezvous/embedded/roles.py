"""Which of a job's embedded services hosts the rendezvous. With several endpoints in
``--rdzv-endpoint``, every node that can serve one runs a service there; one hosts, the others
are standbys that follow it (:mod:`.replicas`) and refuse clients, who move on to the
host (as from any failed member).

- The first service up hosts (a service other than the first listed gives the ones before it
  :data:`START_GRACE` to come up first). A service that finds a host follows it.
- When the host is lost (its stream to a standby ends, or says nothing for
  :data:`HOST_SILENT`), the standby with the newest state (its term, then its revision) takes
  over, the one listed first among equals, in a new term: its state is the host's, so clients
  go on with the same leases, revisions and watches.
- Two hosts that find each other (after a partition healed) keep the one of the newest term;
  the other steps down and follows it, and its clients move on. A host that finds a listed
  endpoint hosting an older term without knowing it (a node started again there, with an
  empty service) announces itself there: that service steps down and follows it.
- With one endpoint, the agents choose a successor (:mod:`.succession`): a service of their
  own, past the list, that follows the host like a listed standby. It never hosts before it
  has a copy of the state.

Without a quorum, a partition that separates a host from its standby while both reach some
nodes can let both serve until it heals; etcd, with its quorum, has no such window
(docs/rendezvous.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from elastic_launch.api import ConfigError
from elastic_launch.net import is_loopback, listener_owners, parse_endpoint
from elastic_launch.rendezvous.embedded.peers import Peer
from elastic_launch.rendezvous.embedded.replicas import Replicas
from elastic_launch.rendezvous.embedded.state import ServiceState
from elastic_launch.rendezvous.etcdpb import replica_pb2
from elastic_launch.rendezvous.store.endpoints import StoreMember

logger = logging.getLogger(__name__)

HOST, STANDBY, SEEKING = "host", "standby", "seeking"
PROBE_INTERVAL = 0.5  # seconds between a host's looks for another host
HOST_SILENT = 2.0  # seconds a standby hears nothing from its host before it looks again
START_GRACE = 1.0  # seconds a new service waits for those listed before it to come up
_SEEK_INTERVAL = 0.1
_FOLLOW_AGAIN = 0.05  # after a stream that ended: a host that drops a standby is not hammered
#: Services a service learned of from announcements, at most (the oldest is forgotten).
MAX_ANNOUNCED = 8
#: Seconds a look at the others may take in all (each probe has its own timeouts, shorter).
LOOK_TIMEOUT = 5.0


@dataclass(frozen=True)
class Place:
    """Where a service stands among the job's: its index (the listed endpoints first, a
    successor past them), how many endpoints are listed, where its clients reach it, and
    whether the job has a token (then a peer proves it holds it before it is followed)."""

    index: int
    listed: int
    address: str
    token: bool = False

    @property
    def successor(self) -> bool:
        """A service the agents chose, not one of the listed endpoints."""
        return self.index >= self.listed


@dataclass(frozen=True)
class Seen:
    """A service as a look at it found it."""

    index: int
    host: bool
    term: int
    revision: int

    @property
    def rank(self) -> tuple[int, int, int]:
        """Who should host: the newest state first, then the first listed."""
        return (self.term, self.revision, -self.index)


def seen(index: int, status: Any) -> Seen:
    """What a service's status says of it (etcd's fields: leader, raftTerm, isLearner)."""
    member = status.header.member_id
    host = bool(status.leader) and status.leader == member and not status.isLearner
    return Seen(index, host, int(status.raftTerm), int(status.header.revision))


def choose(me: Seen, others: list[Seen], grace_over: bool) -> tuple[str, int | None]:
    """What a service does next, given what it sees: ("host", None), ("follow", index) or
    ("wait", None). Pure: the decision of :class:`Roles`."""
    hosts = [s for s in others if s.host]
    if hosts:
        best = max(hosts, key=lambda s: (s.term, -s.index))
        if me.host and (me.term, -me.index) > (best.term, -best.index):
            return HOST, None  # the other one steps down when it sees this one
        return "follow", best.index
    if me.host:
        return HOST, None
    best = max([me, *others], key=lambda s: s.rank)
    if best is not me:
        return "wait", None  # it hosts, then this one follows
    if me.term == 0 and me.index > 0 and not grace_over:
        return "wait", None  # a new job: those listed first may be coming up
    return HOST, None


class Roles:
    """This service's role among the job's services (`peers`: the others, by index), kept
    right from a task on the service's event loop. `make_peer` makes a peer of a service
    that announced itself; `on_demoted` and `on_hosting` are told when this one steps down or
    takes over."""

    def __init__(
        self,
        state: ServiceState,
        replicas: Replicas,
        peers: dict[int, Peer],
        place: Place,
        make_peer: Callable[[int, StoreMember], Peer],
        on_demoted: Callable[[], None],
        on_hosting: Callable[[], None] = lambda: None,
    ) -> None:
        self.state = state
        self.replicas = replicas
        self.peers = peers
        self.place = place
        self.index = place.index
        self.role = SEEKING if peers else HOST
        self.host: int | None = None if peers else self.index  # the index of the host, if known
        self._make_peer = make_peer
        self._on_demoted = on_demoted
        self._on_hosting = on_hosting
        self._announced: list[int] = []  # peers learned from announcements, oldest first
        self._retired: list[Peer] = []  # forgotten ones, to close
        self._foreign_said: set[int] = set()  # ports of another user's, said once
        self._started = asyncio.get_running_loop().time()
        self._wake = asyncio.Event()  # an announcement: look now
        self.looks = 0  # at the others, so far
        self.task: asyncio.Task[None] | None = None  # what runs `run`, if anything
        if not peers:
            state.take_over(1)

    @property
    def serving(self) -> bool:
        return self.role == HOST

    def host_address(self) -> str | None:
        """Where the host is, as clients reach it (None: no host known)."""
        if self.host is None:
            return None
        if self.host == self.index:
            return self.place.address
        peer = self.peers.get(self.host)
        return peer.member.written if peer is not None else None

    async def run(self) -> None:
        while True:
            if self.role == HOST:
                await self._as_host()
            elif self.role == STANDBY:
                await self._as_standby()
            else:
                await self._seek()

    async def close(self) -> None:
        """Stop looking and following; close the channels to the others."""
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        for peer in self.peers.values():
            await peer.close()

    def announced(self, term: int, index: int, address: str) -> str | None:
        """A host of `term` at `address` (the `index`-th service) announced itself: it is
        looked at at once. Why it is not taken (None: it is)."""
        if term <= self.state.term:
            return (
                f"this rendezvous service holds term {self.state.term}, not older than the "
                f"announced {term}"
            )
        if index == self.index:
            return f"index {index} is this service's own"
        try:
            host, port = parse_endpoint(address, "the announced address")
        except ConfigError as e:
            return str(e)
        if self.peers and index in self.peers:
            self._wake.set()
            return None
        if not self._may_follow(host, port):
            return (
                f"{address} is not a service of this user on loopback, and without a token "
                "nothing proves it is the job's"
            )
        if len(self._announced) >= MAX_ANNOUNCED:
            oldest = self._announced.pop(0)
            gone = self.peers.pop(oldest, None) if oldest != self.host else None
            if gone is not None:
                self._retired.append(gone)  # closed after the look that may be using it
            if self.role == STANDBY:  # no look runs while it follows: close them now
                retired, self._retired = self._retired, []
                for peer in retired:
                    asyncio.get_running_loop().create_task(peer.close())
        self.peers[index] = self._make_peer(index, StoreMember(host, port))
        self._announced.append(index)
        self._wake.set()
        return None

    def _may_follow(self, host: str, port: int) -> bool:
        """Without the job's token, only a service of this user on loopback may be followed
        (with it, the peer proves it holds the token before it is followed)."""
        if self.place.token:
            return True
        return is_loopback(host) and listener_owners(port) <= {os.getuid()}

    def _foreign(self, peer: Peer) -> bool:
        """Without the job's token: whether another user listens at `peer`'s port on
        loopback (a service there is never followed, whatever term it claims; said once)."""
        member = peer.member
        if self.place.token or not is_loopback(member.host):
            return False
        others = listener_owners(member.port) - {os.getuid()}
        if others and member.port not in self._foreign_said:
            self._foreign_said.add(member.port)
            logger.warning(
                "the rendezvous endpoint %s is held by another user (uid %d): without a token "
                "nothing proves a service there is the job's, so it is never followed",
                member.written,
                min(others),
            )
        return bool(others)

    async def _look(self) -> list[Seen]:
        """What each of the others says of itself (those that do not answer in time left
        out): their probes run together, within a bound."""
        self.looks += 1
        retired, self._retired = self._retired, []
        for peer in retired:
            await peer.close()
        peers = {i: p for i, p in self.peers.items() if not self._foreign(p)}
        probes = [asyncio.ensure_future(p.status()) for p in peers.values()]
        if not probes:
            return []
        done, pending = await asyncio.wait(probes, timeout=LOOK_TIMEOUT)
        for probe in pending:
            probe.cancel()
        return [
            seen(i, p.result())
            for i, p in zip(peers, probes)
            if p in done and not p.cancelled() and p.exception() is None and p.result()
        ]

    def _me(self) -> Seen:
        return Seen(self.index, self.role == HOST, self.state.term, self.state.revision)

    async def _nap(self, seconds: float) -> None:
        """Sleep `seconds`, or until an announcement wakes this service (not sooner than
        _SEEK_INTERVAL after the last look: announcements in a stream cost a look each
        _SEEK_INTERVAL at most)."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._wake.wait(), seconds)
        self._wake.clear()
        await asyncio.sleep(max(0.0, started + _SEEK_INTERVAL - loop.time()))

    async def _as_host(self) -> None:
        await self._nap(PROBE_INTERVAL)
        others = await self._look()
        what, _ = choose(self._me(), others, True)
        if what != HOST:
            logger.warning(
                "another node's rendezvous service hosts in a newer term: this one steps down"
            )
            self.role, self.host = SEEKING, None
            self.replicas.drop_all()
            self._on_demoted()
            return
        for other in others:
            if other.host and other.term < self.state.term:
                await self._announce_to(self.peers[other.index], other.term)

    async def _announce_to(self, peer: Peer, term: int) -> None:
        """`peer` hosts an older term without knowing this host (a node started again at
        its endpoint): tell it, so that it steps down and follows."""
        problem = await peer.announce(self.state.term, self.index, self.place.address)
        log = logger.debug if problem else logger.info
        log(
            "the rendezvous service at %s hosts term %d (its node started again?): told it this "
            "one hosts term %d%s",
            peer.member.written,
            term,
            self.state.term,
            f" ({problem})" if problem else "",
        )

    async def _as_standby(self) -> None:
        assert self.host is not None
        why = await follow(self.peers[self.host], self.state, self.index + 1)
        logger.info("the rendezvous host %s: %s", self.peers[self.host].member.written, why)
        self.role, self.host = SEEKING, None
        await asyncio.sleep(_FOLLOW_AGAIN)

    async def _seek(self) -> None:
        loop = asyncio.get_running_loop()
        grace_over = loop.time() - self._started >= START_GRACE
        others = await self._look()
        what, index = choose(self._me(), others, grace_over)
        if what == HOST and self.place.successor and self.state.term == 0:
            what = "wait"  # a successor with no copy of the state has nothing to serve
        if what == HOST:
            term = max([self.state.term, *(s.term for s in others)]) + 1
            self.state.take_over(term)
            self.role, self.host = HOST, self.index
            if term > 1:
                logger.warning("this node's rendezvous service hosts the job now (term %d)", term)
                self._on_hosting()
        elif what == "follow":
            self.role, self.host = STANDBY, index
        else:
            await self._nap(_SEEK_INTERVAL)


async def follow(peer: Peer, state: ServiceState, member: int) -> str:
    """Follow the host `peer` (as member `member`): take its state, then apply its changes,
    acknowledging each, until the stream ends; why it ended."""
    acks: asyncio.Queue[replica_pb2.Ack | None] = asyncio.Queue()

    async def requests() -> Any:
        yield replica_pb2.Ack(member=member)
        while (ack := await acks.get()) is not None:
            yield ack

    try:
        call = await peer.follow(requests())
    except (grpc.RpcError, ValueError, asyncio.TimeoutError) as e:
        return f"cannot follow it ({e or type(e).__name__})"
    try:
        return await _apply_updates(call, state, acks)
    except asyncio.TimeoutError:
        return f"it said nothing for {HOST_SILENT:g} s"
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNAUTHENTICATED:
            peer.metadata = []
        return f"{e.code().name}: {e.details()}"
    finally:
        call.cancel()
        acks.put_nowait(None)


async def _apply_updates(
    call: Any, state: ServiceState, acks: asyncio.Queue[replica_pb2.Ack | None]
) -> str:
    parts: list[replica_pb2.Snapshot] = []
    while True:
        update = await asyncio.wait_for(call.read(), HOST_SILENT)
        if update is grpc.aio.EOF:
            return "its stream ended"
        kind = update.WhichOneof("what")
        if kind == "snapshot":
            parts.append(update.snapshot)
            if update.snapshot.done:
                state.load(parts)
                parts = []
                acks.put_nowait(replica_pb2.Ack(seq=update.seq))
        elif kind == "change":
            state.apply(update.change)
            acks.put_nowait(replica_pb2.Ack(seq=update.seq))
