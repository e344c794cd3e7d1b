"""One connection to etcd's v3 API (or the embedded service, which serves the same subset): the
gRPC channel, logging in, and calls retried while the store is unreachable (an etcd restart),
up to a deadline, abandoned at once when the cancel token is.

The store (:mod:`.etcd_v3`), its lease (:mod:`.etcd_v3_lease`) and its watches
(:mod:`.etcd_v3_watch`) all call through one :class:`Client`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from elastic_launch.api import Cancelled
from elastic_launch.cancel import CancelToken
from elastic_launch.rendezvous import challenge
from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc
from elastic_launch.rendezvous.store import StoreAccess, StoreError, Tls, Unanswered

# A server that ran out of a request's deadline before answering may reset the stream, which
# the client sees as CANCELLED, not DEADLINE_EXCEEDED: retried alike (a cancellation of our
# own is told apart by the cancel token). Like a deadline, it may come after a write was
# committed: a retried conditional write then reports it lost (0), and the rendezvous, which
# reads the store again after every lost compare-and-swap, finds it there.
RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
}


class LeaseGoneError(StoreError):
    """A write named a lease the store no longer has: it expired while this node was cut off."""


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def channel(target: str, tls: Tls | None, options: list[tuple[str, Any]] | None = None) -> Any:
    """A gRPC channel to `target`: over TLS when `tls` (ca, cert, key paths, any may be
    None) is given, else plain."""
    if tls is None:
        return grpc.insecure_channel(target, options=options)
    ca, cert, key = (_read(p) if p else None for p in tls)
    creds = grpc.ssl_channel_credentials(ca, key, cert)
    return grpc.secure_channel(target, creds, options=options)


class Client:
    """A channel to `target`, as `access` says to reach it; every request is counted with
    `count`. Thread-safe."""

    def __init__(
        self,
        target: str,
        access: StoreAccess,
        cancel: CancelToken,
        count: Callable[[], None],
    ) -> None:
        self.target = target
        self.name = access.name
        self.retry_for = access.retry_for
        self.read_timeout: float | None = access.read_timeout
        self.cancel = cancel
        self.count = count
        options = [("grpc.keepalive_time_ms", 10000), ("grpc.keepalive_timeout_ms", 5000)]
        self.channel = channel(target, access.tls, options)
        self.kv = rpc_pb2_grpc.KVStub(self.channel)
        self.lease = rpc_pb2_grpc.LeaseStub(self.channel)
        self.watch = rpc_pb2_grpc.WatchStub(self.channel)
        self.maintenance = rpc_pb2_grpc.MaintenanceStub(self.channel)
        self._auth = rpc_pb2_grpc.AuthStub(self.channel)
        self._user, self._password = access.user, access.password
        self._token = access.token  # the embedded service's: proven by a challenge, never sent
        #: What every request carries (etcd's token for a user, or the challenge's credential).
        self.metadata: list[tuple[str, str]] = []
        self._logged_in = access.token is None
        self.closed = threading.Event()  # set by close(): calls under way end with an error
        if access.user is not None:
            self.authenticate()

    # ---- logging in ------------------------------------------------------------------------

    @property
    def logs_in(self) -> bool:
        """Whether requests carry a login's credential (etcd's user, the embedded token)."""
        return self._user is not None or self._token is not None

    def authenticate(self) -> None:
        """Log in (again: etcd's simple tokens expire, and so do the service's credentials)."""
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
        self.metadata = [("token", reply.token)]

    def _challenge(self, token: str) -> None:
        """Log in to the embedded service (:mod:`.challenge`): it proves it holds `token`
        before this node sends anything derived from it."""
        mine = challenge.nonce()
        request = rpc_pb2.AuthenticateRequest(name=challenge.USER, password=mine)
        try:
            reply = self.call(self._auth.Authenticate, request, log_in=False)
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
        self.metadata = [("token", credential)]
        self._logged_in = True

    def log_in_once(self) -> None:
        if not self._logged_in:
            self.authenticate()

    # ---- calls -----------------------------------------------------------------------------

    def call(
        self, method: Any, request: Any, deadline: float | None = None, log_in: bool = True
    ) -> Any:
        """One RPC, retried while the store is unreachable, until `deadline` (monotonic);
        abandoned (Cancelled) as soon as the cancel token is."""
        if log_in:
            self.log_in_once()
        until = deadline if deadline is not None else time.monotonic() + self.retry_for
        delay = 0.05
        relogged = not log_in  # a login of its own is not tried again
        unanswered = Unanswered(self.name, until)
        while True:
            self.cancel.check()
            unanswered.check()
            self.count()
            future = method.future(request, timeout=self.read_timeout, metadata=self.metadata)
            unregister = self.cancel.on_cancel(future.cancel)
            try:
                return future.result()
            except grpc.FutureCancelledError:
                raise Cancelled(self.cancel.signum) from None
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED and self.logs_in and not relogged:
                    self.authenticate()  # etcd's simple tokens expire, and our credentials
                    relogged = True
                    continue
                self._retryable(e, time.monotonic() + delay > until)
                unanswered.failed(f"{e.code().name}: {e.details()}")
            finally:
                unregister()
            if self.cancel.wait(delay):
                raise Cancelled(self.cancel.signum)
            delay = min(delay * 2, 1.0)

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

    def close(self) -> None:
        self.closed.set()
        self.channel.close()
