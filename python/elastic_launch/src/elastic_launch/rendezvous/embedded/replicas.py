"""The host's side of its standbys: each follows on one Follow stream, takes the whole state,
then every change as it is made, and acknowledges each. The host answers no client and tells
no watcher of a change before every standby in sync has acknowledged it: whatever a client
saw, a standby that takes over has too. A standby that falls behind (its acknowledgement late
by :data:`ACK_TIMEOUT`, or its queue past :data:`QUEUE_BYTES`) is dropped; it follows again
from a new copy of the state, and the host goes on without waiting for it meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import grpc

from elastic_launch.rendezvous.embedded.state import ServiceState
from elastic_launch.rendezvous.etcdpb import replica_pb2

logger = logging.getLogger(__name__)

ACK_TIMEOUT = 1.0  # seconds a standby in sync has to acknowledge a change
#: Successors (standbys past the listed endpoints, chosen by the agents) a host keeps at once.
MAX_SUCCESSORS = 2
HEARTBEAT = 0.5  # seconds between the host's word on a quiet stream: a standby hears it lives
QUEUE_BYTES = 16 << 20  # a standby's changes not yet sent, at most


@dataclass(eq=False)
class _Standby:
    member: int
    synced_at: int  # the change its copy of the state stands at: in sync once acknowledged
    queue: asyncio.Queue[replica_pb2.Update | None] = field(default_factory=asyncio.Queue)
    queued: int = 0  # bytes
    acked: int = -1

    @property
    def in_sync(self) -> bool:
        return self.acked >= self.synced_at


class Replicas:
    """The host's standbys (touched only from the service's event loop)."""

    def __init__(self, state: ServiceState, members: int) -> None:
        self.state = state
        self.members = members  # how many services the job has (this one included)
        self.seq = 0  # the last change sent
        self.standbys: dict[int, _Standby] = {}
        # Deliveries to the watchers, each once the standbys in sync have its change.
        self._waiting: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()
        self._progress = asyncio.Event()
        state.send = self.send

    def send(self, change: replica_pb2.Change, deliver: Callable[[], None]) -> None:
        """Send `change` to every standby; `deliver` its events to the watchers once those in
        sync have it (at once when none is)."""
        if not self.standbys:
            deliver()
            return
        self.seq += 1
        update = replica_pb2.Update(seq=self.seq, change=change)
        size = update.ByteSize()
        for standby in list(self.standbys.values()):
            if standby.queued + size > QUEUE_BYTES:
                self.drop(standby, f"it is more than {QUEUE_BYTES} bytes behind")
                continue
            standby.queued += size
            standby.queue.put_nowait(update)
        self._waiting.append((self.seq, deliver))
        self._release()
        seq = self.seq
        asyncio.get_running_loop().call_later(ACK_TIMEOUT, self._late, seq)

    def _late(self, seq: int) -> None:
        """`seq`'s time is up: a standby in sync that has not acknowledged it is dropped."""
        for standby in list(self.standbys.values()):
            if standby.in_sync and standby.acked < seq:
                self.drop(standby, f"it did not acknowledge a change within {ACK_TIMEOUT:g} s")

    def _low(self) -> int | None:
        """The last change every standby in sync has (None: no standby is in sync)."""
        acked = [s.acked for s in self.standbys.values() if s.in_sync]
        return min(acked) if acked else None

    def _release(self) -> None:
        low = self._low()
        while self._waiting and (low is None or self._waiting[0][0] <= low):
            self._waiting.popleft()[1]()

    async def durable(self) -> None:
        """Return once every standby in sync has every change sent so far (one that does not
        acknowledge a change within :data:`ACK_TIMEOUT` is dropped meanwhile)."""
        target = self.seq
        while True:
            low = self._low()
            if low is None or low >= target:
                return
            self._progress.clear()
            await self._progress.wait()

    def drop(self, standby: _Standby, why: str, quiet: bool = False) -> None:
        if self.standbys.get(standby.member) is standby:
            log = logger.info if quiet else logger.warning
            log("the standby rendezvous service %d is dropped: %s", standby.member, why)
            del self.standbys[standby.member]
            standby.queue.put_nowait(None)
            self._release()
            self._progress.set()

    def drop_all(self) -> None:
        for standby in list(self.standbys.values()):
            self.drop(standby, "this service no longer hosts", quiet=True)

    def _acked(self, standby: _Standby, seq: int) -> None:
        standby.acked = max(standby.acked, seq)
        self._release()
        self._progress.set()

    async def follow(
        self, requests: AsyncIterator[replica_pb2.Ack], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[replica_pb2.Update]:
        """A standby's Follow stream: the state, then every change, a heartbeat when quiet."""
        first = await _first(requests)
        member = first.member if first is not None else 0
        problem = self._refuse(member)
        if problem:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, problem)
        old = self.standbys.get(member)
        if old is not None:
            self.drop(old, "it follows again", quiet=True)
        standby = _Standby(member, self.seq)
        self.standbys[member] = standby
        parts = list(self.state.snapshot())  # whole, between two awaits: consistent
        reader = asyncio.ensure_future(self._read_acks(standby, requests))
        try:
            for part in parts:
                yield replica_pb2.Update(seq=standby.synced_at, snapshot=part)
            async for update in self._updates(standby, context):
                yield update
        except asyncio.CancelledError:
            return  # the standby left, or the service stops
        finally:
            reader.cancel()
            if self.standbys.get(member) is standby:
                del self.standbys[member]
                self._release()
                self._progress.set()

    def _refuse(self, member: int) -> str:
        """Why a standby that names itself `member` may not follow ("" if it may)."""
        if member < 1 or member == self.state.member_id:
            return (
                f"a standby names itself by its place in --rdzv-endpoint (from 1, not this "
                f"host's {self.state.member_id}), or past it: {member} is not that"
            )
        successors = [m for m in self.standbys if m > self.members and m != member]
        if member > self.members and len(successors) >= MAX_SUCCESSORS:
            return f"this host keeps {MAX_SUCCESSORS} successors already"
        return ""

    async def _updates(
        self, standby: _Standby, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[replica_pb2.Update]:
        """A standby's changes as they come, and a heartbeat whenever none came for a while."""
        while True:
            try:
                update = await asyncio.wait_for(standby.queue.get(), HEARTBEAT)
            except asyncio.TimeoutError:
                yield replica_pb2.Update(seq=self.seq, heartbeat=True)
                continue
            if update is None:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "dropped: follow again")
                return
            standby.queued -= update.ByteSize()
            yield update

    async def _read_acks(self, standby: _Standby, requests: AsyncIterator[replica_pb2.Ack]) -> None:
        try:
            async for ack in requests:
                self._acked(standby, ack.seq)
        except (grpc.RpcError, asyncio.CancelledError):
            pass
        finally:
            self.drop(standby, "its stream ended", quiet=True)


async def _first(requests: AsyncIterator[replica_pb2.Ack]) -> replica_pb2.Ack | None:
    try:
        return await requests.__anext__()
    except (StopAsyncIteration, grpc.RpcError):
        return None
