"""The elastic rendezvous: one algorithm for every backend with a store (embedded, etcd, etcd-v2).

Rounds are numbered versions that go joinable -> frozen -> final (etcd's classic rendezvous):

- **joinable**: nodes announce themselves with an ephemeral join key ``v<N>/join/<node>`` (bound
  to the node's lease, so a dead node's key vanishes). The first node to have joined (lowest
  creation revision) leads: it freezes the round as soon as MAX nodes have joined, or MIN have
  and the last-call timeout has passed. Nodes beyond MAX wait.
- **frozen**: the membership and ranks are fixed in the state key; each member confirms with an
  ephemeral ``v<N>/confirm/<node>``; when all have, the leader makes the round final (a member
  that vanishes meanwhile sends the round back to joinable).
- **final**: the workers run. A node that arrives registers ``waiting/<node>`` and is admitted at
  the next round; a member whose join key vanishes (lease expiry: the node died) or a worker
  failure re-opens the round (version N+1). Agents learn all of this from one watch.

Every write is one request and every node reads through its watch, so requests per round grow
linearly with the number of nodes. The state key holds the job-wide restart count (a failure
re-opens the round with count + 1, or closes the job when the budget is spent), the previous
round's ranks (survivors keep theirs where they can), and the job's end (``closed``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastic_launch.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConfigError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from elastic_launch.rendezvous.store import KeyValue, Store, StoreError, Watch

logger = logging.getLogger(__name__)

JOINABLE, FROZEN, FINAL, CLOSED = "joinable", "frozen", "final", "closed"
SUCCEEDED = "succeeded"


@dataclass(frozen=True)
class Timeouts:
    """Seconds; from --rdzv-conf (torch's key names)."""

    join: float = 600.0  # to form a round with at least MIN nodes
    last_call: float = 3.0  # after MIN have joined, for more to come
    heartbeat: float = 5.0  # lease TTL: a dead node is noticed within this
    close: float = 30.0  # for a frozen round's members to confirm
    reconnect: float = 30.0  # while running: how long a store that went away may stay away

    @classmethod
    def from_config(cls, conf: Mapping[str, Any]) -> Timeouts:
        t = cls(
            join=float(conf.get("join_timeout", conf.get("timeout", cls.join))),
            last_call=float(conf.get("last_call_timeout", cls.last_call)),
            heartbeat=float(conf.get("heartbeat_timeout", cls.heartbeat)),
            close=float(conf.get("close_timeout", cls.close)),
            reconnect=float(conf.get("reconnect_timeout", cls.reconnect)),
        )
        if t.heartbeat < 2.0:
            raise RendezvousConfigError(
                f"--rdzv-conf heartbeat_timeout={t.heartbeat:g}: the lease needs at least 2 seconds"
            )
        return t


def local_address(target_host: str) -> str:
    """The address of this host on the route to `target_host` (what other nodes reach)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((socket.gethostbyname(target_host), 9))  # no packet is sent
            return str(s.getsockname()[0])
    except OSError:
        return socket.gethostname()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:  # a name or address not on this host: any interface will do
            s.bind(("", 0))
        return int(s.getsockname()[1])


def assign_ranks(members: list[str], previous: Mapping[str, int]) -> dict[str, int]:
    """Ranks 0..n-1: a member keeps its previous rank when it is still in range and free; the
    others take the free ranks in join order."""
    n = len(members)
    ranks: dict[str, int] = {}
    taken: set[int] = set()
    for m in members:
        r = previous.get(m)
        if r is not None and r < n and r not in taken:
            ranks[m] = r
            taken.add(r)
    free = iter(r for r in range(n) if r not in taken)
    for m in members:
        if m not in ranks:
            ranks[m] = next(free)
    return ranks


class ElasticRendezvous(RendezvousHandler):
    def __init__(
        self, params: RendezvousParameters, store: Store, timeouts: Timeouts, store_host: str
    ) -> None:
        self.params = params
        self.store = store
        self.t = timeouts
        self.node = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.addr = params.local_addr or local_address(store_host)
        self.prefix = f"/elasticrun/{params.run_id}"
        self._state_key = f"{self.prefix}/state"
        self._version = 0  # the round this node is in (0: none yet)
        self._info: RendezvousInfo | None = None
        self._closed_reason: str | None = None
        self._changed = threading.Event()
        self._waiting: set[str] = set()
        self._done: set[str] = set()
        self._members: dict[str, Any] = {}
        self._was_waiting = False
        self._finished_first = False  # we succeeded while other members still ran
        self._watcher: threading.Thread | None = None
        self._watch: Watch | None = None
        self._stop = threading.Event()
        self._watch_lock = threading.Lock()
        self.store.start_liveness(self.t.heartbeat)

    # ---- helpers ---------------------------------------------------------------------------

    def _state(self) -> tuple[dict[str, Any] | None, int]:
        kv = self.store.get(self._state_key)
        if kv is None:
            return None, 0
        return json.loads(kv.value), kv.version

    def _state_in(self, kvs: list[KeyValue]) -> tuple[dict[str, Any] | None, int]:
        """The state among the keys of a range (None if absent), and its version."""
        kv = next((kv for kv in kvs if kv.key == self._state_key), None)
        return (json.loads(kv.value), kv.version) if kv is not None else (None, 0)

    def _write_state(self, state: dict[str, Any], version: int) -> int:
        """Write the state if it is still at `version` (0: absent): its new version, or 0 when
        someone moved it on first."""
        data = json.dumps(state).encode()
        if version == 0:
            return self.store.create(self._state_key, data)
        return self.store.cas(self._state_key, data, version)

    def _closed_error(self, reason: str) -> RendezvousClosedError:
        self._closed_reason = reason
        return RendezvousClosedError(
            f"the job '{self.params.run_id}' is over: {reason}"
            if reason != SUCCEEDED
            else f"the job '{self.params.run_id}' has finished"
        )

    def _my_info(self) -> dict[str, Any]:
        return {
            "addr": self.addr,
            "port": _free_port(self.addr),  # used if this node becomes group rank 0
            "lws": self.params.local_world_size,
        }

    # ---- the interface ---------------------------------------------------------------------

    def get_backend(self) -> str:
        return self.params.backend

    def get_run_id(self) -> str:
        return self.params.run_id

    def next_rendezvous(self, reason: str = "start") -> RendezvousInfo:
        self._stop_watcher()
        if self._version:
            self._reopen(reason)
        deadline = time.monotonic() + self.t.join
        while True:
            state, version = self._state()
            if state is None:
                fresh = {"version": 1, "status": JOINABLE, "restarts": 0, "prev_ranks": {}}
                self._write_state(fresh, 0)
                continue
            if state["status"] == CLOSED:
                raise self._closed_error(state.get("closed") or "closed")
            v = state["version"]
            if state["status"] == JOINABLE:
                info = self._join(v, deadline)
            elif state["status"] == FROZEN and self.node in state["nodes"]:
                watch = self.store.watch(self.prefix + "/", version)
                try:
                    info = self._confirm(state, version, watch)
                finally:
                    watch.close()
            elif state["status"] == FINAL and self.node in state["nodes"] and v != self._version:
                info = self._round_info(state)
            elif state["status"] == FINAL and self.node in state["nodes"]:
                self._reopen(reason)  # our own round: we need a new one
                continue
            else:
                info = self._wait_as_spare(v)
            if info is not None:
                self._start_watcher()
                return info

    def _reopen(self, reason: str) -> None:
        """Move our final round back to joinable (N+1); a failure counts against the budget."""
        while True:
            state, version = self._state()
            if state is None or state["version"] != self._version or state["status"] != FINAL:
                return  # someone else moved it on already
            nxt = dict(state)
            nxt.pop("nodes", None)
            nxt["prev_ranks"] = state.get("ranks", {})
            nxt.pop("ranks", None)
            if reason == "failure":
                nxt["restarts"] = state.get("restarts", 0) + 1
                if nxt["restarts"] > self.params.max_restarts:
                    nxt = {
                        **state,
                        "status": CLOSED,
                        "closed": f"failed: restarts exhausted ({self.params.max_restarts}), "
                        f"last failure on {socket.gethostname()}",
                    }
                    if self._write_state(nxt, version):
                        raise self._closed_error(nxt["closed"])
                    continue
            nxt.update(version=state["version"] + 1, status=JOINABLE)
            if self._write_state(nxt, version):
                return

    def _join(self, v: int, deadline: float) -> RendezvousInfo | None:
        """Take part in joinable round `v` until it is frozen with us in it (then confirm),
        moves on without us (None: the caller looks again), or the join timeout passes."""
        join_prefix = f"{self.prefix}/v{v}/join/"
        me = join_prefix + self.node
        self.store.create(me, json.dumps(self._my_info()).encode(), ephemeral=True)
        if self._was_waiting:
            with contextlib.suppress(StoreError):
                self.store.delete(f"{self.prefix}/waiting/{self.node}")
            self._was_waiting = False
        kvs, revision = self.store.range(f"{self.prefix}/")
        joined = {
            kv.key[len(join_prefix) :]: kv.created for kv in kvs if kv.key.startswith(join_prefix)
        }
        found, sversion = self._state_in(kvs)
        if found is None:
            return None
        state = found
        # The first to join leads the round and counts the others; the rest only need the
        # state (so each change reaches N watchers once, not N x N).
        leader = min(joined, key=lambda n: joined[n])
        leading = leader == self.node
        watch = self.store.watch(self.prefix + "/" if leading else self._state_key, revision)
        last_call_at: float | None = None
        next_check = time.monotonic() + 1.0
        try:
            while True:
                if state["version"] != v or state["status"] != JOINABLE:
                    if (
                        state["version"] == v
                        and state["status"] == FROZEN
                        and (self.node in state["nodes"])
                        # Leading the confirmations without having led the join (its leader
                        # rejoined late) needs a watch on the whole job: the caller opens one.
                        and (leading or state.get("leader") != self.node)
                    ):
                        return self._confirm(state, sversion, watch)
                    return None
                now = time.monotonic()
                if not leading and now >= next_check:
                    next_check = now + 1.0
                    if self.store.get(join_prefix + leader) is None:
                        return None  # the leader died: look again, another leads
                    if self.store.liveness_lost() and self.store.get(me) is None:
                        self._rejoin(me)
                if leading and len(joined) >= self.params.min_nodes:
                    if last_call_at is None:
                        last_call_at = now + self.t.last_call
                    if len(joined) >= self.params.max_nodes or now >= last_call_at:
                        frozen = self._freeze(state, sversion, join_prefix)
                        last_call_at = None
                        if frozen is not None:  # go on at once, not when the watch brings it
                            state, sversion = frozen
                            continue
                if now >= deadline:
                    if not leading:
                        joined = {kv.key: kv.created for kv in self.store.range(join_prefix)[0]}
                    with contextlib.suppress(StoreError):
                        self.store.delete(me)
                    raise RendezvousTimeoutError(
                        f"rendezvous of run '{self.params.run_id}' timed out after "
                        f"{self.t.join:g} s: {len(joined)} node(s) joined, at least "
                        f"{self.params.min_nodes} needed (--nnodes {self.params.min_nodes}:"
                        f"{self.params.max_nodes}); start more nodes or raise join_timeout"
                    )
                wait = min(deadline, last_call_at or deadline, now + 1.0) - now
                for change in watch.next(max(0.05, wait)) or []:
                    if change.key == self._state_key:
                        if change.value is None:
                            return None
                        state, sversion = json.loads(change.value), change.revision
                    elif change.key.startswith(join_prefix):
                        node = change.key[len(join_prefix) :]
                        if change.value is not None:
                            joined.setdefault(node, change.revision)
                        elif node == self.node:  # our lease expired: join again
                            self._rejoin(me)
                        else:
                            joined.pop(node, None)
        finally:
            watch.close()

    def _rejoin(self, me: str) -> None:
        """Our lease expired while we waited: a new lease, then our join key again."""
        self.store.ensure_lease()
        self.store.reset_liveness()
        self.store.create(me, json.dumps(self._my_info()).encode(), ephemeral=True)

    def _freeze(
        self, state: dict[str, Any], version: int, join_prefix: str
    ) -> tuple[dict[str, Any], int] | None:
        """Fix the round's members and ranks: the frozen state and its version, or None if too
        few are left or the state moved on."""
        kvs, _ = self.store.range(join_prefix)
        infos = {kv.key[len(join_prefix) :]: json.loads(kv.value) for kv in kvs}
        created = {kv.key[len(join_prefix) :]: kv.created for kv in kvs}
        # First come, first in; the first member leads the confirm phase (normally this
        # node, unless it rejoined late after its lease expired).
        order = sorted(infos, key=lambda n: created[n])[: self.params.max_nodes]
        if len(order) < self.params.min_nodes:
            return None
        nxt = {
            **state,
            "status": FROZEN,
            "nodes": {n: infos[n] for n in order},
            "ranks": assign_ranks(order, state.get("prev_ranks", {})),
            "leader": order[0],
        }
        written = self._write_state(nxt, version)
        return (nxt, written) if written else None

    def _confirm(self, state: dict[str, Any], sversion: int, watch: Watch) -> RendezvousInfo | None:
        """A frozen round with us in it: confirm, and (the leader) make it final once every
        member has; a member that vanishes sends the round back to joinable."""
        v = state["version"]
        confirm_prefix = f"{self.prefix}/v{v}/confirm/"
        self.store.put(confirm_prefix + self.node, b"1", ephemeral=True)
        leader = state.get("leader")
        leading = leader == self.node
        # The leader gives the members `close` seconds to confirm; should the leader itself
        # vanish, the others give up a heartbeat later, or at once if its join key is gone.
        until = time.monotonic() + self.t.close + (0.0 if leading else self.t.heartbeat)
        next_check = time.monotonic() + 1.0
        confirmed: set[str] = set()
        if leading:  # the others only follow the state
            kvs, _ = self.store.range(confirm_prefix)
            confirmed = {kv.key[len(confirm_prefix) :] for kv in kvs}
        while True:
            if state["version"] != v or state["status"] != FROZEN:
                if state["version"] == v and state["status"] == FINAL:
                    return self._round_info(state)
                return None
            now = time.monotonic()
            if not leading and now >= next_check:
                next_check = now + 1.0
                if self.store.get(f"{self.prefix}/v{v}/join/{leader}") is None:
                    until = 0.0
            nxt: dict[str, Any] | None = None
            if leading and set(state["nodes"]) <= confirmed:
                nxt = {**state, "status": FINAL}
            elif now >= until:
                # A member (or the leader) died while the round froze: start over.
                nxt = {**state, "status": JOINABLE, "version": v + 1}
                nxt.pop("nodes", None)
                nxt.pop("ranks", None)
                nxt.pop("leader", None)
            if nxt is not None:
                written = self._write_state(nxt, sversion)
                if written and nxt["status"] == FINAL:
                    with contextlib.suppress(StoreError):  # the previous round's keys
                        self.store.delete(f"{self.prefix}/v{v - 1}/", prefix=True)
                # Go on from what we wrote, or from what got there first, at once.
                current, sversion = (nxt, written) if written else self._state()
                if current is None:
                    return None
                state = current
                continue
            for change in watch.next(0.5) or []:
                if change.key == self._state_key:
                    if change.value is None:
                        return None
                    state, sversion = json.loads(change.value), change.revision
                elif change.key.startswith(confirm_prefix):
                    node = change.key[len(confirm_prefix) :]
                    if change.value is None:
                        confirmed.discard(node)
                    else:
                        confirmed.add(node)
                elif (
                    "/join/" in change.key
                    and change.value is None
                    and leading
                    and change.key.rsplit("/", 1)[1] in state["nodes"]
                ):
                    until = 0.0  # a member died: start over at once

    def _wait_as_spare(self, v: int) -> RendezvousInfo | None:
        """Arrived while a round runs (or beyond MAX): register as waiting until the round
        changes. No join timeout: a spare waits for the job to need it or to end."""
        key = f"{self.prefix}/waiting/{self.node}"
        self.store.put(
            key, json.dumps({"lws": self.params.local_world_size}).encode(), ephemeral=True
        )
        self._was_waiting = True
        kv = self.store.get(self._state_key)
        if kv is None:
            return None
        watch = self.store.watch(self._state_key, kv.version)
        state = json.loads(kv.value)
        try:
            while state["version"] == v and state["status"] in (FROZEN, FINAL):
                for change in watch.next(1.0) or []:
                    if change.value is None:
                        return None
                    state = json.loads(change.value)
            return None
        finally:
            watch.close()

    def _round_info(self, state: dict[str, Any]) -> RendezvousInfo:
        ranks: dict[str, int] = state["ranks"]
        by_rank = sorted(ranks, key=lambda n: ranks[n])
        nodes = state["nodes"]
        master = nodes[by_rank[0]]
        self._version = state["version"]
        self._members = nodes
        self.store.reset_liveness()
        # From now on the job runs: a store that goes away (an etcd restart) may come back
        # within `reconnect`; beyond that the job cannot go on without it.
        self.store.retry_for = self.t.reconnect
        return RendezvousInfo(
            round=state["version"],
            group_rank=ranks[self.node],
            group_world_size=len(by_rank),
            local_world_sizes=tuple(nodes[n]["lws"] for n in by_rank),
            master_addr=master["addr"],
            master_port=master["port"],
            restart_count=state.get("restarts", 0),
        )

    # ---- while the workers run -------------------------------------------------------------------

    def _start_watcher(self) -> None:
        """Follow the running round from a thread, so that its first range and watch are off
        the path to the workers' start."""
        self._changed.clear()
        self._waiting, self._done = set(), set()  # the thread's range fills them in
        self._stop = stop = threading.Event()  # this watcher's own: a late one cannot revive
        self._watcher = threading.Thread(
            target=self._follow_round, args=(stop,), name="elasticrun-rdzv", daemon=True
        )
        self._watcher.start()

    def _follow_round(self, stop: threading.Event) -> None:
        try:
            self._follow(stop)
        except Exception as e:  # any failure: the agent must hear of it, not a dead thread
            if not stop.is_set():
                logger.warning("rendezvous watch: %s", e)
                self._changed.set()

    def _follow(self, stop: threading.Event) -> None:
        kvs, revision = self.store.range(f"{self.prefix}/")
        watch = self.store.watch(f"{self.prefix}/", revision)
        with self._watch_lock:
            if stop.is_set():
                watch.close()
                return
            self._watch = watch
        self._done = {kv.key.rsplit("/", 1)[1] for kv in kvs if "/done/" in kv.key}
        self._waiting = {kv.key.rsplit("/", 1)[1] for kv in kvs if "/waiting/" in kv.key}
        # The watch sees changes after `revision`; whatever happened between the round going
        # final and that range (a member gone, the round reopened) shows in the range itself.
        state, _ = self._state_in(kvs)
        join_prefix = f"{self.prefix}/v{self._version}/join/"
        present = {kv.key[len(join_prefix) :] for kv in kvs if kv.key.startswith(join_prefix)}
        if not self._round_still_runs(state):
            self._changed.set()
        elif not set(self._members) - self._done <= present:
            logger.warning("a node left the job as its round began")
            self._changed.set()
        if self._admissible():
            self._changed.set()
        self._watch_round(watch, stop)

    def _round_still_runs(self, state: dict[str, Any] | None) -> bool:
        """Whether `state` is still our final round (noting the reason if the job closed)."""
        if state is not None and state["status"] == CLOSED:
            self._closed_reason = state.get("closed")
        return state is not None and state["version"] == self._version and state["status"] == FINAL

    def _admissible(self) -> bool:
        return bool(self._waiting) and len(self._members) < self.params.max_nodes

    def _watch_round(self, watch: Watch, stop: threading.Event) -> None:
        join_prefix = f"{self.prefix}/v{self._version}/join/"
        while not stop.is_set():
            if self.store.liveness_lost():
                self._changed.set()  # our lease expired: the others think we are gone
            for c in watch.next(0.5) or []:
                node = c.key.rsplit("/", 1)[1]
                if c.key == self._state_key:
                    if not self._round_still_runs(
                        json.loads(c.value) if c.value is not None else None
                    ):
                        self._changed.set()
                elif "/waiting/" in c.key:
                    if c.value is None:
                        self._waiting.discard(node)
                    else:
                        self._waiting.add(node)
                        if self._admissible():
                            self._changed.set()
                elif "/done/" in c.key and c.value is not None:
                    self._done.add(node)
                elif c.key.startswith(join_prefix) and c.value is None:
                    if node == self.node:
                        self._changed.set()  # our own lease expired
                    elif node in self._members and node not in self._done:
                        logger.warning("node %s left the job (its lease expired)", node)
                        self._changed.set()

    def _stop_watcher(self) -> None:
        self._stop.set()
        with self._watch_lock:
            watch, self._watch = self._watch, None
        if watch is not None:
            watch.close()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
            self._watcher = None

    def membership_changed(self) -> bool:
        return self._changed.is_set()

    def num_nodes_waiting(self) -> int:
        return len(self._waiting) if self._admissible() else 0

    def closed_reason(self) -> str | None:
        return self._closed_reason

    def is_closed(self) -> bool:
        state, _ = self._state()
        return state is not None and state["status"] == CLOSED

    def set_closed(self, reason: str = "closed") -> None:
        while True:
            state, version = self._state()
            if state is None or state["status"] == CLOSED:
                return
            if self._write_state({**state, "status": CLOSED, "closed": reason}, version):
                return

    def mark_done(self) -> bool:
        """Our workers succeeded. The last member to finish closes the job as succeeded.
        Returns True if the whole job has finished."""
        self.store.put(f"{self.prefix}/done/{self.node}", b"1")
        kvs, _ = self.store.range(f"{self.prefix}/done/")
        done = {kv.key.rsplit("/", 1)[1] for kv in kvs}
        while True:
            state, version = self._state()
            if state is None or state["status"] == CLOSED:
                return True
            if state["version"] != self._version or not set(state.get("nodes", {})) <= done:
                self._finished_first = True
                return False
            if self._write_state({**state, "status": CLOSED, "closed": SUCCEEDED}, version):
                return True

    def wait_for_others(self, timeout: float) -> bool:
        """After this node succeeded: wait (up to `timeout`) until the job is closed or every
        other member has gone. True if none is left running. A member that has finished but
        is still there may yet be closing the job (the last to finish does): it counts."""
        if not self._finished_first:
            return True
        join_prefix = f"{self.prefix}/v{self._version}/join/"
        deadline = time.monotonic() + timeout
        while True:
            try:
                state, _ = self._state()
                if state is None or state["status"] == CLOSED:
                    return True
                kvs, _ = self.store.range(join_prefix)
            except StoreError:
                return False
            alive = {kv.key[len(join_prefix) :] for kv in kvs if kv.key.startswith(join_prefix)}
            running = (set(self._members) & alive) - {self.node}
            if not running:
                return True
            if time.monotonic() >= deadline:
                logger.warning(
                    "%d node(s) still running after %.0f s: stopping anyway", len(running), timeout
                )
                return False
            time.sleep(0.2)

    def shutdown(self) -> bool:
        self._stop_watcher()
        self.store.close()
        return True
