"""Following a running round from a thread: the agent asks :attr:`Follower.changed` on every
pass, and the round's leader reopens the round the moment a member leaves.

The round's leader follows all of it (every member's join key, the finished ones) and reopens
the round when a member leaves; the others follow only the state key's prefix (the state with
its notes, the leader key, the waiting spares), so that a node costs the store the same whatever
the number of nodes. Should the leader finish first and go, they follow all of it from then on.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from math import inf

from elastic_launch.api import Cancelled
from elastic_launch.cancel import join
from elastic_launch.rendezvous.api import RestartReason
from elastic_launch.rendezvous.round import state as rnd
from elastic_launch.rendezvous.round.job import Job
from elastic_launch.rendezvous.round.state import RoundState, Status
from elastic_launch.rendezvous.store.api import (
    Change,
    HistoryLostError,
    Inbox,
    KeyValue,
    StoreError,
)
from elastic_launch.rendezvous.store.session import Session

logger = logging.getLogger(__name__)


class Follower:
    """Follows the running round from a thread (its first read and watch off the path to the
    workers' start) and sets :attr:`changed` when the round is over for this node: the state
    moved on (another node reopened it, or closed the job), a member left, a node waits to be
    admitted and there is room, or this node's own lease expired.

    The round's leader follows all of it (every member's join key, the finished ones) and
    reopens the round when a member leaves; the others follow only the state key's prefix
    (the state with its notes, the leader key, the waiting spares), so that a node costs the
    store the same whatever the number of nodes. Should the leader finish first and go, they
    follow all of it from then on."""

    def __init__(
        self,
        job: Job,
        session: Session,
        current: RoundState,
        drop: list[str],
        max_nodes: int,
        max_restarts: int,
    ) -> None:
        self.job = job
        self.session = session
        self.max_nodes = max_nodes
        self.max_restarts = max_restarts
        self.round = current
        self._drop = drop  # the previous rounds' keys, deleted first (by the leader)
        # A loss before now is not this round's: its keys were written with the new lease
        # (or are missing, which the first look below sees).
        self._losses = session.losses
        self.changed = threading.Event()
        self.broken = threading.Event()  # changed, and not merely by a node waiting
        self.waiting: set[str] = set()
        self.done: set[str] = set()
        self.notes: dict[str, str] = dict(current.notes)
        self.leader_done = False
        self._told: set[str] = set()  # members whose leaving this node has logged
        # After the store was started again and filled: whose keys are not back yet (the
        # leader's key: ""); they may come back within a lease's time of it.
        self._awaited: set[str] = set()
        self._stop = threading.Event()
        self._inbox: Inbox | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="elasticrun-rdzv", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            if self._inbox is not None:
                self._inbox.wake()
        join(self._thread, 5, "the rendezvous follower thread")

    def _run(self) -> None:
        try:
            everything = self.round.leader == self.job.node
            while True:
                try:
                    if self._follow(everything):
                        return
                    everything = True  # the leader finished and went: follow all from now on
                except HistoryLostError as e:  # its watch cannot go on: read again, watch again
                    logger.warning("rendezvous: %s; reading the round again", e)
        except Exception as e:  # any failure: the agent must hear of it, not a dead thread
            if not self._stop.is_set():
                if not isinstance(e, Cancelled):
                    logger.warning("rendezvous watch: %s", e)
                self._break()

    def _follow(self, everything: bool) -> bool:
        """Follow the round until stopped (True), or until the leader is found to have
        finished and gone (False: follow everything instead)."""
        job, keys = self.job, self.job.keys
        for prefix in self._drop:
            with contextlib.suppress(StoreError):
                job.store.delete(prefix, prefix=True)
        self._drop = []
        kvs, revision = job.look(everything)
        if not self._take_in(kvs, everything):
            return False
        if rnd.admissible(self.waiting, self.round.size, self.max_nodes):
            self.changed.set()
        watched = [keys.everything] if everything else keys.light
        with self.session.watching(watched, revision) as inbox:
            with self._lock:
                self._inbox = inbox
            if self._stop.is_set():
                return True
            while not self._stop.is_set():
                if self.session.losses != self._losses:
                    self._break()  # our lease expired: the others think we are gone
                batch = inbox.next(self._grace_left() if self._awaited else inf)
                for change in batch or []:
                    if not self._apply(change, everything):
                        return False
                if not self._still_awaited():
                    return False
        return True

    def _take_in(self, kvs: list[KeyValue], everything: bool) -> bool:
        """The read the watch starts after: whatever happened between the round going final
        and it (a member gone, the round reopened) shows in the read itself. False when the
        leader finished and went (follow everything)."""
        job, keys, v = self.job, self.job.keys, self.round.version
        self.waiting = {
            kv.key[len(keys.waiting) :] for kv in kvs if kv.key.startswith(keys.waiting)
        }
        self.leader_done = any(kv.key == keys.leader_done(v) for kv in kvs)
        state, _ = job.state_in(kvs)
        self._note(state)
        self._awaited = set()
        if everything:
            if not self.round.members_complete:  # every member's shard is in the read
                shards = keys.members(v)
                self.round = self.round.with_shards(
                    [kv.value for kv in kvs if kv.key.startswith(shards)], shards
                )
            self.done = {kv.key.rsplit("/", 1)[1] for kv in kvs if kv.key.startswith(keys.done)}
            join_prefix = keys.join(v)
            present = {kv.key[len(join_prefix) :] for kv in kvs if kv.key.startswith(join_prefix)}
            gone = set(self.round.nodes) - self.done - present
            if self._graced():
                self._awaited = gone
            elif rnd.still_runs(state, v) and gone:
                self._lost(sorted(gone)[0], "as its round began")
        elif not any(kv.key == keys.leader(v) for kv in kvs):
            if self._graced():
                self._awaited = {""}
            elif self._leader_gone():
                return False
        return True

    def _grace_left(self) -> float:
        """Seconds during which keys missing from a read may still come back: the store was
        started again, and each node puts its own back once it finds it so (within a lease's
        time, when its keep-alive asks)."""
        since = self.job.store.replaced_at
        if since is None:
            return 0.0
        return max(0.0, since + self.session.ttl + 1.0 - time.monotonic())

    def _graced(self) -> bool:
        return self._grace_left() > 0

    def _still_awaited(self) -> bool:
        """Once the grace is over: members whose keys did not come back are gone (False: the
        leader, whose key did not, finished and went)."""
        if not self._awaited or self._graced():
            return True
        awaited = self._awaited
        try:
            if "" in awaited:
                return not self._leader_gone()
            if rnd.still_runs(self.job.known.state, self.round.version):
                self._lost(sorted(awaited)[0], "(its keys did not come back to the store)")
            return True
        finally:
            self._awaited = set()

    def _note(self, state: RoundState | None) -> None:
        if state is not None and state.status == Status.CLOSED:
            self.job.closed = state.closed
        if not rnd.still_runs(state, self.round.version):
            if (
                state is not None
                and state.left
                and state.left not in self._told
                and state.version == self.round.version + 1
            ):
                # The leader reopened the round for a member that left: say who, as it did.
                self._told.add(state.left)
                logger.warning("node %s left the job", state.left)
            self._break()
        elif state is not None:
            self.notes.update(state.notes)

    def _break(self) -> None:
        self.broken.set()
        self.changed.set()

    def _leader_gone(self) -> bool:
        """The leader key went: False if the leader finished (follow everything from now on);
        otherwise the leader left the job (True, and the round is broken)."""
        leader = self.round.leader
        if self.leader_done:  # it said so on the same watch, before its key went
            return False
        if self.job.closed is None:
            logger.warning("node %s left the job", leader)
        self._break()
        return True

    def _lost(self, node: str, when: str = "") -> None:
        """A member left (the leader sees it): the round is reopened at once, so that every
        node hears of it from the state, which it watches, without waiting for this node's
        agent to stop its workers first."""
        if self.job.closed is None and node not in self._told:  # a closed job's keys all go
            self._told.add(node)
            logger.warning("node %s left the job%s", node, f" {when}" if when else "")
        self._break()
        if self.session.losses != self._losses:
            return  # it is us who were cut off: not ours to decide
        # From a thread of its own: a store going away (the job ending) costs the follower
        # nothing, and stopping it never waits for these requests.
        threading.Thread(
            target=self._reopen, args=(node,), name="elasticrun-reopen", daemon=True
        ).start()

    def _reopen(self, left: str) -> None:
        with contextlib.suppress(Exception):  # gone, closed, moved on: nothing to do
            state, version = self.job.read()
            if rnd.still_runs(state, self.round.version):
                assert state is not None
                reopened = rnd.reopen(state, RestartReason.MEMBERSHIP, self.max_restarts, left=left)
                self.job.commit(reopened, version)

    def _back(self, c: Change, join_prefix: str, leader_key: str) -> None:
        """A member's (or the leader's) key put back into a store started again."""
        if c.value is not None and self._awaited:
            self._awaited.discard("" if c.key == leader_key else c.key[len(join_prefix) :])

    def _apply(self, c: Change, everything: bool) -> bool:
        """Take one change in; False when the leader turns out to have finished and gone."""
        keys = self.job.keys
        join_prefix, leader_key = keys.join(self.round.version), keys.leader(self.round.version)
        node = c.key.rsplit("/", 1)[1]
        self._back(c, join_prefix, leader_key)
        if c.key == keys.state:
            self._note(self.job.saw(c.value, c.key) if c.value is not None else None)
        elif c.key == leader_key and c.value is None and not everything:
            if not self._leader_gone():
                return False
        elif c.key == keys.leader_done(self.round.version) and c.value is not None:
            self.leader_done = True
        elif c.key.startswith(keys.waiting):
            if c.value is None:
                self.waiting.discard(node)
            else:
                self.waiting.add(node)
                if rnd.admissible(self.waiting, self.round.size, self.max_nodes):
                    self.changed.set()
        elif c.key.startswith(keys.done) and c.value is not None:
            self.done.add(node)
        elif c.key.startswith(join_prefix) and c.value is None:
            if node == self.job.node:
                self._break()  # our own lease expired
            elif node in self.round.nodes and node not in self.done:
                self._lost(node)
        return True
