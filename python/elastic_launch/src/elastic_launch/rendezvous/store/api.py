"""The key-value store the elastic rendezvous runs on: the few operations it needs, in one
interface, implemented over etcd's v3 API (and the embedded service, which speaks the same
subset) and over etcd's v2 API.

Semantics follow etcd v3: every change bumps a store-wide revision; a key's ``version`` is the
revision of its last change (CAS compares it); ephemeral keys belong to this client's lease and
vanish when the client stops renewing it; a watch delivers every change under a prefix after a
given revision, in order, with the new value. Every request is bounded (``read_timeout``),
retried while the store is unreachable (up to ``retry_for``) and abandoned at once when the
store's cancel token is cancelled.
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Optional

from elastic_launch.cancel import NEVER, CancelToken, Deadline, Notice, clock
from elastic_launch.rendezvous.api import RendezvousConnectionError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class KeyValue:
    key: str
    value: bytes
    version: int  # revision of the key's last change (its CAS token)
    created: int  # revision of the key's creation


@dataclass(frozen=True)
class Change:
    key: str
    value: bytes | None  # None: deleted (or expired)
    revision: int


#: TLS for a store: the CA, certificate and key paths, any of which may be None.
Tls = tuple[Optional[str], Optional[str], Optional[str]]


@dataclass(frozen=True)
class StoreAccess:
    """How a node reaches a store and proves who it is."""

    name: str = "the store"  # what the store is, in messages ("etcd at host:port", ...)
    token: str | None = None  # the embedded service's shared secret: proven, never sent
    user: str | None = None  # etcd's authentication
    password: str | None = None
    tls: Tls | None = None
    retry_for: float = 30.0  # seconds a request keeps retrying an unreachable store
    read_timeout: float | None = None  # seconds one request may take (None: the default)
    #: Without a credential, members the store names (a successor, a standby's host) are used
    #: only on loopback and of this user, unless the network is trusted (allow_unauthenticated).
    trusted_network: bool = False


class StoreError(RendezvousConnectionError):
    """The store failed or cannot be reached; the message says which and what to check."""


class HistoryLostError(StoreError):
    """A watch could not go on from the revision after the last one it delivered: the store
    compacted that history away (etcd's "required revision has been compacted"), or its new
    host does not have it. The watcher reads the keys again and watches from that read."""


class StoreReplacedError(HistoryLostError):
    """The store was started again empty and is being filled again by the nodes, each with
    what it knows: a key another node put back may not be back yet when this one reads."""


class Inbox:
    """Where watches deliver batches of changes, and where anything else that should end a wait
    (a cancellation, a lost lease, a closed watch) puts a wake-up: one queue a waiter reads,
    so one wait covers several watches."""

    def __init__(self) -> None:
        self._items: queue.Queue[list[Change] | Exception] = queue.Queue()
        self._watches: list[Watch] = []

    def put(self, item: list[Change] | Exception) -> None:
        self._items.put(item)

    def wake(self) -> None:
        """End a wait now (it returns an empty batch)."""
        self._items.put([])

    def next(self, timeout: float) -> list[Change] | None:
        """The next batch (empty for a wake-up), or None if nothing came within `timeout`;
        raises the error that ended a watch."""
        try:
            item = self._items.get(timeout=None if timeout == float("inf") else max(timeout, 0.0))
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def adopt(self, watch: Watch) -> None:
        self._watches.append(watch)

    def close(self) -> None:
        """Close every watch feeding this inbox."""
        watches, self._watches = self._watches, []
        for w in watches:
            w.close()

    def __enter__(self) -> Inbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Watch(abc.ABC):
    """Changes under a prefix, from a revision on, delivered to an :class:`Inbox`."""

    def __init__(self, inbox: Inbox | None) -> None:
        self.inbox = inbox if inbox is not None else Inbox()
        self.inbox.adopt(self)

    def next(self, timeout: float) -> list[Change] | None:
        """The next batch of changes, or None if none came within `timeout` seconds."""
        return self.inbox.next(timeout)

    @abc.abstractmethod
    def close(self) -> None: ...


class Unanswered:
    """While a retried request gets no answer: the last failure, said now and again (a
    :class:`Notice`) with where and until when the request keeps trying. Every request makes
    one; the notice is built only at its first failure."""

    def __init__(self, name: str, until: float) -> None:
        self.last = ""  # the last failure; empty while the store answers
        self._name = name
        self._until = until
        self._start = time.monotonic()
        self._notice: Notice | None = None

    def failed(self, why: str) -> None:
        self.last = why
        if self._notice is None:  # due AFTER seconds from the request's start, as any wait
            waited = time.monotonic() - self._start
            self._notice = Notice(self._describe, logger.warning, max(0.0, Notice.AFTER - waited))

    def check(self) -> None:
        """Say it if a failure was seen and the notice is due."""
        if self._notice is not None:
            self._notice.check()

    def _describe(self) -> str:
        until = clock(Deadline(self._until - time.monotonic()))
        return (
            f"waiting for {self._name} to answer ({self.last}); retrying until {until}, then "
            "giving up (check that it runs and that --rdzv-endpoint is right)"
        )


#: Seconds one store request may take (--rdzv-conf read_timeout).
DEFAULT_READ_TIMEOUT = 10.0


class Store(abc.ABC):
    """One agent's connection to the store. Thread-safe."""

    name = "the store"

    def __init__(self, access: StoreAccess, cancel: CancelToken = NEVER) -> None:
        read_timeout = access.read_timeout
        if read_timeout is None:
            read_timeout = DEFAULT_READ_TIMEOUT
        self.name = access.name
        self._retry_for = access.retry_for
        self.read_timeout = read_timeout  # seconds one request may take
        self.cancel = cancel
        self._requests = 0
        self._count_lock = threading.Lock()
        self._on_lost: Callable[[], None] = lambda: None
        #: Puts back what the job needs when the store was started again empty (a store that
        #: can tell: the v3 API's, by its cluster id and revisions). Its calls go through
        #: while this node's others wait.
        self.on_replaced: Callable[[], None] = lambda: None

    @property
    def replaced_at(self) -> float | None:
        """When (monotonic) this node last found the store started again empty, if ever: the
        other nodes put their keys back within a lease's time of it."""
        return None

    @property
    def retry_for(self) -> float:
        """Seconds a request keeps retrying an unreachable store (the rendezvous shortens it
        to its reconnect timeout once the job runs)."""
        return self._retry_for

    @retry_for.setter
    def retry_for(self, seconds: float) -> None:
        self._retry_for = seconds

    def _count(self, n: int = 1) -> None:
        with self._count_lock:
            self._requests += n

    @property
    def requests(self) -> int:
        """Requests sent so far (for the benchmarks: requests per round as nodes grow)."""
        return self._requests

    @abc.abstractmethod
    def get(self, key: str) -> KeyValue | None: ...

    @abc.abstractmethod
    def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Every key under `prefix`, and the store revision they were read at."""

    @abc.abstractmethod
    def put(self, key: str, value: bytes, ephemeral: bool = False) -> int:
        """Write `key`; returns the new revision."""

    @abc.abstractmethod
    def create(self, key: str, value: bytes, ephemeral: bool = False) -> int:
        """Write `key` only if it does not exist: its version, or 0 if it existed. An
        ephemeral key that exists with this very value (and, where there are leases, this
        store's lease) is this store's own write, whose answer was lost and retried: its
        version, not 0."""

    @abc.abstractmethod
    def cas(self, key: str, value: bytes, version: int, ttl: float | None = None) -> int:
        """Replace `key` only if its version is still `version` (0: only if absent): the key's
        new version, or 0 if it had moved on. With `ttl` the key expires after that many
        seconds (a lease or TTL of its own, never renewed)."""

    def put_get(
        self, key: str, value: bytes, get_key: str, ephemeral: bool = False
    ) -> KeyValue | None:
        """Write `key`, then read `get_key`: in one request where the store can (etcd v3: one
        transaction); here a put, then a get."""
        self.put(key, value, ephemeral)
        return self.get(get_key)

    def cas_with(self, key: str, value: bytes, version: int, puts: Mapping[str, bytes]) -> int:
        """`cas` of `key`, with `puts` written too: in the same transaction where the store can
        (etcd v3: all of them or none); here each of them first, then the cas, so a cas that
        loses leaves them behind (keys of a round the caller's cleanup drops)."""
        for other, other_value in puts.items():
            self.put(other, other_value)
        return self.cas(key, value, version)

    @abc.abstractmethod
    def delete(self, key: str, prefix: bool = False) -> None: ...

    @abc.abstractmethod
    def watch(self, prefix: str, after_revision: int, inbox: Inbox | None = None) -> Watch:
        """Watch changes under `prefix` made after `after_revision`."""

    def watch_many(self, prefixes: list[str], after_revision: int, inbox: Inbox) -> list[Watch]:
        """Watch several prefixes into one inbox (a store may serve them on one stream)."""
        return [self.watch(p, after_revision, inbox) for p in prefixes]

    @abc.abstractmethod
    def start_liveness(self, ttl: float, on_lost: Callable[[], None] | None = None) -> None:
        """Start this client's lease (renewed in the background every ttl/3 seconds). Should
        it expire (the client was cut off), a new one is granted and `on_lost` is called: the
        store may have dropped our ephemeral keys."""

    def request_lease(self, ttl: float) -> None:  # noqa: B027 - optional: an early start
        """Ask for the lease now without waiting for the answer (the agent starts meanwhile);
        `start_liveness` then uses it, or asks again if the request failed."""

    def ensure_lease(self) -> None:  # noqa: B027 - optional: TTL-key stores (v2) need nothing
        """Make sure the lease is valid now (grant a new one if it expired), before writing
        ephemeral keys again after an expiry."""

    def lease_hold(self) -> tuple[int, float] | None:
        """(leases granted so far, until when (``time.monotonic``) the store holds the one in
        use for sure), or None where this store cannot say (its workers are then not fenced:
        :mod:`elastic_launch.processes.fence`)."""
        return None

    @abc.abstractmethod
    def close(self) -> None:
        """Revoke the lease (ephemeral keys go at once) and disconnect; idempotent."""


def nospace(name: str, details: str) -> str:
    """etcd's NOSPACE alarm, in words that say what to run."""
    return (
        f"{name} raised its NOSPACE alarm ({details}): its database reached its quota "
        "(--quota-backend-bytes), and it refuses every write until space is freed and the "
        "alarm is disarmed; run `etcdctl compact REVISION` (the revision `etcdctl endpoint "
        "status -w json` shows), `etcdctl defrag` and `etcdctl alarm disarm`, or give etcd a "
        "larger --quota-backend-bytes"
    )
