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
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from elastic_launch.api import Cancelled
from elastic_launch.cancel import NEVER, CancelToken, join
from elastic_launch.rendezvous.store.api import (
    Change,
    Inbox,
    KeyValue,
    Store,
    StoreAccess,
    StoreError,
    Unanswered,
    Watch,
    nospace,
)
from elastic_launch.rendezvous.store.endpoints import StoreMember, members_of, written
from elastic_launch.rendezvous.store.identity import mixed, two_clusters

logger = logging.getLogger(__name__)

#: A key no job writes: reading it asks a member which cluster it belongs to (every answer,
#: "not found" included, names it).
_PROBE_KEY = "/elasticrun-which-cluster"

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


class Members:
    """The members of the store: one python-etcd client per member for one user (the store's
    requests, the TTL refresher, each watch: each has its own connections, so that a long poll
    holds none of the others'), and the member in use, which all of them share: a member one
    of them found failed is left by all."""

    def __init__(self, store: EtcdV2Store, read_timeout: float | None = None) -> None:
        self._store = store
        self._read_timeout = read_timeout  # the store's, unless given
        self._clients: dict[int, Any] = {}

    def client(self) -> tuple[int, Any]:
        """The member in use and this user's client of it."""
        i = self._store.pinned
        if i not in self._clients:
            self._clients[i] = self._store.client_of(i, self._read_timeout)
        return i, self._clients[i]

    def clear(self) -> None:
        """Let go of every connection (a long poll under way ends when it returns)."""
        for client in self._clients.values():
            with contextlib.suppress(Exception):
                client.http.clear()


class EtcdV2Store(Store):
    """etcd's v2 API at `members` (or one ``host:port``) over `protocol` (http or https),
    reached as `access` says (a user and password; TLS: the CA, and a certificate with its
    key). Requests go to one member and move to the next when it cannot be reached."""

    def __init__(
        self,
        members: str | Sequence[StoreMember],
        access: StoreAccess,
        protocol: str = "http",
        cancel: CancelToken = NEVER,
    ) -> None:
        super().__init__(access, cancel)
        self.etcd = _import_etcd()
        self.members = members_of(members)
        ca, cert, key = access.tls or (None, None, None)
        self._args = {
            "protocol": protocol,
            "username": access.user,
            "password": access.password,
            "ca_cert": ca,
            "cert": (cert, key) if cert and key else None,
            "read_timeout": self.read_timeout,
        }
        self.pinned = 0  # the member in use, shared by every user's clients
        self._pin_lock = threading.Lock()
        self._cluster: tuple[str, StoreMember] | None = None  # the first cluster id seen, where
        self._own = Members(self)
        self._ttl = 0
        self._ephemeral: set[str] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._refresher: threading.Thread | None = None

    @property
    def client(self) -> Any:
        """This store's client of the member in use."""
        return self._own.client()[1]

    def client_of(self, i: int, read_timeout: float | None = None) -> Any:
        """A new client of member `i` (python-etcd puts the host in a URL as it is)."""
        host, port = self.members[i].host, self.members[i].port
        args = {"host": f"[{host}]" if ":" in host else host, "port": port, **self._args}
        if read_timeout is not None:
            args["read_timeout"] = read_timeout
        return self.etcd.Client(**{k: v for k, v in args.items() if v is not None})

    def fail_over(self, i: int, why: str) -> bool:
        """Leave member `i` for the next (if it is still the one in use); False when there is
        no other member."""
        if len(self.members) == 1:
            return False
        with self._pin_lock:
            if self.pinned != i:
                return True
            self.pinned = (i + 1) % len(self.members)
        logger.warning(
            "%s: member %s failed (%s); going on with %s",
            self.name,
            self.members[i].written,
            why,
            self.members[self.pinned].written,
        )
        return True

    def check_one_cluster(self) -> None:
        """At start: the members that answer (asked together, within 2 s each) belong to one
        cluster; StoreError naming two that do not, whatever the order of the list."""
        if len(self.members) < 2:
            return

        def cluster_of(i: int) -> str | None:
            client = self.client_of(i, read_timeout=2.0)
            with contextlib.suppress(Exception):  # a missing key answers with the id too
                client.read(_PROBE_KEY)
            return getattr(client, "expected_cluster_id", None) or None

        with ThreadPoolExecutor(len(self.members), thread_name_prefix="elasticrun-status") as pool:
            ids = list(pool.map(cluster_of, range(len(self.members))))
        answers = [(m.written, c) for m, c in zip(self.members, ids) if c is not None]
        problem = mixed(written(self.members), answers)
        if problem is not None:
            raise StoreError(problem)

    def _check_cluster(self, i: int, client: Any) -> None:
        """Every member must belong to one cluster (python-etcd records the id it saw)."""
        cluster = getattr(client, "expected_cluster_id", None)
        if not cluster:
            return
        with self._pin_lock:
            if self._cluster is None:
                self._cluster = (cluster, self.members[i])
                return
            first, where = self._cluster
        if cluster != first:
            raise StoreError(
                two_clusters(
                    written(self.members), where.written, self.members[i].written, (first, cluster)
                )
            )

    def _call(self, fn: Any, members: Members | None = None, stop: Any = None) -> Any:
        """One request, on the member in use, moving to the next when it cannot be reached
        and retried while none can (a restart), up to retry_for; given `stop` (a closed
        watch), no longer once it is set (Cancelled)."""
        e = self.etcd
        members = members or self._own
        until = time.monotonic() + self.retry_for
        delay = 0.05
        unanswered = Unanswered(self.name, until)
        failed = 0
        while True:
            self.cancel.check()
            if stop is not None and stop.is_set():
                raise Cancelled()
            unanswered.check()
            self._count()
            i, client = members.client()
            try:
                result = fn(client)
                self._check_cluster(i, client)
                return result
            except e.EtcdWatchTimedOut:
                raise  # a quiet long poll, not a failure (it subclasses EtcdConnectionFailed)
            except e.EtcdConnectionFailed as error:
                if time.monotonic() + delay > until:
                    raise StoreError(
                        f"{self.name} is unreachable ({error}); check that it runs and that "
                        "--rdzv-endpoint is right"
                    ) from None
                unanswered.failed(str(error))
                failed += 1
                if self.fail_over(i, str(error)) and failed % len(self.members):
                    continue  # the next member at once; a pause once all were tried
            except e.EtcdException as error:
                self._refused(error, until - delay)
                unanswered.failed(str(error))
            if self.cancel.wait(delay):
                raise Cancelled(self.cancel.signum)
            delay = min(delay * 2, 1.0)

    def _refused(self, error: Any, last_try: float) -> None:
        """Raise what an error etcd answered means, unless it is worth trying again (a busy
        cluster's "request timed out", before `last_try`)."""
        e = self.etcd
        if isinstance(
            error,
            (e.EtcdKeyNotFound, e.EtcdAlreadyExist, e.EtcdCompareFailed, e.EtcdEventIndexCleared),
        ):
            raise error
        if (
            isinstance(error, e.EtcdInsufficientPermissions)
            or "Unauthorized" in str(error)
            or ("401" in str(error))
        ):
            raise StoreError(
                f"{self.name} refused the request: {error}; check the "
                "user and password in --rdzv-conf"
            ) from None
        if "404 page not found" in str(getattr(error, "payload", "") or error):
            raise StoreError(f"{self.name} {_NOT_V2}") from None
        if "database space exceeded" in str(error):
            raise StoreError(nospace(self.name, str(error))) from None
        # Its raft did not commit in time: busy, not down; retried as unreachable is.
        if _OVERLOADED not in str(error) or time.monotonic() > last_try:
            raise StoreError(f"{self.name}: {error}") from None

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
        # A refresh waits a tick at most: one stuck in a member's election ("request timed
        # out" comes after 7 s) is tried again, on the next member, while the TTL lasts.
        members = Members(self, read_timeout=max(self._ttl / 3.0, 0.5))
        while not self._stop.wait(max(self._ttl / 3.0, 0.2)):
            with self._lock:
                keys = list(self._ephemeral)
            for key in keys:
                try:
                    self._call(lambda c, k=key: c.refresh(k, self._ttl), members)
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
        self._members = Members(store)  # its own connections, so close() can cut a long poll
        self._thread = threading.Thread(target=self._run, name="elasticrun-v2watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        e = self._store.etcd
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
                    self._members,
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
        self._members.clear()
