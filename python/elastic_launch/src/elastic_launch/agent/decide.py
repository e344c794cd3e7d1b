"""What the agent does about anything that happens to a worker or to the node: one pure function.

The agent turns each happening into a :class:`Snapshot` (its only reads: the worker's loop
file, its stack, the budget) and :func:`decide` returns one :class:`Decision`, which the agent
carries out with one call on the worker group. The whole policy, row by row (each row is a case
of ``tests/launch/agent/test_decide.py``)::

    happening        the node runs the train loop                 otherwise
    ---------------  -------------------------------------------  -----------------------------
    exited 0         SUCCEED once every worker has, else IGNORE   (the same)
    failed           FAIL_JOB if the worker failed for good or     RESTART_GROUP (a failure:
    (exit, signal)   the budget is spent, else REPLACE_ONE         the rendezvous spends the
                                                                  job's budget)
    hung             IGNORE if spared already; SPARE if it waits   RESTART_GROUP (a failure)
                     on a peer and its limit is finite; else as
                     a failure
    still stuck      as a failure (a spared worker that did not    (cannot happen)
                     beat again within its period)
    GPU fault        RESTART_GROUP (a failure: the node's round     RESTART_GROUP (a failure)
                     is redone, a reset may be due)
    GPU unusable     FAIL_JOB (before a start: a reset is needed)  FAIL_JOB
    spawn failed     FAIL_JOB for a replacement; RESTART_GROUP     RESTART_GROUP (a failure)
                     (a failure) at the attempt's start
    membership       LEAVE_ROUND (the workers keep running and     RESTART_GROUP (membership:
                     re-form their own group)                      no restart spent)
    peers lost       RESTART_GROUP (membership: the failure came   (the same)
                     from a node that is gone)
    signal           STOP                                          STOP

A replacement spends one restart of the job's one count, which the rendezvous keeps and spends
for a group restart too; the decision carries the budget it expects after the spend, which the
agent makes through the rendezvous. Its limit for replacements is the larger of
``--max-restarts`` and the loop's own failure budget (``max_failures``, which the worker
reports), so the loop needs no extra flag; what the worker reports counts up to
``--loop-max-restarts`` only (a worker cannot raise its own budget), which is
``--max-restarts`` when the user gave it (the command line sets it so) and 100 otherwise.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

from elastic_launch.api import FailureKind, RestartBudget
from elastic_launch.rendezvous.api import RestartReason


class Happening(str, enum.Enum):
    """What happened to a worker (the first eight) or to the node."""

    EXITED_OK = "exited_ok"  # a worker exited with 0
    FAILED = "failed"  # a worker exited with another code, or was killed by a signal
    HUNG = "hung"  # a worker made no progress for longer than its limit
    STILL_STUCK = "still_stuck"  # a spared worker did not beat again within its period
    BROKE_HEARTBEAT = "broke_heartbeat"  # its heartbeat file was cut, overwritten or replaced
    GPU_FAULT = "gpu_fault"  # the GPU of a running worker became unhealthy
    GPU_UNUSABLE = "gpu_unusable"  # before a start: a GPU a worker would use needs a reset
    SPAWN_FAILED = "spawn_failed"  # a worker could not be started
    MEMBERSHIP = "membership"  # nodes came or went while the workers ran
    PEERS_LOST = "peers_lost"  # after a failure: members of the round are gone
    SIGNAL = "signal"  # the launcher was told to stop


class Loop(str, enum.Enum):
    """What a worker says of the train loop (its loop file)."""

    NONE = ""  # it does not run it (or has not said so yet)
    RUNNING = "running"
    WAITING = "waiting"  # for a round to take it: a hot spare, or a worker between rounds
    FATAL = "fatal"  # it failed for good: a replacement would fail the same way


class Action(str, enum.Enum):
    IGNORE = "ignore"  # nothing to do yet
    SUCCEED = "succeed"  # every worker finished: this node's part of the job succeeded
    SPARE = "spare"  # a loop worker waits on a peer: judge the peer first
    REPLACE_ONE = "replace_one"  # start one worker in the place of a dead one; the rest run on
    RESTART_GROUP = "restart_group"  # stop every worker, then a new round of the nodes
    LEAVE_ROUND = "leave_round"  # a new round of the nodes; the loop's workers keep running
    FAIL_JOB = "fail_job"  # close the job as failed
    STOP = "stop"  # stop the workers with the launcher's signal, and end

    @property
    def ends_attempt(self) -> bool:
        """Whether the attempt is over (the others are carried out while it runs)."""
        return self not in (Action.IGNORE, Action.SPARE, Action.REPLACE_ONE)


@dataclass(frozen=True)
class Snapshot:
    """Everything the decision reads, gathered by the agent at the moment it is taken."""

    happening: Happening
    budget: RestartBudget
    failure: str = ""  # the failure in words ("rank 1 exit code 3"), for the job's message
    signalled: bool = False  # FAILED: killed by a signal, not an exit code
    loop: Loop = Loop.NONE  # what the worker said of the train loop
    loop_budget: int = 0  # the loop's failure budget, as the worker said it (0: not said)
    loop_cap: int = 100  # the most restarts a loop's budget may give (--loop-max-restarts)
    node_in_loop: bool = False  # a worker of this node runs the train loop (or failed in it)
    all_succeeded: bool = False  # EXITED_OK: every worker of the attempt exited with 0
    spared: bool = False  # HUNG: the worker is spared already (its peer is being judged)
    waits_on_peer: bool = False  # HUNG: its stack is inside torch.distributed
    spare_seconds: float = float("inf")  # HUNG: how long a spare would wait (inf: cannot)
    replacing: bool = False  # SPAWN_FAILED: a replacement, not the attempt's start


@dataclass(frozen=True)
class Decision:
    action: Action
    failure: FailureKind | None = None  # the failure to record before acting, if any
    reason: RestartReason | None = None  # RESTART_GROUP, LEAVE_ROUND: the next round's reason
    detail: str = ""  # FAIL_JOB: why the job fails
    budget: RestartBudget | None = None  # REPLACE_ONE: the budget once it is spent


def decide(s: Snapshot) -> Decision:
    """The one action for `s` (see the module's table)."""
    return _RULES[s.happening](s)


def _stop(s: Snapshot) -> Decision:
    return Decision(Action.STOP)


def _exited_ok(s: Snapshot) -> Decision:
    return Decision(Action.SUCCEED if s.all_succeeded else Action.IGNORE)


def _membership(s: Snapshot) -> Decision:
    """Nodes came or went (or a failure came from a member that is gone): free of budget."""
    keep = s.happening == Happening.MEMBERSHIP and s.node_in_loop
    action = Action.LEAVE_ROUND if keep else Action.RESTART_GROUP
    return Decision(action, reason=RestartReason.MEMBERSHIP)


def _gpu_unusable(s: Snapshot) -> Decision:
    return Decision(Action.FAIL_JOB, FailureKind.GPU, detail=s.failure)


def _gpu_fault(s: Snapshot) -> Decision:
    return _restart(FailureKind.GPU)


def _spawn_failed(s: Snapshot) -> Decision:
    if s.replacing:
        return Decision(Action.FAIL_JOB, FailureKind.SPAWN, detail=s.failure)
    return _restart(FailureKind.SPAWN)


def _worker_failed(s: Snapshot) -> Decision:
    """A worker exited with an error, was killed, or hung (or stays stuck after its spare)."""
    kind = _kind(s)
    if not s.node_in_loop:
        return _restart(kind)
    if s.happening == Happening.HUNG and s.spared:
        return Decision(Action.IGNORE)
    if s.happening == Happening.HUNG and s.waits_on_peer and s.spare_seconds != float("inf"):
        return Decision(Action.SPARE)
    return _replace(s, kind)


_RULES: dict[Happening, Callable[[Snapshot], Decision]] = {
    Happening.SIGNAL: _stop,
    Happening.EXITED_OK: _exited_ok,
    Happening.MEMBERSHIP: _membership,
    Happening.PEERS_LOST: _membership,
    Happening.GPU_UNUSABLE: _gpu_unusable,
    Happening.GPU_FAULT: _gpu_fault,
    Happening.SPAWN_FAILED: _spawn_failed,
    Happening.FAILED: _worker_failed,
    Happening.HUNG: _worker_failed,
    Happening.STILL_STUCK: _worker_failed,
    Happening.BROKE_HEARTBEAT: _worker_failed,
}
assert set(_RULES) == set(Happening)


def _kind(s: Snapshot) -> FailureKind:
    """How the worker of a FAILED, HUNG, STILL_STUCK or BROKE_HEARTBEAT snapshot failed."""
    if s.happening == Happening.FAILED:
        return FailureKind.of_end(s.signalled)
    if s.happening == Happening.BROKE_HEARTBEAT:
        return FailureKind.HEARTBEAT
    return FailureKind.HUNG


def _restart(kind: FailureKind) -> Decision:
    return Decision(Action.RESTART_GROUP, kind, reason=RestartReason.FAILURE)


def _replace(s: Snapshot, kind: FailureKind) -> Decision:
    """A train-loop worker failed: replaced alone while the budget lasts."""
    if s.loop == Loop.FATAL:
        return Decision(Action.FAIL_JOB, kind, detail=s.failure)
    budget = s.budget.at_least(min(s.loop_budget, s.loop_cap))
    spent = budget.spend()
    if spent is None:
        return Decision(Action.FAIL_JOB, kind, detail=budget.exhausted(s.failure))
    return Decision(Action.REPLACE_ONE, kind, budget=spent)
