"""Which of a job's embedded services hosts the rendezvous. With several endpoints in
``--rdzv-endpoint``, every node that can serve one runs a service there; one hosts, the others
are standbys that follow it (:mod:`.embedded_replicas`) and refuse clients, who move on to the
host (as from any failed member).

- The first service up hosts (a service other than the first listed gives the ones before it
  :data:`START_GRACE` to come up first). A service that finds a host follows it.
- When the host is lost (its stream to a standby ends, or says nothing for
  :data:`HOST_SILENT`), the standby with the newest state (its term, then its revision) takes
  over, the one listed first among equals, in a new term: its state is the host's, so clients
  go on with the same leases, revisions and watches.
- Two hosts that find each other (after a partition healed) keep the one of the newest term;
  the other steps down and follows it, and its clients move on.

Without a quorum, a partition that separates a host from its standby while both reach some
nodes can let both serve until it heals; etcd, with its quorum, has no such window
(docs/rendezvous.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from elastic_launch.rendezvous.embedded_peers import Peer
from elastic_launch.rendezvous.embedded_replicas import Replicas
from elastic_launch.rendezvous.embedded_state import ServiceState
from elastic_launch.rendezvous.etcdpb import replica_pb2

logger = logging.getLogger(__name__)

HOST, STANDBY, SEEKING = "host", "standby", "seeking"
PROBE_INTERVAL = 0.5  # seconds between a host's looks for another host
HOST_SILENT = 2.0  # seconds a standby hears nothing from its host before it looks again
START_GRACE = 1.0  # seconds a new service waits for those listed before it to come up
_SEEK_INTERVAL = 0.1
_FOLLOW_AGAIN = 0.05  # after a stream that ended: a host that drops a standby is not hammered


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
    right from a task on the service's event loop."""

    def __init__(
        self,
        state: ServiceState,
        replicas: Replicas,
        peers: dict[int, Peer],
        index: int,
        on_demoted: Callable[[], None],
    ) -> None:
        self.state = state
        self.replicas = replicas
        self.peers = peers
        self.index = index
        self.role = SEEKING if peers else HOST
        self.host: int | None = None if peers else index  # the index of the host, if known
        self._on_demoted = on_demoted
        self._started = asyncio.get_running_loop().time()
        self.task: asyncio.Task[None] | None = None  # what runs `run`, if anything
        if not peers:
            state.take_over(1)

    @property
    def serving(self) -> bool:
        return self.role == HOST

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

    async def _look(self) -> list[Seen]:
        indexes = list(self.peers)
        answers = await asyncio.gather(*(self.peers[i].status() for i in indexes))
        return [seen(i, a) for i, a in zip(indexes, answers) if a is not None]

    def _me(self) -> Seen:
        return Seen(self.index, self.role == HOST, self.state.term, self.state.revision)

    async def _as_host(self) -> None:
        await asyncio.sleep(PROBE_INTERVAL)
        what, _ = choose(self._me(), await self._look(), True)
        if what != HOST:
            logger.warning(
                "another node's rendezvous service hosts in a newer term: this one steps down"
            )
            self.role, self.host = SEEKING, None
            self.replicas.drop_all()
            self._on_demoted()

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
        if what == HOST:
            term = max([self.state.term, *(s.term for s in others)]) + 1
            self.state.take_over(term)
            self.role, self.host = HOST, self.index
            if term > 1:
                logger.warning("this node's rendezvous service hosts the job now (term %d)", term)
        elif what == "follow":
            self.role, self.host = STANDBY, index
        else:
            await asyncio.sleep(_SEEK_INTERVAL)


async def follow(peer: Peer, state: ServiceState, member: int) -> str:
    """Follow the host `peer` (as member `member`): take its state, then apply its changes,
    acknowledging each, until the stream ends; why it ended."""
    acks: asyncio.Queue[replica_pb2.Ack | None] = asyncio.Queue()

    async def requests() -> Any:
        yield replica_pb2.Ack(member=member)
        while (ack := await acks.get()) is not None:
            yield ack

    try:
        if not peer.metadata:
            await peer.log_in()
        call = peer.replica.Follow(requests(), metadata=peer.metadata)
    except (grpc.RpcError, ValueError) as e:
        return f"cannot follow it ({e})"
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
