"""One client of etcd's v3 API (or of the embedded service, which serves the same subset): its
members, the one in use, logging in, and calls retried while the store is unreachable, up to a
deadline, abandoned at once when the cancel token is.

A store is a set of members (etcd's cluster, or the embedded service's hosts). As etcd's own
client does, every call, the lease's keep-alive and each watch run on one member, and move to
the next when theirs fails (refuses, errs, or hangs past a deadline): nothing above this client
knows which member answered. Members the store itself names are used too (:meth:`Client.learn`:
the successor the agents chose, the host a standby's refusal names).

Every answer's header names its cluster (:mod:`.identity`): members of two clusters in one
list are an error, and a member started again empty at its address (its data lost, no other
member serving ours) is the store *replaced*: the client takes it as the store from now on, and
``on_replaced`` fills it again with what this node knows, while the client's other calls wait.

The store (:mod:`.v3`), its lease (:mod:`.v3_lease`) and its watches
(:mod:`.v3_watch`) all call through one :class:`Client`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc

from elastic_launch.api import Cancelled, ConfigError
from elastic_launch.cancel import CancelToken
from elastic_launch.net import is_loopback, listener_owners, parse_endpoint
from elastic_launch.rendezvous.etcd.v3_identity import StoreIdentity
from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.store import challenge
from elastic_launch.rendezvous.store.api import (
    HistoryLostError,
    StoreAccess,
    StoreError,
    Tls,
    Unanswered,
    nospace,
)
from elastic_launch.rendezvous.store.endpoints import StoreMember, members_of, written
from elastic_launch.rendezvous.store.identity import Answered, mixed
from elastic_launch.rendezvous.store.wire import CLUSTER_KEY, HOST_KEY

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
#: Members learned from the store a client keeps at most (the oldest not in use is dropped).
MAX_LEARNED = 8
#: What every stream asks of etcd: a member cut off from its cluster's leader ends the stream
#: (etcd's WithRequireLeader) instead of keeping it open and silent.
STREAM_METADATA = [("hasleader", "true")]


class LeaseGoneError(StoreError):
    """A write named a lease the store no longer has: it expired while this node was cut off."""


class NotProvenError(StoreError):
    """A member that did not prove it holds the job's token (a wrong token, or a process
    without it that took the member's port and passes logins on)."""


class AskAgainError(Exception):
    """An answer that is not to be used: its member was left for another, or it showed the
    store replaced (now filled again). The call is made again at once."""


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

    def __init__(
        self, index: int, member: StoreMember, tls: Tls | None, learned: bool = False
    ) -> None:
        self.index = index
        self.member = member
        self.learned = learned  # named by the store, not by --rdzv-endpoint
        self._tls = tls
        self.metadata: list[tuple[str, str]] = []  # etcd's token, or the challenge's credential
        self.logged_in = False
        self.answered: Answered | None = None  # its cluster and newest read, as last seen
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
        self._tls = access.tls
        self.connections = [Connection(i, m, access.tls) for i, m in enumerate(members)]
        self._current = self.connections[0]  # the member in use (not an index: the list changes)
        self._preferred: Connection | None = None  # the member to leave a failing one for
        self._lock = threading.Lock()
        #: Fills a replaced store again (the store's lease, then the rendezvous's keys).
        self.on_replaced: Callable[[], None] = lambda: None
        #: Which store the members answer for, and what is done when it was replaced.
        self.identity = StoreIdentity(self)
        self._user, self._password = access.user, access.password
        self._trusted = access.trusted_network
        self._refused: set[str] = set()  # members named but not used, said once
        self._token = access.token  # the embedded service's: proven by a challenge, never sent
        self.failovers = 0  # how many times calls moved to another member
        self._said: set[int] = set()  # members whose failure was said, until they answer
        self.closed = threading.Event()  # set by close(): calls under way end with an error

    @property
    def target(self) -> str:
        """The members given, as a list."""
        return written([c.member for c in self.connections if not c.learned])

    def learn(self, member: StoreMember, prefer: bool = False) -> Connection | None:
        """A member the store named (the successor the agents chose, the host a standby's
        refusal names): used like those given, after them (None: not used, see
        :func:`unproven`). At most MAX_LEARNED are kept. With `prefer` (the successor named
        now), it is the one a failing member is left for first: older ones may be gone."""
        conn = self._learn(member)
        if prefer and conn is not None:
            self._preferred = conn
        return conn

    def _learn(self, member: StoreMember) -> Connection | None:
        problem = None if self.logs_in or self._trusted else unproven(member)
        if problem is not None:
            if member.target not in self._refused:
                self._refused.add(member.target)
                logger.warning("%s: %s is not used: %s", self.name, member.written, problem)
            return None
        with self._lock:
            for conn in self.connections:
                if conn.member.target == member.target:
                    return conn
            learned = [
                c
                for c in self.connections
                if c.learned and c is not self.current and c is not self._preferred
            ]
            if len(learned) >= MAX_LEARNED:
                self.connections.remove(learned[0])
                learned[0].close()
                for i, c in enumerate(self.connections):
                    c.index = i
                self._said.clear()
            conn = Connection(len(self.connections), member, self._tls, learned=True)
            self.connections.append(conn)
            return conn

    def asking(self, conn: Connection) -> tuple[str, list[tuple[str, str]]]:
        """A fresh nonce for a call to `conn` whose refusal may be acted on, and the call's
        metadata (with the job's token, a standby proves its refusal for that nonce)."""
        return challenge.asking(conn.metadata, self._token is not None)

    def redirect(
        self, failed: Connection, error: grpc.RpcError, call_nonce: str
    ) -> Connection | None:
        """The host a standby's refusal names (learned), or None. The cluster the standby
        says it follows is judged as its answer: a store this client knew only through it
        may have been replaced by the job's own. With the job's token, a refusal is believed
        only with the standby's proof of it for the call's nonce (`call_nonce`): a process
        that took a member's port cannot send the client elsewhere or make it judge."""
        token = self._token
        target = failed.member.target

        def proven(host: str, cluster: str, proof: str) -> bool:
            if token is None:
                return True
            return challenge.attested(token, target, call_nonce, proof, "refusal", host, cluster)

        named = named_host(error, proven)
        if named is None:
            return None
        address, cluster = named
        if cluster:
            self.identity.judge(failed, cluster)
        return self.learn(address)

    # ---- the member in use -------------------------------------------------------------------

    @property
    def current(self) -> Connection:
        """The member in use."""
        return self._current

    def fail_over(
        self,
        failed: Connection,
        why: str,
        error: grpc.RpcError | None = None,
        call_nonce: str = "",
    ) -> bool:
        """Leave member `failed` for the next (if it is still the one in use), or for the host
        its refusal (`error`) names: what still runs on it ends and goes on with that one.
        False when there is no other member."""
        to = self.redirect(failed, error, call_nonce) if error is not None else None
        if len(self.connections) == 1:
            return False
        with self._lock:
            if self.current is not failed or self.closed.is_set():
                return True  # another thread moved on already
            if failed is self._preferred:
                self._preferred = None  # it failed: the others in turn, until another is named
            nxt = next(
                (c for c in (to, self._preferred) if c is not None and c is not failed), None
            )
            if nxt is None or nxt not in self.connections or not self._usable(nxt):
                nxt = self._after(failed)
            self._current = nxt
            nxt.logged_in = False  # it proves again who it is before it is used
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

    def _after(self, failed: Connection) -> Connection:
        """The member after `failed` in turn that may be used (the first if none may)."""
        n = len(self.connections)
        start = failed.index if failed in self.connections else -1
        for step in range(1, n + 1):
            conn = self.connections[(start + step) % n]
            if self._usable(conn):
                return conn
        return self.connections[0]

    def _usable(self, conn: Connection) -> bool:
        """Whether `conn` may be used: without a credential, a member is checked again each
        time (its port may have been taken by another user since); one the store named must
        be on loopback too."""
        if self.logs_in or self._trusted:
            return True
        if conn.learned:
            return unproven(conn.member) is None
        member = conn.member
        return not (is_loopback(member.host) and listener_owners(member.port) - {os.getuid()})

    def answered(self, conn: Connection) -> None:
        """Member `conn` answered: a failure of it will be said again."""
        if conn.index in self._said:
            with self._lock:
                self._said.discard(conn.index)

    def status(self, conn: Connection) -> Any | None:
        """Member `conn`'s status (logged in first), or None if it does not answer."""
        try:
            self.log_in(conn)
        except (grpc.RpcError, StoreError, AskAgainError):
            return None
        return status_of(conn, min(self.read_timeout or 2.0, 2.0))

    def check_one_cluster(self) -> None:
        """At start: the listed members that answer (asked together, each within the status
        bound) belong to one cluster; StoreError naming two that do not, whatever the order
        of the list (agents given it in two orders would otherwise make two jobs)."""
        listed = [c for c in self.connections if not c.learned]
        if len(listed) < 2:
            return
        with ThreadPoolExecutor(len(listed), thread_name_prefix="elasticrun-status") as pool:
            statuses = list(pool.map(self.status, listed))
        answers = [
            (c.member.written, f"{s.header.cluster_id:x}")
            for c, s in zip(listed, statuses)
            if s is not None
        ]
        problem = mixed(self.target, answers)
        if problem is not None:
            raise StoreError(problem)

    def pin(self, conn: Connection) -> None:
        """Use member `conn` from now on."""
        with self._lock:
            self._current = conn

    def check_cluster(self, conn: Connection, reply: Any, floor: int | None = None) -> bool:
        """See :meth:`.etcd_v3_identity.StoreIdentity.check`."""
        return self.identity.check(conn, reply, floor)

    @property
    def epoch(self) -> int:
        """How many times the store was replaced (started again empty)."""
        return self.identity.epoch

    def same_store(self) -> bool:
        """Ask the member in use for a read (linearizable, of nothing): False if its answer
        shows the store started again empty (then filled again, before this returns). Asked
        before anything gone from the store is taken as gone: a lease that seems expired."""
        epoch = self.epoch
        try:
            self.call("kv.Range", rpc_pb2.RangeRequest(key=b"\0", limit=1))
        except StoreError:
            return True  # unreachable: nothing to tell (the caller goes on as it would)
        return self.epoch == epoch

    # ---- logging in ------------------------------------------------------------------------

    @property
    def logs_in(self) -> bool:
        """Whether requests carry a login's credential (etcd's user, the embedded token)."""
        return self._user is not None or self._token is not None

    def log_in(self, conn: Connection) -> None:
        """Log in to member `conn` if it needs it and has not yet; one request, which raises
        grpc.RpcError when the member cannot be reached (the caller moves on) and StoreError
        when it refuses this node's credentials. A member the store named that does not log
        this node in (it cannot prove it holds the token: another process took its port) is
        left for the next, and AskAgainError raised: it costs a member, not the job. A listed
        one raises NotProvenError: the call tries the others while it may."""
        if not self.logs_in or conn.logged_in:
            return
        try:
            self.authenticate(conn)
        except StoreError as e:
            if not conn.learned:
                raise
            self.fail_over(conn, f"it did not log this node in: {e}")
            raise AskAgainError(conn.member.written) from None

    def authenticate(self, conn: Connection) -> None:
        """Log in to `conn` (again: etcd's simple tokens expire, and are one member's only)."""
        timeout = self.read_timeout
        if self._token is not None:
            conn.metadata = [("token", prove_token(conn, self.name, self._token, timeout))]
        else:
            token = user_token(conn, self.name, (self._user or "", self._password or ""), timeout)
            conn.metadata = [("token", token)]
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
            epoch = self.identity.enter()
            asked: list[str] = []  # the nonce of the attempt, once sent
            try:
                return self._attempt(conn, method, request, (log_in, epoch), asked)
            except AskAgainError:
                continue
            except NotProvenError as e:  # a listed member: the others may be the job's
                if len(self.connections) == 1 or time.monotonic() + delay > until:
                    raise
                unanswered.failed(f"{conn.member.written}: {e}")
                failed += 1
                if self.fail_over(conn, str(e)) and failed % len(self.connections):
                    continue
            except ValueError as e:  # gRPC's "Channel closed!", before the call was sent
                self._check_closed(e)
                continue  # another thread left this member and closed its channel: go on
            except grpc.RpcError as e:
                if self.epoch != epoch:
                    continue  # a refusal of the store before it was replaced: ask again
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
                named = e if self.epoch == epoch and asked else None  # of the store it had
                if self.fail_over(conn, why, named, *asked) and failed % len(self.connections):
                    continue  # the next member at once; a pause once all were tried
            if self.cancel.wait(delay):
                raise Cancelled(self.cancel.signum)
            delay = min(delay * 2, 1.0)

    def _check_closed(self, e: ValueError) -> None:
        """Return if `e` is gRPC's refusal of a call on a channel another thread closed (the
        call is asked again); raise what it means otherwise."""
        if not _closed_channel(e):
            raise e
        if self.closed.is_set():
            raise StoreError(f"{self.name}: the store was closed ({e})") from None

    def _attempt(
        self, conn: Connection, method: str, request: Any, how: tuple[bool, int], asked: list[str]
    ) -> Any:
        """One try of `method` on `conn` (logged in first if `how` says so), sent in the
        client's epoch (`how`'s second): its answer, or the grpc.RpcError it failed with
        (AskAgainError: an answer not to be used: one to a call sent before the store was
        replaced is not even judged, see :meth:`check_cluster`). The call's nonce goes into
        `asked` once it is sent: a failure before that (the login's) names no host."""
        log_in, epoch = how
        if log_in:
            self.log_in(conn)
        floor = self.identity.floor(conn)
        self.count()
        call_nonce, metadata = self.asking(conn)
        asked.append(call_nonce)
        future = conn.method(method).future(request, timeout=self.read_timeout, metadata=metadata)
        unregister = self.cancel.on_cancel(future.cancel)
        try:
            reply = future.result()
        except grpc.FutureCancelledError:
            raise Cancelled(self.cancel.signum) from None
        finally:
            unregister()
        if self.epoch != epoch:  # sent to the store before it was replaced
            raise AskAgainError(method)
        if not self.check_cluster(conn, reply, floor if method.startswith("kv.") else None):
            raise AskAgainError(method)
        if self.epoch != epoch:  # replaced while this answer was judged
            raise AskAgainError(method)
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
        return error_of(self.name, e)

    def close(self) -> None:
        self.closed.set()
        for conn in self.connections:
            conn.close()


def user_token(
    conn: Connection, name: str, credentials: tuple[str, str], timeout: float | None
) -> str:
    """etcd's token for (user, password) at member `conn` of the store `name`."""
    user, password = credentials
    try:
        reply = conn.auth.Authenticate(
            rpc_pb2.AuthenticateRequest(name=user, password=password), timeout=timeout
        )
    except grpc.RpcError as e:
        if e.code() in RETRYABLE:
            raise
        raise StoreError(
            f"{name} refused user '{user}': {e.details()}; check the user and password given "
            "in --rdzv-conf (user=..., password_file=...)"
        ) from None
    return str(reply.token)


def prove_token(conn: Connection, name: str, token: str, timeout: float | None) -> str:
    """The credential of a login to the embedded service at `conn` (:mod:`.challenge`): it
    proves it holds `token` before this node sends anything derived from it."""
    asked = challenge.ask(conn.member.target)
    request = rpc_pb2.AuthenticateRequest(name=challenge.USER, password=asked.password)
    try:
        reply = conn.auth.Authenticate(request, timeout=timeout)
    except grpc.RpcError as e:
        if e.code() in RETRYABLE:
            raise
        if "runs without a token" in (e.details() or ""):
            raise StoreError(
                f"invalid rendezvous token: {name} runs without a token and this node has one: "
                "give every node the same token, or none"
            ) from None
        if e.code() == grpc.StatusCode.PERMISSION_DENIED:
            raise NotProvenError(f"{name} at {conn.member.written}: {e.details()}") from None
        raise error_of(name, e) from None
    try:
        return challenge.respond(token, asked, reply.token)
    except ValueError as e:
        raise NotProvenError(
            f"invalid rendezvous token: {name} did not prove that it holds this node's token "
            f"({e}); give every node the job's token (--rdzv-conf token_file=PATH, or "
            "$ELASTICRUN_RDZV_TOKEN)"
        ) from None


def error_of(name: str, e: grpc.RpcError) -> StoreError:
    """What a failed call to the store `name` means, in words that say what to check."""
    code, details = e.code(), e.details() or ""
    if code == grpc.StatusCode.NOT_FOUND and "lease not found" in details:
        return LeaseGoneError(f"{name}: the lease of this node expired ({details})")
    if code == grpc.StatusCode.OUT_OF_RANGE and "compacted" in details:
        return HistoryLostError(f"{name}: {details}")
    if "database space exceeded" in details and "embedded service" not in details:
        return StoreError(nospace(name, details))
    return StoreError(_words(name, code, details))


def _words(name: str, code: grpc.StatusCode, details: str) -> str:
    if code == grpc.StatusCode.UNAVAILABLE:
        return (
            f"{name} is unreachable ({details}); check that it runs and that --rdzv-endpoint "
            "is right"
        )
    if code == grpc.StatusCode.UNAUTHENTICATED or "user name is empty" in details:
        return (
            f"{name} refused the request: {details}; give the right token or user/password "
            "in --rdzv-conf"
        )
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return f"{name}: permission denied ({details})"
    return f"{name}: {code.name}: {details}"


def status_of(conn: Connection, timeout: float) -> Any | None:
    """Member `conn`'s status (it is logged in), or None if it does not answer."""
    try:
        return conn.maintenance.Status(
            rpc_pb2.StatusRequest(), timeout=timeout, metadata=conn.metadata
        )
    except grpc.RpcError:
        return None


def named_host(
    error: grpc.RpcError, proven: Callable[[str, str, str], bool]
) -> tuple[StoreMember, int] | None:
    """The host a standby's refusal `error` names, and the cluster it says it follows (0:
    not said); None if it names none, or if `proven(host, cluster, proof)` says its proof
    does not hold."""
    said = dict(_trailing(error))
    host = said.get(HOST_KEY, "")
    if not host or not proven(host, said.get(CLUSTER_KEY, ""), said.get(challenge.PROOF_KEY, "")):
        return None
    try:
        address = StoreMember(*parse_endpoint(host, "the host a standby named"))
        return address, int(said.get(CLUSTER_KEY, "0"), 16)
    except (ConfigError, ValueError):
        return None


def unproven(member: StoreMember) -> str | None:
    """Why a member the store named may not be used by a client without a credential (which
    would prove the member holds the job's token), or None: only a port on loopback that no
    other user listens on is this job's for sure."""
    if not is_loopback(member.host):
        return (
            "it is beyond loopback, and without a token nothing proves it is the job's (give "
            "every node the token, or --rdzv-conf allow_unauthenticated=true on a network you "
            "trust)"
        )
    others = sorted(listener_owners(member.port) - {os.getuid()})
    if others:
        return (
            f"another user (uid {others[0]}) listens there, and without a token nothing "
            "proves it is the job's"
        )
    return None


def _closed_channel(e: ValueError) -> bool:
    """Whether `e` is gRPC's refusal of a call on a channel another thread closed ("Channel
    closed!", "Cannot invoke RPC on closed channel!")."""
    text = str(e).lower()
    return "channel closed" in text or "closed channel" in text


def _trailing(error: grpc.RpcError) -> list[tuple[str, str]]:
    """A failed call's trailing metadata (none for an error gRPC made itself)."""
    try:
        return [(str(k), str(v)) for k, v in (error.trailing_metadata() or ())]
    except (AttributeError, ValueError):
        return []
