"""What a node's reads and watches mean while it waits for a round, over sequences of store
changes: who joined, who confirmed, who is gone. No store: the reducers are pure."""

from __future__ import annotations

from elastic_launch.rendezvous.round.job import JobKeys
from elastic_launch.rendezvous.round.state import Member, RoundState, Status
from elastic_launch.rendezvous.round.view import (
    JoinView,
    RoundKeys,
    confirm_read,
    confirm_view,
    join_view,
    on_confirm_changes,
    on_join_changes,
    on_spare_changes,
)
from elastic_launch.rendezvous.store.api import Change, KeyValue

JOB = JobKeys.of("run")
KEYS = RoundKeys(JOB.state, JOB.leader(2), JOB.join(2), JOB.confirm(2), JOB.waiting, "me")
ME = Member("10.0.0.1", 29500, 2).to_json()


def put(key: str, value: bytes, revision: int) -> Change:
    return Change(key, value, revision)


def gone(key: str, revision: int) -> Change:
    return Change(key, None, revision)


def kv(key: str, value: bytes, version: int = 1, created: int = 1) -> KeyValue:
    return KeyValue(key, value, version, created)


def joinable(version: int = 2) -> RoundState:
    return RoundState(version, Status.JOINABLE)


def test_the_first_read_gives_who_joined_and_who_leads():
    view = join_view(
        [
            kv(JOB.state, joinable().to_json(), version=7),
            kv(JOB.leader(2), b"me"),
            kv(KEYS.join + "me", ME, created=10),
            kv(KEYS.join + "b", ME, created=11),
            kv(JOB.waiting + "spare", b"2"),
        ],
        KEYS,
    )
    assert view.state == joinable() and view.version == 7 and view.leader == "me"
    assert view.joined == {"me": 10, "b": 11} and set(view.members) == {"me", "b"}
    assert view.waiting == {"spare"} and view.recheck


def test_joins_and_leaves_change_who_joined_and_ask_for_a_recheck():
    view = join_view([kv(JOB.state, joinable().to_json()), kv(JOB.leader(2), b"me")], KEYS)
    view = JoinView(**{**view.__dict__, "recheck": False})
    view = on_join_changes(view, [put(KEYS.join + "a", ME, 5), put(KEYS.join + "b", ME, 6)], KEYS)
    assert view.joined == {"a": 5, "b": 6} and view.recheck
    view = JoinView(**{**view.__dict__, "recheck": False})
    view = on_join_changes(view, [put(KEYS.join + "a", ME, 9)], KEYS)
    assert view.joined["a"] == 5, "a rewrite keeps when it joined"
    assert not view.recheck, "nobody came or went"
    view = on_join_changes(view, [gone(KEYS.join + "b", 10)], KEYS)
    assert view.joined == {"a": 5} and "b" not in view.members and view.recheck


def test_our_own_key_going_means_join_again_not_leave():
    view = join_view([kv(JOB.state, joinable().to_json()), kv(KEYS.join + "me", ME)], KEYS)
    view = on_join_changes(view, [gone(KEYS.join + "me", 4)], KEYS)
    assert view.lost_own_key and "me" in view.joined


def test_a_spare_coming_asks_for_a_recheck_and_one_leaving_does_not():
    view = JoinView(joinable(), 1, "me", recheck=False)
    view = on_join_changes(view, [put(JOB.waiting + "s", b"1", 3)], KEYS)
    assert view.waiting == {"s"} and view.recheck
    view = JoinView(**{**view.__dict__, "recheck": False})
    view = on_join_changes(view, [gone(JOB.waiting + "s", 4)], KEYS)
    assert view.waiting == frozenset() and not view.recheck


def test_the_state_and_the_leader_key_follow_their_last_change():
    view = JoinView(joinable(), 1, "me")
    frozen = RoundState(2, Status.FROZEN)
    view = on_join_changes(
        view, [put(JOB.state, joinable().to_json(), 5), put(JOB.state, frozen.to_json(), 6)], KEYS
    )
    assert view.state == frozen and view.version == 6
    view = on_join_changes(view, [gone(JOB.leader(2), 7)], KEYS)
    assert view.leader == "", "the leader left: look again"
    view = on_join_changes(view, [gone(JOB.state, 8)], KEYS)
    assert view.state is None


def test_other_rounds_keys_are_ignored():
    view = JoinView(joinable(), 1, "me")
    after = on_join_changes(view, [put(JOB.join(1) + "old", ME, 3), gone(JOB.leader(1), 4)], KEYS)
    assert after == view


def frozen_round(leader: str, nodes: list[str]) -> RoundState:
    return RoundState(2, Status.FROZEN, leader=leader, nodes={n: Member("h", 1, 1) for n in nodes})


def test_the_leader_requires_every_member_and_waits_for_their_confirmations():
    state = frozen_round("me", ["me", "a", "b"])
    view = confirm_view(state, "me", present={"me", "a", "b"}, confirmed={"me"})
    assert view.leading and view.required == {"me", "a", "b"}
    assert view.unconfirmed == {"a", "b"} and not view.absent
    view = on_confirm_changes(view, [put(KEYS.confirm + "a", b"1", 3)], KEYS)
    assert view.unconfirmed == {"b"}
    view = on_confirm_changes(view, [put(KEYS.confirm + "b", b"1", 4)], KEYS)
    assert not view.unconfirmed, "every member confirmed: the leader finalizes"
    view = on_confirm_changes(view, [gone(KEYS.confirm + "b", 5)], KEYS)
    assert view.unconfirmed == {"b"}, "a confirmation taken back is awaited again"


def test_a_member_that_vanishes_is_absent_until_it_comes_back():
    state = frozen_round("me", ["me", "a"])
    view = confirm_view(state, "me", present={"me", "a"}, confirmed={"me"})
    view = on_confirm_changes(view, [gone(KEYS.join + "a", 3)], KEYS)
    assert view.absent == {"a"}, "the round is abandoned"
    view = on_confirm_changes(view, [put(KEYS.join + "a", ME, 4)], KEYS)
    assert not view.absent
    view = on_confirm_changes(view, [gone(KEYS.join + "stranger", 5)], KEYS)
    assert not view.absent, "only members count"


def test_the_others_require_only_the_leader():
    state = frozen_round("lead", ["lead", "me"])
    view = confirm_view(state, "me", present={"lead"}, confirmed=set())
    assert not view.leading and view.required == {"lead"} and not view.unconfirmed
    view = on_confirm_changes(view, [put(KEYS.confirm + "x", b"1", 3)], KEYS)
    assert not view.unconfirmed, "only the leader counts confirmations"
    view = on_confirm_changes(view, [gone(JOB.leader(2), 4)], KEYS)
    assert view.absent == {"lead"}, "the leader left: start over"


def test_a_member_missing_at_the_read_is_absent_at_once():
    state = frozen_round("me", ["me", "a"])
    kvs = [kv(KEYS.join + "me", ME), kv(KEYS.confirm + "me", b"1"), kv(JOB.leader(2), b"me")]
    present, confirmed = confirm_read(kvs, KEYS, "me")
    view = confirm_view(state, "me", present, confirmed)
    assert view.absent == {"a"} and view.confirmed == {"me"}


def test_the_last_state_change_of_a_batch_is_handed_back():
    view = confirm_view(frozen_round("me", ["me"]), "me", {"me"}, {"me"})
    final = RoundState(2, Status.FINAL).to_json()
    view = on_confirm_changes(view, [put(JOB.state, b"x", 3), put(JOB.state, final, 4)], KEYS)
    assert view.state_change == (final, 4)
    view = on_confirm_changes(view, [put(KEYS.confirm + "me", b"1", 5)], KEYS)
    assert view.state_change is None
    view = on_confirm_changes(view, [gone(JOB.state, 6)], KEYS)
    assert view.state_change == (None, 6)


def test_a_spare_sees_the_running_members_come_and_go():
    present = frozenset({"a", "b"})
    present = on_spare_changes(present, [gone(KEYS.join + "a", 3)], KEYS.join)
    assert present == {"b"}
    present = on_spare_changes(
        present, [put(KEYS.join + "c", ME, 4), put(JOB.state, b"x", 5)], KEYS.join
    )
    assert present == {"b", "c"}
