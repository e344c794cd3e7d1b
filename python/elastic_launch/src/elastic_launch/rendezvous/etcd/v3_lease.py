"""This node's lease on an etcd v3 store: what keeps its ephemeral keys alive.

It is asked for early (without waiting, while the agent starts), renewed on one long-lived
keep-alive stream (as etcd's own client does), replaced when it expired while the node was cut
off (the session is told: its ephemeral keys are gone), and revoked at close, so that the
others see this node leave at once.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from elastic_launch.api import Cancelled
from elastic_launch.cancel import join
from elastic_launch.rendezvous.etcd.v3_client import (
    RETRYABLE,
    STREAM_METADATA,
    AskAgainError,
    Client,
    Connection,
)
from elastic_launch.rendezvous.etcdpb import rpc_pb2
from elastic_launch.rendezvous.store.api import StoreError

logger = logging.getLogger(__name__)


class Lease:
    """The lease of one store connection (`client`). `id` is 0 until `start`."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.id = 0
        self.ttl = 0.0
        self.on_lost: Callable[[], None] = lambda: None
        self._lock = threading.Lock()  # the keeper and a write may both find it expired
        self._early: tuple[int, float, Any] | None = None  # (TTL, when, future) of `request`
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._keep_call: Any = None  # the keep-alive stream
        #: Until when (monotonic) the store holds the lease for sure: a renewal asked at t and
        #: answered with TTL holds it until t + TTL at least (the store counts from later).
        self.held_until = 0.0
        self.grants = 0  # leases granted so far: a new one holds nothing the old one held

    def start(self, ttl: float, on_lost: Callable[[], None] | None = None) -> None:
        """Grant the lease (or take the early one) and keep it alive from a thread."""
        self.ttl = ttl
        if on_lost is not None:
            self.on_lost = on_lost
        self._grant()
        self._keeper = threading.Thread(
            target=self._keep_alive, name="elasticrun-lease", daemon=True
        )
        self._keeper.start()

    @property
    def held(self) -> set[int]:
        """The ids of the leases this connection holds (the one in use, one asked for early)."""
        held = {self.id} if self.id else set()
        early = self._early
        if early is not None and early[2].done() and early[2].exception() is None:
            held.add(early[2].result().ID)
        return held

    def request(self, ttl: float) -> None:
        """Ask for a lease now without waiting for the answer; `start` then uses it."""
        if self._early is None and not self.id:
            c = self.client
            conn = c.current
            try:
                c.log_in(conn)
            except (grpc.RpcError, AskAgainError):
                return  # unreachable now: `start` asks, with retries and their notices
            c.count()
            grant = conn.lease.LeaseGrant.future(
                rpc_pb2.LeaseGrantRequest(TTL=round(ttl)),
                timeout=c.read_timeout,
                metadata=conn.metadata,
            )
            self._early = (round(ttl), time.monotonic(), grant)

    def _early_reply(self) -> Any:
        """The answer to `request`, if it asked for this TTL and got one; else None."""
        early, self._early = self._early, None
        if early is None:
            return None
        ttl, asked, future = early
        # Too old (the keeper would renew it too late) or another TTL: ask again.
        if ttl != round(self.ttl) or time.monotonic() - asked > ttl / 3.0:
            self._give_back(future)
            return None
        cancel = self.client.cancel
        unregister = cancel.on_cancel(future.cancel)
        try:
            return future.result()
        except grpc.FutureCancelledError:
            cancel.check()
            return None
        except grpc.RpcError:
            return None  # unreachable then: ask again, with retries and their notices
        finally:
            unregister()

    def _give_back(self, future: Any) -> None:
        """An early grant not used: revoke it if it came (else it expires on its own)."""
        if not future.done():
            future.cancel()
            return
        with contextlib.suppress(grpc.RpcError, grpc.FutureCancelledError):
            self._revoke(future.result().ID)

    def _revoke(self, lease: int) -> None:
        conn = self.client.current
        request = rpc_pb2.LeaseRevokeRequest(ID=lease)
        conn.lease.LeaseRevoke(request, timeout=2.0, metadata=conn.metadata)

    def _grant(self) -> None:
        c = self.client
        early = self._early
        reply = self._early_reply()
        if reply is not None and early is not None:
            asked = early[1]  # when the early grant was asked
        else:
            asked = time.monotonic()
            reply = c.call("lease.LeaseGrant", rpc_pb2.LeaseGrantRequest(TTL=round(self.ttl)))
        if reply.error:
            raise StoreError(f"{c.name} refused a lease: {reply.error}")
        self.id = reply.ID
        self.grants += 1
        self.held_until = asked + reply.TTL

    def restore(self) -> None:
        """The store was started again empty: grant this lease again, with its id and TTL."""
        if not self.id:
            return
        request = rpc_pb2.LeaseGrantRequest(ID=self.id, TTL=round(self.ttl))
        try:
            self.client.call("lease.LeaseGrant", request)
        except StoreError as e:
            if "lease already exists" not in str(e):
                raise
        logger.info("the rendezvous lease %x granted again by the new store", self.id)

    def ensure(self) -> None:
        """Grant a new lease if this one expired."""
        c = self.client
        if c.call("lease.LeaseTimeToLive", rpc_pb2.LeaseTimeToLiveRequest(ID=self.id)).TTL <= 0:
            self._grant()

    def replace(self, expired: int) -> None:
        """Grant a new lease in place of `expired` (once, whichever thread finds it gone
        first) and tell the session: the store has dropped our ephemeral keys."""
        with self._lock:
            if self.id != expired:
                return
            logger.warning("the rendezvous lease expired; this node will rejoin")
            self._grant()
        self.on_lost()

    def _keep_alive(self) -> None:
        """Renew the lease on one long-lived stream: a request every TTL/3, the answers read
        here. A stream that breaks, or whose answers stop coming, is replaced at once (on the
        store's next member, when it has several), so that a slow store or a busy process
        loses the lease only when a whole TTL passed without an answer, never after two slow
        ticks, and a renewal costs the store one message, not a new stream."""
        interval = max(self.ttl / 3.0, 0.2)
        delay = 0.05
        failed = 0  # streams in a row that got no answer
        while not self._stop.is_set():
            conn = self.client.current
            last = [time.monotonic()]  # the last answer (or the stream's start)
            call: list[Any] = []
            sent: collections.deque[float] = collections.deque()  # requests not answered yet
            answered = False
            try:
                requests = self._requests(conn, last, call, interval, sent)
                answered = self._stream(conn, requests, last, call, sent)
            except ValueError:  # "Channel closed": the store is closing, or left this member
                if self.client.closed.is_set():
                    return
            if call:
                call[0].cancel()
            delay, failed = (0.05, 0) if answered else (delay, failed + 1)
            if self.client.current is not conn and failed % len(self.client.connections):
                continue  # on the next member at once; a pause once all were tried
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, 0.5)  # again soon: the TTL has what is left, no more

    def _stale_after(self, interval: float) -> float:
        """Seconds without an answer after which a keep-alive stream is stuck. With one
        member, most of the TTL: a busy process reads answers late too, and a new stream would
        only cost it more. With several, two ticks: a member that hangs (stopped, cut off)
        is left with a third of the TTL to spare, and leaving a slow one costs little."""
        if len(self.client.connections) > 1:
            return 2 * interval
        return max(self.ttl * 0.8, 2 * interval)

    def _stream(
        self,
        conn: Connection,
        requests: Iterator[Any],
        last: list[float],
        call: list[Any],
        sent: collections.deque[float],
    ) -> bool:
        """One keep-alive stream on member `conn`, until it ends; whether it was answered
        (`sent`: when each request not answered yet was sent, oldest first)."""
        c = self.client
        answered = False
        epoch = c.epoch  # not enter(): renewals go on while a replaced store is filled again
        call_nonce = None  # once the stream was asked for (a failed login names no host)
        try:
            c.log_in(conn)
            call_nonce, metadata = c.asking(conn)
            stream = conn.lease.LeaseKeepAlive(requests, metadata=metadata + STREAM_METADATA)
            call.append(stream)
            self._keep_call = stream
            if self._stop.is_set():
                stream.cancel()
            for reply in stream:
                last[0] = time.monotonic()
                answered = True
                asked = sent.popleft() if sent else 0.0
                if not self._take(conn, reply, epoch):
                    return True  # another member, or the store filled again: a new stream
                if reply.TTL > 0 and reply.ID == self.id and asked:
                    self.held_until = max(self.held_until, asked + reply.TTL)
        except grpc.RpcError as e:
            if self._stop.is_set():
                return answered
            unauthenticated = e.code() == grpc.StatusCode.UNAUTHENTICATED
            if unauthenticated and c.logs_in and c.relog(conn):
                return answered
            if e.code() in RETRYABLE or unauthenticated:
                named = e if c.epoch == epoch and call_nonce is not None else None
                why = f"lease keep-alive: {e.code().name}: {e.details()}"
                c.fail_over(conn, why, named, call_nonce or "")
        except StoreError as e:  # a member of another cluster: said, and tried again later
            logger.warning("the rendezvous lease keep-alive: %s", e)
            return False
        except AskAgainError:  # the member was left for another: go on there at once
            return True
        return answered

    def _take(self, conn: Connection, reply: Any, epoch: int) -> bool:
        """One keep-alive answer: False when this stream is to end for a new one (its member
        was left, or the store was started again and filled, this lease back in it); a lease
        the store no longer has is replaced."""
        c = self.client
        if c.epoch != epoch or not c.check_cluster(conn, reply) or c.epoch != epoch:
            return False  # an answer of the store before it was replaced is not judged
        c.answered(conn)
        if reply.TTL <= 0 and not self._stop.is_set():
            if c.identity.refilling or not c.same_store():
                return False  # it was started again empty: the lease is (soon) back
            with contextlib.suppress(StoreError, Cancelled):
                self.replace(reply.ID)
        return True

    def _requests(
        self,
        conn: Connection,
        last: list[float],
        call: list[Any],
        interval: float,
        sent: collections.deque[float],
    ) -> Iterator[rpc_pb2.LeaseKeepAliveRequest]:
        """The keep-alive stream's requests, in gRPC's own thread for the stream: one per
        tick; when its answers stop coming (`last`: the last one), the member is left and
        the stream ends."""
        stale = self._stale_after(interval)
        due = time.monotonic()
        while True:
            if time.monotonic() >= due:
                self.client.count()
                sent.append(time.monotonic())
                yield rpc_pb2.LeaseKeepAliveRequest(ID=self.id)
                due = time.monotonic() + interval
            wake = min(due, last[0] + stale) - time.monotonic()
            if self._stop.wait(max(wake, 0.01)):
                return
            if time.monotonic() - last[0] > stale and call:
                why = f"its lease keep-alive went unanswered for {stale:.1f} s"
                if not self.client.fail_over(conn, why):
                    call[0].cancel()
                return

    def close(self) -> None:
        """Revoke the lease (the ephemeral keys go at once) and stop renewing it."""
        self._stop.set()
        early, self._early = self._early, None
        if early is not None:
            self._give_back(early[2])
        if self.id:
            with contextlib.suppress(grpc.RpcError):
                self._revoke(self.id)
        if self._keep_call is not None:
            self._keep_call.cancel()
        if self._keeper is not None:
            join(self._keeper, (self.client.read_timeout or 0) + 1, "the lease keep-alive thread")
