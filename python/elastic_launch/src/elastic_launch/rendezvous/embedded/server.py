"""The embedded rendezvous service: a small in-memory store (:mod:`.state`) hosted by
one agent, speaking the same etcd v3 gRPC subset as etcd itself (KV, Lease, Watch), so that one
client and one rendezvous algorithm serve both. Revisions, leases with TTLs, and watches from a
past revision (a bounded history) behave as etcd's do. When the job has a token, a client logs
in with the challenge of :mod:`.challenge` (the token never crosses the wire) and every request
carries the credential it earned; with ``tls``, the service speaks TLS.

With several endpoints, every node that serves one runs this service there: one hosts, the
others are standbys that follow it and take over when it is lost (:mod:`.roles`).
A standby answers only Authenticate and Status, and refuses the rest as unavailable, so that a
client moves on to the host as it would from any failed member.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import itertools
import logging
import os
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Sequence
from typing import Any

import grpc

from elastic_launch.cancel import NEVER, CancelToken, join
from elastic_launch.net import host_port, port_listened
from elastic_launch.rendezvous.embedded import bounds
from elastic_launch.rendezvous.embedded.bounds import Outbox
from elastic_launch.rendezvous.embedded.peering import (
    Guard,
    Peering,
    RefusedError,
    refuse,
    requests_of,
    standby_refusal,
)
from elastic_launch.rendezvous.embedded.peers import Peer
from elastic_launch.rendezvous.embedded.reached import ReachedAt
from elastic_launch.rendezvous.embedded.replicas import Replicas
from elastic_launch.rendezvous.embedded.roles import Place, Roles
from elastic_launch.rendezvous.embedded.state import ServedWatch, ServiceState, size_of
from elastic_launch.rendezvous.etcdpb import kv_pb2, replica_pb2_grpc, rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.store import challenge
from elastic_launch.rendezvous.store.endpoints import StoreMember
from elastic_launch.rendezvous.store.wire import MAX_TTL

logger = logging.getLogger(__name__)

_END_TIMEOUT = 1.0  # seconds the service's tasks get to end once cancelled, at a stop

_START_TIMEOUT = 30.0  # seconds for the server to bind and start


def _answering(method: Any) -> Any:
    """A unary handler of the host (a standby refuses it), whose refusals
    (:class:`RefusedError`) become the call's status, whose answer counts against the bytes
    of answers being sent until the call ends, and which answers once the standbys have
    everything it reflects."""

    @functools.wraps(method)
    async def handler(self: _Service, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            self._check(context)
            self._hosting()
            # The method runs to its end without yielding the loop: these are its call's.
            self._answer_bytes, self._client = 0, context.peer() or ""
            try:
                reply = method(self, request)
            finally:
                taken, self._answer_bytes = self._answer_bytes, 0
                if taken:
                    client = self._client
                    context.add_done_callback(lambda _: self.s.read_bytes.give(client, taken))
            await self._durable()
            return reply
        except RefusedError as e:
            await refuse(context, e, self.guard)

    return handler


class _Service(
    rpc_pb2_grpc.AuthServicer,
    rpc_pb2_grpc.KVServicer,
    rpc_pb2_grpc.LeaseServicer,
    rpc_pb2_grpc.WatchServicer,
):
    """The handlers. They run on the service's event loop, one at a time: a unary request is
    answered whole between two awaits, so the store needs no lock, and a thousand nodes' streams
    cost a coroutine each, not a thread each."""

    def __init__(self, state: ServiceState, guard: Guard, members: int) -> None:
        self.s = state
        self.guard = guard
        self.replicas = Replicas(state, members)
        self.roles: Roles | None = None  # made on the loop (see EmbeddedServer._start)
        self.streams: set[Outbox] = set()  # the watch streams open, told when it steps down
        self._watch_ids = iter(range(1, 1 << 62))
        self._answer_bytes = 0  # of the unary call being answered
        self._client = ""  # the connection that made it

    def _hosting(self) -> None:
        """Refuse the request unless this service hosts (a standby's client moves on, to the
        host its refusal names)."""
        refusal = standby_refusal(self.roles, self.s)
        if refusal is not None:
            raise refusal

    async def _durable(self) -> None:
        """Wait until the standbys have what an answer reflects; refuse it if this service
        stepped down meanwhile."""
        if self.replicas.standbys:
            await self.replicas.durable()
            self._hosting()

    def demoted(self) -> None:
        """This service stepped down: its streams end, so that their clients move on."""
        for out in self.streams:
            out.put(("standby", None))

    def _check(self, context: grpc.aio.ServicerContext) -> None:
        self.guard.check(context)

    def _charge_answer(self, size: int) -> None:
        """Count `size` bytes of the answer being built until its call ends (see `_answering`);
        refused (it may be tried again) while other answers hold the room, or naming the limit
        if it could never fit. Checked before the answer is built."""
        if size > bounds.READ_BYTES:
            raise RefusedError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this answer would be {size} bytes, more than the {bounds.READ_BYTES} the "
                "embedded rendezvous service sends at once: read fewer keys at a time (a "
                "limit, or a narrower range)",
            )
        full = self.s.read_bytes.room(self._client, size)
        if full is not None:
            raise RefusedError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"the embedded rendezvous service is sending answers: {full}; try again",
            )
        self.s.read_bytes.take(self._client, size)
        self._answer_bytes += size

    async def Authenticate(  # noqa: N802 - gRPC's name
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """The challenge's first step (:mod:`.challenge`): prove this service holds the token,
        to a client that reached it where it is."""
        roles = self.roles
        role = challenge.HOST if roles is None or roles.serving else challenge.STANDBY
        try:
            reply = await self.guard.log_in(request.name, request.password, role)
        except RefusedError as e:
            await refuse(context, e, self.guard)
        return rpc_pb2.AuthenticateResponse(header=self.s.header(), token=reply)

    async def _admit(self, context: grpc.aio.ServicerContext) -> str:
        """A stream starts only with the job's token, and within its connection's share of
        streams (:data:`bounds.STREAMS_PER_CLIENT`) and the service's. The connection."""
        client = context.peer() or ""
        try:
            self._check(context)
            self._hosting()
            full = self.s.streams.room(client)
            if full is not None:
                raise RefusedError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the embedded rendezvous service opens no more streams: {full}",
                )
        except RefusedError as e:
            await refuse(context, e, self.guard)
        self.s.streams.take(client)
        context.add_done_callback(lambda _: self.s.streams.give(client))
        return client

    # ---- KV ----------------------------------------------------------------------------------

    def _range(self, r: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse:
        keys = self.s.select(r.key, r.range_end)
        kvs = [self.s.data[k] for k in keys[: r.limit or None]]
        self._charge_answer(sum(len(kv.key) + len(kv.value) + bounds.EVENT_OVERHEAD for kv in kvs))
        return rpc_pb2.RangeResponse(header=self.s.header(), kvs=kvs, count=len(keys))

    @_answering
    def Range(self, request: Any) -> Any:  # noqa: N802 - gRPC's name
        if request.revision and request.revision != self.s.revision:
            # It keeps no old versions: say so rather than answer with today's keys.
            raise RefusedError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"the embedded rendezvous service reads only the current revision "
                f"({self.s.revision}), not {request.revision}",
            )
        return self._range(request)

    def _put(self, r: rpc_pb2.PutRequest) -> rpc_pb2.PutResponse:
        self.s.put(r.key, r.value, r.lease, self._client)
        return rpc_pb2.PutResponse(header=self.s.header())

    def _check_put(self, r: rpc_pb2.PutRequest) -> None:
        """Before any change (a refused request leaves no revision): the lease exists and
        the store has room (a Txn's puts are checked one by one: within one request's size)."""
        try:
            self.s.check_lease(r.lease)
        except KeyError as e:
            raise RefusedError(grpc.StatusCode.NOT_FOUND, str(e.args[0])) from None
        full = self.s.room_for(r.key, r.value, self._client)
        if full is not None:
            raise RefusedError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"etcdserver: mvcc: database space exceeded (the embedded service: {full})",
            )

    @_answering
    def Put(self, request: Any) -> Any:  # noqa: N802
        self._check_put(request)
        self.s.revision += 1
        reply = self._put(request)
        self.s.commit()
        return reply

    def _delete(self, r: rpc_pb2.DeleteRangeRequest) -> rpc_pb2.DeleteRangeResponse:
        keys = list(self.s.select(r.key, r.range_end))
        for k in keys:
            self.s.delete(k)
        return rpc_pb2.DeleteRangeResponse(header=self.s.header(), deleted=len(keys))

    @_answering
    def DeleteRange(self, request: Any) -> Any:  # noqa: N802
        if self.s.select(request.key, request.range_end):
            self.s.revision += 1
        reply = self._delete(request)
        self.s.commit()
        return reply

    @_answering
    def Txn(self, request: Any) -> Any:  # noqa: N802
        ok = all(self.s.compare(c) for c in request.compare)
        ops = request.success if ok else request.failure
        for op in ops:
            if op.WhichOneof("request") == "request_put":
                self._check_put(op.request_put)
        if any(op.WhichOneof("request") != "request_range" for op in ops):
            self.s.revision += 1
        responses = []
        for op in ops:
            kind = op.WhichOneof("request")
            if kind == "request_range":
                responses.append(rpc_pb2.ResponseOp(response_range=self._range(op.request_range)))
            elif kind == "request_put":
                responses.append(rpc_pb2.ResponseOp(response_put=self._put(op.request_put)))
            else:
                responses.append(
                    rpc_pb2.ResponseOp(response_delete_range=self._delete(op.request_delete_range))
                )
        self.s.commit()
        return rpc_pb2.TxnResponse(header=self.s.header(), succeeded=ok, responses=responses)

    # ---- leases --------------------------------------------------------------------------

    async def LeaseGrant(  # noqa: N802
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        try:
            self._check(context)
            self._hosting()
            reply = self._grant(request, context.peer() or "")
            await self._durable()
            return reply
        except RefusedError as e:
            await refuse(context, e, self.guard)

    def _grant(self, request: Any, client: str) -> Any:
        ttl = min(max(int(request.TTL), 1), MAX_TTL)
        if request.ID in self.s.leases:  # as etcd: granting it again would make it immortal
            raise RefusedError(
                grpc.StatusCode.FAILED_PRECONDITION, "etcdserver: lease already exists"
            )
        if request.ID < 0:
            raise RefusedError(grpc.StatusCode.INVALID_ARGUMENT, "lease ID must not be negative")
        full = self.s.holders.room(client)
        if full is not None:
            raise RefusedError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"etcdserver: too many leases (the embedded service: {full}); revoke the "
                "leases you no longer use",
            )
        lease_id = request.ID or int.from_bytes(os.urandom(7), "big") or 1
        while lease_id in self.s.leases:  # a random ID another client asked for by number
            lease_id = int.from_bytes(os.urandom(7), "big") or 1
        self.s.grant(lease_id, ttl, client)
        return rpc_pb2.LeaseGrantResponse(header=self.s.header(), ID=lease_id, TTL=ttl)

    @_answering
    def LeaseRevoke(self, request: Any) -> Any:  # noqa: N802
        if request.ID not in self.s.leases:
            raise RefusedError(grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")
        self.s.revoke(request.ID)
        return rpc_pb2.LeaseRevokeResponse(header=self.s.header())

    async def LeaseKeepAlive(  # noqa: N802
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        await self._admit(context)
        async for request in requests_of(context):
            try:
                self._hosting()
            except RefusedError as e:
                await refuse(context, e, self.guard)
            lease_id = request.ID
            del request  # not held while the next is awaited
            ttl = self.s.renew(lease_id)
            yield rpc_pb2.LeaseKeepAliveResponse(header=self.s.header(), ID=lease_id, TTL=ttl)

    @_answering
    def LeaseTimeToLive(self, request: Any) -> Any:  # noqa: N802
        lease = self.s.leases.get(request.ID)
        if lease is None:
            return rpc_pb2.LeaseTimeToLiveResponse(header=self.s.header(), ID=request.ID, TTL=-1)
        left = max(0, int(lease.expires - time.monotonic()))
        return rpc_pb2.LeaseTimeToLiveResponse(
            header=self.s.header(), ID=request.ID, TTL=left, grantedTTL=lease.ttl
        )

    # ---- watch ---------------------------------------------------------------------------

    async def Watch(  # noqa: N802
        self, request_iterator: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        client = await self._admit(context)
        out = Outbox(self.s.watch_bytes, self.s.watched, client)
        self.streams.add(out)

        def ended(_: Any) -> None:
            out.drop()
            self.streams.discard(out)

        context.add_done_callback(ended)
        mine: dict[int, ServedWatch] = {}
        reader = asyncio.ensure_future(_read_watch_requests(requests_of(context), out))
        # When the call ends, however it ends: a generator cancelled while it waits at a yield
        # runs its finally only when it is collected.
        context.add_done_callback(lambda _: self.s.remove_watchers(list(mine.values())))
        try:
            while True:
                kind, arg = await out.get()
                if kind in ("create", "refuse", "cancel"):
                    out.unhandled.release()  # the reader may read the next
                if kind == "end":
                    return
                if kind == "create":
                    await self._durable_or_end(context)
                if kind == "standby":
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "this service stepped down")
                if kind == "overflow":
                    self.s.remove_watchers(list(mine.values()))
                    mine.clear()
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"this watch stream fell more than {bounds.STREAM_BYTES} bytes behind "
                        "(or the service's watches hold all they may) and was cut off; watch "
                        "again from the revision you last saw",
                    )
                for response, size in self._watch_step(kind, arg, out, mine):
                    yield response  # returns once the network has taken it
                    out.sent(size)
        finally:
            reader.cancel()

    def _watch_step(
        self, kind: Any, arg: Any, out: Outbox, mine: dict[int, ServedWatch]
    ) -> Iterable[tuple[Any, int]]:
        """The responses to one item of a watch stream's queue, each with the bytes it holds
        of the stream's account: a watcher's events of one revision, a cancel, or a create
        (its past replayed at once)."""
        header = self.s.header()
        if isinstance(kind, int):
            events, size = arg
            if kind not in mine:
                out.sent(size)
                return []
            return [(rpc_pb2.WatchResponse(header=header, watch_id=kind, events=events), size)]
        if kind == "cancel":
            gone = mine.pop(arg, None)
            if gone is not None:
                self.s.remove_watchers([gone])
                out.unwatch(gone.cost)
            return [(rpc_pb2.WatchResponse(header=header, watch_id=arg, canceled=True), 0)]
        if kind == "refuse":  # its range did not fit the connection's share
            reply = rpc_pb2.WatchResponse(
                header=header,
                watch_id=next(self._watch_ids),
                created=True,
                canceled=True,
                cancel_reason=f"the embedded rendezvous service watches no more ranges: {arg}",
            )
            return [(reply, 0)]
        create, cost = arg
        return self._create(create, cost, header, out, mine)

    def _create(
        self, create: Any, cost: int, header: Any, out: Outbox, mine: dict[int, ServedWatch]
    ) -> Iterable[tuple[Any, int]]:
        """A watch whose range holds `cost` bytes of the stream's share already."""
        w = ServedWatch(create.key, create.range_end, out, next(self._watch_ids), cost)

        def refused(**why: Any) -> list[tuple[Any, int]]:
            out.unwatch(cost)
            reply = rpc_pb2.WatchResponse(
                header=header, watch_id=w.watch_id, created=True, canceled=True, **why
            )
            return [(reply, 0)]

        if len(mine) >= bounds.WATCHERS_PER_STREAM:
            return refused(
                cancel_reason=f"at most {bounds.WATCHERS_PER_STREAM} watches on one stream"
            )
        start = create.start_revision
        if start and (start <= self.s.compacted or self.s.unknown_past(start)):
            # The events from `start` on are gone (or another host's): the client reads again.
            return refused(compact_revision=max(self.s.compacted, self.s.fork) + 1)
        past = self.s.since(start, w) if start else []
        self.s.add_watcher(w)  # what comes after `past` arrives through `out`
        mine[w.watch_id] = w
        return itertools.chain(
            [(rpc_pb2.WatchResponse(header=header, watch_id=w.watch_id, created=True), 0)],
            self._replay(past, w.watch_id, header, out),
        )

    @staticmethod
    def _replay(
        past: list[tuple[int, kv_pb2.Event]], watch_id: int, header: Any, out: Outbox
    ) -> Iterator[tuple[Any, int]]:
        """A watch's past, one revision's answer at a time, each counted on the stream's
        account before it is built: a past of any length flows to a client that reads, and
        a stream that does not read is cut off at its share."""
        for _, group in itertools.groupby(past, key=lambda p: p[0]):
            events = [ev for _, ev in group]
            size = sum(size_of(ev) for ev in events)
            if not out.charge(size):
                return  # cut off: the loop finds the overflow next
            yield rpc_pb2.WatchResponse(header=header, watch_id=watch_id, events=events), size

    async def _durable_or_end(self, context: grpc.aio.ServicerContext) -> None:
        """Before a watch replays its past: the standbys have all of it (or the stream ends,
        if this service stepped down meanwhile)."""
        try:
            await self._durable()
        except RefusedError as e:
            await refuse(context, e, self.guard)


class EmbeddedServer:
    """The service, listening on host:port (raises OSError if the port is taken). It runs on
    an event loop in a thread of its own: every stream is a coroutine, so a node costs the
    hosting process no thread, and the store is touched only from that thread."""

    def __init__(
        self,
        host: str,
        port: int,
        token: str | None,
        tls: tuple[str | None, str | None, str | None] | None = None,
        members: Sequence[StoreMember] = (),
        index: int = 0,
    ) -> None:
        """`tls`: (CA certificate, certificate, key) paths; with a CA, clients must present a
        certificate it signed. `members`: every service of the job (the endpoints), this one
        the `index`-th; with none, this service hosts alone."""
        self.state = ServiceState()
        self.state.member_id = index + 1
        self._tls = tls
        self._token = token
        self._members, self._index = list(members), index
        self._kept: frozenset[int] = frozenset()  # the state's, as its loop last told
        self._kept_changed = threading.Condition()
        self.state.on_kept = self._told
        self._guard = Guard(token)
        self._service = _Service(self.state, self._guard, max(len(self._members), 1))
        self._peering = Peering(self.state, self._guard, self._service.replicas)
        self.on_hosting: Callable[[], None] = lambda: None
        self._host = host
        self._address = host_port(host, port)
        # Found here, not by gRPC: its failed bind logs an error line (add_port.cc) in every
        # agent that does not host, the normal case for all but one.
        if port and port_listened(host, port):
            raise OSError(f"cannot listen on {self._address}: another process listens there")
        self._loop = asyncio.new_event_loop()
        self._server: grpc.aio.Server | None = None
        self._trimming: asyncio.Task[None] | None = None  # kept: the loop holds tasks weakly
        started: concurrent.futures.Future[int] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._serve, args=(started,), name="elasticrun-rdzv-service", daemon=True
        )
        self._thread.start()
        try:
            self.port = started.result(timeout=_START_TIMEOUT)
        except concurrent.futures.TimeoutError:
            self.close(grace=0)
            raise OSError(
                f"cannot listen on {self._address}: the service did not start in "
                f"{_START_TIMEOUT:g} s"
            ) from None
        except OSError:
            self._thread.join(timeout=5)
            raise

    def _serve(self, started: concurrent.futures.Future[int]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._loop.run_until_complete(self._start(started))
        except BaseException as e:  # the constructor raises it
            if not started.done():
                started.set_exception(e if isinstance(e, OSError) else OSError(str(e)))
            self._loop.close()
            return
        self._loop.create_task(self._expire())
        try:
            self._loop.run_forever()
        finally:
            # Whatever is left (the lease expirer, streams a slow stop left behind) is
            # cancelled and given a moment to end before the loop closes: a stop is never
            # held up by a task that will not end.
            left = asyncio.all_tasks(self._loop)
            for task in left:
                task.cancel()
            with contextlib.suppress(BaseException):
                if left:
                    self._loop.run_until_complete(asyncio.wait(left, timeout=_END_TIMEOUT))
                self._loop.run_until_complete(
                    asyncio.wait_for(self._loop.shutdown_asyncgens(), _END_TIMEOUT)
                )
            self._loop.close()

    async def _start(self, started: concurrent.futures.Future[int]) -> None:
        server = grpc.aio.server(
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", bounds.MAX_REQUEST),
                ("grpc.server_handshake_timeout_ms", bounds.HANDSHAKE_MS),
                # A request waiting for its turn (bounds.Turns) holds at most this window:
                # without them, gRPC grows each stream's window and takes it whole.
                ("grpc.http2.bdp_probe", 0),
                ("grpc.http2.lookahead_bytes", 64 << 10),
                ("grpc.max_concurrent_streams", bounds.CALLS_PER_CONNECTION),
            ]
        )
        in_turns = _InTurns(server, self._service)
        for add in (
            rpc_pb2_grpc.add_KVServicer_to_server,
            rpc_pb2_grpc.add_LeaseServicer_to_server,
            rpc_pb2_grpc.add_WatchServicer_to_server,
            rpc_pb2_grpc.add_AuthServicer_to_server,
        ):
            add(self._service, in_turns)
        rpc_pb2_grpc.add_MaintenanceServicer_to_server(self._peering, in_turns)
        replica_pb2_grpc.add_ReplicaServicer_to_server(self._peering, in_turns)
        try:
            if self._tls is None:
                port = server.add_insecure_port(self._address)
            else:
                port = server.add_secure_port(self._address, _server_credentials(*self._tls))
        except RuntimeError as e:
            raise OSError(f"cannot listen on {self._address}: {e}") from None
        if port == 0:
            raise OSError(f"cannot listen on {self._address} (in use?)")
        await server.start()
        self._server = server
        self._trimming = asyncio.get_running_loop().create_task(in_turns.trimmer.run())
        own = [host_port(self._host, port)]
        if self._index < len(self._members):
            listed = self._members[self._index]
            own += [listed.target, listed.written]
        self._guard.reached = ReachedAt(own, port, self._host)
        self._roles(port)
        started.set_result(port)

    def _roles(self, port: int) -> None:
        """Who hosts: this service's role among the job's, kept by a task on the loop."""

        def peer(i: int, member: StoreMember) -> Peer:
            return Peer(member, i, self._token, self._tls)

        peers = {i: peer(i, m) for i, m in enumerate(self._members) if i != self._index}
        place = Place(
            self._index,
            len(self._members),
            host_port(self._host, port),
            token=self._token is not None,
        )
        roles = Roles(
            self.state,
            self._service.replicas,
            peers,
            place,
            peer,
            self._service.demoted,
            self._took_over,
        )
        self._service.roles = self._peering.roles = roles
        # Always: a service alone may still hear of a newer host (it was started again at
        # its address while the one the agents chose hosts).
        roles.task = asyncio.get_running_loop().create_task(_keep_running(roles.run, "its role"))

    @property
    def host(self) -> str:
        """The address it listens on (with :attr:`port`)."""
        return self._host

    def _took_over(self) -> None:
        self.on_hosting()  # looked up now: set after the service started

    @property
    def hosting(self) -> bool:
        """Whether this service hosts the job now (with several, one does; the others are
        standbys)."""
        roles = self._service.roles
        return roles is not None and roles.serving

    def _told(self, ids: frozenset[int]) -> None:
        with self._kept_changed:
            self._kept = ids
            self._kept_changed.notify_all()

    def wait_for_clients(self, own: set[int], timeout: float, cancel: CancelToken = NEVER) -> bool:
        """Wait (up to `timeout`, or until `cancel`) until no lease but `own` is kept alive:
        every other client has left (revoked its lease) or is gone (its lease expired). True
        if none is left."""

        def wake() -> None:
            with self._kept_changed:
                self._kept_changed.notify_all()

        unregister = cancel.on_cancel(wake)
        try:
            with self._kept_changed:
                self._kept_changed.wait_for(
                    lambda: not self._kept - own or cancel.cancelled, timeout
                )
                return not self._kept - own
        finally:
            unregister()

    async def _expire(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            if self.hosting:  # a standby's leases are the host's to end
                self.state.expire(time.monotonic())

    def _stop_loop(self) -> None:
        with contextlib.suppress(RuntimeError):  # closed already
            self._loop.call_soon_threadsafe(self._loop.stop)
        join(self._thread, 2 * _END_TIMEOUT + 1, "the rendezvous service's thread")

    async def _stop(self, grace: float) -> None:
        roles = self._service.roles
        if roles is not None:
            await roles.close()  # its look at the others ends, and its channels to them
        assert self._server is not None
        await self._server.stop(grace)

    def close(self, grace: float = 1.0) -> None:
        """Stop serving: calls under way get `grace` seconds to finish (0: cut them off)."""
        if not self._thread.is_alive():
            return
        if self._server is not None:
            stopping = asyncio.run_coroutine_threadsafe(self._stop(grace), self._loop)
            try:
                stopping.result(timeout=grace + _END_TIMEOUT)
            except concurrent.futures.TimeoutError:
                logger.warning(
                    "the rendezvous service did not stop within %.0f s: going on",
                    grace + _END_TIMEOUT,
                )
            except Exception as e:  # the loop is gone already: nothing left to stop
                logger.debug("stopping the rendezvous service: %s", e)
        self._stop_loop()


class _InTurns:
    """Stands for the server while the generated code adds a service: each unary method is
    added as one that reads its request itself, in its turn (:class:`bounds.Turns`). gRPC
    would read a unary request whole before the method runs, so that requests at the size
    limit on many connections at once were all held at once. A call without the job's token
    is refused before it takes a turn (Authenticate, which earns it, excepted); the services'
    probes of each other (Status) have turns of their own."""

    def __init__(self, server: grpc.aio.Server, service: _Service) -> None:
        self.server = server
        self.service = service
        self.turns = bounds.Turns(bounds.REQUEST_BYTES // bounds.MAX_REQUEST)
        self.probes = bounds.Turns(bounds.PROBE_SLOTS)
        self.trimmer = bounds.Trimmer()  # told of every request and answer that passes

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        """Code generated before gRPC's registered methods adds its services this way."""
        self.server.add_generic_rpc_handlers([_Converted(h, self._convert) for h in handlers])

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        handlers = {name: self._convert(name, h) for name, h in handlers.items()}
        self.server.add_registered_method_handlers(service, handlers)

    def _convert(self, name: str, handler: Any) -> Any:
        if handler is None or handler.request_streaming or handler.response_streaming:
            return handler
        behaviour, service = handler.unary_unary, self.service
        turns = self.probes if name in ("Status", "Announce") else self.turns
        authenticate = name == "Authenticate"

        async def read_in_turn(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                if not authenticate:
                    service._check(context)
                async with turns.turn(context.peer() or ""):
                    request = await _one_request(requests, context)
            except RefusedError as e:
                await refuse(context, e, service.guard)
            except bounds.NoTurnError:
                await context.abort(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the embedded rendezvous service reads {turns.slots} requests at a time "
                    f"and this one waited {bounds.TURN_WAIT:g} s for its turn: try again",
                )
            try:
                return await behaviour(request, context)
            except grpc.aio.AbortError as e:
                # gRPC keeps the error of an aborted call with the call, in a cycle: through
                # its traceback (and the refusal's it arose from), the handlers' frames would
                # keep the request alive until a full collection. Refused writes at the limit
                # piled up 500 MB that way.
                del request
                e.__context__ = e.__cause__ = None
                raise e.with_traceback(None) from None

        return grpc.stream_unary_rpc_method_handler(
            read_in_turn,
            request_deserializer=self._counted(handler.request_deserializer, into=False),
            response_serializer=self._counted(handler.response_serializer, into=True),
        )

    def _counted(self, convert: Callable[[Any], Any] | None, into: bool) -> Any:
        """`convert` (a message from bytes, or `into` bytes), telling the trimmer the size."""
        passed = self.trimmer.passed
        if convert is None:
            return None

        def counted(message: Any) -> Any:
            converted = convert(message)
            passed(len(converted if into else message))
            return converted

        return counted


class _Converted(grpc.GenericRpcHandler):  # type: ignore[misc]
    """A generic handler whose unary methods read their requests in turns."""

    def __init__(self, inner: Any, convert: Callable[[str, Any], Any]) -> None:
        self.inner = inner
        self.convert = convert
        self.made: dict[str, Any] = {}

    def service(self, handler_call_details: Any) -> Any:
        method = handler_call_details.method
        if method not in self.made:
            self.made[method] = self.convert(
                method.rsplit("/", 1)[-1], self.inner.service(handler_call_details)
            )
        return self.made[method]


async def _one_request(requests: Any, context: grpc.aio.ServicerContext) -> Any:
    """A unary call's request, which has :data:`bounds.RECEIVE_TIMEOUT` to arrive. The reader
    is closed once it has: gRPC's would hold the request until the call's objects are
    collected, which their cycles put off until a collection that may come late."""
    reader = requests.__aiter__()
    try:
        return await asyncio.wait_for(reader.__anext__(), bounds.RECEIVE_TIMEOUT)
    except asyncio.TimeoutError:
        await context.abort(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the request did not arrive within {bounds.RECEIVE_TIMEOUT:g} s of its turn",
        )
    except StopAsyncIteration:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the call carries no request")
    finally:
        await reader.aclose()


def _server_credentials(ca: str | None, cert: str | None, key: str | None) -> Any:
    if not (cert and key):
        raise OSError("serving over TLS needs cert= and key= (this node hosts the service)")
    with open(key, "rb") as k, open(cert, "rb") as c:
        pair = (k.read(), c.read())
    root = None
    if ca:
        with open(ca, "rb") as f:
            root = f.read()
    return grpc.ssl_server_credentials(
        [pair], root_certificates=root, require_client_auth=bool(root)
    )


async def _keep_running(step: Callable[[], Awaitable[None]], what: str) -> None:
    """Run `step` (a loop) for as long as the service runs: a failure is said, and it goes on."""
    while True:
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("the rendezvous service's %s failed; going on", what)
            await asyncio.sleep(0.5)


async def _read_watch_requests(requests: AsyncIterator[Any], out: Outbox) -> None:
    """A watch stream's requests into its queue; however the reading ends, the stream ends.
    A watch's range counts against the stream's share as it is read: requests that wait in
    the queue (a stream not read waits to send) are counted too."""
    try:
        while True:
            await out.unhandled.acquire()  # given back as the stream takes each from its queue
            request = await requests.__anext__()
            kind = request.WhichOneof("request_union")
            if kind == "create_request":
                create = request.create_request
                cost = bounds.watch_cost(create.key, create.range_end)
                full = out.watch(cost)
                out.put(("refuse", full) if full else ("create", (create, cost)))
                del create  # a refused one is not held while the next is awaited
            elif kind == "cancel_request":
                out.put(("cancel", request.cancel_request.watch_id))
            else:
                out.unhandled.release()  # nothing queued for it
            del request
    except (StopAsyncIteration, grpc.RpcError, asyncio.CancelledError):
        pass
    finally:
        out.put(("end", None))
