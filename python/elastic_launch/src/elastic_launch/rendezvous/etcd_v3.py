"""The store over etcd's v3 API (gRPC, the project's own subset in :mod:`.etcdpb`).

Works against etcd 3.4 to 3.6 and against the embedded rendezvous service, which serves the same
subset. Calls retry while the store is unreachable (an etcd restart), up to a deadline; the lease
is renewed in the background; watches reconnect from the last revision they delivered.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from elastic_launch.api import Cancelled
from elastic_launch.cancel import NEVER, CancelToken, join
from elastic_launch.rendezvous import challenge
from elastic_launch.rendezvous.etcdpb import kv_pb2, rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.store import (
    Change,
    Inbox,
    KeyValue,
    Store,
    StoreError,
    Unanswered,
    Watch,
)

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# A server that ran out of a request's deadline before answering may reset the stream, which
# the client sees as CANCELLED, not DEADLINE_EXCEEDED: retried alike (a cancellation of our
# own is told apart by the cancel token). Like a deadline, it may come after a write was
# committed: a retried conditional write then reports it lost (0), and the rendezvous, which
# reads the store again after every lost compare-and-swap, finds it there.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}


class _LeaseGoneError(StoreError):
    """A write named a lease the store no longer has: it expired while this node was cut off."""


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for "every key starting with prefix"."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def channel(
    target: str,
    tls: tuple[str | None, str | None, str | None] | None,
    options: list[tuple[str, Any]] | None = None,
) -> grpc.Channel:
    """A gRPC channel to `target`: over TLS when `tls` (ca, cert, key paths, any may be
    None) is given, else plain."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    ca, cert, key = (_read(p) if p else None for p in tls)
    creds = grpc.ssl_channel_credentials(ca, key, cert)
    return grpc.secure_channel(target, creds, options=options)


def key_text(key: bytes) -> str:
    """A key as text. Keys under the job's prefix are ours, but anyone may write one that is
    not UTF-8: it reads with U+FFFD in place and matches none of ours."""
    return key.decode("utf-8", "replace")


def _kv(kv: kv_pb2.KeyValue) -> KeyValue:
    return KeyValue(key_text(kv.key), kv.value, kv.mod_revision, kv.create_revision)


class EtcdV3Store(Store):
    """`target` is host:port; `token` a shared secret sent as gRPC metadata (the embedded
    service); `user`/`password` authenticate against etcd; `tls` is (ca, cert, key) paths, any
    of which may be None; `retry_for` bounds how long a call keeps retrying an unreachable
    store, `read_timeout` one call; `cancel` abandons calls and retries. `watch_from_now`:
    see `_EtcdWatch` (etcd needs it; the embedded service replays its history at once, and
    cannot read past revisions); None asks the server which it is, once."""

    def __init__(
        self,
        target: str,
        name: str,
        token: str | None = None,
        user: str | None = None,
        password: str | None = None,
        tls: tuple[str | None, str | None, str | None] | None = None,
        retry_for: float = 30.0,
        read_timeout: float | None = None,
        cancel: CancelToken = NEVER,
        watch_from_now: bool | None = None,
    ) -> None:
        super().__init__(read_timeout, cancel)
        self.target = target
        self._watch_from_now = watch_from_now
        self.name = name  # what the store is, in messages ("etcd at host:port", ...)
        self.retry_for = retry_for
        options = [("grpc.keepalive_time_ms", 10000), ("grpc.keepalive_timeout_ms", 5000)]
        self._channel = channel(target, tls, options)
        self._kv = rpc_pb2_grpc.KVStub(self._channel)
        self._lease = rpc_pb2_grpc.LeaseStub(self._channel)
        self._watch = rpc_pb2_grpc.WatchStub(self._channel)
        self._auth = rpc_pb2_grpc.AuthStub(self._channel)
        self._maintenance = rpc_pb2_grpc.MaintenanceStub(self._channel)
        self._user, self._password = user, password
        self._token = token  # the embedded service's: proven by a challenge, never sent
        self._metadata: list[tuple[str, str]] = []
        self._logged_in = token is None
        if user is not None:
            self._authenticate()
        self._lease_id = 0
        self._lease_ttl = 0.0
        self._lease_lock = threading.Lock()  # the keeper and a write may both find it expired
        # (TTL, when, future) of request_lease's grant
        self._early_grant: tuple[int, float, Any] | None = None
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        self._keep_call: Any = None  # the keep-alive stream

    # ---- calls ---------------------------------------------------------------------------

    @property
    def _logs_in(self) -> bool:
        """Whether requests carry a login's credential (etcd's user, the embedded token)."""
        return self._user is not None or self._token is not None

    def _authenticate(self) -> None:
        if self._token is not None:
            self._challenge(self._token)
            return
        try:
            reply = self._auth.Authenticate(
                rpc_pb2.AuthenticateRequest(name=self._user or "", password=self._password or ""),
                timeout=self.read_timeout,
            )
        except grpc.RpcError as e:
            raise StoreError(
                f"{self.name} refused user '{self._user}': {e.details()}; check the user and "
                "password given in --rdzv-conf (user=..., password_file=...)"
            ) from None
        self._metadata = [("token", reply.token)]

    def _challenge(self, token: str) -> None:
        """Log in to the embedded service (:mod:`.challenge`): it proves it holds `token`
        before this node sends anything derived from it."""
        mine = challenge.nonce()
        request = rpc_pb2.AuthenticateRequest(name=challenge.USER, password=mine)
        try:
            reply = self._call(self._auth.Authenticate, request, log_in=False)
        except StoreError as e:
            if "runs without a token" in str(e):
                raise StoreError(
                    f"invalid rendezvous token: {self.name} runs without a token and this node "
                    "has one: give every node the same token, or none"
                ) from None
            raise
        try:
            credential = challenge.respond(token, mine, reply.token)
        except ValueError as e:
            raise StoreError(
                f"invalid rendezvous token: {self.name} did not prove that it holds this "
                f"node's token ({e}); give every node the job's token (--rdzv-conf "
                "token_file=PATH, or $ELASTICRUN_RDZV_TOKEN)"
            ) from None
        self._metadata = [("token", credential)]
        self._logged_in = True

    def _log_in_once(self) -> None:
        if not self._logged_in:
            self._authenticate()

    def _call(
        self, method: Any, request: Any, deadline: float | None = None, log_in: bool = True
    ) -> Any:
        """One RPC, retried while the store is unreachable, until `deadline` (monotonic);
        abandoned (Cancelled) as soon as the cancel token is."""
        if log_in:
            self._log_in_once()
        until = deadline if deadline is not None else time.monotonic() + self.retry_for
        delay = 0.05
        reauthenticated = False
        unanswered = Unanswered(self.name, until)
        while True:
            self.cancel.check()
            unanswered.check()
            self._count()
            future = method.future(request, timeout=self.read_timeout, metadata=self._metadata)
            unregister = self.cancel.on_cancel(future.cancel)
            try:
                return future.result()
            except grpc.FutureCancelledError:
                raise Cancelled(self.cancel.signum) from None
            except grpc.RpcError as e:
                code = e.code()
                if code == grpc.StatusCode.CANCELLED and self.cancel.cancelled:
                    raise Cancelled(self.cancel.signum) from None
                if code == grpc.StatusCode.CANCELLED and self._stop.is_set():
                    raise self._error(e) from None  # this store was closed under the call
                if (
                    code == grpc.StatusCode.UNAUTHENTICATED
                    and self._logs_in
                    and log_in
                    and (not reauthenticated)
                ):
                    self._authenticate()  # etcd's simple tokens expire, and our credentials
                    reauthenticated = True
                    continue
                if code not in _RETRYABLE or time.monotonic() + delay > until:
                    raise self._error(e) from None
                unanswered.failed(f"{code.name}: {e.details()}")
            finally:
                unregister()
            if self.cancel.wait(delay):
                raise Cancelled(self.cancel.signum)
            delay = min(delay * 2, 1.0)

    def _error(self, e: grpc.RpcError) -> StoreError:
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
            return _LeaseGoneError(f"{self.name}: the lease of this node expired ({details})")
        if code == grpc.StatusCode.UNAVAILABLE:
            return StoreError(
                f"{self.name} is unreachable ({details}); check that it runs and that "
                "--rdzv-endpoint is right"
            )
        if code == grpc.StatusCode.UNAUTHENTICATED or "user name is empty" in details:
            return StoreError(
                f"{self.name} refused the request: {details}; give the right token or "
                "user/password in --rdzv-conf"
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return StoreError(f"{self.name}: permission denied ({details})")
        return StoreError(f"{self.name}: {code.name}: {details}")

    # ---- key-value ---------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        reply = self._call(self._kv.Range, rpc_pb2.RangeRequest(key=key.encode()))
        return _kv(reply.kvs[0]) if reply.kvs else None

    def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        p = prefix.encode()
        reply = self._call(self._kv.Range, rpc_pb2.RangeRequest(key=p, range_end=prefix_end(p)))
        return [_kv(kv) for kv in reply.kvs], reply.header.revision

    def put(self, key: str, value: bytes, ephemeral: bool = False) -> int:
        def put(lease: int) -> int:
            request = rpc_pb2.PutRequest(key=key.encode(), value=value, lease=lease)
            return int(self._call(self._kv.Put, request).header.revision)

        return self._with_lease(ephemeral, put)

    def put_get(
        self, key: str, value: bytes, get_key: str, ephemeral: bool = False
    ) -> KeyValue | None:
        def put_get(lease: int) -> Any:
            put = rpc_pb2.PutRequest(key=key.encode(), value=value, lease=lease)
            get = rpc_pb2.RangeRequest(key=get_key.encode())
            request = rpc_pb2.TxnRequest(
                success=[rpc_pb2.RequestOp(request_put=put), rpc_pb2.RequestOp(request_range=get)]
            )
            return self._call(self._kv.Txn, request)

        found = self._with_lease(ephemeral, put_get).responses[1].response_range.kvs
        return _kv(found[0]) if found else None

    def cas_with(self, key: str, value: bytes, version: int, puts: Mapping[str, bytes]) -> int:
        others = [rpc_pb2.PutRequest(key=k.encode(), value=v) for k, v in puts.items()]
        put = rpc_pb2.PutRequest(key=key.encode(), value=value)
        return self._txn(self._unchanged(key.encode(), version), *others, put)

    def _with_lease(self, ephemeral: bool, write: Callable[[int], _T]) -> _T:
        """`write(lease)`: with our lease for an ephemeral key (else none). A lease that
        expired while this node was cut off (a network partition longer than its TTL) is
        replaced, the session told, and the write made with the new one."""
        if not ephemeral:
            return write(0)
        if not self._lease_id:
            raise StoreError("an ephemeral key needs start_liveness() first")
        lease = self._lease_id
        try:
            return write(lease)
        except _LeaseGoneError:
            self._replace_lease(lease)
            return write(self._lease_id)

    def _replace_lease(self, expired: int) -> None:
        """Grant a new lease in place of `expired` (once, whichever thread finds it gone
        first) and tell the session: the store has dropped our ephemeral keys."""
        with self._lease_lock:
            if self._lease_id != expired:
                return
            logger.warning("the rendezvous lease expired; this node will rejoin")
            self._grant()
        self._on_lost()

    def _txn(self, compare: rpc_pb2.Compare, *puts: rpc_pb2.PutRequest) -> int:
        """The puts if `compare` holds: the revision they made, or 0."""
        request = rpc_pb2.TxnRequest(
            compare=[compare], success=[rpc_pb2.RequestOp(request_put=p) for p in puts]
        )
        response = self._call(self._kv.Txn, request)
        return int(response.header.revision) if response.succeeded else 0

    def create(self, key: str, value: bytes, ephemeral: bool = False) -> int:
        k = key.encode()
        compare = self._unchanged(k, 0)

        def create(lease: int) -> int:
            # On failure the key is read in the same transaction: a create whose answer was
            # lost (a deadline, a reset) and that was retried finds its own key, with this
            # session's lease and its value, and is the creator still.
            request = rpc_pb2.TxnRequest(
                compare=[compare],
                success=[
                    rpc_pb2.RequestOp(
                        request_put=rpc_pb2.PutRequest(key=k, value=value, lease=lease)
                    )
                ],
                failure=[rpc_pb2.RequestOp(request_range=rpc_pb2.RangeRequest(key=k))],
            )
            response = self._call(self._kv.Txn, request)
            if response.succeeded:
                return int(response.header.revision)
            found = response.responses[0].response_range.kvs if response.responses else []
            if lease and found and found[0].lease == lease and found[0].value == value:
                return int(found[0].mod_revision)
            return 0

        return self._with_lease(ephemeral, create)

    @staticmethod
    def _unchanged(k: bytes, version: int) -> rpc_pb2.Compare:
        """The cas condition: `k` still at `version` (0: absent)."""
        if version:
            return rpc_pb2.Compare(
                key=k,
                target=rpc_pb2.Compare.MOD,
                result=rpc_pb2.Compare.EQUAL,
                mod_revision=version,
            )
        return rpc_pb2.Compare(
            key=k,
            target=rpc_pb2.Compare.CREATE,
            result=rpc_pb2.Compare.EQUAL,
            create_revision=0,
        )

    def cas(self, key: str, value: bytes, version: int, ttl: float | None = None) -> int:
        k = key.encode()
        compare = self._unchanged(k, version)
        lease = 0
        if ttl is not None:  # a lease of its own, never renewed: the key goes when it expires
            reply = self._call(self._lease.LeaseGrant, rpc_pb2.LeaseGrantRequest(TTL=round(ttl)))
            lease = reply.ID
        return self._txn(compare, rpc_pb2.PutRequest(key=k, value=value, lease=lease))

    def delete(self, key: str, prefix: bool = False) -> None:
        k = key.encode()
        request = rpc_pb2.DeleteRangeRequest(key=k, range_end=prefix_end(k) if prefix else b"")
        self._call(self._kv.DeleteRange, request)

    # ---- lease ---------------------------------------------------------------------------

    def start_liveness(self, ttl: float, on_lost: Callable[[], None] | None = None) -> None:
        self._lease_ttl = ttl
        if on_lost is not None:
            self._on_lost = on_lost
        self._grant()
        self._keeper = threading.Thread(
            target=self._keep_alive, name="elasticrun-lease", daemon=True
        )
        self._keeper.start()

    @property
    def leases(self) -> set[int]:
        """The ids of the leases this connection holds (the one in use, one asked for early)."""
        held = {self._lease_id} if self._lease_id else set()
        early = self._early_grant
        if early is not None and early[2].done() and early[2].exception() is None:
            held.add(early[2].result().ID)
        return held

    def request_lease(self, ttl: float) -> None:
        if self._early_grant is None and not self._lease_id:
            self._log_in_once()
            self._count()
            self._early_grant = (
                round(ttl),
                time.monotonic(),
                self._lease.LeaseGrant.future(
                    rpc_pb2.LeaseGrantRequest(TTL=round(ttl)),
                    timeout=self.read_timeout,
                    metadata=self._metadata,
                ),
            )

    def _early_reply(self) -> Any:
        """The answer to request_lease, if it asked for this TTL and got one; else None."""
        early, self._early_grant = self._early_grant, None
        if early is None:
            return None
        ttl, asked, future = early
        # Too old (the keeper would renew it too late) or another TTL: ask again.
        if ttl != round(self._lease_ttl) or time.monotonic() - asked > ttl / 3.0:
            self._give_back(future)
            return None
        unregister = self.cancel.on_cancel(future.cancel)
        try:
            return future.result()
        except grpc.FutureCancelledError:
            self.cancel.check()
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
            lease = future.result().ID
            self._lease.LeaseRevoke(
                rpc_pb2.LeaseRevokeRequest(ID=lease), timeout=2.0, metadata=self._metadata
            )

    def _grant(self) -> None:
        reply = self._early_reply() or self._call(
            self._lease.LeaseGrant, rpc_pb2.LeaseGrantRequest(TTL=round(self._lease_ttl))
        )
        if reply.error:
            raise StoreError(f"{self.name} refused a lease: {reply.error}")
        self._lease_id = reply.ID

    def ensure_lease(self) -> None:
        request = rpc_pb2.LeaseTimeToLiveRequest(ID=self._lease_id)
        if self._call(self._lease.LeaseTimeToLive, request).TTL <= 0:
            self._grant()

    def _keep_alive(self) -> None:
        """Renew the lease on one long-lived stream (as etcd's own client does): a request
        every TTL/3, the answers read here. A stream that breaks, or that has not answered for
        most of the TTL, is replaced at once, so that a slow store or a busy process loses the
        lease only when a whole TTL passed without an answer, never after two slow ticks, and
        a renewal costs the store one message, not a new stream."""
        interval = max(self._lease_ttl / 3.0, 0.2)
        # Answers late by most of the TTL: the stream is stuck (a busy process reads them
        # late too, and a new stream would only cost it more). A broken one errors at once.
        stale = max(self._lease_ttl * 0.8, 2 * interval)
        delay = 0.05
        while not self._stop.is_set():
            last = [time.monotonic()]  # the last answer (or the stream's start)
            call: list[Any] = []

            try:
                requests = self._keep_requests(last, call, interval, stale)
                stream = self._lease.LeaseKeepAlive(requests, metadata=self._metadata)
                call.append(stream)
                self._keep_call = stream
                if self._stop.is_set():
                    stream.cancel()
                for reply in stream:
                    last[0] = time.monotonic()
                    delay = 0.05
                    if reply.TTL <= 0 and not self._stop.is_set():
                        with contextlib.suppress(StoreError, Cancelled):
                            self._replace_lease(reply.ID)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED and self._logs_in:
                    with contextlib.suppress(StoreError, Cancelled):
                        self._authenticate()
            except ValueError:
                return  # the channel was closed: the store is closing
            if call:
                call[0].cancel()
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, 0.5)  # again soon: the TTL has what is left, no more

    def _keep_requests(
        self, last: list[float], call: list[Any], interval: float, stale: float
    ) -> Iterator[rpc_pb2.LeaseKeepAliveRequest]:
        """The keep-alive stream's requests, in gRPC's own thread for the stream: one per
        tick; the stream is cancelled when its answers stop coming (`last`: the last one)."""
        while True:
            self._count()
            yield rpc_pb2.LeaseKeepAliveRequest(ID=self._lease_id)
            if self._stop.wait(interval):
                return
            if time.monotonic() - last[0] > stale and call:
                call[0].cancel()
                return

    # ---- watch ---------------------------------------------------------------------------

    @property
    def watch_from_now(self) -> bool:
        """Whether watches start at the server's revision and fill the gap by reading (etcd),
        or start at the caller's revision (the embedded service)."""
        if self._watch_from_now is None:
            from elastic_launch.rendezvous.embedded_server import VERSION

            reply = self._call(self._maintenance.Status, rpc_pb2.StatusRequest())
            self._watch_from_now = reply.version != VERSION
        return self._watch_from_now

    def watch(self, prefix: str, after_revision: int, inbox: Inbox | None = None) -> Watch:
        return _EtcdWatch(self, [prefix], after_revision, inbox)

    def watch_many(self, prefixes: list[str], after_revision: int, inbox: Inbox) -> list[Watch]:
        return [_EtcdWatch(self, prefixes, after_revision, inbox)]  # one stream for all

    def close(self) -> None:
        if self._stop.is_set():
            return  # closed already
        self._stop.set()
        early, self._early_grant = self._early_grant, None
        if early is not None:
            self._give_back(early[2])
        if self._lease_id:
            with contextlib.suppress(grpc.RpcError):
                self._lease.LeaseRevoke(
                    rpc_pb2.LeaseRevokeRequest(ID=self._lease_id),
                    timeout=2.0,
                    metadata=self._metadata,
                )
        if self._keep_call is not None:
            self._keep_call.cancel()
        if self._keeper is not None:
            join(self._keeper, self.read_timeout + 1, "the lease keep-alive thread")
        self._channel.close()


class _EtcdWatch(Watch):
    """One watch stream (and reader thread) for one or more prefixes; reconnects from the last
    revision delivered for each.

    etcd serves a watch whose start revision has already passed from its history, by a loop
    that runs every 100 ms: such a watch hears nothing, not even new changes, for up to 100 ms
    (measured: 83 ms median on etcd 3.4). A rendezvous that reads, then watches from the
    read, meets that whenever anyone writes in between. So each stream starts at the server's
    current revision, and the changes between the caller's revision and it (a gap that is
    usually empty) come from two reads: the keys then and now."""

    def __init__(
        self, store: EtcdV3Store, prefixes: list[str], after_revision: int, inbox: Inbox | None
    ) -> None:
        self._store = store
        self._keys = [p.encode() for p in prefixes]
        self._next = dict.fromkeys(self._keys, after_revision + 1)  # per prefix
        self._created = 0  # `created` replies on the current stream: they come in order
        self._from_now = store.watch_from_now
        super().__init__(inbox)
        self._closed = threading.Event()
        self._requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
        self._call: Any = None
        self._thread = threading.Thread(target=self._run, name="elasticrun-watch", daemon=True)
        self._thread.start()

    def _request_stream(
        self, requests: queue.Queue[rpc_pb2.WatchRequest | None]
    ) -> Iterator[rpc_pb2.WatchRequest]:
        # start_revision 0: the server's current revision; the gap is filled on `created`.
        self._created = 0
        for key in self._keys:
            start = 0 if self._from_now else self._next[key]
            create = rpc_pb2.WatchCreateRequest(
                key=key, range_end=prefix_end(key), start_revision=start
            )
            yield rpc_pb2.WatchRequest(create_request=create)
        while True:  # keep the stream open until closed (its own queue: one per stream)
            item = requests.get()
            if item is None:
                return
            yield item

    def _run(self) -> None:
        retry = _Retry()
        while not self._closed.is_set():
            again = self._stream(retry)
            if again is None:
                return
            self._requests.put(None)  # end the old request stream
            self._requests = queue.Queue()
            if again:
                continue  # logged in once more: at once
            if self._closed.wait(retry.delay):
                return
            retry.delay = min(retry.delay * 2, 1.0)

    def _stream(self, retry: _Retry) -> bool | None:
        """One watch stream, until it ends: None when the watch is over (an error delivered,
        cancelled, closed), else whether to open the next one at once (True) or after the
        retry delay (False)."""
        self._store._count()
        try:
            self._store._log_in_once()
            self._call = self._store._watch.Watch(
                self._request_stream(self._requests), metadata=self._store._metadata
            )
            if self._closed.is_set():  # closed before the call existed to be cancelled
                self._call.cancel()
            for reply in self._call:
                retry.reset()
                if not self._take(reply):
                    return None
            return False
        except StoreError as error:  # the gap could not be read (compacted, unreachable)
            if not self._closed.is_set():
                self.inbox.put(error)
        except Cancelled:
            pass  # the session's waits are woken by the cancellation itself
        except ValueError:  # "Channel closed": the store was closed under this watch
            if not self._closed.is_set():
                self.inbox.put(StoreError(f"{self._store.name}: the connection was closed"))
        except grpc.RpcError as e:
            return self._again(e, retry)
        return None

    def _take(self, reply: Any) -> bool:
        """Deliver one reply of the stream; False when the watch is over (canceled)."""
        if reply.canceled:
            reason = reply.cancel_reason or (
                f"revision {min(self._next.values())} was compacted"
                if reply.compact_revision
                else "canceled by the server"
            )
            self.inbox.put(StoreError(f"{self._store.name}: watch lost: {reason}"))
            return False
        if reply.created:
            key = self._keys[min(self._created, len(self._keys) - 1)]
            self._created += 1
            if self._from_now:
                self._fill_gap(key, reply.header.revision)
            return True
        batch = []
        for ev in reply.events:
            value = None if ev.type == kv_pb2.Event.DELETE else ev.kv.value
            batch.append(Change(key_text(ev.kv.key), value, ev.kv.mod_revision))
            for key in self._keys:
                if ev.kv.key.startswith(key):
                    self._next[key] = ev.kv.mod_revision + 1
        if batch:
            self.inbox.put(batch)
        return True

    def _again(self, e: grpc.RpcError, retry: _Retry) -> bool | None:
        """After a failed stream: None to give up (the error is delivered), True to open a
        new stream at once (after logging in again: etcd's simple tokens expire), False to
        open one after the retry delay."""
        if self._closed.is_set():
            return None
        code = e.code()
        if code == grpc.StatusCode.UNAUTHENTICATED and self._store._logs_in and not retry.relogged:
            retry.relogged = True
            try:
                self._store._authenticate()
            except StoreError as error:
                self.inbox.put(error)
                return None
            return True
        now = time.monotonic()
        retry.failing_since = retry.failing_since or now
        cut_off = code == grpc.StatusCode.RESOURCE_EXHAUSTED and "cut off" in (e.details() or "")
        if (code in _RETRYABLE or cut_off) and now - retry.failing_since <= self._store.retry_for:
            return False  # a stream the service cut off (it fell behind) is watched again
        self.inbox.put(self._store._error(e))
        return None

    def _fill_gap(self, key: bytes, current: int) -> None:
        """The watch of `key` hears changes after `current`: deliver those since the last
        revision delivered up to it, as the difference of the keys then and at `current`."""
        after = self._next[key] - 1
        self._next[key] = current + 1
        if current <= after:
            return  # nothing was written in between: the usual case, no read
        then = {kv.key: kv for kv in self._read(key, after)} if after > 0 else {}
        now = self._read(key, current)
        batch = [
            Change(key_text(kv.key), kv.value, kv.mod_revision)
            for kv in now
            if kv.mod_revision > after
        ]
        keys = {kv.key for kv in now}
        batch += [Change(key_text(k), None, current) for k in then if k not in keys]
        if batch:
            self.inbox.put(sorted(batch, key=lambda c: c.revision))

    def _read(self, key: bytes, revision: int) -> list[Any]:
        request = rpc_pb2.RangeRequest(key=key, range_end=prefix_end(key), revision=revision)
        return list(self._store._call(self._store._kv.Range, request).kvs)

    def close(self) -> None:
        self._closed.set()
        self._requests.put(None)
        if self._call is not None:
            self._call.cancel()
        self.inbox.wake()  # a waiter reading this watch returns now
        join(self._thread, 5, "a store watch thread")


@dataclass
class _Retry:
    """A watch's reconnection: the next delay, since when it fails, whether it logged in again."""

    delay: float = 0.05
    failing_since: float | None = None
    relogged: bool = False

    def reset(self) -> None:
        """The stream works: the next failure starts afresh."""
        self.delay, self.failing_since, self.relogged = 0.05, None, False
