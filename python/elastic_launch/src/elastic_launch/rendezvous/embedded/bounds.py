"""What a client can make the embedded rendezvous service hold, and the accounts that keep it
to that.

Every dimension is capped, and what a caller holds is counted against its connection's share
as well as the service's total (:class:`Shares`): the streams open, the events queued on
them and not yet taken by the network, the ranges its watches hold, the answers to its reads
being sent, its leases (none outlives ``store.wire.MAX_TTL`` unrenewed). A connection's first few of
each are its own whatever the others hold, so that no caller can use up a total and keep an
honest agent out. Requests are read in turns (:class:`Turns`): a unary request is read only
once its turn comes, so that however many arrive at once, a bounded number of bytes is being
read. Keys and their bytes, and the history kept for watches that start in the past, are
capped for the service.

A write past a cap is refused with RESOURCE_EXHAUSTED; a watch past its connection's share
of ranges is refused naming the share; a watch stream past its share of events is cut off
(as etcd cancels a slow watcher); a read that would pass the answers' cap is refused (it may
be tried again), and one that could never fit is refused naming the limit. A round of 1,024
nodes uses a few thousand keys, a lease per node and well under a MiB, far inside every cap.

So, whatever clients do, the service holds at most the data cap (64 MiB) plus the history
(16 MiB), the events queued (12 MiB), the ranges watched (8 MiB), the answers being sent
(16 MiB), the requests being read (16 MiB, held two or three times over while parsed), the
leases (a few MiB) and, for each open connection, its own parts of the shares, the window of
each of its calls waiting a turn (64 KiB, at most CALLS_PER_CONNECTION) and what gRPC keeps
(about half a MiB once it has read a request at the limit, up to 1 MiB while they keep
coming). What it frees goes back to the system (:class:`Trimmer`): once a load ends, it holds
its data and history and little more.
``tests/launch/rendezvous/test_embedded_bounds.py`` measures it under each attack. A request
arriving on a stream (a watch's, a keep-alive's) is read as it comes: each open stream may
have one arriving at once; the job's token is what keeps strangers from opening streams at
all."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ctypes
from collections.abc import AsyncIterator, Callable
from typing import Any

HISTORY = 100_000  # events kept for watches that start in the past
HISTORY_BYTES = 16 << 20
MAX_KEYS = 100_000
MAX_DATA_BYTES = 64 << 20  # keys and values held
KEYS_PER_CLIENT = MAX_KEYS // 4  # the keys one connection wrote last
DATA_PER_CLIENT = MAX_DATA_BYTES // 4  # ... and their bytes
MAX_REQUEST = 2 << 20  # one request: etcd's (its 1.5 MiB request limit, and 512 KiB for gRPC)
#: Requests being read at once, by their largest size: a request's size is known only once
#: it has arrived, so each is counted at MAX_REQUEST, and REQUEST_BYTES // MAX_REQUEST are
#: read at a time, one per connection, the others waiting their turn in the order they came.
REQUEST_BYTES = 16 << 20
TURN_WAIT = 30.0  # seconds a request waits for its turn before it is refused
#: Seconds a request, once its turn came, has to arrive: a unary call's client sends it with
#: the call's headers, and one that does not holds a turn no longer than this.
RECEIVE_TIMEOUT = 2.0
#: Bytes of requests read and answers sent between two returns of the memory freed to the
#: system (:class:`Trimmer`), and once fewer have passed, every TRIM_PERIOD seconds. What is
#: given back is faulted in again: a write at the limit cost 3-4 ms of CPU untrimmed, 5-6.5
#: at 16 MiB, 6 at 8 MiB (whose peak was 10-20 MB lower).
TRIM_BYTES = 16 << 20
TRIM_PERIOD = 0.25
TRIM_LATE = 4  # periods after the last trim, one more
PROBE_SLOTS = 2  # Status requests (the services' probes of each other) have turns of their own
CALLS_PER_CONNECTION = 128  # HTTP/2 streams at once: each waiting call holds a 64 KiB window
UNHANDLED_REQUESTS = 16  # a watch stream's requests read and not yet handled
STREAM_BYTES = 4 << 20  # events queued or being sent on one watch stream
WATCH_BYTES = 12 << 20  # ... on all watch streams together
EVENTS_PER_CLIENT = 4 << 20  # ... on one connection's streams
RESERVED_EVENTS = 64 << 10  # ... each connection's own, whatever the others hold
#: Bytes of the ranges watched: what a watch's key and range end hold while it lives.
RANGE_BYTES = 8 << 20
RANGES_PER_CLIENT = 1 << 20
RESERVED_RANGES = 16 << 10  # an agent's few watches always fit
WATCH_OVERHEAD = 256  # bytes a watch costs beyond its key and range end
READ_BYTES = 16 << 20  # answers to reads being sent, together
RESERVED_READS = 256 << 10  # each connection's own
MAX_STREAMS = 8192  # watch and keep-alive streams at once
STREAMS_PER_CLIENT = 64
RESERVED_STREAMS = 4  # an agent's watch and keep-alive streams always open
WATCHERS_PER_STREAM = 256
EVENT_OVERHEAD = 64  # bytes an event costs beyond its key and value
HANDSHAKE_MS = 5000  # a connection that has not said it speaks HTTP/2 (or TLS) by then is closed
MAX_LEASES = 10_000
LEASES_PER_CLIENT = 256  # a client: one connection (an agent holds one or two)
#: Leases a connection is granted whatever the others hold: however many leases one client
#: takes, an honest agent (which needs one or two) can still join.
RESERVED_PER_CLIENT = 4


class Shares:
    """What each caller (a connection) holds of one thing, against its share and the service's
    total: a take past either is refused, naming the limit. A caller's first `reserved` are its
    own whatever the others hold, so that no caller can use up the total and keep an honest
    agent out; the total can pass its cap by at most those reserves."""

    def __init__(self, unit: str, per_client: int, total: int, reserved: int = 0) -> None:
        self.unit = unit
        self.per_client = per_client
        self.total = total
        self.reserved = reserved
        self.count = 0
        self.held: collections.Counter[str] = collections.Counter()

    def room(self, client: str, n: int = 1) -> str | None:
        """Why `client` may not take `n` more, or None."""
        mine = self.held[client] + n
        if mine > self.per_client:
            return (
                f"this connection would hold {mine} {self.unit}; one connection may hold "
                f"{self.per_client}"
            )
        if self.count + n > self.total and mine > self.reserved:
            return (
                f"the service holds {self.count} {self.unit} already and may hold "
                f"{self.total} (each connection's first {self.reserved} are its own)"
            )
        return None

    def take(self, client: str, n: int = 1) -> None:
        self.count += n
        self.held[client] += n

    def give(self, client: str, n: int = 1) -> None:
        self.count -= n
        self.held[client] -= n
        if self.held[client] <= 0:
            del self.held[client]


class Writers:
    """Who wrote each key last, and what that holds of their connection's shares of keys and
    of bytes: one connection cannot fill the store alone. (Stored data outlives connections,
    so no connection has a part of its own beyond the total; a standby's copy, and a new
    host's after a takeover, count only in the total.)"""

    def __init__(self) -> None:
        self.bytes = Shares("bytes of keys and values", DATA_PER_CLIENT, MAX_DATA_BYTES)
        self.keys = Shares("keys", KEYS_PER_CLIENT, MAX_KEYS)
        self.of: dict[bytes, tuple[str, int]] = {}  # key: (its writer, its size)

    def room(self, client: str, key: bytes, size: int) -> str | None:
        """Why `client` may not write `key` with `size` bytes in all, or None."""
        if not client:
            return None
        was = self.of.get(key)
        mine = was is not None and was[0] == client
        if not mine:
            full = self.keys.room(client)
            if full is not None:
                return full
        grows = size - (was[1] if was is not None and mine else 0)
        return self.bytes.room(client, grows) if grows > 0 else None

    def wrote(self, client: str, key: bytes, size: int) -> None:
        self.forget(key)
        if client:
            self.of[key] = (client, size)
            self.keys.take(client)
            self.bytes.take(client, size)

    def forget(self, key: bytes) -> None:
        was = self.of.pop(key, None)
        if was is not None:
            self.keys.give(was[0])
            self.bytes.give(was[0], was[1])


def leases() -> Shares:
    return Shares("leases", LEASES_PER_CLIENT, MAX_LEASES, RESERVED_PER_CLIENT)


class Outbox:
    """A watch stream's queue and what the stream holds: the bytes of its events from the
    moment they are queued until the network has taken them, and of the ranges it watches.
    Events are counted against the stream's :data:`STREAM_BYTES` and its connection's share
    of `events`: a stream whose client stops reading is cut off instead of growing. Ranges
    are counted against the connection's share of `ranges`: a watch past it is refused."""

    def __init__(self, events: Shares, ranges: Shares, client: str) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.events = events
        self.ranges = ranges
        self.client = client
        self.bytes = 0
        self.watched = 0  # bytes of the ranges this stream's watches hold
        self.overflowed = False
        self.closed = False
        # Requests read and not yet handled: the reader waits while there are many, so that
        # a stream whose answers are not read stops being read too.
        self.unhandled = asyncio.Semaphore(UNHANDLED_REQUESTS)

    def put(self, item: Any) -> None:
        self.queue.put_nowait(item)

    def charge(self, size: int) -> bool:
        """Count `size` bytes about to be sent (a watch's past); False if they do not fit, and
        the stream is then cut off."""
        if self.overflowed:
            return False
        if self.bytes + size > STREAM_BYTES or self.events.room(self.client, size) is not None:
            self.overflowed = True
            self.queue.put_nowait(("overflow", None))
            return False
        self.events.take(self.client, size)
        self.bytes += size
        return True

    def send(self, watch_id: int, events: list[Any], size: int) -> None:
        if self.charge(size):
            self.queue.put_nowait((watch_id, (events, size)))

    async def get(self) -> Any:
        """The next item; an item of events stays counted until :meth:`sent`."""
        return await self.queue.get()

    def sent(self, size: int) -> None:
        """The network took `size` bytes of this stream's."""
        if not self.overflowed or self.bytes:
            self.bytes -= size
            self.events.give(self.client, size)

    def watch(self, cost: int) -> str | None:
        """Hold `cost` bytes for a watch's range; why not, if it does not fit."""
        if self.closed:
            return "the stream has ended"
        full = self.ranges.room(self.client, cost)
        if full is None:
            self.ranges.take(self.client, cost)
            self.watched += cost
        return full

    def unwatch(self, cost: int) -> None:
        cost = min(cost, self.watched)
        self.ranges.give(self.client, cost)
        self.watched -= cost

    def drop(self) -> None:
        """The stream ended: what it still held is no longer held (its queue emptied: a call
        cut off by an abort is kept, in a cycle, until a full collection, and with it this
        queue, which may hold a stream's share of events)."""
        self.events.give(self.client, self.bytes)
        self.unwatch(self.watched)
        self.bytes = 0
        self.overflowed = self.closed = True
        while not self.queue.empty():
            self.queue.get_nowait()


def watch_cost(key: bytes, end: bytes) -> int:
    """What a watch of [key, end) holds while it lives."""
    return len(key) + len(end) + WATCH_OVERHEAD


class NoTurnError(Exception):
    """A request waited :data:`TURN_WAIT` seconds and its turn did not come."""


class Turns:
    """Whose requests are read now: `slots` at once, one per connection; the others wait in
    the order they came. A connection's second request waits behind its first, so that a
    connection with many requests waits its turn as one with one does, and no connection
    keeps the others out."""

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._all: asyncio.Semaphore | None = None  # made on the service's loop
        self._mine: dict[str, list[Any]] = {}  # a connection's lock, and how many use it

    @contextlib.asynccontextmanager
    async def turn(self, client: str) -> AsyncIterator[None]:
        """Hold a turn for `client`; raises :class:`NoTurnError` past :data:`TURN_WAIT`."""
        if self._all is None:
            self._all = asyncio.Semaphore(self.slots)
        every, entry = self._all, self._mine.setdefault(client, [asyncio.Lock(), 0])
        entry[1] += 1
        try:
            end = asyncio.get_running_loop().time() + TURN_WAIT
            if not await _acquire(entry[0], TURN_WAIT):
                raise NoTurnError
            try:
                if not await _acquire(every, end - asyncio.get_running_loop().time()):
                    raise NoTurnError
            except BaseException:
                entry[0].release()
                raise
            try:
                yield
            finally:
                every.release()
                entry[0].release()
        finally:
            entry[1] -= 1
            if not entry[1]:
                del self._mine[client]


async def _acquire(held: asyncio.Lock | asyncio.Semaphore, timeout: float) -> bool:
    """Acquire `held` within `timeout` seconds; False if not. Whether it times out or is
    cancelled, nothing is left held (an acquire that completes as it is given up is undone)."""
    task = asyncio.ensure_future(held.acquire())
    try:
        done, _ = await asyncio.wait({task}, timeout=max(timeout, 0.0))
    except BaseException:
        _abandon(task, held)
        raise
    if done:
        return True
    _abandon(task, held)
    return False


def _abandon(task: asyncio.Future[Any], held: asyncio.Lock | asyncio.Semaphore) -> None:
    def undo(t: asyncio.Future[Any]) -> None:
        if not t.cancelled() and t.exception() is None:
            held.release()

    task.cancel()
    task.add_done_callback(undo)  # called at once if it is done already


class Trimmer:
    """Gives the memory the service freed back to the system: after every :data:`TRIM_BYTES`
    of requests read and answers sent, and within :data:`TRIM_PERIOD` seconds once they
    stop. The C library keeps what is freed for reuse, in an arena for each thread that
    allocated it (gRPC's read the requests, the service's parses and answers them): without
    this, writes at the request limit from 64 connections for 20 s grew the process by
    240 MB where it used 160, and it kept 160 MB after, where it stored 85."""

    def __init__(self, every: int = TRIM_BYTES) -> None:
        self.every = every
        self.since = 0  # bytes read or sent since the last trim
        self.late = 0  # periods until the trim after the last
        self._trim = _malloc_trim()

    def passed(self, size: int) -> None:
        """`size` bytes of a request or an answer went through."""
        self.since += size
        if self.since >= self.every:
            self.trim()

    def trim(self) -> None:
        self.since = 0
        self.late = TRIM_LATE
        self._give_back()

    def _give_back(self) -> None:
        if self._trim is not None:
            self._trim(0)

    async def run(self) -> None:
        """Trim every :data:`TRIM_PERIOD` seconds while the service runs, once large requests
        or answers came (small ones, a round's, leave it alone): what the last of a load
        freed is given back within that. Once more :data:`TRIM_LATE` periods after the last:
        what gRPC frees once the load's connections have closed."""
        while True:
            await asyncio.sleep(TRIM_PERIOD)
            if self.since >= MAX_REQUEST // 2:
                self.trim()
            elif self.late:
                self.late -= 1
                if not self.late:
                    self._give_back()


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None (another C library)."""
    try:
        trim: Callable[[int], int] = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None
    return trim
