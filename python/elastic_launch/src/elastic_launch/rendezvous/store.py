"""The key-value store the elastic rendezvous runs on: the few operations it needs, in one
interface, implemented over etcd's v3 API (and the embedded service, which speaks the same
subset) and over etcd's v2 API.

Semantics follow etcd v3: every change bumps a store-wide revision; a key's ``version`` is the
revision of its last change (CAS compares it); ephemeral keys belong to this client's liveness
lease and vanish when the client stops renewing it; a watch delivers every change under a prefix
after a given revision, in order, with the new value.
"""

from __future__ import annotations

import abc
import queue
import threading
from dataclasses import dataclass

from elastic_launch.rendezvous.api import RendezvousConnectionError


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


class StoreError(RendezvousConnectionError):
    """The store failed or cannot be reached; the message says which and what to check."""


class Watch(abc.ABC):
    """Changes under a prefix, from a revision on."""

    @abc.abstractmethod
    def next(self, timeout: float) -> list[Change] | None:
        """The next batch of changes, or None if none came within `timeout` seconds."""

    @abc.abstractmethod
    def close(self) -> None: ...


class QueuedWatch(Watch):
    """A watch whose reader thread puts batches of changes (or the error that ended it) on a
    queue; `next` hands them out and raises the error."""

    def __init__(self) -> None:
        self._changes: queue.Queue[list[Change] | Exception] = queue.Queue()

    def next(self, timeout: float) -> list[Change] | None:
        try:
            item = self._changes.get(timeout=max(timeout, 0.0))
        except queue.Empty:
            return None
        if isinstance(item, Exception):
            raise item
        return item

    def _wake_reader(self) -> None:
        """On close: a `next` waiting now returns (an empty batch) instead of timing out."""
        self._changes.put([])


class Store(abc.ABC):
    """One agent's connection to the store. Thread-safe."""

    def __init__(self) -> None:
        self.retry_for = 30.0  # seconds a request keeps retrying an unreachable store
        self._lost = False  # set by the lease keeper when the lease expired
        self._requests = 0
        self._count_lock = threading.Lock()

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
        """Write `key` only if it does not exist: its version, or 0 if it existed."""

    @abc.abstractmethod
    def cas(self, key: str, value: bytes, version: int) -> int:
        """Replace `key` only if its version is still `version`: the key's new version, or 0
        if it had moved on."""

    @abc.abstractmethod
    def delete(self, key: str, prefix: bool = False) -> None: ...

    @abc.abstractmethod
    def watch(self, prefix: str, after_revision: int) -> Watch:
        """Watch changes under `prefix` made after `after_revision`."""

    @abc.abstractmethod
    def start_liveness(self, ttl: float) -> None:
        """Start this client's lease (renewed in the background every ttl/3 seconds)."""

    def liveness_lost(self) -> bool:
        """True once the lease expired (the store may have dropped our ephemeral keys)."""
        return self._lost

    def reset_liveness(self) -> None:
        """Forget a past expiry (a new lease is in place and the caller rejoined)."""
        self._lost = False

    def ensure_lease(self) -> None:  # noqa: B027 - optional: TTL-key stores (v2) need nothing
        """Make sure the lease is valid now (grant a new one if it expired), before writing
        ephemeral keys again after an expiry."""

    @abc.abstractmethod
    def close(self) -> None:
        """Revoke the lease (ephemeral keys go at once) and disconnect; idempotent."""
