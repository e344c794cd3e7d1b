"""The elastic rendezvous: one algorithm for every backend with a store (embedded, etcd, etcd-v2).

The decisions (who leads, when to freeze, ranks, the restart budget, closing) are the pure
functions of :mod:`.round`; this module reads the store, asks them, and writes what they return,
with compare-and-swap on the job's state key. Keys, under ``/elasticrun/<run id>/``::

    state                      the RoundState (small JSON: no membership); CAS-versioned
    state/v<N>/leader          ephemeral: round N's leader (the first to create it), its name
    m/v<N>/join/<node>         ephemeral (the node's lease): the node joined round N (its Member)
    m/v<N>/members/<shard>     round N's membership (ranks, addresses) in shards of 64 nodes,
                               written at its freeze; a node reads its own shard
    m/v<N>/confirm/<node>      ephemeral: the node confirmed frozen round N
    state/waiting/<node>       ephemeral: a spare, waiting to be admitted
    m/done/<node>              the node's workers finished

Every wait is a watch, bounded by a deadline and ended at once by a cancellation or a lost lease;
nothing polls. The leader of a round reads and watches all of it; every other node reads and
watches only the state key's prefix (the state and the leader's key, whose deletion says the
leader is gone) and the waiting spares, and reads its own shard of the round's membership once:
each node's requests and bytes per round stay the same whatever the number of nodes, and the
leader's grow with it (docs/rendezvous_scale.md). When a job closes, its state
is kept for :data:`CLOSED_TTL` seconds (so late nodes learn how it ended) and every other key is
removed; after that its run id is free again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import socket
import threading
import time

from elastic_launch._version import __version__
from elastic_launch.api import Cancelled
from elastic_launch.cancel import NEVER, CancelToken, Deadline, Notice, clock
from elastic_launch.net import REFUSED, SILENT, PresencePort, free_port, local_address, probe
from elastic_launch.rendezvous import round as rnd
from elastic_launch.rendezvous.api import (
    CloseReason,
    JobClosed,
    RendezvousClosedError,
    RendezvousCounters,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    RendezvousVersionError,
    RestartReason,
    RunIdInUseError,
)
from elastic_launch.rendezvous.conf import RendezvousConf
from elastic_launch.rendezvous.round import Member, RoundState, Status
from elastic_launch.rendezvous.session import Session
from elastic_launch.rendezvous.store import Change, Inbox, KeyValue, Store, StoreError

logger = logging.getLogger(__name__)

#: How long a closed job's state stays in the store (seconds).
CLOSED_TTL = 600.0
#: How long lost_members() probes the other members' agents.
PROBE_TIMEOUT = 2.0
PROBE_BATCH = 64  # presence ports probed at once (each a socket: far below the fd limit)
FEW_AWAITED = 4  # previous members awaited, below which their join keys are read singly


def _mark(node: str, there: bool, present: set[str], absent: set[str], required: set[str]) -> None:
    """`node`'s key came (`there`) or went: in `present`, and in `absent` if `required`."""
    if there:
        present.add(node)
        absent.discard(node)
    else:
        present.discard(node)
        if node in required:
            absent.add(node)


@dataclasses.dataclass
class _Gone:
    """What a reopened round's leader knows of the previous round's members: who is gone for
    good, and how many it still awaited when it last read their keys."""

    ran: int  # the previous round
    nodes: set[str] = dataclasses.field(default_factory=set)
    awaited_at_last_read: int = 2**62  # the first call reads


class ElasticRendezvous(RendezvousHandler):
    def __init__(
        self, params: RendezvousParameters, store: Store, conf: RendezvousConf, store_host: str
    ) -> None:
        self.params = params
        self.store = store
        self.conf = conf
        self.session = Session(store, conf.lease_ttl)
        store.retry_for = conf.join_timeout
        self.node = f"{socket.gethostname()}-{os.getpid()}-{os.urandom(3).hex()}"
        self.addr = params.local_addr or local_address(store_host)
        self.release = __version__
        self.prefix = f"/elasticrun/{params.run_id}"
        self._state_key = f"{self.prefix}/state"
        self._m = f"{self.prefix}/m"
        # What every node follows besides the state: the rounds' leader keys and the spares.
        self._shared = f"{self.prefix}/s/"
        self._waiting = f"{self._shared}waiting/"
        self._light = [self._state_key, self._shared]  # what a node that does not lead watches
        self._round: RoundState | None = None  # our final round, while it runs
        self._closed: JobClosed | None = None
        self._seen_open = False  # whether this node saw the job before it closed
        self._spare = False  # it wrote a waiting key (as a spare)
        self._drop: list[str] = []  # finished rounds' keys this node is to delete
        self._rounds = 0
        self._phase = ""
        self._presence: PresencePort | None = None
        self._follower: _Follower | None = None
        self._finished_first = False  # our workers succeeded while other members still ran
        self._members: tuple[int, RoundState] | None = None  # (round, with its members), once read
        self._prev: tuple[int, dict[str, int]] | None = None  # (round that ran, its ranks)
        self._confirmed = ""  # the confirmation key this node wrote last
        self._gone: _Gone | None = None  # (a reopened round's leader) who is gone for good
        # The lease is asked for now and the presence port opened, while the agent starts:
        # the first round costs only its own requests. Neither waits: nothing to cancel here.
        self.session.prepare()
        self._presence = PresencePort(self.addr)

    # ---- the store ------------------------------------------------------------------------

    def _read(self) -> tuple[RoundState | None, int]:
        kv = self.store.get(self._state_key)
        return (RoundState.from_json(kv.value), kv.version) if kv is not None else (None, 0)

    def _state_in(self, kvs: list[KeyValue]) -> tuple[RoundState | None, int]:
        kv = next((kv for kv in kvs if kv.key == self._state_key), None)
        return (RoundState.from_json(kv.value), kv.version) if kv is not None else (None, 0)

    def _commit(self, state: RoundState, version: int) -> int:
        """Write `state` if the state key is still at `version` (0: absent): its new version,
        or 0 if someone got there first. A closing state expires after CLOSED_TTL, and the
        job's other keys are removed."""
        if state.status == Status.FROZEN and state.nodes:
            # The membership, in its shards (each node reads its own), with the state that
            # names the round frozen: one transaction on etcd v3. Where the shards go first
            # (v2), a state that loses its CAS leaves those of a round that never froze; the
            # round's keys go with it.
            prefix = self._members_prefix(state.version)
            shards = {prefix + str(shard): v for shard, v in state.shard_values().items()}
            written = self.store.cas_with(self._state_key, state.to_json(), version, shards)
            if written:
                self._members = (state.version, state)
            return written
        if state.status != Status.CLOSED:
            return self.store.cas(self._state_key, state.to_json(), version)
        state = dataclasses.replace(state, expires_at=time.time() + CLOSED_TTL)
        written = self.store.cas(self._state_key, state.to_json(), version, ttl=CLOSED_TTL)
        if written:
            self._closed = state.closed
            with contextlib.suppress(StoreError):
                self.store.delete(self._m + "/", prefix=True)
                self.store.delete(self._shared, prefix=True)
        return written

    def _advance(self, state: RoundState, version: int) -> tuple[RoundState | None, int]:
        """Commit `state` and go on from it at once (not when the watch brings it back), or
        from what got there first. A round made final drops the previous round's keys."""
        written = self._commit(state, version)
        if not written:
            found, found_version = self._read()
            if found is not None and found.status in (Status.FROZEN, Status.FINAL):
                found = self._with_members(found)  # None: it moved on again, look again
            return found, found_version
        if state.status == Status.FINAL and state.version > 1:
            # The rounds since the last final one (abandoned ones too), by the follower, off
            # the path to the workers' start.
            first = state.ran or 1
            rounds = range(first, state.version)
            self._drop = [f"{self._m}/v{v}/" for v in rounds]
            self._drop += [f"{self._shared}v{v}/" for v in rounds]
        return state, written

    def _leader_key(self, version: int) -> str:
        """Round `version`'s leader key: where every node looks (with the state), so that the
        nodes that do not lead see the leader come and go on the watch they have anyway."""
        return f"{self._shared}v{version}/leader"

    def _look(self, leading: bool) -> tuple[list[KeyValue], int]:
        """What a node reads before it watches: the leader the whole job, the others the state
        and the shared keys (the leader keys, the spares), the same whatever N is."""
        if leading:
            return self.store.range(self.prefix + "/")
        kvs, revision = self.store.range(self._state_key)
        shared, shared_revision = self.store.range(self._shared)
        return kvs + shared, min(revision, shared_revision)

    def _leader_done_key(self, version: int) -> str:
        """Written by round `version`'s leader when its workers finished: its leaving after
        that is no loss."""
        return f"{self._shared}v{version}/done"

    def _members_prefix(self, version: int) -> str:
        return f"{self._m}/v{version}/members/"

    def _confirm_key(self, version: int) -> str:
        return f"{self._m}/v{version}/confirm/{self.node}"

    def _with_members(
        self, state: RoundState, every: bool = False, confirm: bool = False
    ) -> RoundState | None:
        """`state` (frozen or final) with its round's membership: this node's shard (one read
        per round, kept), or with `every` all of them (the leader, a spare, the job's end);
        None if the shards are gone (the round has moved on: look again). With `confirm`,
        the read of the shard also writes this node's confirmation of the frozen round (one
        request on etcd v3, where a member's part of the freeze is then one round trip);
        `_confirmed` says whether it was written."""
        if not state.size or state.members_complete:
            return state
        cached = self._members
        if (
            cached is None
            or cached[0] != state.version
            or (every and not cached[1].members_complete)
        ):
            prefix = self._members_prefix(state.version)
            if every:
                kvs, _ = self.store.range(prefix)
                values = [kv.value for kv in kvs]
            else:
                shard = prefix + str(rnd.shard_of(self.node, state.shards))
                if confirm:
                    key = self._confirm_key(state.version)
                    kv = self.store.put_get(key, b"1", shard, ephemeral=True)
                    self._confirmed = key
                else:
                    kv = self.store.get(shard)
                values = [kv.value] if kv is not None else []
            if not values:
                return None
            cached = self._members = (state.version, state.with_shards(values))
        # Parsed once per round: the state's other fields may have moved on (notes).
        m = cached[1]
        return dataclasses.replace(state, nodes=m.nodes, ranks=m.ranks, offsets=m.offsets)

    def _me(self) -> bytes:
        assert self._presence is not None
        return Member(
            addr=self.addr,
            port=free_port(self.addr),  # MASTER_PORT, should this node become group rank 0
            lws=self.params.local_world_size,
            release=self.release,
            presence=self._presence.port,
        ).to_json()

    # ---- the interface ---------------------------------------------------------------------

    def get_backend(self) -> str:
        return self.params.backend

    def get_run_id(self) -> str:
        return self.params.run_id

    def next_rendezvous(
        self,
        reason: RestartReason = RestartReason.START,
        *,
        cancel: CancelToken = NEVER,
        failure: str = "",
    ) -> RendezvousInfo:
        self.session.use(cancel)
        self._stop_follower()
        if self._presence is None:
            self._presence = PresencePort(self.addr)
        self.session.open()
        # A lease lost before now (this node was cut off while its workers ran) cost us the
        # keys of the round we leave; every key of this call is written with the new lease.
        self.session.take_lost()
        if self._round is not None:
            self._leave(reason, failure)
        deadline = Deadline(self.conf.join_timeout)
        while True:
            cancel.check()
            state, version = self._read()
            if state is None:
                first = rnd.initial(self.release)
                written = self._commit(first, 0)
                if not written:
                    continue  # another node created it first: read theirs
                state, version = first, written
            if state.status == Status.CLOSED:
                raise self._closed_error(state)
            conflict = rnd.version_conflict(state, self.release)
            if conflict is not None:
                raise RendezvousVersionError(
                    f"this node cannot join job '{self.params.run_id}' on {self.store.name}: "
                    f"{conflict}; run the same elasticrun version on every node"
                )
            self._seen_open = True
            info: RendezvousInfo | None
            if state.status == Status.JOINABLE:
                info = self._join(state, version, deadline)
                if info is not None:
                    return info
                continue
            full = self._with_members(state, every=state.leader == self.node)
            if full is None:
                continue  # the round moved on as we looked
            if full.status == Status.FROZEN and self.node in full.nodes:
                info = self._confirm(full, version)
            elif full.status == Status.FINAL and self.node in full.nodes:
                info = self._enter(full)
            else:
                info = self._wait_as_spare(full)
            if info is not None:
                return info

    def _closed_error(self, state: RoundState) -> Exception:
        closed = state.closed or JobClosed(CloseReason.FAILED)
        self._closed = closed
        self._phase = "closed"
        if not self._seen_open:
            left = (state.expires_at or time.time()) - time.time()
            return RunIdInUseError(
                f"the run id '{self.params.run_id}' names a job that has already ended "
                f"({closed}) on {self.store.name}; give this job a new --rdzv-id (its keys are "
                f"removed in {max(left, 0):.0f} s, after which the id is free again)"
            )
        if closed.reason == CloseReason.SUCCEEDED:
            return RendezvousClosedError(f"the job '{self.params.run_id}' has finished", closed)
        return RendezvousClosedError(f"the job '{self.params.run_id}' is over: {closed}", closed)

    def _leave(self, reason: RestartReason, failure: str) -> None:
        """Move our final round on to the next (a failure spends one restart of the budget)."""
        assert self._round is not None
        ours = self._round.version
        self._round = None
        detail = f"{failure} (on {socket.gethostname()})" if failure else ""
        while True:
            state, version = self._read()
            if not rnd.still_runs(state, ours):
                return  # someone else moved it on already
            assert state is not None
            nxt = rnd.reopen(state, reason, self.params.max_restarts, detail)
            if self._commit(nxt, version):
                return

    def _enter(self, state: RoundState) -> RendezvousInfo:
        """The round is final with us in it: the workers may start."""
        self._round = state
        self._rounds += 1
        self._phase = "running"
        # From now on the job runs: a store that goes away (an etcd restart) may come back
        # within `reconnect_timeout`; beyond that the job cannot go on without it.
        self.store.retry_for = self.conf.reconnect_timeout
        self._start_follower()
        return rnd.round_info(state, self.node)

    # ---- joinable --------------------------------------------------------------------------

    def _join(self, state: RoundState, version: int, deadline: Deadline) -> RendezvousInfo | None:
        """Take part in joinable round `state` until it is frozen with us in it (then confirm),
        moves on without us (None: the caller looks again), or the join timeout passes."""
        self._phase = "joining"
        v = state.version
        join_prefix = f"{self._m}/v{v}/join/"
        me = join_prefix + self.node
        self.store.create(me, self._me(), ephemeral=True)
        if self._spare:  # it waited as a spare: its waiting key goes (else there is none)
            with contextlib.suppress(StoreError):
                self.store.delete(self._waiting + self.node)
            self._spare = False
        # The first to create the round's leader key leads: it reads and watches the whole
        # round and freezes it. The others read and watch only the state key's prefix (the
        # state and the leader key): a join costs each of them the same whatever N is.
        leader_key = self._leader_key(v)
        leading = bool(self.store.create(leader_key, self.node.encode(), ephemeral=True))
        kvs, revision = self._look(leading)
        found, sversion = self._state_in(kvs)
        if found is None:
            return None
        state = found
        leader_kv = next((kv for kv in kvs if kv.key == leader_key), None)
        if leader_kv is None:
            return None  # the leader left already (or our own key went): look again
        leader = leader_kv.value.decode()
        if leading and leader != self.node:
            return None  # our lease was replaced between the create and the read
        joined = {
            kv.key[len(join_prefix) :]: kv.created for kv in kvs if kv.key.startswith(join_prefix)
        }
        infos = {
            kv.key[len(join_prefix) :]: Member.from_json(kv.value)
            for kv in kvs
            if kv.key.startswith(join_prefix)
        }
        watched = [self.prefix + "/"] if leading else self._light
        last_call: Deadline | None = None
        spares = self._waiting
        waiting = {kv.key[len(spares) :] for kv in kvs if kv.key.startswith(spares)}
        changes = 0  # (the leader) how often `joined` changed: who is back is looked at anew
        looked = -1
        rest_gone = False
        p = self.params

        def waiting_for() -> str:
            have = f"{len(joined)} node(s) joined, " if leading else ""
            return (
                f"waiting for nodes to join run '{p.run_id}' at {self.store.name}: {have}at "
                f"least {p.min_nodes} needed (--nnodes {p.min_nodes}:{p.max_nodes}); giving up "
                f"at {clock(deadline)} (join_timeout {self.conf.join_timeout:g} s)"
            )

        notice = Notice(waiting_for, logger.warning)
        with self.session.watching(watched, revision) as inbox:
            while True:
                notice.check()
                if state.version != v or state.status != Status.JOINABLE:
                    if state.version == v and state.status == Status.FROZEN:
                        full = self._with_members(state, every=leading, confirm=not leading)
                        if full is not None and self.node in full.nodes:
                            present = set(joined) if leading else {leader}
                            return self._confirm(full, sversion, (inbox, present, leader))
                        self._unconfirm(v)  # not a member (more joined than the max)
                    return None
                if self.session.take_lost():
                    self._rejoin(me, joined)
                    if leading:
                        return None  # our leader key went with the lease: another leads
                if leader_kv is None:
                    return None  # the leader left: look again, another leads
                if leading and len(joined) >= self.params.min_nodes:
                    if last_call is None:
                        last_call = Deadline(self.conf.last_call_timeout)
                    if changes != looked:  # who is back: look again at who is not
                        looked, rest_gone = changes, self._rest_gone(state, joined, waiting)
                    ready = rnd.ready_to_freeze(
                        len(joined),
                        self.params.min_nodes,
                        self.params.max_nodes,
                        last_call.passed or rest_gone,
                    )
                    if ready:
                        frozen = rnd.freeze(
                            self._with_previous(state),
                            joined,
                            infos,
                            self.params.min_nodes,
                            self.params.max_nodes,
                            freezer=self.node,
                        )
                        last_call = None
                        if frozen is not None:
                            found, sversion = self._advance(frozen, sversion)
                            if found is None:
                                return None
                            state = found
                            continue
                if deadline.passed:
                    raise self._timeout(me, join_prefix, len(joined) if leading else None)
                until = Deadline.earliest(deadline, last_call, notice.due())
                for change in self.session.wait(inbox, until):
                    if change.key == self._state_key:
                        if change.value is None:
                            return None
                        state, sversion = RoundState.from_json(change.value), change.revision
                    elif change.key == leader_key:
                        if change.value is None:
                            leader_kv = None
                    elif change.key.startswith(spares):
                        spare = change.key[len(spares) :]
                        if change.value is None:
                            waiting.discard(spare)
                        else:
                            waiting.add(spare)
                            looked = -1  # a spare is coming: wait for the last call
                    elif change.key.startswith(join_prefix):
                        node = change.key[len(join_prefix) :]
                        if change.value is not None:
                            changes += node not in joined
                            joined.setdefault(node, change.revision)
                            infos[node] = Member.from_json(change.value)
                        elif node == self.node:
                            self._rejoin(me, joined)  # our lease expired: join again
                        else:
                            changes += node in joined
                            joined.pop(node, None)
                            infos.pop(node, None)

    def _with_previous(self, state: RoundState) -> RoundState:
        """`state` with the ranks of the last round that ran (the leader's one read of that
        round's members key), so that survivors keep their ranks."""
        if state.prev_ranks or not state.ran:
            return state
        if self._prev is None or self._prev[0] != state.ran:
            ranks: dict[str, int] = {}
            with contextlib.suppress(StoreError):
                kvs, _ = self.store.range(self._members_prefix(state.ran))
                ran = RoundState(state.ran, Status.FINAL).with_shards([kv.value for kv in kvs])
                ranks = dict(ran.ranks)
            self._prev = (state.ran, ranks)
        return dataclasses.replace(state, prev_ranks=self._prev[1])

    def _rest_gone(self, state: RoundState, joined: dict[str, int], waiting: set[str]) -> bool:
        """Whether the last call can be skipped: this round follows another, no spare waits,
        and every member of the previous round is back or provably gone (its join key expired,
        or its presence port refuses: a process that died on a host that is up). Survivors of
        a failure go on at once instead of waiting for the dead.

        Called as members come back, so its cost must not grow with N per call: who is known
        gone is kept (an expired key does not come back, nor does a dead process), the
        previous round's join keys are read again only once those still awaited have halved
        (so O(log N) reads of N keys in a round, not one per join), singly once a few are
        left, and presence ports are probed a few at a time, stopping at the first alive."""
        state = self._with_previous(state)
        if not state.prev_ranks or state.version <= 1 or waiting - set(joined):
            return False
        if self._gone is None or self._gone.ran != state.ran:
            self._gone = _Gone(state.ran)
        gone = self._gone
        awaited = set(state.prev_ranks) - set(joined) - gone.nodes
        if not awaited:
            return True
        if len(awaited) > FEW_AWAITED and 2 * len(awaited) > gone.awaited_at_last_read:
            return False  # most of those last read were alive: they are on their way back
        gone.awaited_at_last_read = len(awaited)
        prev = f"{self._m}/v{state.ran}/join/"
        if len(awaited) <= FEW_AWAITED:
            kvs = [kv for node in sorted(awaited) if (kv := self.store.get(prev + node))]
        else:
            kvs, _ = self.store.range(prev)  # one request for all: those absent have expired
        targets: dict[str, tuple[str, int]] = {}
        for kv in kvs:
            node = kv.key[len(prev) :]
            if node not in awaited:
                continue
            member = Member.from_json(kv.value)
            if not member.presence:
                return False
            targets[node] = (member.addr, member.presence)
        gone.nodes |= awaited - set(targets)  # their keys expired
        batch = list(targets.items())
        for start in range(0, len(batch), PROBE_BATCH):
            answers = probe(dict(batch[start : start + PROBE_BATCH]), min(PROBE_TIMEOUT, 0.25))
            gone.nodes |= {node for node, a in answers.items() if a == REFUSED}
            if any(a != REFUSED for a in answers.values()):
                return False
        return True

    def _unconfirm(self, version: int) -> None:
        """Take back a confirmation written with the read of a round that turned out not to
        include this node (or to have moved on)."""
        if self._confirmed == self._confirm_key(version):
            self._confirmed = ""
            with contextlib.suppress(StoreError):
                self.store.delete(self._confirm_key(version))

    def _rejoin(self, me: str, joined: dict[str, int]) -> None:
        """Our lease expired while we waited: our join key again (a new lease is in place)."""
        self.store.ensure_lease()
        self.session.take_lost()
        self.store.create(me, self._me(), ephemeral=True)

    def _timeout(self, me: str, join_prefix: str, count: int | None) -> Exception:
        if count is None:
            count = len(self.store.range(join_prefix)[0])
        with contextlib.suppress(StoreError):
            self.store.delete(me)
        p = self.params
        return RendezvousTimeoutError(
            f"rendezvous of run '{p.run_id}' timed out after {self.conf.join_timeout:g} s: "
            f"{count} node(s) joined, at least {p.min_nodes} needed (--nnodes {p.min_nodes}:"
            f"{p.max_nodes}); start more nodes or raise join_timeout"
        )

    # ---- frozen ----------------------------------------------------------------------------

    def _confirm(
        self,
        state: RoundState,
        sversion: int,
        joined: tuple[Inbox, set[str], str] | None = None,
    ) -> RendezvousInfo | None:
        """A frozen round with us in it (`state` with its membership): confirm, and (the
        leader) make it final once every member has; a member that vanishes sends the round
        back to joinable. `joined` is what the join phase leaves: its watch (open since before
        the freeze, so everything after is in it), who it saw present, and who led it."""
        self._phase = "confirming"
        v = state.version
        round_prefix = f"{self._m}/v{v}/"
        confirm_prefix = round_prefix + "confirm/"
        join_prefix = round_prefix + "join/"
        leader_key = self._leader_key(v)
        if self._confirmed != self._confirm_key(v):  # written with the read of our shard
            self.store.put(self._confirm_key(v), b"1", ephemeral=True)
            self._confirmed = self._confirm_key(v)
        leading = state.leader == self.node
        inbox: Inbox | None = None
        if joined is not None and joined[2] == state.leader:
            # Straight from the join: its watch already covers what this phase follows (the
            # leader: the whole round; the others: the state and the leader key), so no read
            # and no new watch stand between the freeze and the confirmation.
            inbox, present, _ = joined
            confirmed = {self.node}
        else:
            # The state may have moved on since the caller looked (the round may be final
            # already), and the watches start where this look ends. The leader reads the
            # round (every member's keys); the others only the state and the leader key.
            kvs, revision = self._look(leading)
            found, found_version = self._state_in(kvs)
            if found is None:
                return None
            if found_version != sversion:
                full = self._with_members(found, every=leading)
                if full is None:
                    return None
                state, sversion = full, found_version
            confirmed = {
                kv.key[len(confirm_prefix) :] for kv in kvs if kv.key.startswith(confirm_prefix)
            }
            present = {kv.key[len(join_prefix) :] for kv in kvs if kv.key.startswith(join_prefix)}
            if any(kv.key == leader_key for kv in kvs):
                present.add(state.leader)
        # Who must be there for the round to go on: the leader follows every member (their
        # join keys), the others the leader (its leader key).
        required = set(state.nodes) if leading else {state.leader}
        # Who of those is missing, and (the leader) who has yet to confirm, kept as the
        # changes come: each costs O(1), not a pass over every member.
        absent = required - present
        unconfirmed = required - confirmed if leading else set()
        # The leader gives the members `close_timeout` to confirm; should the leader itself
        # vanish, the others start over at once (its key is gone), or a lease later.
        until = Deadline(self.conf.close_timeout + (0.0 if leading else self.conf.lease_ttl))
        watched = [self._state_key, self._shared, round_prefix] if leading else self._light
        with contextlib.ExitStack() as stack:
            if inbox is None:
                inbox = stack.enter_context(self.session.watching(watched, revision))
            while True:
                if state.version != v or state.status != Status.FROZEN:
                    if state.version == v and state.status == Status.FINAL:
                        full = self._with_members(state)
                        return self._enter(full) if full is not None else None
                    return None
                nxt: RoundState | None = None
                if leading and not unconfirmed:
                    nxt = rnd.finalize(state, confirmed)
                if nxt is None and (absent or until.passed):
                    nxt = rnd.abandon(state)  # a member (or the leader) died: start over
                if nxt is not None:
                    found, sversion = self._advance(nxt, sversion)
                    if found is None:
                        return None
                    state = found
                    continue
                for change in self.session.wait(inbox, until):
                    if change.key == self._state_key:
                        if change.value is None:
                            return None
                        found = RoundState.from_json(change.value)
                        full = (
                            self._with_members(found, every=leading)
                            if found.version == v and found.status in (Status.FROZEN, Status.FINAL)
                            else found
                        )
                        if full is None:
                            return None
                        state, sversion = full, change.revision
                    elif change.key == leader_key:
                        _mark(state.leader, change.value is not None, present, absent, required)
                    elif change.key.startswith(confirm_prefix):
                        node = change.key[len(confirm_prefix) :]
                        if change.value is not None:
                            confirmed.add(node)
                            unconfirmed.discard(node)
                        else:
                            confirmed.discard(node)
                            if leading and node in required:
                                unconfirmed.add(node)
                    elif change.key.startswith(join_prefix):
                        node = change.key[len(join_prefix) :]
                        _mark(node, change.value is not None, present, absent, required)

    # ---- spares ------------------------------------------------------------------------------

    def _wait_as_spare(self, state: RoundState) -> RendezvousInfo | None:
        """Arrived while a round runs (or beyond MAX): register as waiting until the round
        changes. No join timeout: a spare waits for the job to need it or to end. A round
        whose members have all vanished (a job that crashed) is abandoned."""
        self._phase = "spare"
        key = self._waiting + self.node
        self.store.put(key, str(self.params.local_world_size).encode(), ephemeral=True)
        self._spare = True
        v = state.version
        join_prefix = f"{self._m}/v{v}/join/"
        kvs, revision = self.store.range(self.prefix + "/")
        found, sversion = self._state_in(kvs)
        if found is not None and found.status in (Status.FROZEN, Status.FINAL):
            found = self._with_members(found, every=True)  # it watches every member
        if found is None:
            return None
        state = found
        present = {kv.key[len(join_prefix) :] for kv in kvs if kv.key.startswith(join_prefix)}
        notice = Notice(
            lambda: (
                f"this node waits as a spare of run '{self.params.run_id}' at "
                f"{self.store.name}: round {v} runs with {len(state.nodes)} node(s) (--nnodes "
                f"{self.params.min_nodes}:{self.params.max_nodes}); it joins when the job "
                "re-forms (a node leaves or fails) and ends with the job, with no time limit"
            ),
            logger.warning,
        )
        with self.session.watching([self._state_key, join_prefix], revision) as inbox:
            while state.version == v and state.status in (Status.FROZEN, Status.FINAL):
                notice.check()
                if self.session.take_lost():
                    self.store.put(key, str(self.params.local_world_size).encode(), ephemeral=True)
                if not set(state.nodes) & present:
                    logger.warning("every node of round %d is gone: starting a new round", v)
                    self._commit(rnd.abandon(state), sversion)
                    return None
                for change in self.session.wait(inbox, notice.due()):
                    if change.key == self._state_key:
                        if change.value is None:
                            return None
                        found = RoundState.from_json(change.value)
                        if found.version == v and found.status in (Status.FROZEN, Status.FINAL):
                            found = self._with_members(found, every=True)  # the same round: kept
                            if found is None:
                                return None
                        state, sversion = found, change.revision
                    elif not change.key.startswith(join_prefix):
                        continue  # the leader key, other spares
                    elif change.value is None:
                        present.discard(change.key[len(join_prefix) :])
                    else:
                        present.add(change.key[len(join_prefix) :])
            return None

    # ---- while the workers run -------------------------------------------------------------------

    def _start_follower(self) -> None:
        assert self._round is not None
        drop, self._drop = self._drop, []
        self._follower = _Follower(self, self._round, drop)

    def _stop_follower(self) -> None:
        if self._follower is not None:
            self._follower.stop()
            self._follower = None

    def membership_changed(self) -> bool:
        return self._follower is not None and self._follower.changed.is_set()

    def round_broken(self) -> bool:
        return self._follower is not None and self._follower.broken.is_set()

    def post_note(self, name: str, value: str) -> None:
        """Tell every member of the running round `name` = `value` (they read it with
        :meth:`note`, from their watch: no request per read). The note goes with the round."""
        if self._round is None:
            raise RuntimeError("post_note() needs a running round")
        ours = self._round.version
        while True:  # in the state, which every member watches already
            state, version = self._read()
            if not rnd.still_runs(state, ours):
                return  # the round is over: so is its note
            assert state is not None
            noted = dataclasses.replace(state, notes={**state.notes, name: value})
            if self._commit(noted, version):
                return

    def note(self, name: str) -> str | None:
        """A note of the running round, as far as this member's watch has seen."""
        f = self._follower
        return f.notes.get(name) if f is not None else None

    def num_nodes_waiting(self) -> int:
        f = self._follower
        if f is None or self._round is None:
            return 0
        waiting = set(f.waiting)
        return (
            len(waiting) if rnd.admissible(waiting, self._round.size, self.params.max_nodes) else 0
        )

    def lost_members(self, cancel: CancelToken = NEVER) -> list[str]:
        """Members whose agent is gone. Its join key vanished, or its presence port refuses (an
        agent SIGKILLed on a host that is up: seen at once); their join keys are removed, so
        the others see it at once too. A member that does not answer at all (a host that is
        down, or a network that drops) is lost only if its lease expires within its TTL: a
        firewall never turns a failure into a free restart."""
        if self._round is None:
            return []
        self.session.use(cancel)
        join_prefix = f"{self._m}/v{self._round.version}/join/"
        try:
            current = self._with_members(self._round, every=True)
            kvs, revision = self.store.range(f"{self._m}/")
        except StoreError:
            return []
        if current is None:
            return []
        present = {kv.key[len(join_prefix) :] for kv in kvs if kv.key.startswith(join_prefix)}
        done = {kv.key.rsplit("/", 1)[1] for kv in kvs if kv.key.startswith(f"{self._m}/done/")}
        others = {n: m for n, m in current.nodes.items() if n != self.node and n not in done}
        gone = {n for n in others if n not in present}
        targets = {
            n: (m.addr, m.presence) for n, m in others.items() if n in present and m.presence
        }
        answers = probe(targets, min(PROBE_TIMEOUT, self.conf.lease_ttl))
        refused = {n for n, a in answers.items() if a == REFUSED}
        for n in refused:
            with contextlib.suppress(StoreError):
                self.store.delete(join_prefix + n)
                if n == current.leader:  # the key the nodes that do not lead follow
                    self.store.delete(self._leader_key(current.version))
        silent = {n for n, a in answers.items() if a == SILENT}
        if silent:
            gone |= self._expired(silent, join_prefix, revision)
        return sorted(gone | refused)

    def _expired(self, nodes: set[str], join_prefix: str, revision: int) -> set[str]:
        """Which of `nodes` lose their join key within a lease's TTL (from `revision` on)."""
        expired: set[str] = set()
        deadline = Deadline(self.conf.lease_ttl + 1.0)
        watched = [join_prefix + n for n in sorted(nodes)]
        with self.session.watching(watched, revision) as inbox:
            while expired != nodes and not deadline.passed:
                for change in self.session.wait(inbox, deadline):
                    node = change.key[len(join_prefix) :]
                    if change.value is None and node in nodes:
                        expired.add(node)
        return expired

    def closed(self) -> JobClosed | None:
        return self._closed

    def counters(self) -> RendezvousCounters:
        return RendezvousCounters(
            rounds=self._rounds, store_requests=self.store.requests, phase=self._phase
        )

    def set_closed(self, reason: CloseReason, detail: str = "") -> None:
        while True:
            state, version = self._read()
            if state is None or state.status == Status.CLOSED:
                return
            if self._commit(rnd.close(state, reason, detail), version):
                return

    def mark_done(self) -> bool:
        """Our workers succeeded. The last member to finish closes the job as succeeded.
        Returns True if the whole job has finished."""
        self._stop_follower()
        if self._round is not None and self._round.leader == self.node:
            self.store.put(self._leader_done_key(self._round.version), b"1")
        self.store.put(f"{self._m}/done/{self.node}", b"1")
        kvs, _ = self.store.range(f"{self._m}/done/")
        done = {kv.key.rsplit("/", 1)[1] for kv in kvs}
        ours = self._round.version if self._round is not None else 0
        while True:
            state, version = self._read()
            if state is None or state.status == Status.CLOSED:
                self._closed = (
                    state.closed if state is not None else JobClosed(CloseReason.SUCCEEDED)
                )
                return True
            if state.version == ours and state.status == Status.FINAL:
                state = self._with_members(state, every=True) or state
            if state.version != ours or not state.nodes or not rnd.everyone_done(state, done):
                self._finished_first = True
                return False
            if self._commit(rnd.close(state, CloseReason.SUCCEEDED), version):
                return True

    def wait_for_others(self, timeout: float, cancel: CancelToken = NEVER) -> bool:
        """After this node succeeded: wait (up to `timeout`) until the job is closed or every
        other member has gone. True if none is left running. A member that has finished but
        is still there may yet be closing the job (the last to finish does): it counts."""
        if not self._finished_first or self._round is None:
            return True
        self.session.use(cancel)
        try:
            every = self._with_members(self._round, every=True)
        except StoreError:
            every = None
        members = set((every or self._round).nodes) - {self.node}
        join_prefix = f"{self._m}/v{self._round.version}/join/"
        deadline = Deadline(timeout)
        try:
            kvs, revision = self.store.range(self.prefix + "/")
            state, _ = self._state_in(kvs)
            alive = {kv.key[len(join_prefix) :] for kv in kvs if kv.key.startswith(join_prefix)}
            with self.session.watching([self._state_key, join_prefix], revision) as inbox:
                while True:
                    if state is None or state.status == Status.CLOSED or not members & alive:
                        return True
                    if deadline.passed:
                        logger.warning(
                            "%d node(s) still running after %.0f s: stopping anyway",
                            len(members & alive),
                            timeout,
                        )
                        return False
                    for change in self.session.wait(inbox, deadline):
                        if change.key == self._state_key:
                            state = RoundState.from_json(change.value) if change.value else None
                        elif change.value is None:
                            alive.discard(change.key[len(join_prefix) :])
        except StoreError:
            return False

    def shutdown(self, cancel: CancelToken = NEVER) -> None:
        self._stop_follower()
        if self._presence is not None:
            self._presence.close()
            self._presence = None
        self.session.close()


class _Follower:
    """Follows the running round from a thread (its first read and watch off the path to the
    workers' start) and sets :attr:`changed` when the round is over for this node: the state
    moved on (another node reopened it, or closed the job), a member left, a node waits to be
    admitted and there is room, or this node's own lease expired.

    The round's leader follows all of it (every member's join key, the finished ones) and
    reopens the round when a member leaves; the others follow only the state key's prefix
    (the state with its notes, the leader key, the waiting spares), so that a node costs the
    store the same whatever the number of nodes. Should the leader finish first and go, they
    follow all of it from then on."""

    def __init__(self, rdzv: ElasticRendezvous, current: RoundState, drop: list[str]) -> None:
        self.rdzv = rdzv
        self.round = current
        self._drop = drop  # the previous rounds' keys, deleted first (by the leader)
        # A loss before now is not this round's: its keys were written with the new lease
        # (or are missing, which the first look below sees).
        self._losses = rdzv.session.losses
        self.changed = threading.Event()
        self.broken = threading.Event()  # changed, and not merely by a node waiting
        self.waiting: set[str] = set()
        self.done: set[str] = set()
        self.notes: dict[str, str] = dict(current.notes)
        self.leader_done = False
        self._told: set[str] = set()  # members whose leaving this node has logged
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
        self._thread.join(timeout=5)

    def _run(self) -> None:
        try:
            everything = self.round.leader == self.rdzv.node
            while not self._follow(everything):
                everything = True  # the leader finished and went: follow all from now on
        except Exception as e:  # any failure: the agent must hear of it, not a dead thread
            if not self._stop.is_set():
                if not isinstance(e, Cancelled):
                    logger.warning("rendezvous watch: %s", e)
                self._break()

    def _follow(self, everything: bool) -> bool:
        """Follow the round until stopped (True), or until the leader is found to have
        finished and gone (False: follow everything instead)."""
        r = self.rdzv
        for prefix in self._drop:
            with contextlib.suppress(StoreError):
                r.store.delete(prefix, prefix=True)
        self._drop = []
        watched = [r.prefix + "/"] if everything else r._light
        kvs, revision = r._look(everything)
        v = self.round.version
        join_prefix = f"{r._m}/v{v}/join/"
        leader_key = r._leader_key(v)
        self.waiting = {kv.key[len(r._waiting) :] for kv in kvs if kv.key.startswith(r._waiting)}
        self.leader_done = any(kv.key == r._leader_done_key(v) for kv in kvs)
        # The watch sees changes after `revision`; whatever happened between the round going
        # final and that read (a member gone, the round reopened) shows in the read itself.
        state, _ = r._state_in(kvs)
        self._note(state)
        if everything:
            if not self.round.members_complete:  # every member's shard is in the read
                shards = r._members_prefix(v)
                self.round = self.round.with_shards(
                    [kv.value for kv in kvs if kv.key.startswith(shards)]
                )
            self.done = {
                kv.key.rsplit("/", 1)[1] for kv in kvs if kv.key.startswith(f"{r._m}/done/")
            }
            present = {kv.key[len(join_prefix) :] for kv in kvs if kv.key.startswith(join_prefix)}
            gone = set(self.round.nodes) - self.done - present
            if rnd.still_runs(state, v) and gone:
                self._lost(sorted(gone)[0], "as its round began")
        elif not any(kv.key == leader_key for kv in kvs) and self._leader_gone():
            return False
        if rnd.admissible(self.waiting, self.round.size, r.params.max_nodes):
            self.changed.set()
        with r.session.watching(watched, revision) as inbox:
            with self._lock:
                self._inbox = inbox
            if self._stop.is_set():
                return True
            while not self._stop.is_set():
                if r.session.losses != self._losses:
                    self._break()  # our lease expired: the others think we are gone
                batch = inbox.next(float("inf"))
                for change in batch or []:
                    if not self._apply(change, join_prefix, leader_key, everything):
                        return False
        return True

    def _note(self, state: RoundState | None) -> None:
        if state is not None and state.status == Status.CLOSED:
            self.rdzv._closed = state.closed
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
        r = self.rdzv
        leader = self.round.leader
        if self.leader_done:  # it said so on the same watch, before its key went
            return False
        if r._closed is None:
            logger.warning("node %s left the job", leader)
        self._break()
        return True

    def _lost(self, node: str, when: str = "") -> None:
        """A member left (the leader sees it): the round is reopened at once, so that every
        node hears of it from the state, which it watches, without waiting for this node's
        agent to stop its workers first."""
        r = self.rdzv
        if r._closed is None and node not in self._told:  # a closed job's keys all go
            self._told.add(node)
            logger.warning("node %s left the job%s", node, f" {when}" if when else "")
        self._break()
        if r.session.losses != self._losses:
            return  # it is us who were cut off: not ours to decide
        # From a thread of its own: a store going away (the job ending) costs the follower
        # nothing, and stopping it never waits for these requests.
        threading.Thread(
            target=self._reopen, args=(node,), name="elasticrun-reopen", daemon=True
        ).start()

    def _reopen(self, left: str) -> None:
        r = self.rdzv
        with contextlib.suppress(Exception):  # gone, closed, moved on: nothing to do
            state, version = r._read()
            if rnd.still_runs(state, self.round.version):
                assert state is not None
                reopened = rnd.reopen(
                    state, RestartReason.MEMBERSHIP, r.params.max_restarts, left=left
                )
                r._commit(reopened, version)

    def _apply(self, c: Change, join_prefix: str, leader_key: str, everything: bool) -> bool:
        """Take one change in; False when the leader turns out to have finished and gone."""
        r = self.rdzv
        node = c.key.rsplit("/", 1)[1]
        if c.key == r._state_key:
            self._note(RoundState.from_json(c.value) if c.value is not None else None)
        elif c.key == leader_key and c.value is None and not everything:
            if not self._leader_gone():
                return False
        elif c.key == r._leader_done_key(self.round.version) and c.value is not None:
            self.leader_done = True
        elif c.key.startswith(r._waiting):
            if c.value is None:
                self.waiting.discard(node)
            else:
                self.waiting.add(node)
                if rnd.admissible(self.waiting, self.round.size, r.params.max_nodes):
                    self.changed.set()
        elif c.key.startswith(f"{r._m}/done/") and c.value is not None:
            self.done.add(node)
        elif c.key.startswith(join_prefix) and c.value is None:
            if node == r.node:
                self._break()  # our own lease expired
            elif node in self.round.nodes and node not in self.done:
                self._lost(node)
        return True
