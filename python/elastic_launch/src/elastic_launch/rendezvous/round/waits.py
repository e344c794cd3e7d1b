"""The three waits of a node for its round: joining a joinable round, confirming a frozen one,
and waiting as a spare while one runs.

Each wait reads the round's keys once, watches from that revision on, and hands every batch of
changes to the pure reducers of :mod:`.view`; the decisions (freeze, finalize, abandon) are
:mod:`.state`'s. A wait ends with the final round that includes this node, or None when the
round moved on without it (the caller looks again). Every wait is bounded by a deadline and
ended at once by a cancellation or a lost lease; nothing polls.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

from elastic_launch.cancel import Deadline, Notice, clock
from elastic_launch.rendezvous.api import RendezvousParameters, RendezvousTimeoutError
from elastic_launch.rendezvous.conf import WORKERS_ROLE, RendezvousConf
from elastic_launch.rendezvous.round import state as rnd
from elastic_launch.rendezvous.round.job import Job
from elastic_launch.rendezvous.round.pace import Pace, write_lost
from elastic_launch.rendezvous.round.presence import RestGone
from elastic_launch.rendezvous.round.state import RoundState, Status
from elastic_launch.rendezvous.round.view import (
    ConfirmView,
    JoinView,
    RoundKeys,
    confirm_read,
    confirm_view,
    join_view,
    on_confirm_changes,
    on_join_changes,
    on_spare_changes,
)
from elastic_launch.rendezvous.store.api import Inbox, StoreError
from elastic_launch.rendezvous.store.session import Session

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Joined:
    """What the join phase hands to the confirm phase: its watch (open since before the freeze,
    so everything after is in it), who it saw present, and who led the round."""

    inbox: Inbox
    present: set[str]
    leader: str


class RoundWaits:
    """One node's waits for a round (see the module's docstring)."""

    def __init__(
        self,
        job: Job,
        session: Session,
        params: RendezvousParameters,
        conf: RendezvousConf,
        me: Callable[[], bytes],
    ) -> None:
        self.job = job
        self.session = session
        self.params = params
        self.conf = conf
        self.me = me  # this node's join value (its Member)
        self.phase = ""
        self.spare = False  # it wrote a waiting key (as a spare)
        self._prev: tuple[int, dict[str, int]] | None = None  # (round that ran, its ranks)
        self._gone: RestGone | None = None  # (a reopened round's leader) who is gone for good
        self.on_spare: Callable[[], None] = lambda: None  # told when it waits as a spare

    def keys_of(self, version: int) -> RoundKeys:
        k = self.job.keys
        return RoundKeys(
            k.state,
            k.leader(version),
            k.join(version),
            k.confirm(version),
            k.waiting,
            self.job.node,
        )

    # ---- joinable --------------------------------------------------------------------------

    def join(self, state: RoundState, deadline: Deadline) -> RoundState | None:
        """Take part in joinable round `state` until it is frozen with us in it (then confirm),
        moves on without us (None), or the join timeout passes."""
        self.phase = "joining"
        job, v = self.job, state.version
        keys = self.keys_of(v)
        me = keys.join + job.node
        self._join_key(me)
        if self.spare:  # it waited as a spare: its waiting key goes (else there is none)
            job.known.mine.pop("waiting", None)
            with contextlib.suppress(StoreError):
                job.store.delete(job.keys.waiting + job.node)
            self.spare = False
        # The first to create the round's leader key leads: it reads and watches the whole
        # round and freezes it. The others read and watch only the state and the shared keys:
        # a join costs each of them the same whatever N is.
        leading = bool(job.store.create(keys.leader, job.node.encode(), ephemeral=True))
        if leading:
            job.known.wrote("leader", keys.leader, job.node.encode())
        kvs, revision = job.look(leading)
        view = join_view(kvs, keys)
        if view.state is None or not view.leader or (leading and view.leader != job.node):
            return None  # gone as we looked, or our lease was replaced in between
        leader = view.leader
        notice = Notice(lambda: self._waiting_for(view, leading, deadline), logger.warning)
        last_call: Deadline | None = None
        watched = [job.keys.everything] if leading else job.keys.light
        with self.session.watching(watched, revision) as inbox:
            while True:
                notice.check()
                state = view.state
                if state is None or state.version != v or state.status != Status.JOINABLE:
                    present = set(view.joined) if leading else {leader}
                    return self._frozen(view, v, leading, Joined(inbox, present, leader))
                if self.session.take_lost():
                    self._rejoin(me)
                    if leading:
                        return None  # our leader key went with the lease: another leads
                if view.lost_own_key:  # our join key expired: join again
                    self._rejoin(me)
                    view = dataclasses.replace(view, lost_own_key=False)
                if not view.leader:
                    return None  # the leader left: look again, another leads
                if leading and len(view.joined) >= self.params.min_nodes:
                    view, last_call, advanced = self._leader_step(view, last_call)
                    if advanced:
                        continue  # frozen (by us, or another first): look at it
                if deadline.passed:
                    raise self._timeout(me, keys.join, len(view.joined) if leading else None)
                until = Deadline.earliest(deadline, last_call, notice.due())
                view = on_join_changes(view, self.session.wait(inbox, until), keys)

    def _leader_step(
        self, view: JoinView, last_call: Deadline | None
    ) -> tuple[JoinView, Deadline | None, bool]:
        """The leader, once MIN nodes joined: freeze the round when it is full, when the last
        call is over, or when every member of the previous round is back or provably gone.
        Returns the view, the last call (None once a freeze was tried) and whether the state
        moved on (to the frozen round, or to what got there first)."""
        last_call = last_call or Deadline(self.conf.last_call_timeout)
        view = self._recheck(view)
        if not self._ready(view, last_call):
            return view, last_call, False
        frozen = self._freeze(view)
        if frozen is None:
            return view, None, False
        found, version = self.job.advance(frozen, view.version)
        return dataclasses.replace(view, state=found, version=version), None, True

    def _recheck(self, view: JoinView) -> JoinView:
        """The leader, when who came back changed (or a spare came): look again at whether
        the rest of the previous round is gone (then the last call can be skipped)."""
        if not view.recheck:
            return view
        assert view.state is not None
        return dataclasses.replace(view, recheck=False, rest_gone=self._rest_gone(view.state, view))

    def _ready(self, view: JoinView, last_call: Deadline) -> bool:
        p = self.params
        done = last_call.passed or view.rest_gone
        return rnd.ready_to_freeze(len(view.joined), p.min_nodes, p.max_nodes, done)

    def _freeze(self, view: JoinView) -> RoundState | None:
        assert view.state is not None
        p = self.params
        previous = self._with_previous(view.state)
        return rnd.freeze(
            previous, view.joined, view.members, p.min_nodes, p.max_nodes, freezer=self.job.node
        )

    def _frozen(self, view: JoinView, v: int, leading: bool, joined: Joined) -> RoundState | None:
        """Our joinable round `v` moved on. Frozen: confirm it if we are in it (the read of our
        shard writes our confirmation), else take the confirmation back; anything else: None,
        look again."""
        state = view.state
        if state is None or state.version != v or state.status != Status.FROZEN:
            return None
        full = self.job.with_members(state, every=leading, confirm=not leading)
        if full is not None and self.job.node in full.nodes:
            return self.confirm(full, view.version, joined)
        self.job.unconfirm(state.version)  # not a member (more joined than the max)
        return None

    def _waiting_for(self, view: JoinView, leading: bool, deadline: Deadline) -> str:
        p = self.params
        have = f"{len(view.joined)} node(s) joined, " if leading else ""
        return (
            f"waiting for nodes to join run '{p.run_id}' at {self.job.store.name}: {have}at "
            f"least {p.min_nodes} needed (--nnodes {p.min_nodes}:{p.max_nodes}); giving up "
            f"at {clock(deadline)} (join_timeout {self.conf.join_timeout:g} s)"
        )

    def _with_previous(self, state: RoundState) -> RoundState:
        """`state` with the ranks of the last round that ran (the leader's one read of that
        round's members), so that survivors keep their ranks."""
        if state.prev_ranks or not state.ran:
            return state
        if self._prev is None or self._prev[0] != state.ran:
            self._prev = (state.ran, self.job.ran_ranks(state.ran))
        return dataclasses.replace(state, prev_ranks=self._prev[1])

    def _rest_gone(self, state: RoundState, view: JoinView) -> bool:
        """Whether the last call can be skipped: this round follows another, no spare waits,
        and every member of the previous round is back or provably gone (presence.py)."""
        state = self._with_previous(state)
        if not state.prev_ranks or state.version <= 1 or view.waiting - set(view.joined):
            return False
        if self._gone is None or self._gone.ran != state.ran:
            self._gone = RestGone(state.ran)
        return self._gone.check(self.job, state.prev_ranks, set(view.joined))

    def _rejoin(self, me: str) -> None:
        """Our lease expired while we waited: our join key again (a new lease is in place)."""
        self.job.store.ensure_lease()
        self.session.take_lost()
        self._join_key(me)

    def _join_key(self, key: str) -> None:
        """Write this node's join key `key` (its Member), and know it."""
        value = self.me()
        self.job.store.create(key, value, ephemeral=True)
        self.job.known.wrote("join", key, value)

    def _timeout(self, me: str, join_prefix: str, count: int | None) -> Exception:
        if count is None:
            count = len(self.job.store.range(join_prefix)[0])
        with contextlib.suppress(StoreError):
            self.job.store.delete(me)
        p = self.params
        return RendezvousTimeoutError(
            f"rendezvous of run '{p.run_id}' timed out after {self.conf.join_timeout:g} s: "
            f"{count} node(s) joined, at least {p.min_nodes} needed (--nnodes {p.min_nodes}:"
            f"{p.max_nodes}); start more nodes or raise join_timeout"
        )

    # ---- frozen ----------------------------------------------------------------------------

    def confirm(
        self, state: RoundState, version: int, joined: Joined | None = None
    ) -> RoundState | None:
        """A frozen round with us in it (`state` with its membership): confirm, and (the
        leader) make it final once every member has; a member that vanishes sends the round
        back to joinable. `joined`: what the join phase leaves, if it led here."""
        self.phase = "confirming"
        job, v = self.job, state.version
        keys = self.keys_of(v)
        if job.confirmed != job.confirm_key(v):  # written with the read of our shard
            job.store.put(job.confirm_key(v), b"1", ephemeral=True)
            job.confirmed = job.confirm_key(v)
        leading = state.leader == job.node
        with contextlib.ExitStack() as stack:
            if joined is not None and joined.leader == state.leader:
                # Straight from the join: its watch already covers what this phase follows,
                # so no read and no new watch stand between the freeze and the confirmation.
                inbox = joined.inbox
                view = confirm_view(state, job.node, joined.present, {job.node})
            else:
                # The state may have moved on since the caller looked, and the watches start
                # where this look ends.
                kvs, revision = job.look(leading)
                found, found_version = job.state_in(kvs)
                if found is None:
                    return None
                if found_version != version:
                    full = job.with_members(found, every=leading)
                    if full is None:
                        return None
                    state, version = full, found_version
                present, confirmed = confirm_read(kvs, keys, state.leader)
                view = confirm_view(state, job.node, present, confirmed)
                watched = [keys.state, job.keys.shared, job.keys.round(v)]
                inbox = stack.enter_context(
                    self.session.watching(watched if leading else job.keys.light, revision)
                )
            return self._until_final(state, version, view, inbox, keys)

    def _until_final(
        self, state: RoundState, version: int, view: ConfirmView, inbox: Inbox, keys: RoundKeys
    ) -> RoundState | None:
        """Follow frozen round `state` until it is final (or moves on, or is abandoned). The
        leader gives the members `close_timeout` to confirm; should the leader itself vanish,
        the others start over at once (its key is gone), or a lease later."""
        v = state.version
        until = Deadline(self.conf.close_timeout + (0.0 if view.leading else self.conf.lease_ttl))
        patience = self.conf.join_timeout
        what = f"moving round {v} of job '{self.params.run_id}' on"
        pace = Pace(write_lost(what, self.job.store.name, patience), Deadline(patience))
        while True:
            if state.version != v or state.status != Status.FROZEN:
                if state.version == v and state.status == Status.FINAL:
                    return self.job.with_members(state)
                return None
            nxt: RoundState | None = None
            if view.leading and not view.unconfirmed:
                nxt = rnd.finalize(state, set(view.confirmed))
            if nxt is None and (view.absent or until.passed):
                nxt = rnd.abandon(state)  # a member (or the leader) died: start over
            if nxt is not None:
                found, version = self.job.advance(nxt, version)
                if found is None:
                    return None
                if found is not nxt:
                    pace.again()  # the write lost to what it read back: not at once forever
                state = found
                continue
            view = on_confirm_changes(view, self.session.wait(inbox, until), keys)
            if view.state_change is not None:
                value, revision = view.state_change
                changed = self._state_of(value, v, every=view.leading)
                if changed is None:
                    return None
                state, version = changed, revision

    def _state_of(self, value: bytes | None, v: int, every: bool) -> RoundState | None:
        """A changed state key: None if deleted (or if it is still round `v` but its
        membership is gone); round `v` frozen or final comes with its membership."""
        if value is None:
            return None
        found = self.job.saw(value, self.job.keys.state)
        if found.version == v and found.status in (Status.FROZEN, Status.FINAL):
            return self.job.with_members(found, every=every)
        return found

    # ---- spares ------------------------------------------------------------------------------

    def as_spare(self, state: RoundState) -> None:
        """Arrived while a round runs (or beyond MAX): register as waiting until the round
        changes (then the caller looks again). No join timeout: a spare waits for the job to
        need it or to end. A round whose members have all vanished (a job that crashed) is
        abandoned."""
        self.phase = "spare"
        job, v = self.job, state.version
        key = job.keys.waiting + job.node
        lws = str(self.params.local_world_size).encode()
        job.store.put(key, lws, ephemeral=True)
        job.known.wrote("waiting", key, lws)
        self.spare = True
        self.on_spare()
        join = job.keys.join(v)
        kvs, revision = job.store.range(job.keys.everything)
        found, version = job.state_in(kvs)
        if found is not None and found.status in (Status.FROZEN, Status.FINAL):
            found = job.with_members(found, every=True)  # it watches every member
        if found is None:
            return
        state = found
        present = frozenset(kv.key[len(join) :] for kv in kvs if kv.key.startswith(join))
        p = self.params
        notice = Notice(
            lambda: _spare_notice(p, job.store.name, v, len(state.nodes)),
            logger.warning,
            after=0.0,  # at once: a node should say it is a spare, not seem stuck
        )
        with self.session.watching([job.keys.state, join], revision) as inbox:
            while state.version == v and state.status in (Status.FROZEN, Status.FINAL):
                notice.check()
                if self.session.take_lost():
                    job.store.put(key, lws, ephemeral=True)
                if not set(state.nodes) & present:
                    logger.warning("every node of round %d is gone: starting a new round", v)
                    job.commit(rnd.abandon(state), version)
                    return
                changes = self.session.wait(inbox, notice.due())
                present = on_spare_changes(present, changes, join)
                last = next((c for c in reversed(changes) if c.key == job.keys.state), None)
                if last is None:
                    continue
                changed = self._state_of(last.value, v, every=True)
                if changed is None:
                    return
                state, version = changed, last.revision


def _spare_notice(p: RendezvousParameters, store: str, version: int, size: int) -> str:
    """What a spare says as it waits: a node of the job, or a worker of the train loop's."""
    if p.role == WORKERS_ROLE:
        return (
            f"this worker waits as a hot spare in the train loop's rendezvous at {store}: round "
            f"{version} trains with {size} worker(s), at most {p.max_nodes}; it takes the place "
            "of a worker that fails or leaves, at the next round, and ends with the job"
        )
    return (
        f"this node waits as a spare of run '{p.run_id}' at {store}: round {version} runs with "
        f"{size} node(s) (--nnodes {p.min_nodes}:{p.max_nodes}); it joins when the job "
        "re-forms (a node leaves or fails) and ends with the job, with no time limit"
    )
