"""The embedded rendezvous service: a small in-memory store hosted by one agent, speaking the
same etcd v3 gRPC subset as etcd itself (KV, Lease, Watch), so that one client and one
rendezvous algorithm serve both. Revisions, leases with TTLs, and watches from a past revision
(a bounded history) behave as etcd's do. Requests must carry the job's token, when it has one.
"""

from __future__ import annotations

import bisect
import collections
import hmac
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from elastic_launch.net import host_port
from elastic_launch.rendezvous.etcdpb import kv_pb2, rpc_pb2, rpc_pb2_grpc

logger = logging.getLogger(__name__)

_MAX_STREAMS = 4096
_HISTORY = 100_000  # events kept for watches that start in the past


VERSION = "elasticrun-embedded"  # what Status says: clients tell it from etcd by it


@dataclass
class _Entry:
    value: bytes
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    def proto(self, key: bytes) -> kv_pb2.KeyValue:
        return kv_pb2.KeyValue(
            key=key,
            value=self.value,
            create_revision=self.create_revision,
            mod_revision=self.mod_revision,
            version=self.version,
            lease=self.lease,
        )


@dataclass
class _Lease:
    ttl: int
    expires: float
    keys: set[bytes] = field(default_factory=set)


@dataclass(eq=False)  # identity: found by its id, never by comparing fields
class _Watcher:
    key: bytes
    end: bytes
    out: queue.Queue[Any]  # (watch_id, [events of one revision]) for the stream's sender
    watch_id: int

    def matches(self, key: bytes) -> bool:
        if not self.end:
            return key == self.key
        return key >= self.key and (self.end == b"\0" or key < self.end)


class _State:
    """The store: every method runs under one lock (the service is small)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.revision = 1
        self.keys: list[bytes] = []  # sorted
        self.data: dict[bytes, _Entry] = {}
        self.leases: dict[int, _Lease] = {}
        self.history: collections.deque[tuple[int, kv_pb2.Event]] = collections.deque(
            maxlen=_HISTORY
        )
        self.compacted = 0  # the newest revision with events dropped from the history
        self.pending: list[kv_pb2.Event] = []  # the current revision's events
        # Watchers by the range they watch, then by id: many nodes watch the same few ranges
        # (the state, the shared keys), so a commit matches each event against ranges, not
        # watchers, and a watcher comes and goes in O(1) (a thousand nodes leaving a range
        # at once, as after a node loss, must not cost a million comparisons under the lock).
        self.watchers: dict[tuple[bytes, bytes], dict[int, _Watcher]] = {}

    def add_watcher(self, w: _Watcher) -> None:
        self.watchers.setdefault((w.key, w.end), {})[w.watch_id] = w

    def remove_watchers(self, gone: list[_Watcher]) -> None:
        for w in gone:
            group = self.watchers.get((w.key, w.end))
            if group is not None and group.pop(w.watch_id, None) is not None and not group:
                del self.watchers[(w.key, w.end)]

    def since(self, start: int, w: _Watcher) -> list[tuple[int, kv_pb2.Event]]:
        """The history's events from revision `start` on that `w` watches (read from the
        newest back: a new watch usually starts near the present)."""
        past = []
        for rev, ev in reversed(self.history):
            if rev < start:
                break
            if w.matches(ev.kv.key):
                past.append((rev, ev))
        past.reverse()
        return past

    def header(self) -> rpc_pb2.ResponseHeader:
        return rpc_pb2.ResponseHeader(cluster_id=1, member_id=1, revision=self.revision)

    def select(self, key: bytes, end: bytes) -> list[bytes]:
        if not end:
            return [key] if key in self.data else []
        lo = bisect.bisect_left(self.keys, key)
        hi = len(self.keys) if end == b"\0" else bisect.bisect_left(self.keys, end)
        return self.keys[lo:hi]

    def _emit(self, event: kv_pb2.Event) -> None:
        self.pending.append(event)

    def commit(self) -> None:
        """Publish the current revision's events: to the history, and to each watcher as one
        response (as etcd sends a transaction's or a lease expiry's events together)."""
        events, self.pending = self.pending, []
        for event in events:
            if len(self.history) == self.history.maxlen:
                self.compacted = self.history[0][0]
            self.history.append((self.revision, event))
        for group in self.watchers.values():
            first = next(iter(group.values()))
            mine = [e for e in events if first.matches(e.kv.key)]
            if mine:
                for w in group.values():
                    w.out.put((w.watch_id, mine))

    def check_lease(self, lease: int) -> None:
        if lease and lease not in self.leases:
            raise KeyError("etcdserver: requested lease not found")

    def put(self, key: bytes, value: bytes, lease: int) -> None:
        old = self.data.get(key)
        if old is not None and old.lease and old.lease in self.leases:
            self.leases[old.lease].keys.discard(key)
        if old is None:
            bisect.insort(self.keys, key)
            entry = _Entry(value, self.revision, self.revision, 1, lease)
        else:
            entry = _Entry(value, old.create_revision, self.revision, old.version + 1, lease)
        self.data[key] = entry
        if lease:
            self.leases[lease].keys.add(key)
        self._emit(kv_pb2.Event(type=kv_pb2.Event.PUT, kv=entry.proto(key)))

    def delete(self, key: bytes) -> None:
        entry = self.data.pop(key)
        self.keys.pop(bisect.bisect_left(self.keys, key))
        if entry.lease in self.leases:
            self.leases[entry.lease].keys.discard(key)
        self._emit(
            kv_pb2.Event(
                type=kv_pb2.Event.DELETE, kv=kv_pb2.KeyValue(key=key, mod_revision=self.revision)
            )
        )

    def compare(self, c: rpc_pb2.Compare) -> bool:
        entry = self.data.get(c.key)
        target = c.target
        if target == rpc_pb2.Compare.VALUE:
            if entry is None:
                return False  # as etcd: a missing key's value compares false, whatever the op
            have: Any = entry.value
            want: Any = c.value
        else:
            attr = {
                rpc_pb2.Compare.VERSION: ("version", "version"),
                rpc_pb2.Compare.CREATE: ("create_revision", "create_revision"),
                rpc_pb2.Compare.MOD: ("mod_revision", "mod_revision"),
                rpc_pb2.Compare.LEASE: ("lease", "lease"),
            }[target]
            have = getattr(entry, attr[0]) if entry else 0
            want = getattr(c, attr[1])
        result = c.result
        if result == rpc_pb2.Compare.EQUAL:
            return bool(have == want)
        if result == rpc_pb2.Compare.NOT_EQUAL:
            return bool(have != want)
        if result == rpc_pb2.Compare.GREATER:
            return bool(have > want)
        return bool(have < want)

    def expire(self, now: float) -> None:
        for lease_id, lease in list(self.leases.items()):
            if lease.expires <= now:
                self.revoke(lease_id)

    def revoke(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is None or not lease.keys:
            return
        self.revision += 1
        for key in sorted(lease.keys):
            if key in self.data:
                self.delete(key)
        self.commit()


class _Service(
    rpc_pb2_grpc.KVServicer,
    rpc_pb2_grpc.LeaseServicer,
    rpc_pb2_grpc.WatchServicer,
    rpc_pb2_grpc.MaintenanceServicer,
):
    def __init__(self, state: _State, token: str | None) -> None:
        self.s = state
        self.token = token
        self._watch_ids = iter(range(1, 1 << 62))

    def _check(self, context: grpc.ServicerContext) -> None:
        if self.token is None:
            return
        sent = dict(context.invocation_metadata()).get("token", "")
        if not hmac.compare_digest(str(sent), self.token):
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "invalid rendezvous token: this node's token (--rdzv-conf token=..., or "
                "$ELASTICRUN_RDZV_TOKEN) differs from the job's",
            )

    # ---- KV ----------------------------------------------------------------------------------

    def _range(self, r: rpc_pb2.RangeRequest) -> rpc_pb2.RangeResponse:
        keys = self.s.select(r.key, r.range_end)
        kvs = [self.s.data[k].proto(k) for k in keys[: r.limit or None]]
        return rpc_pb2.RangeResponse(header=self.s.header(), kvs=kvs, count=len(keys))

    def Range(self, request: Any, context: Any) -> Any:  # noqa: N802 - gRPC's name
        self._check(context)
        with self.s.lock:
            if request.revision and request.revision != self.s.revision:
                # It keeps no old versions: say so rather than answer with today's keys.
                context.abort(
                    grpc.StatusCode.UNIMPLEMENTED,
                    f"the embedded rendezvous service reads only the current revision "
                    f"({self.s.revision}), not {request.revision}",
                )
            return self._range(request)

    def _put(self, r: rpc_pb2.PutRequest) -> rpc_pb2.PutResponse:
        self.s.put(r.key, r.value, r.lease)
        return rpc_pb2.PutResponse(header=self.s.header())

    def _check_lease(self, lease: int, context: Any) -> None:
        try:
            self.s.check_lease(lease)
        except KeyError as e:  # before any change: a refused request leaves no revision
            context.abort(grpc.StatusCode.NOT_FOUND, str(e.args[0]))

    def Put(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._check(context)
        with self.s.lock:
            self._check_lease(request.lease, context)
            self.s.revision += 1
            reply = self._put(request)
            self.s.commit()
            return reply

    def _delete(self, r: rpc_pb2.DeleteRangeRequest) -> rpc_pb2.DeleteRangeResponse:
        keys = list(self.s.select(r.key, r.range_end))
        for k in keys:
            self.s.delete(k)
        return rpc_pb2.DeleteRangeResponse(header=self.s.header(), deleted=len(keys))

    def DeleteRange(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._check(context)
        with self.s.lock:
            if self.s.select(request.key, request.range_end):
                self.s.revision += 1
            reply = self._delete(request)
            self.s.commit()
            return reply

    def Txn(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._check(context)
        with self.s.lock:
            ok = all(self.s.compare(c) for c in request.compare)
            ops = request.success if ok else request.failure
            for op in ops:
                if op.WhichOneof("request") == "request_put":
                    self._check_lease(op.request_put.lease, context)
            if any(op.WhichOneof("request") != "request_range" for op in ops):
                self.s.revision += 1
            responses = []
            for op in ops:
                kind = op.WhichOneof("request")
                if kind == "request_range":
                    responses.append(
                        rpc_pb2.ResponseOp(response_range=self._range(op.request_range))
                    )
                elif kind == "request_put":
                    responses.append(rpc_pb2.ResponseOp(response_put=self._put(op.request_put)))
                else:
                    responses.append(
                        rpc_pb2.ResponseOp(
                            response_delete_range=self._delete(op.request_delete_range)
                        )
                    )
            self.s.commit()
            return rpc_pb2.TxnResponse(header=self.s.header(), succeeded=ok, responses=responses)

    # ---- leases --------------------------------------------------------------------------

    def LeaseGrant(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._check(context)
        ttl = max(int(request.TTL), 1)
        with self.s.lock:
            lease_id = request.ID or int.from_bytes(os.urandom(7), "big") or 1
            self.s.leases[lease_id] = _Lease(ttl, time.monotonic() + ttl)
            return rpc_pb2.LeaseGrantResponse(header=self.s.header(), ID=lease_id, TTL=ttl)

    def LeaseRevoke(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._check(context)
        with self.s.lock:
            if request.ID not in self.s.leases:
                context.abort(grpc.StatusCode.NOT_FOUND, "etcdserver: requested lease not found")
            self.s.revoke(request.ID)
            return rpc_pb2.LeaseRevokeResponse(header=self.s.header())

    def LeaseKeepAlive(self, request_iterator: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        self._check(context)
        for request in request_iterator:
            with self.s.lock:
                lease = self.s.leases.get(request.ID)
                ttl = 0
                if lease is not None:
                    lease.expires = time.monotonic() + lease.ttl
                    ttl = lease.ttl
                reply = rpc_pb2.LeaseKeepAliveResponse(
                    header=self.s.header(), ID=request.ID, TTL=ttl
                )
            yield reply  # never under the lock: the client may be slow to read

    def LeaseTimeToLive(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._check(context)
        with self.s.lock:
            lease = self.s.leases.get(request.ID)
            if lease is None:
                return rpc_pb2.LeaseTimeToLiveResponse(
                    header=self.s.header(), ID=request.ID, TTL=-1
                )
            left = max(0, int(lease.expires - time.monotonic()))
            return rpc_pb2.LeaseTimeToLiveResponse(
                header=self.s.header(), ID=request.ID, TTL=left, grantedTTL=lease.ttl
            )

    # ---- watch ---------------------------------------------------------------------------

    def Watch(self, request_iterator: Any, context: Any) -> Iterator[Any]:  # noqa: N802
        self._check(context)
        out: queue.Queue[Any] = queue.Queue()
        mine: list[_Watcher] = []

        def read_requests() -> None:
            try:
                for request in request_iterator:
                    kind = request.WhichOneof("request_union")
                    if kind == "create_request":
                        out.put(("create", request.create_request))
                    elif kind == "cancel_request":
                        out.put(("cancel", request.cancel_request.watch_id))
            except grpc.RpcError:
                pass
            out.put(("end", None))

        threading.Thread(target=read_requests, daemon=True).start()
        try:
            while context.is_active():
                try:
                    item = out.get(timeout=1.0)
                except queue.Empty:
                    continue
                kind, arg = item
                if isinstance(kind, int):  # a watcher's events of one revision
                    if any(w.watch_id == kind for w in mine):
                        yield rpc_pb2.WatchResponse(
                            header=self.s.header(), watch_id=kind, events=arg
                        )
                    continue
                if kind == "end":
                    return
                if kind == "cancel":
                    with self.s.lock:
                        self.s.remove_watchers([w for w in mine if w.watch_id == arg])
                    mine[:] = [w for w in mine if w.watch_id != arg]
                    yield rpc_pb2.WatchResponse(header=self.s.header(), watch_id=arg, canceled=True)
                    continue
                create = arg
                w = _Watcher(create.key, create.range_end, out, next(self._watch_ids))
                start = create.start_revision
                with self.s.lock:
                    header = self.s.header()
                    compacted = bool(start) and start <= self.s.compacted
                    past: list[tuple[int, kv_pb2.Event]] = []
                    if not compacted:
                        past = self.s.since(start, w) if start else []
                        self.s.add_watcher(w)
                        mine.append(w)
                if compacted:  # events from `start` on are gone: the client must re-read
                    yield rpc_pb2.WatchResponse(
                        header=header,
                        watch_id=w.watch_id,
                        created=True,
                        canceled=True,
                        compact_revision=self.s.compacted + 1,
                    )
                    continue
                yield rpc_pb2.WatchResponse(header=header, watch_id=w.watch_id, created=True)
                for _, group in itertools.groupby(past, key=lambda p: p[0]):
                    yield rpc_pb2.WatchResponse(
                        header=header, watch_id=w.watch_id, events=[ev for _, ev in group]
                    )
        finally:
            with self.s.lock:
                self.s.remove_watchers(mine)

    def Status(self, request: Any, context: Any) -> Any:  # noqa: N802
        self._check(context)
        with self.s.lock:
            return rpc_pb2.StatusResponse(header=self.s.header(), version=VERSION)


class EmbeddedServer:
    """The service, listening on host:port (raises OSError if the port is taken)."""

    def __init__(self, host: str, port: int, token: str | None) -> None:
        self.state = _State()
        service = _Service(self.state, token)
        self.server = grpc.server(
            # A watch or keep-alive stream holds a thread for its life: room for a few thousand
            # nodes' streams (threads start as needed).
            futures.ThreadPoolExecutor(
                max_workers=_MAX_STREAMS, thread_name_prefix="elasticrun-rdzv"
            ),
            options=[("grpc.so_reuseport", 0)],
        )
        rpc_pb2_grpc.add_KVServicer_to_server(service, self.server)
        rpc_pb2_grpc.add_LeaseServicer_to_server(service, self.server)
        rpc_pb2_grpc.add_WatchServicer_to_server(service, self.server)
        rpc_pb2_grpc.add_MaintenanceServicer_to_server(service, self.server)
        address = host_port(host, port)
        try:
            self.port = self.server.add_insecure_port(address)
        except RuntimeError as e:
            raise OSError(f"cannot listen on {address}: {e}") from None
        if self.port == 0:
            raise OSError(f"cannot listen on {address} (in use?)")
        self.server.start()
        self._stop = threading.Event()
        self._expirer = threading.Thread(target=self._expire, name="elasticrun-leases", daemon=True)
        self._expirer.start()

    def _expire(self) -> None:
        while not self._stop.wait(0.1):
            with self.state.lock:
                self.state.expire(time.monotonic())

    def close(self, grace: float = 1.0) -> None:
        self._stop.set()
        self.server.stop(grace).wait(timeout=grace + 5)
        self._expirer.join(timeout=5)
