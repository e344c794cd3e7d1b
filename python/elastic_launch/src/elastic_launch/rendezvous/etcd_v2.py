"""The store over etcd's v2 API (python-etcd), for clusters that still serve it (etcd started with
``--enable-v2``; etcd 3.6 removed it). Versions are v2 modified indexes; ephemeral keys are TTL
keys refreshed in the background (v2 has no leases); watches are long polls that continue from
the last index they saw.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from elastic_launch.api import Cancelled
from elastic_launch.cancel import NEVER, CancelToken, join
from elastic_launch.rendezvous.store import (
    Change,
    Inbox,
    KeyValue,
    Store,
    StoreAccess,
    StoreError,
    Unanswered,
    Watch,
)

logger = logging.getLogger(__name__)

# A long poll that hears nothing ends after this long and is asked again: every watch costs the
# store a request per period while quiet (a thousand nodes' watches polled every second were a
# thousand requests a second). close() does not wait for a pending poll: the thread ends
# when it returns.
_POLL_SECONDS = 10.0

# etcd's answer when a write was not committed through raft in time (a busy cluster, or a slow
# disk): retried as an unreachable store is, until retry_for.
_OVERLOADED = "etcdserver: request timed out"

_NOT_V2 = (
    "does not serve the etcd v2 API (etcd 3.4 and 3.5 need --enable-v2; 3.6 removed it): use "
    "--rdzv-backend etcd, which speaks the v3 API, or start etcd with --enable-v2"
)


def _import_etcd() -> Any:
    try:
        import etcd
    except ImportError:
        raise StoreError(
            "the etcd-v2 rendezvous needs python-etcd: pip install 'elasticrun-launch[etcd-v2]' "
            "(or use --rdzv-backend etcd, which needs nothing more)"
        ) from None
    return etcd


class EtcdV2Store(Store):
    """etcd's v2 API at `host`:`port` over `protocol` (http or https), reached as `access`
    says (a user and password; TLS: the CA, and a certificate with its key)."""

    def __init__(
        self,
        host: str,
        port: int,
        access: StoreAccess,
        protocol: str = "http",
        cancel: CancelToken = NEVER,
    ) -> None:
        super().__init__(access, cancel)
        self.etcd = _import_etcd()
        ca, cert, key = access.tls or (None, None, None)
        self._args = {
            "host": host,
            "port": port,
            "protocol": protocol,
            "username": access.user,
            "password": access.password,
            "ca_cert": ca,
            "cert": (cert, key) if cert and key else None,
            "read_timeout": self.read_timeout,
        }
        self.client = self._client()
        self._ttl = 0
        self._ephemeral: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    def _client(self) -> Any:
        return self.etcd.Client(**{k: v for k, v in self._args.items() if v is not None})

    def _call(self, fn: Any, client: Any = None, stop: threading.Event | None = None) -> Any:
        """One request, retried while etcd is unreachable (a restart), up to retry_for; given
        `stop` (a closed watch), no longer once it is set (Cancelled)."""
        e = self.etcd
        until = time.monotonic() + self.retry_for
        delay = 0.05
        unanswered = Unanswered(self.name, until)
        while True:
            self.cancel.check()
            if stop is not None and stop.is_set():
                raise Cancelled()
            unanswered.check()
            self._count()
            try:
                return fn(client or self.client)
            except e.EtcdWatchTimedOut:
                raise  # a quiet long poll, not a failure (it subclasses EtcdConnectionFailed)
            except e.EtcdConnectionFailed as error:
                if time.monotonic() + delay > until:
                    raise StoreError(
                        f"{self.name} is unreachable ({error}); check that it runs and that "
                        "--rdzv-endpoint is right"
                    ) from None
                unanswered.failed(str(error))
            except e.EtcdInsufficientPermissions as error:
                raise StoreError(
                    f"{self.name} refused the request: {error}; check the "
                    "user and password in --rdzv-conf"
                ) from None
            except (
                e.EtcdKeyNotFound,
                e.EtcdAlreadyExist,
                e.EtcdCompareFailed,
                e.EtcdEventIndexCleared,
            ):
                raise
            except e.EtcdException as error:
                if "404 page not found" in str(getattr(error, "payload", "") or error):
                    raise StoreError(f"{self.name} {_NOT_V2}") from None
                if "Unauthorized" in str(error) or "401" in str(error):
                    raise StoreError(
                        f"{self.name} refused the request: {error}; check the "
                        "user and password in --rdzv-conf"
                    ) from None
                # Its raft did not commit in time: busy, not down; retried as unreachable is.
                if _OVERLOADED not in str(error) or time.monotonic() + delay > until:
                    raise StoreError(f"{self.name}: {error}") from None
                unanswered.failed(str(error))
            if self.cancel.wait(delay):
                raise Cancelled(self.cancel.signum)
            delay = min(delay * 2, 1.0)

    @staticmethod
    def _kv(node: Any) -> KeyValue:
        return KeyValue(
            node.key, (node.value or "").encode(), node.modifiedIndex, node.createdIndex
        )

    def get(self, key: str) -> KeyValue | None:
        try:
            return self._kv(self._call(lambda c: c.read(key)))
        except self.etcd.EtcdKeyNotFound:
            return None

    def range(self, prefix: str) -> tuple[list[KeyValue], int]:
        base = prefix.rstrip("/") or "/"
        try:
            result = self._call(lambda c: c.read(base, recursive=True))
        except self.etcd.EtcdKeyNotFound as error:
            return [], int((getattr(error, "payload", None) or {}).get("index", 0))
        nodes = [self._kv(n) for n in result.leaves if not n.dir and n.key.startswith(prefix)]
        return nodes, int(result.etcd_index)

    def _ttl_for(self, ephemeral: bool) -> int | None:
        if not ephemeral:
            return None
        if not self._ttl:
            raise StoreError("an ephemeral key needs start_liveness() first")
        return self._ttl

    def _keep_alive(self, key: str, ephemeral: bool) -> None:
        # Registered once written: the refresher must never see it before it exists.
        if ephemeral:
            with self._lock:
                self._ephemeral.add(key)

    def put(self, key: str, value: bytes, ephemeral: bool = False) -> int:
        ttl = self._ttl_for(ephemeral)
        result = self._call(lambda c: c.write(key, value.decode(), ttl=ttl))
        self._keep_alive(key, ephemeral)
        return int(result.modifiedIndex)

    def create(self, key: str, value: bytes, ephemeral: bool = False) -> int:
        ttl = self._ttl_for(ephemeral)
        try:
            result = self._call(lambda c: c.write(key, value.decode(), ttl=ttl, prevExist=False))
            version = int(result.modifiedIndex)
        except self.etcd.EtcdAlreadyExist:
            # A create whose answer was lost ("request timed out") and that was retried finds
            # its own key: an ephemeral key holds its node's own name, so the same value is
            # this node's write.
            found = self.get(key) if ephemeral else None
            if found is None or found.value != value:
                return 0
            version = found.version
        self._keep_alive(key, ephemeral)
        return version

    def cas(self, key: str, value: bytes, version: int, ttl: float | None = None) -> int:
        expiry = None if ttl is None else max(round(ttl), 1)
        condition: dict[str, Any] = {"prevIndex": version} if version else {"prevExist": False}
        try:
            result = self._call(lambda c: c.write(key, value.decode(), ttl=expiry, **condition))
        except (
            self.etcd.EtcdCompareFailed,
            self.etcd.EtcdKeyNotFound,
            self.etcd.EtcdAlreadyExist,
        ):
            return 0
        return int(result.modifiedIndex)

    def delete(self, key: str, prefix: bool = False) -> None:
        with self._lock:
            if prefix:
                self._ephemeral = {k for k in self._ephemeral if not k.startswith(key)}
            else:
                self._ephemeral.discard(key)
        with contextlib.suppress(self.etcd.EtcdKeyNotFound):
            if prefix:
                self._call(lambda c: c.delete(key.rstrip("/"), recursive=True, dir=True))
            else:
                self._call(lambda c: c.delete(key))

    def start_liveness(self, ttl: float, on_lost: Callable[[], None] | None = None) -> None:
        if on_lost is not None:
            self._on_lost = on_lost
        self._call(lambda c: c.read("/", recursive=False))  # reachable, and speaks v2?
        self._ttl = max(round(ttl), 1)
        self._refresher = threading.Thread(target=self._refresh, name="elasticrun-ttl", daemon=True)
        self._refresher.start()

    def _refresh(self) -> None:
        client = self._client()
        while not self._stop.wait(max(self._ttl / 3.0, 0.2)):
            with self._lock:
                keys = list(self._ephemeral)
            for key in keys:
                try:
                    self._call(lambda c, k=key: c.refresh(k, self._ttl), client)
                except self.etcd.EtcdKeyNotFound:
                    with self._lock:
                        if key not in self._ephemeral:
                            continue  # deleted meanwhile, on purpose
                        self._ephemeral.discard(key)
                    logger.warning("the rendezvous key %s expired; this node will rejoin", key)
                    self._on_lost()
                except (StoreError, Cancelled):
                    pass  # unreachable for now: try again next tick

    def watch(self, prefix: str, after_revision: int, inbox: Inbox | None = None) -> Watch:
        return _V2Watch(self, prefix, after_revision, inbox)

    def close(self) -> None:
        if self._stop.is_set():
            return  # closed already
        self._stop.set()
        if self._refresher is not None:
            join(self._refresher, 15, "the lease refresher thread")
        with self._lock:
            keys = list(self._ephemeral)
        for key in keys:  # what a revoked lease would do
            with contextlib.suppress(Exception):
                self.client.delete(key)


class _V2Watch(Watch):
    def __init__(self, store: EtcdV2Store, prefix: str, after: int, inbox: Inbox | None) -> None:
        self._store = store
        self._prefix = prefix
        self._index = after + 1
        self._seen: set[str] = set()  # keys this watch saw written and not deleted since
        super().__init__(inbox)
        self._closed = threading.Event()
        self._client = store._client()  # its own connection, so close() can cut a long poll
        self._thread = threading.Thread(target=self._run, name="elasticrun-v2watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        e = self._store.etcd
        client = self._client
        base = self._prefix.rstrip("/") or "/"
        while not self._closed.is_set():
            try:
                result = self._store._call(
                    lambda c: c.read(
                        base,
                        wait=True,
                        recursive=True,
                        waitIndex=self._index,
                        timeout=_POLL_SECONDS,
                    ),
                    client,
                    self._closed,
                )
            except (e.EtcdWatchTimedOut, e.EtcdKeyNotFound):
                continue
            except e.EtcdEventIndexCleared:
                # etcd v2 keeps its last 1,000 events only: a busy job (many nodes writing)
                # moves past a quiet watcher's index. Catch up from a read instead of failing.
                try:
                    self._catch_up()
                except Exception as error:
                    self.inbox.put(
                        StoreError(
                            f"{self._store.name}: watch lost: index {self._index} was cleared "
                            f"and the keys could not be read again ({error})"
                        )
                    )
                    return
                continue
            except Cancelled:
                return  # the waiter sees the cancellation itself
            except StoreError as error:
                if not self._closed.is_set():
                    self.inbox.put(error)
                return
            except Exception as error:  # read timeouts surface as urllib3 errors
                if "timed out" in str(error).lower() or "Read timed out" in str(error):
                    continue
                if not self._closed.is_set():
                    self.inbox.put(StoreError(f"{self._store.name}: watch failed: {error}"))
                return
            if self._closed.is_set():
                return  # a poll that outlived close(): its news belongs to no one now
            self._index = int(result.modifiedIndex) + 1
            if not result.key.startswith(self._prefix) and result.key != base:
                continue
            gone = result.action in ("delete", "expire", "compareAndDelete")
            value = None if gone else (result.value or "").encode()
            (self._seen.discard if gone else self._seen.add)(result.key)
            self.inbox.put([Change(result.key, value, int(result.modifiedIndex))])

    def _catch_up(self) -> None:
        """After the events from our index on were dropped: the keys as they are now, as
        changes (those written since our index), and deletions of the keys this watch saw
        that are gone; then watch on from the read's index. (A key that existed before the
        watch began and went in the dropped events is not seen: the rendezvous' waits have
        deadlines for that.)"""
        kvs, index = self._store.range(self._prefix)
        batch = [Change(kv.key, kv.value, kv.version) for kv in kvs if kv.version >= self._index]
        present = {kv.key for kv in kvs}
        batch += [Change(k, None, index) for k in sorted(self._seen - present)]
        self._seen = present
        self._index = index + 1
        if batch:
            self.inbox.put(sorted(batch, key=lambda c: c.revision))

    def close(self) -> None:
        self._closed.set()
        self.inbox.wake()
        # The thread ends when its pending long poll returns (within _POLL_SECONDS; urllib3
        # cannot cut a request in flight), quietly and without retrying; waiting for it would
        # delay every caller by that much.
        with contextlib.suppress(Exception):
            self._client.http.clear()
