"""The agent's policy, row by row: every happening, with and without the train loop, against
the budget. No process, no agent: :func:`decide` is a pure function of its snapshot."""

from __future__ import annotations

import dataclasses

import pytest
from elastic_launch.agent.decide import Action, Decision, Happening, Loop, Snapshot, decide
from elastic_launch.api import FailureKind, RestartBudget
from elastic_launch.rendezvous.api import RestartReason

LEFT = RestartBudget(1, 3)  # two restarts left
SPENT = RestartBudget(3, 3)
FAILURE = RestartReason.FAILURE
MEMBERSHIP = RestartReason.MEMBERSHIP
H = Happening

ROWS = [
    # (row, snapshot, decision)
    ("a worker exits 0, others still run", Snapshot(H.EXITED_OK, LEFT), Decision(Action.IGNORE)),
    (
        "the last worker exits 0",
        Snapshot(H.EXITED_OK, LEFT, all_succeeded=True),
        Decision(Action.SUCCEED),
    ),
    (
        "the last loop worker exits 0",
        Snapshot(H.EXITED_OK, LEFT, node_in_loop=True, all_succeeded=True),
        Decision(Action.SUCCEED),
    ),
    (
        "a worker exits 3: the group restarts (the rendezvous spends the budget)",
        Snapshot(H.FAILED, LEFT, failure="rank 1 exit code 3"),
        Decision(Action.RESTART_GROUP, FailureKind.EXIT_CODE, reason=FAILURE),
    ),
    (
        "a worker is killed by a signal, budget spent: still the rendezvous' call",
        Snapshot(H.FAILED, SPENT, signalled=True),
        Decision(Action.RESTART_GROUP, FailureKind.SIGNAL, reason=FAILURE),
    ),
    (
        "a loop worker dies: replaced alone, one restart spent",
        Snapshot(H.FAILED, LEFT, signalled=True, loop=Loop.RUNNING, node_in_loop=True),
        Decision(Action.REPLACE_ONE, FailureKind.SIGNAL, budget=RestartBudget(2, 3)),
    ),
    (
        "a loop worker that never said so dies while its peers run the loop: replaced",
        Snapshot(H.FAILED, LEFT, node_in_loop=True),
        Decision(Action.REPLACE_ONE, FailureKind.EXIT_CODE, budget=RestartBudget(2, 3)),
    ),
    (
        "a loop worker dies with the budget spent: the job fails, saying so",
        Snapshot(
            H.FAILED, SPENT, failure="rank 0 exit code 1", loop=Loop.RUNNING, node_in_loop=True
        ),
        Decision(
            Action.FAIL_JOB,
            FailureKind.EXIT_CODE,
            detail="restarts exhausted (3); rank 0 exit code 1",
        ),
    ),
    (
        "a loop worker dies, --max-restarts spent, the loop's own budget (5) not: replaced",
        Snapshot(H.FAILED, SPENT, loop=Loop.RUNNING, loop_budget=5, node_in_loop=True),
        Decision(Action.REPLACE_ONE, FailureKind.EXIT_CODE, budget=RestartBudget(4, 5)),
    ),
    (
        "a loop worker says its budget is 10^9: it counts up to --loop-max-restarts (4)",
        Snapshot(
            H.FAILED,
            RestartBudget(4, 0),
            failure="rank 1 exit code 1",
            loop=Loop.RUNNING,
            loop_budget=999_999_999,
            loop_cap=4,
            node_in_loop=True,
        ),
        Decision(
            Action.FAIL_JOB,
            FailureKind.EXIT_CODE,
            detail="restarts exhausted (4); rank 1 exit code 1",
        ),
    ),
    (
        "a loop worker dies with both budgets spent: the job fails, naming the larger",
        Snapshot(
            H.FAILED,
            RestartBudget(5, 0),
            failure="rank 2 exit code 1",
            loop=Loop.RUNNING,
            loop_budget=5,
            node_in_loop=True,
        ),
        Decision(
            Action.FAIL_JOB,
            FailureKind.EXIT_CODE,
            detail="restarts exhausted (5); rank 2 exit code 1",
        ),
    ),
    (
        "a loop worker failed for good: the job fails at once, budget or not",
        Snapshot(H.FAILED, LEFT, failure="rank 1 exit code 1", loop=Loop.FATAL, node_in_loop=True),
        Decision(Action.FAIL_JOB, FailureKind.EXIT_CODE, detail="rank 1 exit code 1"),
    ),
    (
        "a worker hangs: the group restarts",
        Snapshot(H.HUNG, LEFT),
        Decision(Action.RESTART_GROUP, FailureKind.HUNG, reason=FAILURE),
    ),
    (
        "a worker broke its heartbeat file: the group restarts, the worker named",
        Snapshot(H.BROKE_HEARTBEAT, LEFT),
        Decision(Action.RESTART_GROUP, FailureKind.HEARTBEAT, reason=FAILURE),
    ),
    (
        "a loop worker broke its heartbeat file: replaced alone",
        Snapshot(H.BROKE_HEARTBEAT, LEFT, loop=Loop.RUNNING, node_in_loop=True),
        Decision(Action.REPLACE_ONE, FailureKind.HEARTBEAT, budget=RestartBudget(2, 3)),
    ),
    (
        "a hung worker inside a collective, not in the loop: the group restarts",
        Snapshot(H.HUNG, LEFT, waits_on_peer=True, spare_seconds=60.0),
        Decision(Action.RESTART_GROUP, FailureKind.HUNG, reason=FAILURE),
    ),
    (
        "a hung loop worker: replaced alone",
        Snapshot(H.HUNG, LEFT, loop=Loop.RUNNING, node_in_loop=True),
        Decision(Action.REPLACE_ONE, FailureKind.HUNG, budget=RestartBudget(2, 3)),
    ),
    (
        "a hung loop worker waiting on a peer: spared, its peer is judged first",
        Snapshot(
            H.HUNG, LEFT, loop=Loop.RUNNING, node_in_loop=True, waits_on_peer=True, spare_seconds=5
        ),
        Decision(Action.SPARE),
    ),
    (
        "a hung loop worker waiting on a peer, with no finite limit: replaced",
        Snapshot(H.HUNG, LEFT, loop=Loop.RUNNING, node_in_loop=True, waits_on_peer=True),
        Decision(Action.REPLACE_ONE, FailureKind.HUNG, budget=RestartBudget(2, 3)),
    ),
    (
        "a spared loop worker found hung again: it waits out its period",
        Snapshot(H.HUNG, LEFT, loop=Loop.RUNNING, node_in_loop=True, spared=True),
        Decision(Action.IGNORE),
    ),
    (
        "a hung loop worker with the budget spent: the job fails",
        Snapshot(H.HUNG, SPENT, failure="rank 2 hung", loop=Loop.RUNNING, node_in_loop=True),
        Decision(Action.FAIL_JOB, FailureKind.HUNG, detail="restarts exhausted (3); rank 2 hung"),
    ),
    (
        "a spared worker still stuck after its period: replaced",
        Snapshot(H.STILL_STUCK, LEFT, loop=Loop.RUNNING, node_in_loop=True),
        Decision(Action.REPLACE_ONE, FailureKind.HUNG, budget=RestartBudget(2, 3)),
    ),
    (
        "a GPU fault: the group restarts",
        Snapshot(H.GPU_FAULT, LEFT),
        Decision(Action.RESTART_GROUP, FailureKind.GPU, reason=FAILURE),
    ),
    (
        "a GPU fault under the loop: the node's round is redone all the same",
        Snapshot(H.GPU_FAULT, LEFT, loop=Loop.RUNNING, node_in_loop=True),
        Decision(Action.RESTART_GROUP, FailureKind.GPU, reason=FAILURE),
    ),
    (
        "an unusable GPU before a start: the job fails",
        Snapshot(H.GPU_UNUSABLE, LEFT, failure="an unusable GPU on n0: rank 0 GPU fault: XID 79"),
        Decision(
            Action.FAIL_JOB,
            FailureKind.GPU,
            detail="an unusable GPU on n0: rank 0 GPU fault: XID 79",
        ),
    ),
    (
        "a worker cannot start: the group restarts",
        Snapshot(H.SPAWN_FAILED, LEFT),
        Decision(Action.RESTART_GROUP, FailureKind.SPAWN, reason=FAILURE),
    ),
    (
        "a replacement cannot start: the job fails",
        Snapshot(
            H.SPAWN_FAILED,
            LEFT,
            failure="a replacement for rank 1 could not start: x",
            replacing=True,
            node_in_loop=True,
        ),
        Decision(
            Action.FAIL_JOB,
            FailureKind.SPAWN,
            detail="a replacement for rank 1 could not start: x",
        ),
    ),
    (
        "nodes came or went: the group restarts without spending a restart",
        Snapshot(H.MEMBERSHIP, SPENT),
        Decision(Action.RESTART_GROUP, reason=MEMBERSHIP),
    ),
    (
        "nodes came or went under the loop: a new round, the workers keep running",
        Snapshot(H.MEMBERSHIP, SPENT, node_in_loop=True),
        Decision(Action.LEAVE_ROUND, reason=MEMBERSHIP),
    ),
    (
        "a failure caused by a member that is gone: a membership restart",
        Snapshot(H.PEERS_LOST, SPENT, node_in_loop=True),
        Decision(Action.RESTART_GROUP, reason=MEMBERSHIP),
    ),
    ("a signal", Snapshot(H.SIGNAL, LEFT), Decision(Action.STOP)),
    ("a signal under the loop", Snapshot(H.SIGNAL, LEFT, node_in_loop=True), Decision(Action.STOP)),
]


@pytest.mark.parametrize(("row", "snapshot", "expected"), ROWS, ids=[r[0] for r in ROWS])
def test_decide(row, snapshot, expected):
    assert decide(snapshot) == expected


def test_every_happening_has_a_row():
    assert {s.happening for _, s, _ in ROWS} == set(Happening)


def test_every_action_is_reached():
    assert {d.action for _, _, d in ROWS} == set(Action)


def test_only_the_actions_that_leave_the_workers_running_keep_the_attempt():
    running = {a for a in Action if not a.ends_attempt}
    assert running == {Action.IGNORE, Action.SPARE, Action.REPLACE_ONE}


def test_a_replacement_never_spends_past_the_budget():
    budget = RestartBudget(0, 2)
    snapshot = Snapshot(H.FAILED, budget, loop=Loop.RUNNING, node_in_loop=True)
    spent = 0
    while (d := decide(snapshot)).action == Action.REPLACE_ONE:
        assert d.budget is not None
        spent += 1
        snapshot = Snapshot(H.FAILED, d.budget, loop=Loop.RUNNING, node_in_loop=True)
    assert spent == 2 and d.action == Action.FAIL_JOB


def test_a_replacement_spends_the_loops_budget_when_it_is_the_larger():
    snapshot = Snapshot(H.FAILED, RestartBudget(0, 0), loop=Loop.RUNNING, node_in_loop=True)
    replaced = 0
    while (d := decide(dataclasses.replace(snapshot, loop_budget=3))).action == Action.REPLACE_ONE:
        assert d.budget is not None
        replaced += 1
        snapshot = dataclasses.replace(snapshot, budget=d.budget)
    assert replaced == 3 and d.detail == "restarts exhausted (3)"
