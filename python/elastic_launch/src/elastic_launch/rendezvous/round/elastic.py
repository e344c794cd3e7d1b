"""The elastic rendezvous: one algorithm for every backend with a store (embedded, etcd, etcd-v2).

Rounds are numbered and go joinable -> frozen -> final (or closed). The decisions (who leads,
when to freeze, ranks, the restart budget, closing) are the pure functions of :mod:`.state`, and
what a node's reads and watches mean is the pure reducers of :mod:`.view`. This module is the
handler the agent calls; it reads and writes the job's keys through :class:`.job.Job`, waits for
a round through :class:`.waits.RoundWaits`, follows the running round through
:class:`.follower.Follower`, and asks :mod:`.presence` who of the members is gone.

The leader of a round reads and watches all of it; every other node reads and watches only the
state and the shared keys, and reads its own shard of the round's membership once: each node's
requests and bytes per round stay the same whatever the number of nodes, and the leader's grow
with it (docs/rendezvous_scale.md). When a job closes, its state is kept for
:data:`~.job.CLOSED_TTL` seconds (so late nodes learn how it ended) and every other key is
removed; after that its run id is free again.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable

from elastic_launch._version import __version__
from elastic_launch.api import RestartBudget
from elastic_launch.cancel import NEVER, CancelToken, Deadline
from elastic_launch.net import PresencePort, free_port, local_address
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
from elastic_launch.rendezvous.round import presence
from elastic_launch.rendezvous.round import state as rnd
from elastic_launch.rendezvous.round.follower import Follower
from elastic_launch.rendezvous.round.job import Job, JobKeys
from elastic_launch.rendezvous.round.pace import RATE, Pace, write_lost
from elastic_launch.rendezvous.round.state import Member, RoundState, Status
from elastic_launch.rendezvous.round.waits import RoundWaits
from elastic_launch.rendezvous.store.api import HistoryLostError, Store, StoreError
from elastic_launch.rendezvous.store.session import Session

logger = logging.getLogger(__name__)


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
        self.job = Job(store, JobKeys.of(params.run_id), self.node)
        self.waits = RoundWaits(self.job, self.session, params, conf, self._me)
        self.waits.on_spare = self._joined
        self._round: RoundState | None = None  # our final round, while it runs
        self._seen_open = False  # whether this node saw the job before it closed
        self._rounds = 0
        self._entered_with = 0  # the lease grant the running round was entered with
        self._closed_phase = False
        self._follower: Follower | None = None
        self._done = False  # this node's workers finished (its done key is written)
        #: How long the first contact with the store may be retried, if longer than the join
        #: timeout (the embedded service's host may be starting: see backends.HOST_WAIT).
        self.first_contact: float | None = None
        store.on_replaced = self._put_back
        # The lease is asked for now and the presence port opened, while the agent starts:
        # the first round costs only its own requests. Neither waits: nothing to cancel here.
        self.session.prepare()
        self._presence: PresencePort | None = PresencePort(self.addr)

    @property
    def _phase(self) -> str:
        if self._closed_phase:
            return "closed"
        return "running" if self._round is not None else self.waits.phase

    def _me(self) -> bytes:
        assert self._presence is not None
        return Member(
            addr=self.addr,
            port=free_port(self.addr),  # MASTER_PORT, should this node become group rank 0
            lws=self.params.local_world_size,
            release=self.release,
            presence=self._presence.port,
            role=self.params.role,
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
        if self.first_contact is not None:
            self.store.retry_for = max(self.first_contact, self.conf.join_timeout)
        self.session.open()
        if self.first_contact is not None:  # the store answers: the join timeout from now
            self.store.retry_for, self.first_contact = self.conf.join_timeout, None
        # A lease lost before now (this node was cut off while its workers ran) cost us the
        # keys of the round we leave; every key of this call is written with the new lease.
        self.session.take_lost()
        if self._round is not None:
            self._leave(reason, failure)
        deadline = Deadline(self.conf.join_timeout)
        stalled: list[int] = []  # the state's version, when a look gave nothing to wait on
        pace = Pace(self._lost("joining"), deadline, cancel)
        while True:
            cancel.check()
            state, version = self._open_state()
            if state is None:
                pace.again()  # another node created it first: read theirs
                continue
            try:
                final = self._wait(state, version, deadline)
            except HistoryLostError as e:  # its watch cannot go on: read again, watch again
                logger.warning("rendezvous: %s; reading the round again", e)
                pace.again()
                continue
            if final is not None:
                return self._enter(final)
            self._no_progress(state, version, stalled, deadline, cancel)

    def _no_progress(
        self,
        state: RoundState,
        version: int,
        last: list[int],
        deadline: Deadline,
        cancel: CancelToken,
    ) -> None:
        """A look that found nothing to wait on, at the same state as the look before: the
        store holds a state no node can go on from (a final round whose membership is
        missing, say). It is looked at again pace.RATE times a second at most, and is a
        clear error at the join timeout."""
        if last != [version]:
            last[:] = [version]
            return
        if deadline.passed:
            raise RendezvousTimeoutError(
                f"rendezvous of run '{self.params.run_id}' on {self.store.name}: its round "
                f"{state.version} is {state.status.value} but cannot be joined or entered (its "
                f"membership is missing or does not fit it) and did not change within "
                f"{self.conf.join_timeout:g} s; give the job a new --rdzv-id"
            )
        cancel.wait(min(deadline.left(), 1.0 / RATE))

    def _lost(self, what: str) -> Callable[[], str]:
        """What a paced loop says at its deadline (:mod:`.pace`)."""
        return write_lost(f"{what} job '{self.params.run_id}'", self.store.name, self._patience)

    def _pace(self, what: str, cancel: CancelToken = NEVER) -> Pace:
        """A pace for a write outside a join: bounded by how long a request keeps trying."""
        return Pace(self._lost(what), Deadline(self._patience), cancel)

    @property
    def _patience(self) -> float:
        return max(self.store.retry_for, self.conf.join_timeout)

    def _open_state(self) -> tuple[RoundState | None, int]:
        """The job's state, created if there is none yet (None: another node created it as we
        tried); raises if the job is closed or was made by another release."""
        state, version = self.job.read()
        if state is None:
            first = rnd.initial(self.release)
            written = self.job.commit(first, 0)
            self._seen_open = self._seen_open or bool(written)  # this job is ours, not a past one
            return (first, written) if written else (None, 0)
        if state.status == Status.CLOSED:
            raise self._closed_error(state)
        conflict = rnd.version_conflict(state, self.release)
        if conflict is not None:
            raise RendezvousVersionError(
                f"this node cannot join job '{self.params.run_id}' on {self.store.name}: "
                f"{conflict}; run the same elasticrun version on every node"
            )
        self._seen_open = True
        return state, version

    def _wait(self, state: RoundState, version: int, deadline: Deadline) -> RoundState | None:
        """Wait for the round `state` is in: join it, confirm it, enter it (the final round
        with us in it), or wait as a spare (None: look again)."""
        if state.status == Status.JOINABLE:
            return self.waits.join(state, deadline)
        full = self.job.with_members(state, every=state.leader == self.node)
        if full is None:
            return None  # the round moved on as we looked
        if full.status == Status.FROZEN and self.node in full.nodes:
            return self.waits.confirm(full, version)
        if full.status == Status.FINAL and self.node in full.nodes:
            return full
        self.waits.as_spare(full)
        return None

    def _closed_error(self, state: RoundState) -> Exception:
        closed = state.closed or JobClosed(CloseReason.FAILED)
        self.job.closed = closed
        self._closed_phase = True
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
        pace = self._pace("leaving the round of")
        while True:
            state, version = self.job.read()
            if not rnd.still_runs(state, ours):
                return  # someone else moved it on already
            assert state is not None
            nxt = rnd.reopen(state, reason, self.params.max_restarts, detail)
            if self.job.commit(nxt, version):
                return
            pace.again()

    def spend_restart(self, limit: int, cancel: CancelToken = NEVER) -> RestartBudget | None:
        """One of the job's restarts, spent in the state (the count group restarts spend)."""
        pace = self._pace("spending a restart of", cancel)
        while True:
            cancel.check()
            state, version = self.job.read()
            if state is None or state.status == Status.CLOSED:
                return None
            spent = rnd.spend(state, limit)
            if spent is None:
                return None
            if self.job.commit(spent, version):
                return RestartBudget(spent.restarts, limit)
            pace.again()

    def _put_back(self) -> None:
        """The store was started again empty (:attr:`.store.Store.on_replaced`): put back
        what this node knows the job needs, as a standby's copy would have held it: the
        state (its round, restarts, a closed job's mark) and the round's membership unless
        another node put back a newer one, and this node's own keys (its lease is back
        already)."""
        self.job.known.put_back(self.store, self.job.keys.state)
        if self._round is not None:
            self.job.known.put_back_mine(self.store, "join", "leader")
        if self.waits.spare:
            self.job.known.put_back_mine(self.store, "waiting")
        if self._done:
            self.store.put(self.job.keys.done + self.node, b"1")

    def _joined(self) -> None:
        """This node is in the job now (in a round, or waiting as a spare): a hook."""

    def _enter(self, state: RoundState) -> RendezvousInfo:
        """The round is final with us in it: the workers may start."""
        self._round = state
        self._rounds += 1
        hold = self.store.lease_hold()
        self._entered_with = hold[0] if hold is not None else 0
        self._joined()
        # From now on the job runs: a store that goes away (an etcd restart) may come back
        # within `reconnect_timeout`; beyond that the job cannot go on without it.
        self.store.retry_for = self.conf.reconnect_timeout
        drop, self.job.drop = self.job.drop, []
        p = self.params
        self._follower = Follower(self.job, self.session, state, drop, p.max_nodes, p.max_restarts)
        return rnd.round_info(state, self.node)

    # ---- while the workers run -------------------------------------------------------------------

    def held_until(self) -> float | None:
        """Until when (``time.monotonic``) this node's place in the running round is certain:
        while the lease it entered the round with is renewed, the others cannot have gone on
        without it (:mod:`elastic_launch.processes.fence`). 0.0: not certain now (that lease
        expired: the round may have gone on without this node). None: nothing to say (no
        round runs, or the store cannot say)."""
        hold = self.store.lease_hold()
        if hold is None or self._round is None:
            return None
        grants, until = hold
        return until if grants == self._entered_with else 0.0

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
        pace = self._pace("posting a note to")
        while True:  # in the state, which every member watches already
            state, version = self.job.read()
            if not rnd.still_runs(state, ours):
                return  # the round is over: so is its note
            assert state is not None
            noted = dataclasses.replace(state, notes={**state.notes, name: value})
            if self.job.commit(noted, version):
                return
            pace.again()

    def note(self, name: str) -> str | None:
        """A note of the running round, as far as this member's watch has seen."""
        f = self._follower
        return f.notes.get(name) if f is not None else None

    def num_nodes_waiting(self) -> int:
        f = self._follower
        if f is None or self._round is None:
            return 0
        waiting = set(f.waiting)
        admissible = rnd.admissible(waiting, self._round.size, self.params.max_nodes)
        return len(waiting) if admissible else 0

    def lost_members(self, cancel: CancelToken = NEVER) -> list[str]:
        """Members whose agent is gone (:func:`.presence.lost_members`)."""
        if self._round is None:
            return []
        self.session.use(cancel)
        try:
            current = self.job.with_members(self._round, every=True)
            if current is None:
                return []
            return presence.lost_members(self.job, self.session, current, self.conf.lease_ttl)
        except StoreError:
            return []

    # ---- the job's end ---------------------------------------------------------------------------

    def closed(self) -> JobClosed | None:
        return self.job.closed

    def counters(self) -> RendezvousCounters:
        return RendezvousCounters(
            rounds=self._rounds, store_requests=self.store.requests, phase=self._phase
        )

    def set_closed(self, reason: CloseReason, detail: str = "") -> None:
        pace = self._pace("closing")
        while True:
            state, version = self.job.read()
            if state is None or state.status == Status.CLOSED:
                return
            if self.job.commit(rnd.close(state, reason, detail), version):
                return
            pace.again()

    def mark_done(self) -> bool:
        """Our workers succeeded. The last member to finish closes the job as succeeded.
        Returns True if the whole job has finished."""
        self._stop_follower()
        keys = self.job.keys
        if self._round is not None and self._round.leader == self.node:
            self.store.put(keys.leader_done(self._round.version), b"1")
        self.store.put(keys.done + self.node, b"1")
        self._done = True
        kvs, _ = self.store.range(keys.done)
        done = {kv.key.rsplit("/", 1)[1] for kv in kvs}
        ours = self._round.version if self._round is not None else 0
        pace = self._pace("closing (done)")
        while True:
            state, version = self.job.read()
            if state is None or state.status == Status.CLOSED:
                ended = state.closed if state is not None else None
                self.job.closed = ended or JobClosed(CloseReason.SUCCEEDED)
                return True
            if state.version == ours and state.status == Status.FINAL:
                state = self.job.with_members(state, every=True) or state
            if state.version != ours or not state.nodes or not rnd.everyone_done(state, done):
                return False
            if self.job.commit(rnd.close(state, CloseReason.SUCCEEDED), version):
                return True
            pace.again()

    def ended_here(self) -> bool:
        """True once the job is closed or this node's workers finished: the others then end
        too, and their last requests (done, closing the job, how it ended) need the store."""
        keys = self.job.keys
        try:
            kvs, _ = self.store.range(keys.everything)
        except StoreError:
            return False
        state, _ = self.job.state_in(kvs)
        closed = state is not None and state.status == Status.CLOSED
        return closed or any(kv.key == keys.done + self.node for kv in kvs)

    def shutdown(self, cancel: CancelToken = NEVER) -> None:
        self._stop_follower()
        if self._presence is not None:
            self._presence.close()
            self._presence = None
        self.session.close()
