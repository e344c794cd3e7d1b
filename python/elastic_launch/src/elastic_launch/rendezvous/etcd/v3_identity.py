"""Which store a client's members answer for, and what the client does when that store was
replaced (:mod:`.identity` judges each answer): it takes the new store as its own, ends
its watches (their revisions are another store's), and fills the store again with what the
node knows (the client's ``on_replaced``) while its other calls wait.

A store is replaced when a member started again empty (a new cluster id at its address), when
etcd lost its data (its reads' revision went back), or when the embedded service's new host
took over without changes this client had seen from the one before: a standby dropped for
falling behind, whose copy ends at its *fork* (the last revision it had, in its status), below
the revision this client saw in the term before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from elastic_launch.rendezvous.store.api import StoreError
from elastic_launch.rendezvous.store.identity import (
    Answered,
    Verdict,
    judge,
    lacks,
    seen,
    serves,
    two_clusters,
)

logger = logging.getLogger(__name__)


class ClientView(Protocol):
    """What this needs of the client (:class:`.etcd_v3_client.Client`)."""

    name: str
    retry_for: float
    connections: list[Any]
    on_replaced: Callable[[], None]

    @property
    def target(self) -> str: ...

    @property
    def current(self) -> Any: ...

    def status(self, conn: Any) -> Any | None: ...

    def pin(self, conn: Any) -> None: ...

    def fail_over(self, failed: Any, why: str, error: Any = None) -> bool: ...


class StoreIdentity:
    """The store `client` uses: its cluster, how many times it was replaced (`epoch`), the
    terms and revisions seen of it, and the filling again of a replaced one."""

    def __init__(self, client: ClientView) -> None:
        self.client = client
        self._lock = threading.Lock()
        self.cluster: int | None = None  # ours: the cluster id of the first answer
        self._first = ""  # the member that gave it, as written
        self._origin: Any = None  # ... and its connection
        self.epoch = 0  # how many times the store was replaced
        self.replaced_at: float | None = None  # when (monotonic), the last time
        self._term = (0, 0)  # (the newest term answered in, the newest revision seen in it)
        self._refill = threading.RLock()  # held while a replaced store is filled again
        self._refiller: int | None = None  # the thread that fills it
        self._watches: set[Any] = set()  # told that their revisions are another store's

    # ---- judging answers -----------------------------------------------------------------

    def floor(self, conn: Any) -> int:
        """The revision member `conn` has shown of ours: a read sent now cannot be older."""
        with self._lock:
            answered = conn.answered
            ours = answered is not None and answered.cluster == self.cluster
            return int(answered.revision) if answered is not None and ours else 0

    def check(self, conn: Any, reply: Any, floor: int | None = None) -> bool:
        """Judge an answer of member `conn` by the cluster, revision and term in its header
        (for a read, sent when the member had shown revision `floor`: linearizable, it cannot
        be older while the member keeps its data). True: use it. False: do not (the member
        was left for one that serves ours, or the store was replaced and is filled again
        now): ask again. A member of another cluster given with ours is a StoreError."""
        header = getattr(reply, "header", None)
        cluster = int(getattr(header, "cluster_id", 0))
        if header is None or not cluster:
            return True
        revision = int(header.revision) if floor is not None else None
        if not self.judge(conn, cluster, revision, floor or 0):
            return False
        return self._same_history(conn, int(header.raft_term), revision)

    def judge(self, conn: Any, cluster: int, revision: int | None = None, floor: int = 0) -> bool:
        """Judge that member `conn` answers for `cluster` (see :meth:`check`)."""
        with self._lock:
            ours, before, epoch = self.cluster, conn.answered, self.epoch
            verdict = judge(ours, before, cluster, revision, floor)
            if verdict in (Verdict.FIRST, Verdict.SAME):
                if verdict is Verdict.FIRST:
                    self.cluster, self._first, self._origin = cluster, conn.member.written, conn
                conn.answered = seen(before, cluster, revision)
                return True
        if verdict is Verdict.FOREIGN:
            return self._foreign(conn, ours or 0, cluster, epoch)
        assert ours is not None
        assert before is not None
        now = Answered(cluster, revision or 0)
        return self._changed(conn, before, now, epoch, _what(ours, before, now))

    def _foreign(self, conn: Any, ours: int, cluster: int, epoch: int) -> bool:
        """Member `conn` answers for another cluster than ours, and never did for ours."""
        if conn.learned:  # a member the store named, taken since by another
            self.client.fail_over(conn, f"it belongs to another cluster ({cluster:x})")
            return False
        origin = self._origin
        if origin is not None and origin is not conn and self._follows(origin, cluster):
            # Ours came from a member that answers for this cluster now (a host of a moment
            # that stepped down into it): ours is gone, this is the store.
            before = origin.answered or Answered(ours)
            now = Answered(cluster)
            return self._changed(origin, before, now, epoch, _what(ours, before, now))
        raise StoreError(
            two_clusters(
                self.client.target, self._first, conn.member.written, (f"{ours:x}", f"{cluster:x}")
            )
        )

    def _same_history(self, conn: Any, term: int, revision: int | None) -> bool:
        """An answer of ours in `term` (a read's or write's `revision`: answered once the
        standbys had it). In a newer term than those seen, the new host's copy must hold
        what this client saw before (its status says where its copy ends); one that does not
        is the store replaced: it lost changes. False: ask again."""
        with self._lock:
            before, epoch = self._term, self.epoch
            if term < before[0]:
                return True  # an answer of an older term, come late
            newest = before[1] if term == before[0] else 0
            self._term = (term, max(newest, revision or 0))
        if term == before[0] or not before[0] or not before[1]:
            return True
        status = self.client.status(conn)
        if status is None or not lacks(status, before[1]):
            return True
        ours, fork = self.cluster or 0, int(status.raftIndex)
        what = (
            f"hosts a copy that ends at revision {fork}, short of {before[1]} this node saw "
            "(the standby that took over had fallen behind)"
        )
        return self._changed(conn, Answered(ours, before[1]), Answered(ours, fork), epoch, what)

    # ---- a member that changed -----------------------------------------------------------

    def _changed(self, conn: Any, before: Answered, now: Answered, epoch: int, what: str) -> bool:
        """Member `conn` answered for our cluster with `before` (in `epoch`), and now with
        `now` (`what` happened, in words): it was started again empty, follows another host,
        or hosts a copy short of what was seen. If another member still serves ours, `conn`
        is left for it; if none does, the store was replaced: `now` is ours from now on, and
        the store is filled again (the client's ``on_replaced``) before any other call."""
        elsewhere = self._serving(before.cluster, before.revision, conn)
        if elsewhere is not None:
            if self.client.current is conn:
                self.client.pin(elsewhere)
            logger.info(
                "%s: member %s answers as another store now; going on with %s, which serves "
                "the job's",
                self.client.name,
                conn.member.written,
                elsewhere.member.written,
            )
            return False
        with self._refill:
            if self.epoch != epoch:
                return False  # another thread took the new store first
            self._refiller = threading.get_ident()  # before the epoch: see enter()
            try:
                self._adopt(conn, now)
                self._fill_again(f"{conn.member.written} {what}")
            finally:
                self._refiller = None
        return False

    def _adopt(self, conn: Any, now: Answered) -> None:
        """Take `now` (what member `conn` answered) as the store from now on; the watches
        under way are told their revisions are another store's."""
        with self._lock:
            self.cluster, self._first, self._origin = now.cluster, conn.member.written, conn
            self.epoch += 1
            self.replaced_at = time.monotonic()
            self._term = (0, 0)
            for c in self.client.connections:
                c.answered = None
            conn.answered = now
            watches = list(self._watches)
        self.client.pin(conn)
        for watch in watches:  # those idle on the new store would wait for revisions
            watch.store_replaced()  # that it may reach only much later

    def _fill_again(self, why: str) -> None:
        """Run the client's ``on_replaced`` (its calls go through; the other threads' wait)."""
        logger.warning(
            "%s: %s; putting back what this node knows of the job, where it is missing",
            self.client.name,
            why,
        )
        try:
            self.client.on_replaced()
        except Exception as e:  # a thread that found it goes on, whatever the store holds
            logger.warning("%s: could not put the job's state back: %s", self.client.name, e)

    def _follows(self, conn: Any, cluster: int) -> bool:
        """Whether member `conn` answers as a member of `cluster` now (a standby of its host)."""
        reply = self.client.status(conn)
        return reply is not None and int(reply.header.cluster_id) == cluster

    def _serving(self, ours: int, revision: int, exclude: Any) -> Any:
        """Another member that still serves cluster `ours` at `revision` at least (as its
        host, for the embedded service); None if none answers so."""
        others = [c for c in list(self.client.connections) if c is not exclude]
        return next((c for c in others if serves(self.client.status(c), ours, revision)), None)

    # ---- calls around a replacement ------------------------------------------------------

    def watching(self, watch: Any) -> Callable[[], None]:
        """Tell `watch` (its ``store_replaced()``) when the store is replaced; the undo."""
        with self._lock:
            self._watches.add(watch)
        return lambda: self._watches.discard(watch)

    @property
    def refilling(self) -> bool:
        """Whether a replaced store is being filled again now."""
        return self._refiller is not None

    def enter(self) -> int:
        """Before a call: wait while another thread fills a replaced store again (a read of
        it before then would find it empty); the store's epoch."""
        epoch = self.epoch  # first: a store replaced after this read is seen by the caller
        other = self._refiller not in (None, threading.get_ident())
        if other and self._refill.acquire(timeout=self.client.retry_for):
            self._refill.release()
            return self.epoch
        return epoch


def _what(ours: int, before: Answered, now: Answered) -> str:
    """What happened to a member whose answers changed, in words."""
    if now.cluster != ours:
        return (
            f"answers as another store (cluster id {ours:x}, then {now.cluster:x}): it was "
            "started again empty, or it follows the job's host now"
        )
    return f"lost its data: its revision went back from {before.revision} to {now.revision}"
