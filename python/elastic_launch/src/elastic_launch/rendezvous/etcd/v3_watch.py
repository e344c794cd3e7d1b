"""A watch on an etcd v3 store: one stream (and reader thread) for one or more prefixes, which
reconnects from the last revision it delivered for each, and delivers into an inbox."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from elastic_launch.api import Cancelled
from elastic_launch.cancel import join
from elastic_launch.rendezvous.etcd.v3_client import (
    RETRYABLE,
    STREAM_METADATA,
    AskAgainError,
    Client,
    Connection,
)
from elastic_launch.rendezvous.etcdpb import kv_pb2, rpc_pb2
from elastic_launch.rendezvous.store.api import (
    Change,
    HistoryLostError,
    Inbox,
    StoreError,
    StoreReplacedError,
    Watch,
)


def prefix_end(prefix: bytes) -> bytes:
    """etcd's range_end for "every key starting with prefix"."""
    end = bytearray(prefix)
    for i in reversed(range(len(end))):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


def key_text(key: bytes) -> str:
    """A key as text. Keys under the job's prefix are ours, but anyone may write one that is
    not UTF-8: it reads with U+FFFD in place and matches none of ours."""
    return key.decode("utf-8", "replace")


class EtcdWatch(Watch):
    """One watch stream (and reader thread) for one or more prefixes; reconnects (on the
    store's next member, when it has several) from the revision after the last one delivered
    for each, so that no change is lost or seen twice. A history compacted away under it
    ends the watch with :class:`~.store.HistoryLostError`: the watcher reads again.

    etcd serves a watch whose start revision has already passed from its history, by a loop
    that runs every 100 ms: such a watch hears nothing, not even new changes, for up to 100 ms
    (measured: 83 ms median on etcd 3.4). A rendezvous that reads, then watches from the
    read, meets that whenever anyone writes in between. So each stream starts at the server's
    current revision, and the changes between the caller's revision and it (a gap that is
    usually empty) come from two reads: the keys then and now. A stream opened again after one
    broke starts from the revision after the last one delivered: the changes since come one by
    one, as they were made."""

    def __init__(
        self,
        client: Client,
        prefixes: list[str],
        after_revision: int,
        inbox: Inbox | None,
        from_now: bool,
    ) -> None:
        self._client = client
        self._keys = [p.encode() for p in prefixes]
        self._next = dict.fromkeys(self._keys, after_revision + 1)  # per prefix
        self._created = 0  # `created` replies on the current stream: they come in order
        self._from_now = from_now  # the first stream's start: see the class's docstring
        self._epoch = client.epoch  # the store this watch's revisions are of
        super().__init__(inbox)
        self._unwatch = client.identity.watching(self)
        self._closed = threading.Event()
        self._requests: queue.Queue[rpc_pb2.WatchRequest | None] = queue.Queue()
        self._call: Any = None
        self._nonce: str | None = None  # the stream's, once asked for (its refusal's proof)
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
        client = self._client
        conn = client.current
        client.count()
        try:
            self._same_store()
            self._nonce = None
            client.log_in(conn)
            self._nonce, metadata = client.asking(conn)
            self._call = conn.watch.Watch(
                self._request_stream(self._requests), metadata=metadata + STREAM_METADATA
            )
            if self._closed.is_set():  # closed before the call existed to be cancelled
                self._call.cancel()
            return self._deliver(conn, retry)
        except StoreError as error:  # the gap could not be read (compacted, unreachable)
            if not self._closed.is_set():
                self.inbox.put(error)
        except Cancelled:
            pass  # the session's waits are woken by the cancellation itself
        except ValueError:  # "Channel closed": the store closed, or this member was left
            if not self._closed.is_set() and client.closed.is_set():
                self.inbox.put(StoreError(f"{client.name}: the connection was closed"))
            elif not self._closed.is_set():
                return True
        except grpc.RpcError as e:
            return self._again(e, retry, conn)
        except AskAgainError:  # the member was left for another: go on there at once
            return True
        finally:
            self._from_now = False  # from now on, every stream goes on where the last ended
        return None

    def _deliver(self, conn: Connection, retry: _Retry) -> bool | None:
        """The stream's replies, delivered: as :meth:`_stream` says when it ends. A reply of
        another member's (it was left) opens a new stream at once."""
        for reply in self._call:
            retry.reset()
            self._same_store()  # an answer of the store before it was replaced is not judged
            if not self._client.check_cluster(conn, reply):
                self._same_store()
                return True  # on the member that serves the job's store, at once
            self._same_store()
            if not self._take(reply):
                return None
        return False

    def _same_store(self) -> None:
        """Raise HistoryLostError if the store was replaced since this watch began: its
        revisions are another store's (the watcher reads again, and watches from that read)."""
        if self._client.epoch != self._epoch:
            raise StoreReplacedError(
                f"{self._client.name}: the store was started again since this watch began"
            )

    def _take(self, reply: Any) -> bool:
        """Deliver one reply of the stream; False when the watch is over (canceled)."""
        if reply.canceled:
            where = self._client.name
            if reply.compact_revision:
                start = min(self._next.values())
                self.inbox.put(
                    HistoryLostError(
                        f"{where}: the changes from revision {start} on were compacted "
                        f"(it keeps them from {reply.compact_revision} on)"
                    )
                )
            else:
                reason = reply.cancel_reason or "canceled by the server"
                self.inbox.put(StoreError(f"{where}: watch lost: {reason}"))
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

    def _again(self, e: grpc.RpcError, retry: _Retry, conn: Connection) -> bool | None:
        """After a failed stream on member `conn`: None to give up (the error is delivered),
        True to open a new stream at once (after logging in again: etcd's simple tokens
        expire; or on the store's next member), False to open one after the retry delay."""
        if self._closed.is_set():
            return None
        code = e.code()
        client = self._client
        if code == grpc.StatusCode.UNAUTHENTICATED and client.logs_in and not retry.relogged:
            retry.relogged = True
            try:
                if client.relog(conn):
                    return True
            except StoreError as error:
                self.inbox.put(error)
                return None
        now = time.monotonic()
        retry.failing_since = retry.failing_since or now
        cut_off = code == grpc.StatusCode.RESOURCE_EXHAUSTED and "cut off" in (e.details() or "")
        if (code in RETRYABLE or cut_off) and now - retry.failing_since <= client.retry_for:
            why = f"watch: {code.name}: {e.details()}"
            named = e if client.epoch == self._epoch and self._nonce is not None else None
            nonce, self._nonce = self._nonce or "", None  # the next stream asks its own
            if code in RETRYABLE and client.fail_over(conn, why, named, nonce):
                retry.tried += 1
                return retry.tried % len(client.connections) != 0  # a pause once all were tried
            return False  # a stream the service cut off (it fell behind) is watched again
        self.inbox.put(client.error(e))
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
        return list(self._client.call("kv.Range", request).kvs)

    def store_replaced(self) -> None:
        """The store was started again empty: this watch ends with HistoryLostError (its
        watcher reads again), at once, whatever its stream is doing."""
        if not self._closed.is_set():
            self.inbox.put(
                StoreReplacedError(f"{self._client.name}: the store was started again, empty")
            )
        self._closed.set()
        self._requests.put(None)
        if self._call is not None:
            self._call.cancel()

    def close(self) -> None:
        self._unwatch()
        self._closed.set()
        self._requests.put(None)
        if self._call is not None:
            self._call.cancel()
        self.inbox.wake()  # a waiter reading this watch returns now
        join(self._thread, 5, "a store watch thread")


@dataclass
class _Retry:
    """A watch's reconnection: the next delay, since when it fails, whether it logged in again,
    how many members it tried in a row."""

    delay: float = 0.05
    failing_since: float | None = None
    relogged: bool = False
    tried: int = 0  # members tried in a row

    def reset(self) -> None:
        """The stream works: the next failure starts afresh."""
        self.delay, self.failing_since, self.relogged, self.tried = 0.05, None, False, 0
