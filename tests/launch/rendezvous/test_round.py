"""The rendezvous' decisions, without a store: who leads, when a round freezes, ranks, spares,
the restart budget, closing, versions."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from elastic_launch.api import RestartBudget
from elastic_launch.rendezvous.api import CloseReason, JobClosed, RestartReason
from elastic_launch.rendezvous.round import state as rnd
from elastic_launch.rendezvous.round.state import PROTOCOL, Member, RoundState, Status


def member(addr: str = "10.0.0.1", lws: int = 2, release: str = "1.0", protocol: int = PROTOCOL):
    return Member(addr=addr, port=5000, lws=lws, release=release, protocol=protocol, presence=6000)


def joinable(**kw) -> RoundState:
    return RoundState(version=kw.pop("version", 3), status=Status.JOINABLE, release="1.0", **kw)


def test_nodes_are_ordered_by_when_they_joined():
    joined = {"b": 12, "a": 15, "c": 11, "d": 11}
    assert rnd.join_order(joined) == ["c", "d", "b", "a"], "a tie goes by name"
    assert rnd.join_order({}) == []


@pytest.mark.parametrize(
    ("joined", "last_call_passed", "ready"),
    [(1, True, False), (2, False, False), (2, True, True), (4, False, True), (5, False, True)],
)
def test_a_round_freezes_at_max_or_at_min_after_the_last_call(joined, last_call_passed, ready):
    assert rnd.ready_to_freeze(joined, 2, 4, last_call_passed) is ready


def test_survivors_keep_their_ranks():
    assert rnd.assign_ranks(["a", "b", "c"], {}) == {"a": 0, "b": 1, "c": 2}
    # b (rank 1) died; a spare s arrives: a and c keep 0 and 2, s takes 1.
    assert rnd.assign_ranks(["a", "c", "s"], {"a": 0, "b": 1, "c": 2}) == {"a": 0, "c": 2, "s": 1}
    # Shrinking to two: c's old rank 2 is out of range, it takes the free one.
    assert rnd.assign_ranks(["a", "c"], {"a": 0, "b": 1, "c": 2}) == {"a": 0, "c": 1}


def test_rank_zero_goes_to_a_node_that_ran_when_its_own_is_gone():
    # a (rank 0, the workers' store) died; s is new: b, first of those that ran, takes 0; s takes 1.
    assert rnd.assign_ranks(["b", "c", "s"], {"a": 0, "b": 1, "c": 2}) == {"b": 0, "c": 2, "s": 1}
    assert rnd.assign_ranks(["s", "c"], {"a": 0, "c": 1}) == {"c": 0, "s": 1}
    assert rnd.assign_ranks(["s", "t"], {"a": 0}) == {"s": 0, "t": 1}, "no one ran: join order"


def test_freeze_takes_the_first_max_nodes_and_the_rest_are_spares():
    joined = {"n1": 1, "n2": 2, "n3": 3}
    infos = {n: member() for n in joined}
    frozen = rnd.freeze(joinable(prev_ranks={"n2": 0}), joined, infos, 1, 2)
    assert frozen is not None
    assert frozen.status == Status.FROZEN and list(frozen.nodes) == ["n1", "n2"]
    assert dict(frozen.ranks) == {"n2": 0, "n1": 1}, "n2 keeps its rank of the last round"
    assert frozen.leader == "n1"
    assert rnd.spares(joined, 2) == ["n3"]


def test_role_ranks_count_within_each_role_in_group_rank_order():
    """As torch's agent assigns them (``_assign_worker_ranks``): RANK over every node, ROLE_RANK
    over the nodes of the same role, both in group rank order; ROLE_WORLD_SIZE is the role's
    workers."""
    joined = {"t1": 1, "ps": 2, "t2": 3}
    infos = {
        "t1": replace(member(lws=2), role="trainer"),
        "ps": replace(member(lws=1), role="ps"),
        "t2": replace(member(lws=2), role="trainer"),
    }
    frozen = rnd.freeze(joinable(), joined, infos, 3, 3)
    assert frozen is not None
    assert dict(frozen.ranks) == {"t1": 0, "ps": 1, "t2": 2}
    got = {n: rnd.round_info(frozen, n) for n in joined}
    assert {n: i.rank_offset for n, i in got.items()} == {"t1": 0, "ps": 2, "t2": 3}
    assert {n: i.role_rank_offset for n, i in got.items()} == {"t1": 0, "ps": 0, "t2": 2}
    assert {n: i.role_world_size for n, i in got.items()} == {"t1": 4, "ps": 1, "t2": 4}
    # A node that reads only its own shard of the membership learns the same.
    for n in joined:
        shard = frozen.shard_values()[rnd.shard_of(n, frozen.shards)]
        alone = replace(frozen, nodes={}, ranks={}, offsets={}).with_shards([shard])
        assert rnd.round_info(alone, n) == got[n]


def test_freeze_needs_min_nodes_with_their_information():
    joined = {"n1": 1, "n2": 2}
    assert rnd.freeze(joinable(), joined, {"n1": member()}, 2, 4) is None, "n2 has no info"
    assert rnd.freeze(joinable(), {"n1": 1}, {"n1": member()}, 2, 4) is None


def test_members_of_different_versions_close_the_job_naming_both():
    joined = {"old": 1, "new": 2}
    infos = {"old": member(release="0.9"), "new": member(release="1.0")}
    closed = rnd.freeze(joinable(), joined, infos, 2, 2)
    assert closed is not None and closed.status == Status.CLOSED
    assert closed.closed is not None and closed.closed.reason == CloseReason.ERROR
    assert "0.9" in closed.closed.detail and "1.0" in closed.closed.detail


def test_a_node_of_another_release_or_protocol_cannot_join():
    assert rnd.version_conflict(rnd.initial("1.0"), "1.0") is None
    why = rnd.version_conflict(rnd.initial("1.0"), "1.1")
    assert why is not None and "1.0" in why and "1.1" in why
    old = RoundState.from_json(json.dumps({"version": 2, "status": "joinable"}).encode())
    why = rnd.version_conflict(old, "1.0")
    assert why is not None and "protocol 1" in why and f"protocol {PROTOCOL}" in why


def test_a_frozen_round_is_final_once_everyone_confirmed():
    frozen = rnd.freeze(joinable(), {"a": 1, "b": 2}, {"a": member(), "b": member()}, 2, 2)
    assert frozen is not None
    assert rnd.finalize(frozen, {"a"}) is None
    final = rnd.finalize(frozen, {"a", "b", "stranger"})
    assert final is not None and final.status == Status.FINAL
    assert rnd.finalize(final, {"a", "b"}) is None, "only a frozen round is finalized"


def test_abandoning_a_round_opens_the_next():
    frozen = rnd.freeze(joinable(), {"a": 1}, {"a": member()}, 1, 1)
    assert frozen is not None
    nxt = rnd.abandon(frozen)
    assert (nxt.version, nxt.status, dict(nxt.nodes), nxt.leader) == (4, Status.JOINABLE, {}, "")


def final_round(restarts: int = 0) -> RoundState:
    frozen = rnd.freeze(
        joinable(restarts=restarts), {"a": 1, "b": 2}, {"a": member(), "b": member()}, 2, 2
    )
    assert frozen is not None
    final = rnd.finalize(frozen, {"a", "b"})
    assert final is not None
    return final


def test_membership_changes_are_free_and_failures_spend_the_budget():
    final = final_round()
    moved = rnd.reopen(final, RestartReason.MEMBERSHIP, max_restarts=0)
    assert (moved.status, moved.version, moved.restarts) == (Status.JOINABLE, 4, 0)
    assert dict(moved.prev_ranks) == {"a": 0, "b": 1}, "the next round keeps the ranks it can"
    failed = rnd.reopen(final, RestartReason.FAILURE, max_restarts=2)
    assert (failed.status, failed.restarts) == (Status.JOINABLE, 1)


def test_a_replacement_and_a_group_restart_spend_the_same_count():
    final = final_round()
    replaced = rnd.spend(final, 2)
    assert replaced is not None and replaced.restarts == 1
    assert (replaced.status, replaced.version) == (final.status, final.version), "the round runs on"
    failed = rnd.reopen(replaced, RestartReason.FAILURE, max_restarts=2)
    assert failed.restarts == 2
    assert rnd.spend(failed, 2) is None, "both spent: none left for anyone"
    closed = rnd.reopen(failed, RestartReason.FAILURE, max_restarts=2)
    assert closed.status == Status.CLOSED


def test_the_failure_past_the_budget_closes_the_job_with_what_failed():
    closed = rnd.reopen(final_round(restarts=2), RestartReason.FAILURE, 2, "rank 3 exit code 1")
    assert closed.status == Status.CLOSED
    assert closed.closed == JobClosed(
        CloseReason.FAILED, "restarts exhausted (2); rank 3 exit code 1"
    )
    assert RestartBudget(0, 0).spend() is None
    assert RestartBudget(1, 3).spend() == RestartBudget(2, 3)
    assert RestartBudget(3, 3).exhausted() == "restarts exhausted (3)"


def test_a_running_round_makes_room_only_when_there_is_some():
    assert rnd.admissible({"s"}, 2, 3)
    assert not rnd.admissible({"s"}, 2, 2), "at MAX the waiting node stays a spare"
    assert not rnd.admissible(set(), 2, 3)


def test_still_runs_and_everyone_done():
    final = final_round()
    assert rnd.still_runs(final, final.version)
    assert not rnd.still_runs(final, final.version - 1)
    assert not rnd.still_runs(None, final.version)
    assert not rnd.everyone_done(final, {"a"})
    assert rnd.everyone_done(final, {"a", "b"})


def test_round_info_puts_rank_zero_node_as_master():
    infos = {"a": member("10.0.0.1", lws=2), "b": member("10.0.0.2", lws=4)}
    state = joinable(version=7, restarts=1, prev_ranks={"a": 1, "b": 0})
    frozen = rnd.freeze(state, {"a": 1, "b": 2}, infos, 2, 2)
    assert frozen is not None
    final = rnd.finalize(frozen, {"a", "b"})
    assert final is not None
    info = rnd.round_info(final, "a")
    assert (info.round, info.group_rank, info.group_world_size) == (7, 1, 2)
    assert info.world_size == 6 and info.rank_offset == 4
    assert (info.master_addr, info.master_port, info.restart_count) == ("10.0.0.2", 5000, 1)
    # A member that read only its own shard knows the same (the state carries the rest).
    again = RoundState.from_json(final.to_json())
    shard = final.shard_values()[rnd.shard_of("a", final.shards)]
    assert rnd.round_info(again.with_shards([shard]), "a") == info


def test_the_state_survives_its_json():
    closed = rnd.close(final_round(), CloseReason.SUCCEEDED, "", expires_at=123.0)
    again = RoundState.from_json(closed.to_json())
    assert not again.nodes and again.size == 2, "the membership is not in the state key"
    assert again.with_shards(list(closed.shard_values().values())) == replace(closed, prev_ranks={})
    assert len(closed.to_json()) < 300
    assert Member.from_json(member().to_json()) == member()
    assert Member.from_json(b'{"addr": "h", "port": 1, "lws": 1, "future": 3}').addr == "h"


def test_the_state_key_stays_small_and_each_node_reads_a_small_shard():
    joined = {f"host{i:04d}-1234-abcdef": i for i in range(1000)}
    infos = {n: member() for n in joined}
    frozen = rnd.freeze(joinable(), joined, infos, 1, 1000)
    assert frozen is not None and frozen.size == 1000 and frozen.world == 2000
    assert len(frozen.to_json()) < 400, "every node watches the state: its size is not N's"
    shards = frozen.shard_values()
    assert len(shards) == frozen.shards == 16
    assert max(len(v) for v in shards.values()) < 8 * 1024, "a node reads a few KiB"
    again = RoundState.from_json(frozen.to_json())
    assert not again.members_complete
    mine = "host0421-1234-abcdef"
    one = again.with_shards([shards[rnd.shard_of(mine, again.shards)]])
    assert mine in one.nodes and not one.members_complete
    assert one.ranks[mine] == frozen.ranks[mine] and one.offsets[mine] == frozen.offsets[mine]
    every = again.with_shards(list(shards.values()))
    assert every.members_complete and dict(every.ranks) == dict(frozen.ranks)
    final_one = replace(one, status=Status.FINAL)
    assert not rnd.everyone_done(final_one, set(joined)), "one shard cannot say all are done"
    assert rnd.everyone_done(replace(every, status=Status.FINAL), set(joined))


def test_the_freezer_leads_and_a_reopened_round_knows_which_ran_last():
    joined = {"a": 1, "b": 2, "c": 3}
    frozen = rnd.freeze(joinable(), joined, {n: member() for n in joined}, 2, 2, freezer="c")
    assert frozen is not None
    assert frozen.leader == "c" and list(frozen.nodes) == ["c", "a"], "the freezer is a member"
    final = rnd.finalize(frozen, {"a", "c"})
    assert final is not None
    reopened = rnd.reopen(final, RestartReason.MEMBERSHIP, 0)
    assert reopened.ran == final.version and reopened.version == final.version + 1
    assert rnd.abandon(reopened).ran == final.version, "an abandoned round never ran"


def test_a_reopened_round_says_who_left_until_it_freezes():
    final = final_round()
    reopened = rnd.reopen(final, RestartReason.MEMBERSHIP, 3, left="b")
    again = RoundState.from_json(reopened.to_json())
    assert again.left == "b", "the others learn who left from the state they watch"
    assert RoundState.from_json(rnd.reopen(final, RestartReason.MEMBERSHIP, 3).to_json()).left == ""
    frozen = rnd.freeze(again, {"a": 1, "c": 2}, {"a": member(), "c": member()}, 1, 3)
    assert frozen is not None and frozen.left == "" and b'"left"' not in frozen.to_json()
