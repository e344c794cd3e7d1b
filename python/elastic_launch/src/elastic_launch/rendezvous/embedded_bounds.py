"""What a client can make the embedded rendezvous service hold, and the accounts that keep it
to that.

Every dimension is capped: keys and their bytes, the history kept for watches that start in
the past, the streams open, the watches on one stream, the leases (per connection and in all;
a few of each connection's are its own, whatever the others hold, and none outlives
:data:`MAX_TTL` unrenewed), and the bytes of answers not yet taken by the network: a watch
stream's queued and unsent events (per stream and for all streams), and the answers to
reads. A write past a cap is refused with RESOURCE_EXHAUSTED; a watch stream past its share
is cut off (as etcd cancels a slow watcher); a read that would pass the answers' cap is
refused (it may be tried again), and one that could never fit is refused naming the limit.
A round of 1,024 nodes uses a few thousand keys, a lease per node and well under a MiB, far
inside every cap.

So, whatever clients do, the service holds at most the data cap (64 MiB) plus the history
(16 MiB), the watches' bytes (12 MiB), the reads' bytes (16 MiB) and the leases (a few MiB), and
gRPC's own copy of what it is writing: ``tests/launch/rendezvous/test_embedded_bounds.py``
measures it under each attack."""

from __future__ import annotations

import asyncio
import collections
from typing import Any

HISTORY = 100_000  # events kept for watches that start in the past
HISTORY_BYTES = 16 << 20
STREAM_BYTES = 8 << 20  # queued or being sent on one watch stream
WATCH_BYTES = 12 << 20  # queued or being sent on all watch streams together
READ_BYTES = 16 << 20  # answers to reads being sent, together
MAX_STREAMS = 8192  # watch and keep-alive streams at once
WATCHERS_PER_STREAM = 256
MAX_KEYS = 100_000
MAX_DATA_BYTES = 64 << 20  # keys and values held
MAX_REQUEST = 4 << 20  # one request (gRPC's default, said explicitly)
EVENT_OVERHEAD = 64  # bytes an event costs beyond its key and value
HANDSHAKE_MS = 5000  # a connection that has not said it speaks HTTP/2 (or TLS) by then is closed
#: The longest lease, in seconds (etcd's is 9e9): a departed client's leases end within it.
#: A rendezvous asks for its heartbeat_timeout (5 s by default), which may not be longer.
MAX_TTL = 3600
MAX_LEASES = 10_000
LEASES_PER_CLIENT = 256  # a client: one connection (an agent holds one or two)
#: Leases a connection is granted whatever the others hold: however many leases one client
#: takes, an honest agent (which needs one or two) can still join.
RESERVED_PER_CLIENT = 4


class Account:
    """Bytes held against a limit."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.bytes = 0

    def take(self, n: int) -> bool:
        if self.bytes + n > self.limit:
            return False
        self.bytes += n
        return True

    def give(self, n: int) -> None:
        self.bytes -= n


class Leases:
    """Who holds how many leases: a grant past either cap is refused."""

    def __init__(self) -> None:
        self.count = 0
        self.per_client: collections.Counter[str] = collections.Counter()

    def room(self, client: str) -> str | None:
        """Why `client` may not be granted another lease, or None."""
        if self.per_client[client] >= LEASES_PER_CLIENT:
            return f"this connection holds {LEASES_PER_CLIENT} leases already"
        if self.count >= MAX_LEASES and self.per_client[client] >= RESERVED_PER_CLIENT:
            return f"it holds {MAX_LEASES} leases already"
        return None

    def granted(self, client: str) -> None:
        self.count += 1
        self.per_client[client] += 1

    def ended(self, client: str) -> None:
        self.count -= 1
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]


class Outbox:
    """A watch stream's queue, which counts the bytes of its events from the moment they are
    queued until the network has taken them: a stream whose client stops reading is cut off
    at :data:`STREAM_BYTES`, or when all streams together hold :data:`WATCH_BYTES`, instead of
    growing."""

    def __init__(self, total: Account) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.total = total
        self.bytes = 0
        self.overflowed = False

    def put(self, item: Any) -> None:
        self.queue.put_nowait(item)

    def charge(self, size: int) -> bool:
        """Count `size` bytes about to be sent (a watch's past); False if they do not fit, and
        the stream is then cut off."""
        if self.overflowed:
            return False
        if self.bytes + size > STREAM_BYTES or not self.total.take(size):
            self.overflowed = True
            self.queue.put_nowait(("overflow", None))
            return False
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
            self.total.give(size)

    def drop(self) -> None:
        """The stream ended: what it still held is no longer held."""
        self.total.give(self.bytes)
        self.bytes = 0
        self.overflowed = True
