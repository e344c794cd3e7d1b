"""A node's view of a round while it waits for it: who joined, who confirmed, who is gone.

Pure functions, as :mod:`.state` is for the decisions: a view starts from what a node read
(:func:`join_view`, :func:`confirm_view`) and each batch of store changes gives a new view
(:func:`on_join_changes`, :func:`on_confirm_changes`). The rendezvous does the reading and the
writing; these only say what the reads mean. Unit-tested over sequences of changes, with no
store (``tests/launch/rendezvous/test_view.py``).

Each reducer copies the view's sets once per batch, not per change: a batch is what one watch
response carries, so a round of N nodes costs the leader O(N) copies of O(N) sets at worst,
and a few at best.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field

from elastic_launch.rendezvous.round.state import Member, RoundState
from elastic_launch.rendezvous.round.values import text_value
from elastic_launch.rendezvous.store.api import Change, KeyValue


@dataclass(frozen=True)
class RoundKeys:
    """The keys a node follows for round `version` (from :class:`.job.JobKeys`)."""

    state: str
    leader: str  # the round's leader key
    join: str  # the round's join prefix
    confirm: str  # the round's confirm prefix
    waiting: str  # the spares' prefix
    node: str  # this node's name


# ---- joinable -----------------------------------------------------------------------------


@dataclass(frozen=True)
class JoinView:
    """A joinable round, as a node sees it. Only the leader reads and watches the joins (and
    so has `joined`); every node sees the state, the leader key and the spares."""

    state: RoundState | None  # None: the state key is gone (the job ended)
    version: int  # the state key's revision
    leader: str  # the round's leader, as its key says ("" once it is gone)
    joined: dict[str, int] = field(default_factory=dict)  # node -> revision it joined at
    members: dict[str, Member] = field(default_factory=dict)  # what each joined node said
    waiting: frozenset[str] = frozenset()  # spares waiting to be admitted
    recheck: bool = True  # who came back changed, or a spare came: look again at who is not
    lost_own_key: bool = False  # our own join key went (our lease expired): join again
    rest_gone: bool = False  # (set by the caller) the rest of the previous round is gone


def join_view(kvs: list[KeyValue], keys: RoundKeys) -> JoinView:
    """The view from a read of the round's keys (the state and the shared keys for those that
    do not lead; everything for the leader)."""
    state_kv = _find(kvs, keys.state)
    leader_kv = _find(kvs, keys.leader)
    joins = [kv for kv in kvs if kv.key.startswith(keys.join)]
    return JoinView(
        state=RoundState.from_json(state_kv.value, keys.state) if state_kv is not None else None,
        version=state_kv.version if state_kv is not None else 0,
        leader=text_value(leader_kv.value, keys.leader) if leader_kv is not None else "",
        joined={kv.key[len(keys.join) :]: kv.created for kv in joins},
        members={kv.key[len(keys.join) :]: Member.from_json(kv.value, kv.key) for kv in joins},
        waiting=frozenset(
            kv.key[len(keys.waiting) :] for kv in kvs if kv.key.startswith(keys.waiting)
        ),
    )


def on_join_changes(view: JoinView, changes: Iterable[Change], keys: RoundKeys) -> JoinView:
    """The view after `changes` (one watch batch, in order)."""
    state, version, leader = view.state, view.version, view.leader
    joined, members, waiting = dict(view.joined), dict(view.members), set(view.waiting)
    recheck, lost_own = view.recheck, view.lost_own_key
    for c in changes:
        if c.key == keys.state:
            state = RoundState.from_json(c.value, c.key) if c.value is not None else None
            version = c.revision
        elif c.key == keys.leader:
            leader = text_value(c.value, c.key) if c.value is not None else ""
        elif c.key.startswith(keys.waiting):
            spare = c.key[len(keys.waiting) :]
            if c.value is None:
                waiting.discard(spare)
            else:
                waiting.add(spare)
                recheck = True  # a spare is coming: the last call is waited out
        elif c.key.startswith(keys.join):
            node = c.key[len(keys.join) :]
            if c.value is not None:
                recheck |= node not in joined
                joined.setdefault(node, c.revision)
                members[node] = Member.from_json(c.value, c.key)
            elif node == keys.node:
                lost_own = True  # ours stays in `joined`: it is written again at once
            else:
                recheck |= node in joined
                joined.pop(node, None)
                members.pop(node, None)
    return dataclasses.replace(
        view,
        state=state,
        version=version,
        leader=leader,
        joined=joined,
        members=members,
        waiting=frozenset(waiting),
        recheck=recheck,
        lost_own_key=lost_own,
    )


# ---- frozen -------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfirmView:
    """A frozen round, as a member sees it while the members confirm. Who must stay for the
    round to go on is `required`: the leader follows every member (their join keys), the
    others the leader (its leader key). Who of those is missing (`absent`) and, for the
    leader, who has yet to confirm (`unconfirmed`) are kept as the changes come."""

    leader: str
    leading: bool
    required: frozenset[str]
    present: frozenset[str]
    confirmed: frozenset[str]
    absent: frozenset[str] = frozenset()
    unconfirmed: frozenset[str] = frozenset()
    # The last change of the state key in the batch, for the caller to read its membership:
    # (its value, or None when deleted; its revision).
    state_change: tuple[bytes | None, int] | None = None


def confirm_view(
    state: RoundState, node: str, present: Iterable[str], confirmed: Iterable[str]
) -> ConfirmView:
    """The view of frozen round `state` (with its membership) for `node`, from who was seen
    present (join keys, and the leader key) and who confirmed."""
    leading = state.leader == node
    required = frozenset(state.nodes) if leading else frozenset({state.leader})
    present_, confirmed_ = frozenset(present), frozenset(confirmed)
    return ConfirmView(
        leader=state.leader,
        leading=leading,
        required=required,
        present=present_,
        confirmed=confirmed_,
        absent=required - present_,
        unconfirmed=required - confirmed_ if leading else frozenset(),
    )


def confirm_read(kvs: list[KeyValue], keys: RoundKeys, leader: str) -> tuple[set[str], set[str]]:
    """Who is present and who confirmed, in a read of the round's keys."""
    confirmed = {kv.key[len(keys.confirm) :] for kv in kvs if kv.key.startswith(keys.confirm)}
    present = {kv.key[len(keys.join) :] for kv in kvs if kv.key.startswith(keys.join)}
    if _find(kvs, keys.leader) is not None:
        present.add(leader)
    return present, confirmed


def on_confirm_changes(
    view: ConfirmView, changes: Iterable[Change], keys: RoundKeys
) -> ConfirmView:
    """The view after `changes` (one watch batch, in order)."""
    present, absent = set(view.present), set(view.absent)
    confirmed, unconfirmed = set(view.confirmed), set(view.unconfirmed)
    state_change = None

    def mark(node: str, there: bool) -> None:
        if there:
            present.add(node)
            absent.discard(node)
        else:
            present.discard(node)
            if node in view.required:
                absent.add(node)

    for c in changes:
        if c.key == keys.state:
            state_change = (c.value, c.revision)
        elif c.key == keys.leader:
            mark(view.leader, c.value is not None)
        elif c.key.startswith(keys.confirm):
            node = c.key[len(keys.confirm) :]
            if c.value is not None:
                confirmed.add(node)
                unconfirmed.discard(node)
            else:
                confirmed.discard(node)
                if view.leading and node in view.required:
                    unconfirmed.add(node)
        elif c.key.startswith(keys.join):
            mark(c.key[len(keys.join) :], c.value is not None)
    return dataclasses.replace(
        view,
        present=frozenset(present),
        absent=frozenset(absent),
        confirmed=frozenset(confirmed),
        unconfirmed=frozenset(unconfirmed),
        state_change=state_change,
    )


# ---- as a spare ---------------------------------------------------------------------------


def on_spare_changes(
    present: frozenset[str], changes: Iterable[Change], join: str
) -> frozenset[str]:
    """Who of a running round is still there (its join keys), after `changes`."""
    out = set(present)
    for c in changes:
        if c.key.startswith(join):
            node = c.key[len(join) :]
            if c.value is None:
                out.discard(node)
            else:
                out.add(node)
    return frozenset(out)


def _find(kvs: list[KeyValue], key: str) -> KeyValue | None:
    return next((kv for kv in kvs if kv.key == key), None)
