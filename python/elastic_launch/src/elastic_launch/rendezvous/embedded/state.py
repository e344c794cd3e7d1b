"""The embedded rendezvous service's store: keys with revisions and versions as etcd keeps them,
leases, a bounded history for watches that start in the past, and the watchers. The host's
changes go to its standbys (:mod:`.replicas`), which apply them here as the host made
them, so that one of them can take over with the very same revisions, leases and history.
"""

from __future__ import annotations

import bisect
import collections
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from elastic_launch.rendezvous.embedded import bounds
from elastic_launch.rendezvous.embedded.bounds import Outbox
from elastic_launch.rendezvous.etcdpb import kv_pb2, replica_pb2, rpc_pb2

#: A host's term starts its revisions at (term - 1) << TERM_BITS (see ServiceState.take_over).
TERM_BITS = 40


@dataclass
class HeldLease:
    ttl: int
    expires: float
    keys: set[bytes] = field(default_factory=set)
    kept: bool = False  # renewed at least once
    client: str = ""  # the connection that was granted it


@dataclass(eq=False)  # identity: found by its id, never by comparing fields
class ServedWatch:
    key: bytes
    end: bytes
    out: Outbox  # (watch_id, [events of one revision]) for the stream's sender
    watch_id: int
    cost: int = 0  # bytes of the stream's share of watched ranges it holds

    def matches(self, key: bytes) -> bool:
        if not self.end:
            return key == self.key
        return key >= self.key and (self.end == b"\0" or key < self.end)


class ServiceState:
    """The store. Touched only from the service's event loop, so it needs no lock.

    Every change goes out through :attr:`send` (the host's standbys get it, then the watchers
    hear of it); a standby applies the host's changes with :meth:`apply`, or takes all of its
    state with :meth:`load`."""

    def __init__(self) -> None:
        self.revision = 1
        self.member_id = 1  # this service's place in --rdzv-endpoint, from 1
        self.term = 0  # the host's term (0: none yet): a standby that takes over starts the next
        self.fork = 0  # the last revision this term's host had from the one before
        # Which service this is, in every answer's header: a client given two services of two
        # jobs as one store's members tells them apart by it, as it would two etcd clusters.
        self.cluster_id = int.from_bytes(os.urandom(8), "big") >> 1 or 1
        self.keys: list[bytes] = []  # sorted
        # Each key's current version, as the message ranges and events copy (built once, when
        # written: three times cheaper than one per read, and a node's shard is 64 of them).
        self.data: dict[bytes, kv_pb2.KeyValue] = {}
        self.leases: dict[int, HeldLease] = {}
        # The leases kept alive (renewed at least once: a node's session, not a key's own
        # expiry such as the closed job's state), told on every change.
        self.on_kept: Callable[[frozenset[int]], None] = lambda ids: None
        self.history: collections.deque[tuple[int, kv_pb2.Event]] = collections.deque()
        self.compacted = 0  # the newest revision with events dropped from the history
        self.history_bytes = 0
        self.data_bytes = 0  # keys and values held
        # What each connection holds: streams open, events queued or being sent, the ranges
        # its watches hold, answers being sent, leases (embedded_bounds says why each).
        self.streams = bounds.Shares(
            "streams", bounds.STREAMS_PER_CLIENT, bounds.MAX_STREAMS, bounds.RESERVED_STREAMS
        )
        self.watch_bytes = bounds.Shares(
            "bytes of events not yet sent",
            bounds.EVENTS_PER_CLIENT,
            bounds.WATCH_BYTES,
            bounds.RESERVED_EVENTS,
        )
        self.watched = bounds.Shares(
            "bytes of watched ranges",
            bounds.RANGES_PER_CLIENT,
            bounds.RANGE_BYTES,
            bounds.RESERVED_RANGES,
        )
        self.read_bytes = bounds.Shares(
            "bytes of answers", bounds.READ_BYTES, bounds.READ_BYTES, bounds.RESERVED_READS
        )
        self.holders = bounds.leases()
        self.writers = bounds.Writers()  # who wrote each key, against their shares
        self.pending: list[kv_pb2.Event] = []  # the current revision's events
        # Watchers by the range they watch, then by id: many nodes watch the same few ranges
        # (the state, the shared keys), so a commit matches each event against ranges, not
        # watchers, and a watcher comes and goes in O(1) (a thousand nodes leaving a range
        # at once, as after a node loss, must not cost a million comparisons in one commit).
        self.watchers: dict[tuple[bytes, bytes], dict[int, ServedWatch]] = {}
        # Lease changes since the last change sent (grants, revocations, first renewals).
        self.granted: list[replica_pb2.Lease] = []
        self.revoked: list[int] = []
        self.kept: list[int] = []
        # A change, and what delivers its events to the watchers once the standbys have it.
        self.send: Callable[[replica_pb2.Change, Callable[[], None]], None] = _at_once

    def add_watcher(self, w: ServedWatch) -> None:
        self.watchers.setdefault((w.key, w.end), {})[w.watch_id] = w

    def remove_watchers(self, gone: list[ServedWatch]) -> None:
        for w in gone:
            group = self.watchers.get((w.key, w.end))
            if group is not None and group.pop(w.watch_id, None) is not None and not group:
                del self.watchers[(w.key, w.end)]

    def since(self, start: int, w: ServedWatch) -> list[tuple[int, kv_pb2.Event]]:
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
        return rpc_pb2.ResponseHeader(
            cluster_id=self.cluster_id,
            member_id=self.member_id,
            revision=self.revision,
            raft_term=self.term,
        )

    def select(self, key: bytes, end: bytes) -> list[bytes]:
        if not end:
            return [key] if key in self.data else []
        lo = bisect.bisect_left(self.keys, key)
        hi = len(self.keys) if end == b"\0" else bisect.bisect_left(self.keys, end)
        return self.keys[lo:hi]

    def _emit(self, event: kv_pb2.Event) -> None:
        self.pending.append(event)

    def commit(self) -> None:
        """Publish the current revision's events: to the history, to the standbys, and (once
        they have them) to each watcher as one response (as etcd sends a transaction's or a
        lease expiry's events together)."""
        events, self.pending = self.pending, []
        self._remember(events)
        change = replica_pb2.Change(revision=self.revision, events=events)
        self._with_leases(change)
        self.send(change, lambda: self._deliver(events))

    def flush(self) -> None:
        """Send the leases' changes that came without a revision (a grant, a first renewal)."""
        if self.granted or self.revoked or self.kept:
            change = replica_pb2.Change(revision=self.revision)
            self._with_leases(change)
            self.send(change, _nothing)

    def _with_leases(self, change: replica_pb2.Change) -> None:
        change.granted.extend(self.granted)
        change.revoked.extend(self.revoked)
        change.kept.extend(self.kept)
        self.granted, self.revoked, self.kept = [], [], []

    def _remember(self, events: list[kv_pb2.Event]) -> None:
        """Keep `events` (the current revision's) in the bounded history."""
        for event in events:
            size = size_of(event)
            while self.history and (
                len(self.history) >= bounds.HISTORY
                or self.history_bytes + size > bounds.HISTORY_BYTES
            ):
                rev, dropped = self.history.popleft()
                self.compacted = rev
                self.history_bytes -= size_of(dropped)
            self.history.append((self.revision, event))
            self.history_bytes += size

    def _deliver(self, events: list[kv_pb2.Event]) -> None:
        for group in self.watchers.values():
            first = next(iter(group.values()))
            mine = [e for e in events if first.matches(e.kv.key)]
            if mine:
                size = sum(size_of(e) for e in mine)
                for w in group.values():
                    w.out.send(w.watch_id, mine, size)

    def check_lease(self, lease: int) -> None:
        if lease and lease not in self.leases:
            raise KeyError("etcdserver: requested lease not found")

    def room_for(self, key: bytes, value: bytes, client: str = "") -> str | None:
        """Why a put of `key` by `client` cannot be held (the caps on keys and bytes, the
        connection's shares of them), or None."""
        old = self.data.get(key)
        grows = len(key) + len(value) - (len(old.key) + len(old.value) if old else 0)
        if old is None and len(self.data) >= bounds.MAX_KEYS:
            return f"it holds {bounds.MAX_KEYS} keys already"
        if self.data_bytes + grows > bounds.MAX_DATA_BYTES:
            held, most = self.data_bytes, bounds.MAX_DATA_BYTES
            return f"it holds {held} bytes of keys and values (at most {most})"
        return self.writers.room(client, key, len(key) + len(value))

    def put(self, key: bytes, value: bytes, lease: int, client: str = "") -> None:
        """Write `key` (as `client`, whose shares it then counts against)."""
        self.writers.wrote(client, key, len(key) + len(value))
        old = self.data.get(key)
        self.data_bytes += len(key) + len(value) - (len(old.key) + len(old.value) if old else 0)
        if old is not None and old.lease and old.lease in self.leases:
            self.leases[old.lease].keys.discard(key)
        if old is None:
            bisect.insort(self.keys, key)
        entry = kv_pb2.KeyValue(
            key=key,
            value=value,
            create_revision=old.create_revision if old is not None else self.revision,
            mod_revision=self.revision,
            version=old.version + 1 if old is not None else 1,
            lease=lease,
        )
        self.data[key] = entry
        if lease:
            self.leases[lease].keys.add(key)
        self._emit(kv_pb2.Event(type=kv_pb2.Event.PUT, kv=entry))

    def delete(self, key: bytes) -> None:
        self.writers.forget(key)
        entry = self.data.pop(key)
        self.data_bytes -= len(entry.key) + len(entry.value)
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
            have = getattr(entry, attr[0]) if entry is not None else 0
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

    def renew(self, lease_id: int) -> int:
        """Keep a lease alive: its TTL, or 0 if it is gone."""
        lease = self.leases.get(lease_id)
        if lease is None:
            return 0
        lease.expires = time.monotonic() + lease.ttl
        if not lease.kept:
            lease.kept = True
            self.kept.append(lease_id)
            self._tell_kept()
            self.flush()
        return lease.ttl

    def _tell_kept(self) -> None:
        self.on_kept(frozenset(i for i, lease in self.leases.items() if lease.kept))

    def grant(self, lease_id: int, ttl: int, client: str) -> None:
        self.leases[lease_id] = HeldLease(ttl, time.monotonic() + ttl, client=client)
        self.holders.take(client)
        self.granted.append(replica_pb2.Lease(id=lease_id, ttl=ttl, client=client))
        self.flush()

    def revoke(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is not None:
            self.holders.give(lease.client)
            self.revoked.append(lease_id)
        if lease is not None and lease.kept:
            self._tell_kept()
        if lease is None or not lease.keys:
            self.flush()
            return
        self.revision += 1
        for key in sorted(lease.keys):
            if key in self.data:
                self.delete(key)
        self.commit()

    # ---- as a standby ------------------------------------------------------------------------

    def apply(self, change: replica_pb2.Change) -> None:
        """Make the host's `change` here, as the host made it (the same revision, the same
        versions), and keep its events in the history."""
        for lease in change.granted:
            self.leases[lease.id] = HeldLease(lease.ttl, float("inf"), client=lease.client)
            self.holders.take(lease.client)
        if change.revision != self.revision:
            self.revision = change.revision
            for event in change.events:
                if event.type == kv_pb2.Event.PUT:
                    self.put(event.kv.key, event.kv.value, event.kv.lease)
                elif event.kv.key in self.data:
                    self.delete(event.kv.key)
            events, self.pending = self.pending, []
            self._remember(events)
        for lease_id in change.revoked:
            gone = self.leases.pop(lease_id, None)
            if gone is not None:
                self.holders.give(gone.client)
        for lease_id in change.kept:
            if lease_id in self.leases:
                self.leases[lease_id].kept = True

    def snapshot(self, part_bytes: int = 1 << 20) -> Iterator[replica_pb2.Snapshot]:
        """The whole state, in parts of about `part_bytes`; the last says `done`."""
        part, size = replica_pb2.Snapshot(), 0
        items: list[tuple[str, Any, int]] = [
            ("kvs", kv, len(kv.key) + len(kv.value)) for kv in self.data.values()
        ]
        items += [
            ("leases", replica_pb2.Lease(id=i, ttl=x.ttl, client=x.client, kept=x.kept), 64)
            for i, x in self.leases.items()
        ]
        items += [
            ("history", replica_pb2.Past(revision=r, event=e), size_of(e)) for r, e in self.history
        ]
        for field_name, item, n in items:
            if size + n > part_bytes and size:
                yield part
                part, size = replica_pb2.Snapshot(), 0
            getattr(part, field_name).append(item)
            size += n
        part.revision, part.compacted, part.cluster_id = (
            self.revision,
            self.compacted,
            self.cluster_id,
        )
        part.term, part.fork, part.done = self.term, self.fork, True
        yield part

    def load(self, parts: list[replica_pb2.Snapshot]) -> None:
        """Take the host's whole state (its `snapshot`) in place of this one's."""
        self.keys, self.data, self.leases = [], {}, {}
        self.history.clear()
        self.history_bytes = self.data_bytes = 0
        self.holders = bounds.leases()
        self.writers = bounds.Writers()
        for part in parts:
            for kv in part.kvs:
                self.data[kv.key] = kv
                self.data_bytes += len(kv.key) + len(kv.value)
            for lease in part.leases:
                self.leases[lease.id] = HeldLease(
                    lease.ttl, float("inf"), kept=lease.kept, client=lease.client
                )
                self.holders.take(lease.client)
            for past in part.history:
                self.history.append((past.revision, past.event))
                self.history_bytes += size_of(past.event)
        self.keys = sorted(self.data)
        for kv in self.data.values():
            if kv.lease in self.leases:
                self.leases[kv.lease].keys.add(kv.key)
        last = parts[-1]
        self.revision, self.compacted, self.cluster_id = (
            last.revision,
            last.compacted,
            last.cluster_id,
        )
        self.term, self.fork = last.term, last.fork

    def take_over(self, term: int) -> None:
        """This standby hosts from now on, in `term`: every lease gets its whole TTL from now
        (as etcd's new leader extends them), and this term's revisions start past any the
        last host could have made, so that a watch from another host's history (a partition
        that let two hosts serve) is told its history is gone rather than given this one."""
        self.term, self.fork = term, self.revision
        self.revision = max(self.revision, (term - 1) << TERM_BITS)
        now = time.monotonic()
        for lease in self.leases.values():
            lease.expires = now + lease.ttl
        self._tell_kept()

    def unknown_past(self, start: int) -> bool:
        """Whether revision `start` on is another history than this host's: a revision after
        the fork that this term never made."""
        return self.fork + 1 < start <= (self.term - 1) << TERM_BITS


def size_of(event: kv_pb2.Event) -> int:
    return len(event.kv.key) + len(event.kv.value) + bounds.EVENT_OVERHEAD


def _at_once(change: replica_pb2.Change, deliver: Callable[[], None]) -> None:
    deliver()  # no standby: the watchers hear of it now


def _nothing() -> None:
    pass
