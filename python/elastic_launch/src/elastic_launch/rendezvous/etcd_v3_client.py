"""One client of etcd's v3 API (or of the embedded service, which serves the same subset): its
members, the one in use, logging in, and calls retried while the store is unreachable, up to a
deadline, abandoned at once when the cancel token is.

A store is a set of members (etcd's cluster, or the embedded service's hosts). As etcd's own
client does, every call, the lease's keep-alive and each watch run on one member, and move to
the next when theirs fails (refuses, errs, or hangs past a deadline): nothing above this client
knows which member answered. Every answer's header names its cluster: members of two clusters
in one list are an error.

The store (:mod:`.etcd_v3`), its lease (:mod:`.etcd_v3_lease`) and its watches
(:mod:`.etcd_v3_watch`) all call through one :class:`Client`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from elastic_launch.api import Cancelled
from elastic_launch.cancel import CancelToken
from elastic_launch.rendezvous import challenge
from elastic_launch.rendezvous.endpoints import StoreMember, members_of, written
from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.store import (
    HistoryLostError,
    StoreAccess,
    StoreError,
    Tls,
    Unanswered,
    nospace,
)

logger = logging.getLogger(__name__)

# A server that ran out of a request's deadline before answering may reset the stream, which
# the client sees as CANCELLED, not DEADLINE_EXCEEDED: retried alike (a cancellation of our
# own is told apart by the cancel token). Like a deadline, it may come after a write was
# committed: a retried conditional write then reports it lost (0), and the rendezvous, which
# reads the store again after every lost compare-and-swap, finds it there. etcd says
# UNAVAILABLE for "no leader", "leader changed" and "request timed out" (an election).
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}

#: gRPC's own check of a connection that carries streams: a ping every 10 s (etcd refuses
#: pings more often than every 5 s), a member that does not answer it within 2 s is gone. A
#: member that refused a connection is tried again within a second (gRPC's backoff grows to
#: two minutes, and fails every call at once meanwhile): a member that comes back is used.
CHANNEL_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.keepalive_time_ms", 10000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.http2.ping_timeout_ms", 2000),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
#: What the embedded service's Status says it is: clients tell it from etcd by it.
EMBEDDED_VERSION = "elasticrun-embedded"
#: What every stream asks of etcd: a member cut off from its cluster's leader ends the stream
#: (etcd's WithRequireLeader) instead of keeping it open and silent.
STREAM_METADATA = [("hasleader", "true")]


class LeaseGoneError(StoreError):
    """A write named a lease the store no longer has: it expired while this node was cut off."""


def read_file(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def channel(target: str, tls: Tls | None, options: list[tuple[str, Any]] | None = None) -> Any:
    """A gRPC channel to `target`: over TLS when `tls` (ca, cert, key paths, any may be
    None) is given, else plain."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    ca, cert, key = (read_file(p) if p else None for p in tls)
    creds = grpc.ssl_channel_credentials(ca, key, cert)
    return grpc.secure_channel(target, creds, options=options)


class Connection:
    """One member's channel, its stubs, and the credential its requests carry. A member left
    for another is `reset`: its channel closed (what still ran on it ends), a new one made."""

    def __init__(self, index: int, member: StoreMember, tls: Tls | None) -> None:
        self.index = index
        self.member = member
        self._tls = tls
        self.metadata: list[tuple[str, str]] = []  # etcd's token, or the challenge's credential
        self.logged_in = False
        self._open()

    def _open(self) -> None:
        options = list(CHANNEL_OPTIONS)
        if self.member.name is not None and self._tls is not None:
            options.append(("grpc.ssl_target_name_override", self.member.name))
        self.channel = channel(self.member.target, self._tls, options)
        self.kv = rpc_pb2_grpc.KVStub(self.channel)
        self.lease = rpc_pb2_grpc.LeaseStub(self.channel)
        self.watch = rpc_pb2_grpc.WatchStub(self.channel)
        self.maintenance = rpc_pb2_grpc.MaintenanceStub(self.channel)
        self.auth = rpc_pb2_grpc.AuthStub(self.channel)

    def method(self, name: str) -> Any:
        """The stub method `name` ("kv.Range") of this member."""
        service, call = name.split(".")
        return getattr(getattr(self, service), call)

    def reset(self) -> None:
        old = self.channel
        self._open()
        self.logged_in = False
        old.close()

    def close(self) -> None:
        self.channel.close()


class Client:
    """A client of the store whose members are `targets` (one ``host:port``, or the members
    of a list), reached as `access` says; every request is counted with `count`. Thread-safe."""

    def __init__(
        self,
        targets: str | Sequence[StoreMember],
        access: StoreAccess,
        cancel: CancelToken,
        count: Callable[[], None],
    ) -> None:
        members = members_of(targets)
        self.name = access.name
        self.retry_for = access.retry_for
        self.read_timeout: float | None = access.read_timeout
        self.cancel = cancel
        self.count = count
        self.connections = [Connection(i, m, access.tls) for i, m in enumerate(members)]
        self._pinned = 0
        self._lock = threading.Lock()
        self._cluster: tuple[int, Connection] | None = None  # the first cluster id seen, where
        self._user, self._password = access.user, access.password
        self._token = access.token  # the embedded service's: proven by a challenge, never sent
        self.failovers = 0  # how many times calls moved to another member
        self._said: set[int] = set()  # members whose failure was said, until they answer
        self.closed = threading.Event()  # set by close(): calls under way end with an error

    @property
    def target(self) -> str:
        """The members, as a list."""
        return written([c.member for c in self.connections])

    # ---- the member in use -------------------------------------------------------------------

    @property
    def current(self) -> Connection:
        """The member in use."""
        return self.connections[self._pinned]

    # The member in use's stubs and credential (tests and the early lease grant reach them).
    @property
    def kv(self) -> Any:
        return self.current.kv

    @property
    def lease(self) -> Any:
        return self.current.lease

    @property
    def metadata(self) -> list[tuple[str, str]]:
        return self.current.metadata

    @metadata.setter
    def metadata(self, value: list[tuple[str, str]]) -> None:
        self.current.metadata = value

    def fail_over(self, failed: Connection, why: str) -> bool:
        """Leave member `failed` for the next (if it is still the one in use): what still runs
        on it ends and goes on with the next. False when there is no other member."""
        if len(self.connections) == 1:
            return False
        with self._lock:
            if self.current is not failed or self.closed.is_set():
                return True  # another thread moved on already
            self._pinned = (failed.index + 1) % len(self.connections)
            self.failovers += 1
            nxt = self.current
            said = failed.index in self._said
            self._said.add(failed.index)
        # Said once until the member answers again; a standby of the embedded service that
        # sends the client on to its host is routing, not a failure.
        standby = "is a standby" in why
        log = logger.info if said or standby else logger.warning
        log(
            "%s: member %s %s (%s); going on with %s",
            self.name,
            failed.member.written,
            "stands by" if standby else "failed",
            why,
            nxt.member.written,
        )
        failed.reset()
        return True

    def answered(self, conn: Connection) -> None:
        """Member `conn` answered: a failure of it will be said again."""
        if conn.index in self._said:
            with self._lock:
                self._said.discard(conn.index)

    def check_cluster(self, conn: Connection, reply: Any) -> None:
        """Every member must belong to one cluster: the first answer's cluster id is the
        job's, and a member that answers with another is an error naming both."""
        header = getattr(reply, "header", None)
        cluster = getattr(header, "cluster_id", 0)
        if not cluster:
            return
        with self._lock:
            if self._cluster is None:
                self._cluster = (cluster, conn)
                return
            first, where = self._cluster
        if cluster != first:
            raise StoreError(
                f"--rdzv-endpoint {self.target}: {where.member.written} and "
                f"{conn.member.written} belong to two different clusters (cluster ids {first:x} "
                f"and {cluster:x}); give the members of one cluster only"
            )

    # ---- logging in ------------------------------------------------------------------------

    @property
    def logs_in(self) -> bool:
        """Whether requests carry a login's credential (etcd's user, the embedded token)."""
        return self._user is not None or self._token is not None

    def log_in(self, conn: Connection) -> None:
        """Log in to member `conn` if it needs it and has not yet; one request, which raises
        grpc.RpcError when the member cannot be reached (the caller moves on) and StoreError
        when it refuses this node's credentials."""
        if self.logs_in and not conn.logged_in:
            self.authenticate(conn)

    def authenticate(self, conn: Connection) -> None:
        """Log in to `conn` (again: etcd's simple tokens expire, and are one member's only)."""
        if self._token is not None:
            self._challenge(conn, self._token)
            return
        try:
            reply = conn.auth.Authenticate(
                rpc_pb2.AuthenticateRequest(name=self._user or "", password=self._password or ""),
                timeout=self.read_timeout,
            )
        except grpc.RpcError as e:
            if e.code() in RETRYABLE:
                raise
            raise StoreError(
                f"{self.name} refused user '{self._user}': {e.details()}; check the user and "
                "password given in --rdzv-conf (user=..., password_file=...)"
            ) from None
        conn.metadata = [("token", reply.token)]
        conn.logged_in = True

    def _challenge(self, conn: Connection, token: str) -> None:
        """Log in to the embedded service (:mod:`.challenge`): it proves it holds `token`
        before this node sends anything derived from it."""
        mine = challenge.nonce()
        request = rpc_pb2.AuthenticateRequest(name=challenge.USER, password=mine)
        try:
            reply = conn.auth.Authenticate(request, timeout=self.read_timeout)
        except grpc.RpcError as e:
            if e.code() in RETRYABLE:
                raise
            if "runs without a token" in (e.details() or ""):
                raise StoreError(
                    f"invalid rendezvous token: {self.name} runs without a token and this node "
                    "has one: give every node the same token, or none"
                ) from None
            raise self.error(e) from None
        try:
            credential = challenge.respond(token, mine, reply.token)
        except ValueError as e:
            raise StoreError(
                f"invalid rendezvous token: {self.name} did not prove that it holds this "
                f"node's token ({e}); give every node the job's token (--rdzv-conf "
                "token_file=PATH, or $ELASTICRUN_RDZV_TOKEN)"
            ) from None
        conn.metadata = [("token", credential)]
        conn.logged_in = True

    def relog(self, conn: Connection) -> bool:
        """Log in to `conn` again after it refused a credential; False when it could not be
        reached (the caller moves on as after any failure)."""
        try:
            self.authenticate(conn)
        except grpc.RpcError:
            return False
        return True

    # ---- calls -----------------------------------------------------------------------------

    def call(
        self, method: str, request: Any, deadline: float | None = None, log_in: bool = True
    ) -> Any:
        """The RPC `method` ("kv.Range") on the member in use, moving to the next member at
        once when it fails and retrying while none answers, until `deadline` (monotonic);
        abandoned (Cancelled) as soon as the cancel token is."""
        until = deadline if deadline is not None else time.monotonic() + self.retry_for
        delay = 0.05
        relogged: set[int] = set()  # members logged in again once already
        unanswered = Unanswered(self.name, until)
        failed = 0  # members tried in a row without an answer
        while True:
            self.cancel.check()
            unanswered.check()
            conn = self.current
            try:
                return self._attempt(conn, method, request, log_in)
            except ValueError as e:  # gRPC's "Channel closed!", before the call was sent
                if "Channel closed" not in str(e):
                    raise
                if self.closed.is_set():
                    raise StoreError(f"{self.name}: the store was closed ({e})") from None
                continue  # another thread left this member and closed its channel: go on
            except grpc.RpcError as e:
                code = e.code()
                unauthenticated = code == grpc.StatusCode.UNAUTHENTICATED and self.logs_in
                if unauthenticated and conn.index not in relogged:
                    relogged.add(conn.index)  # etcd's simple tokens expire, and ours
                    conn.logged_in = False
                    continue
                self._retryable(e, time.monotonic() + delay > until)
                why = f"{code.name}: {e.details()}"
                unanswered.failed(
                    why if len(self.connections) == 1 else f"{conn.member.written}: {why}"
                )
                failed += 1
                if self.fail_over(conn, why) and failed % len(self.connections):
                    continue  # the next member at once; a pause once all were tried
            if self.cancel.wait(delay):
                raise Cancelled(self.cancel.signum)
            delay = min(delay * 2, 1.0)

    def _attempt(self, conn: Connection, method: str, request: Any, log_in: bool) -> Any:
        """One try of `method` on `conn`: its answer, or the grpc.RpcError it failed with."""
        if log_in:
            self.log_in(conn)
        self.count()
        future = conn.method(method).future(
            request, timeout=self.read_timeout, metadata=conn.metadata
        )
        unregister = self.cancel.on_cancel(future.cancel)
        try:
            reply = future.result()
        except grpc.FutureCancelledError:
            raise Cancelled(self.cancel.signum) from None
        finally:
            unregister()
        self.check_cluster(conn, reply)
        self.answered(conn)
        return reply

    def _retryable(self, e: grpc.RpcError, too_late: bool) -> None:
        """Return if the failed call `e` is to be tried again, else raise what it means."""
        code = e.code()
        if code == grpc.StatusCode.CANCELLED and self.cancel.cancelled:
            raise Cancelled(self.cancel.signum) from None
        if code == grpc.StatusCode.CANCELLED and self.closed.is_set():
            raise self.error(e) from None  # this store was closed under the call
        if code not in RETRYABLE or too_late:
            raise self.error(e) from None

    def error(self, e: grpc.RpcError) -> StoreError:
        """What a failed call means, in words that say what to check."""
        code, details = e.code(), e.details() or ""
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
            return LeaseGoneError(f"{self.name}: the lease of this node expired ({details})")
        if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
            return HistoryLostError(f"{self.name}: {details}")
        if "database space exceeded" in details and "embedded service" not in details:
            return StoreError(nospace(self.name, details))
        return StoreError(self._words(code, details))

    def _words(self, code: grpc.StatusCode, details: str) -> str:
        if code == grpc.StatusCode.UNAVAILABLE:
            return (
                f"{self.name} is unreachable ({details}); check that it runs and that "
                "--rdzv-endpoint is right"
            )
        if code == grpc.StatusCode.UNAUTHENTICATED or "user name is empty" in details:
            return (
                f"{self.name} refused the request: {details}; give the right token or "
                "user/password in --rdzv-conf"
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return f"{self.name}: permission denied ({details})"
        return f"{self.name}: {code.name}: {details}"

    def close(self) -> None:
        self.closed.set()
        for conn in self.connections:
            conn.close()
