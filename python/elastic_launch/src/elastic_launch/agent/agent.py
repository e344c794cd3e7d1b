"""The elastic agent: one per node. A small loop over three steps::

    rendezvous -> attempt (start the workers, watch them) -> end the attempt (restart or end)

Whatever happens while the workers run (an exit, a hang, a GPU fault, a membership change, a
signal) becomes a :class:`~elastic_launch.agent.decide.Snapshot`, and the pure
:func:`~elastic_launch.agent.decide.decide` says what to do; the agent only carries it out, with
one call on the worker group.

The agent owns no resource: the launcher opens them (log directory, heartbeat table, watchdog,
spawner, rendezvous handler, servers) and hands them over; the worker group owns the workers.
Its life is an :class:`~elastic_launch.api.AgentState`, changed in one place
(:meth:`ElasticAgent._transition`), which also emits the ``state_changed`` event; ``/healthz``
and the failure summary show the same names. The agent never imports torch.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import time
from typing import Any

import elastic_core

from elastic_launch.agent.decide import Action, Decision, Happening, Loop, Snapshot, decide
from elastic_launch.agent.events import Events
from elastic_launch.agent.failures import FailureLog
from elastic_launch.agent.hang import HangMonitor
from elastic_launch.agent.learning import Learning
from elastic_launch.agent.observe import Observer
from elastic_launch.agent.spares import HotSpares, emit_replaced
from elastic_launch.agent.summary import describe, who
from elastic_launch.agent.worker import Happened, SpawnError, UnusableGpu, Worker
from elastic_launch.agent.workers import WorkerGroup
from elastic_launch.api import (
    AgentState,
    Cancelled,
    FailureKind,
    RestartBudget,
    RunResult,
    WorkerFailure,
)
from elastic_launch.cancel import NEVER, CancelToken
from elastic_launch.rendezvous.api import (
    CloseReason,
    JobClosed,
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RestartReason,
)
from elastic_launch.rendezvous.team import TeamService

logger = logging.getLogger(__name__)

#: Seconds to wait for the signal relay to cancel the token after a handler raised Cancelled
#: (it does so at once; the bound is for a relay that is gone).
RELAY_WAIT = 5.0


class ElasticAgent:
    """Runs one node's share of a job until it succeeds, fails for good, or is stopped."""

    def __init__(
        self,
        group: WorkerGroup,
        rendezvous: RendezvousHandler,
        events: Events,
        cancel: CancelToken = NEVER,
        team: TeamService | None = None,
        hangs: HangMonitor | None = None,
    ) -> None:
        context = group.context
        self.config = config = context.config
        self.group = group
        self.rdzv = rendezvous
        self.events = events
        self.run_id = context.run_id
        self.entrypoint = context.entrypoint.name
        self.cancel = cancel
        self.log_dir = context.log_dir
        self.host = group.host
        self.team = team  # the train loop's rendezvous (started when a worker needs it)
        self._state = AgentState.INIT
        self.attempt = -1
        self.restarts = 0  # the job's restarts, as its rendezvous (their one count) said last
        self.failures = FailureLog(events, self.host)
        self.hangs = hangs or HangMonitor(
            config.hang_timeout, config.hang_timeout_floor, config.hang_timeout_factor
        )
        self._detected_ns: int | None = None  # when the last attempt's end was seen
        self._restart_reason = RestartReason.START
        self._kept = False  # train-loop workers kept running across a new round of the nodes
        self._failure: WorkerFailure | None = None  # what the last decision recorded
        self.spares = HotSpares(group, events, config.hot_spares)
        self.learning = Learning(group, events)
        self.observer = Observer(group, rendezvous, cancel, self.hangs, self.failures)

    # ---- state -----------------------------------------------------------------------------

    @property
    def state(self) -> AgentState:
        return self._state

    def _transition(self, new: AgentState, **data: Any) -> None:
        """The one place the state changes; emits ``state_changed`` (and ``job_<state>`` for
        the final states)."""
        previous, self._state = self._state, new
        self.events.emit(
            "state_changed", self.attempt, state=new.value, previous=previous.value, **data
        )
        if new.terminal:
            self.events.emit(f"job_{new.value}", self.attempt, restarts=self.restarts, **data)

    def health(self) -> dict[str, Any]:
        """What ``/healthz`` serves."""
        counters = self.rdzv.counters()
        return {
            "state": self._state.value,
            "healthy": self._state.healthy,
            "run_id": self.run_id,
            "host": self.host,
            "attempt": self.attempt,
            "restarts": self.restarts,
            "max_restarts": self.config.max_restarts,
            "hang_timeout": _finite(self.hangs.limit()),
            "hang_detection": "auto" if self.hangs.auto else "fixed",
            "rendezvous": {"phase": counters.phase, "rounds": counters.rounds},
            "workers": self.group.health(),
        }

    # ---- the loop ----------------------------------------------------------------------------

    def run(self) -> RunResult:
        self.events.emit(
            "job_started",
            self.attempt,
            min_nodes=self.config.min_nodes,
            max_nodes=self.config.max_nodes,
            nproc_per_node=self.config.nproc_per_node,
            entrypoint=self.entrypoint,
            host=self.host,
            log_dir=self.log_dir,
        )
        reason, failure = RestartReason.START, ""
        while True:
            info = self._rendezvous(reason, failure)
            if isinstance(info, RunResult):
                return info
            decision = self._resume(info) if self._kept else self._attempt(info)
            step = self._end_attempt(decision)
            if isinstance(step, RunResult):
                return step
            reason, failure = step

    def _rendezvous(self, reason: RestartReason, failure: str) -> RendezvousInfo | RunResult:
        self._transition(AgentState.RENDEZVOUS, reason=reason.value)
        joined_at = time.time()
        try:
            info = self.rdzv.next_rendezvous(reason, cancel=self.cancel, failure=failure)
        except RendezvousClosedError as e:
            return self._closed(e.closed)
        except Exception as e:
            # A signal in a handler that takes no token (torch's) raised Cancelled at once:
            # the relay thread cancels the token a moment later, with the signal's number.
            if isinstance(e, Cancelled):
                self.cancel.wait(RELAY_WAIT)
            if self.cancel.cancelled:
                return self._stopped()
            if isinstance(e, RendezvousError):
                self._transition(AgentState.FAILED, reason=str(e))
            raise
        counters = self.rdzv.counters()
        self.events.emit(
            "rendezvous_done",
            self.attempt + 1,
            round=info.round,
            nodes=info.group_world_size,
            group_rank=info.group_rank,
            joined_at=joined_at,
            formed_at=time.time(),
            store_requests=counters.store_requests,
        )
        self.restarts = info.restart_count
        if self._kept:
            return info  # the same workers go on: neither an attempt nor a restart
        self.attempt += 1
        _log_restart(reason, failure, info, self.restarts, self.config.max_restarts)
        return info

    def _attempt(self, info: RendezvousInfo) -> Decision:
        """Start this node's workers for round `info` and watch them until a decision ends the
        attempt."""
        self.failures.new_attempt(self.attempt)
        self.hangs.new_attempt()
        self.spares.new_attempt()
        self.group.set_hang_timeout(self.hangs.watchdog_timeout())
        self._transition(AgentState.STARTING, round=info.round)
        t0 = elastic_core.now_ns()
        try:
            self.group.start_all(info, self.attempt, self.restarts)
        except (SpawnError, UnusableGpu) as e:
            if self.cancel.cancelled:  # the spawn was cut short by the signal
                return self._decide(Happened(Happening.SIGNAL))
            spawn = isinstance(e, SpawnError)
            happening = Happening.SPAWN_FAILED if spawn else Happening.GPU_UNUSABLE
            rank = info.rank_offset + e.local_rank
            return self._decide(Happened(happening, None, 0, str(e), rank, e.local_rank))
        self._started(info, t0)
        self._transition(AgentState.RUNNING)
        return self._watch()

    def _started(self, info: RendezvousInfo, t0: int) -> None:
        started = elastic_core.now_ns()
        self.events.emit(
            "group_started",
            self.attempt,
            workers=len(self.group.workers),
            world_size=info.world_size,
            nodes=info.group_world_size,
            group_rank=info.group_rank,
            restarts=self.restarts,
            spawn_seconds=(started - t0) / 1e9,
            # Asked after the spawns: a zygote found unready or unsafe by the first one is gone.
            forked=self.group.spawner.forks,
            spawner=self.group.spawner.name,
        )
        if self._detected_ns is not None:
            self.events.emit(
                "group_restarted",
                self.attempt,
                restarts=self.restarts,
                reason=self._restart_reason.value,
                recovery_seconds=(started - self._detected_ns) / 1e9,
            )

    def _resume(self, info: RendezvousInfo) -> Decision:
        """A new round of the nodes while this node's train-loop workers keep running: they
        re-form their own group (:mod:`elastic_launch.rendezvous.team`); replacements join
        this round."""
        self._kept = False
        self.group.follow(info)
        self._transition(AgentState.RUNNING, round=info.round, kept=len(self.group.alive()))
        return self._watch()

    def _watch(self) -> Decision:
        """Decide on each happening until a decision ends the attempt; carry out the others
        (ignore, spare, replace one) while the workers run."""
        ready = False
        while True:
            happened = self.observer.next()
            if happened is not None:
                decision = self._decide(happened)
                if decision.action.ends_attempt:
                    return decision
                ended = self._carry_out(decision, happened)
                if ended is not None:
                    return ended
            if self.team is not None and self.team.pending and self.group.in_train_loop():
                self.team.ensure()  # a worker runs the loop: it waits for its rendezvous
            if not ready and self.group.all_beating():
                ready = True
                first = min(w.started_ns for w in self.group.workers)
                self.events.emit(
                    "group_ready", self.attempt, seconds=(elastic_core.now_ns() - first) / 1e9
                )
            if ready and self.spares.due():
                self.spares.start(self.attempt)
            self.learning.poll(self.attempt)

    # ---- deciding --------------------------------------------------------------------------------

    def _decide(self, h: Happened) -> Decision:
        """Decide on `h`, and record the failure the decision acts on, as the kind it says
        (:attr:`_failure`)."""
        decision = decide(self.observer.snapshot(h, self._budget()))
        self._failure = None
        if decision.failure is not None:
            if h.worker is not None:
                self.group.mark_failed(h.worker)
            self._failure = self.observer.failure(h, decision.failure)
            self.failures.record(self._failure)
        return decision

    def _budget(self) -> RestartBudget:
        return RestartBudget(self.restarts, self.config.max_restarts)

    # ---- carrying out --------------------------------------------------------------------------

    def _carry_out(self, decision: Decision, h: Happened) -> Decision | None:
        """Carry out a decision that leaves the attempt running; a decision that ends it after
        all (a replacement that could not start) is returned."""
        w = h.worker
        if decision.action == Action.SPARE and w is not None:
            seconds = self.observer.spare_seconds(w)
            self.group.spare(w.local_rank, seconds)
            logger.warning(
                "rank %d is stuck in a collective: it waits for a peer, which is judged first; "
                "it is replaced only if it is still stuck in %.0f s",
                w.rank,
                seconds,
            )
        elif decision.action == Action.REPLACE_ONE and w is not None:
            assert decision.budget is not None
            assert self._failure is not None
            return self._replace(w, self._failure, decision.budget)
        return None

    def _replace(self, w: Worker, failure: WorkerFailure, budget: RestartBudget) -> Decision | None:
        """A train-loop worker died: spend one of the job's restarts (the rendezvous keeps the
        count), start one in its place and leave the others running (they roll back and
        re-form without it, or with its replacement)."""
        what = f"{who(failure.rank)} {describe(failure)}"
        try:
            spent = self.rdzv.spend_restart(budget.limit, self.cancel)
        except Cancelled:
            return Decision(Action.STOP)
        except RendezvousError as e:
            return Decision(Action.FAIL_JOB, detail=f"{what}; its restart was not counted: {e}")
        if spent is None:  # other nodes spent the rest meanwhile
            exhausted = RestartBudget(budget.limit, budget.limit).exhausted(what)
            return Decision(Action.FAIL_JOB, detail=exhausted)
        self.restarts = spent.spent
        waited = w.hot_spare and w.train_loop() == Loop.WAITING  # no place of its own
        spares = self.spares.free(w)
        _log_replace(w, failure, f"restart {self.restarts} of {budget.limit}", waited, spares)
        if spares and not waited:  # it takes the place; the one behind starts once it trains
            taker = spares[0].local_rank
            self.spares.leave_place(w.local_rank, failure.time_ns, self.restarts, taker)
            return None
        t0 = elastic_core.now_ns()
        try:
            new = self.group.replace(w.local_rank, hot_spare=w.hot_spare)
        except SpawnError as e:
            spawn = Happened(Happening.SPAWN_FAILED, detail=str(e), rank=w.rank, replacing=True)
            return self._decide(dataclasses.replace(spawn, local_rank=w.local_rank))
        emit_replaced(self.events, self.attempt, new, self.restarts, t0, failure.time_ns)
        return None

    def _end_attempt(self, decision: Decision) -> RunResult | tuple[RestartReason, str]:
        """Carry out a decision that ends the attempt: the job's result, or why to go on."""
        action = decision.action
        if action == Action.SUCCEED:
            values = self.group.finish()
            self.rdzv.mark_done()
            self._transition(AgentState.SUCCEEDED)
            return self._result(AgentState.SUCCEEDED, values)
        if action == Action.STOP:
            return self._stopped()
        if action == Action.FAIL_JOB:
            self.rdzv.set_closed(CloseReason.FAILED, decision.detail)
            if self.group.alive():
                self._stop_workers(signal.SIGTERM)
            return self._failed(f"the job failed: {decision.detail}")
        if action == Action.LEAVE_ROUND:
            # The nodes' round is redone; the train loop's workers keep running and re-form
            # their group by themselves.
            self._kept = True
            return self._membership()
        return self._restart(decision)

    def _restart(self, decision: Decision) -> RunResult | tuple[RestartReason, str]:
        """RESTART_GROUP: stop every worker, then ask for a new round. A failure whose cause is
        a member gone from the round is a membership change (``lost_members``)."""
        self._detected_ns = elastic_core.now_ns()
        if decision.reason == RestartReason.FAILURE:
            self._detected_ns = self.failures.root_time_ns() or self._detected_ns
        assert decision.reason is not None
        self._transition(AgentState.RESTARTING, reason=decision.reason.value)
        self._stop_workers(signal.SIGTERM)
        if self.cancel.cancelled:
            return self._stopped()
        failed = decision.reason == RestartReason.FAILURE
        lost = self.rdzv.lost_members(self.cancel) if failed else []
        if lost:
            logger.warning(
                "node(s) %s left the job (their agent is gone): a membership change, not a "
                "failure of this node's workers",
                ", ".join(lost),
            )
            decision = decide(Snapshot(Happening.PEERS_LOST, self._budget()))
        if decision.reason == RestartReason.FAILURE:
            self._restart_reason = RestartReason.FAILURE
            return RestartReason.FAILURE, self.failures.root_line()
        return self._membership()

    def _membership(self) -> tuple[RestartReason, str]:
        self.events.emit("membership_changed", self.attempt, waiting=self.rdzv.num_nodes_waiting())
        self._restart_reason = RestartReason.MEMBERSHIP
        return RestartReason.MEMBERSHIP, ""

    # ---- endings -------------------------------------------------------------------------------

    def _stopped(self) -> RunResult:
        """A signal: stop the workers with it (a second one skips the grace period)."""
        sig = self.cancel.signum or signal.SIGTERM
        self._transition(AgentState.STOPPING, signal=sig)
        self._stop_workers(sig)
        self._transition(AgentState.STOPPED, signal=sig)
        return self._result(AgentState.STOPPED, signal=sig)

    def _closed(self, closed: JobClosed) -> RunResult:
        """The job was closed (by another node, or by the budget): end as it says. Train-loop
        workers kept across the nodes' round are stopped with the grace period first."""
        if self.group.alive():
            self._stop_workers(signal.SIGTERM)
        if closed.reason == CloseReason.SUCCEEDED:
            self._transition(AgentState.SUCCEEDED, reason=str(closed))
            return self._result(AgentState.SUCCEEDED)
        return self._failed(
            f"the job {closed}" if closed.detail else f"the job was closed: {closed}"
        )

    def _failed(self, message: str) -> RunResult:
        self._transition(AgentState.FAILED, reason=message)
        return dataclasses.replace(self._result(AgentState.FAILED), message=message)

    def _stop_workers(self, sig: int) -> None:
        t0 = elastic_core.now_ns()
        report = self.group.stop_all(sig, self.config.shutdown_timeout, self.cancel)
        recorded = self.failures.ranks
        for w in report.stopped:
            if w.local_rank not in recorded:
                self.failures.stopped(w, sig)
        # A worker that ended on its own just before the stop reports its own status, not
        # "stopped by elasticrun".
        for w in report.ended:
            if w.local_rank not in recorded:
                seen = w.exited_ns or elastic_core.now_ns()
                kind = FailureKind.of_end(w.signal is not None)
                self.failures.record(self.failures.of_worker(w, kind, seen, ""))
        self.events.emit(
            "group_stopped", self.attempt, stop_seconds=(elastic_core.now_ns() - t0) / 1e9
        )

    def _result(
        self, state: AgentState, values: dict[int, Any] | None = None, signal: int | None = None
    ) -> RunResult:
        return RunResult(
            state=state,
            return_values=values or {},
            failures=list(self.failures.all),
            attempts=self.attempt + 1,
            restarts=self.restarts,
            signal=signal,
            log_dir=self.log_dir,
        )


def _log_restart(
    reason: RestartReason, failure: str, info: RendezvousInfo, restarts: int, limit: int
) -> None:
    if reason == RestartReason.FAILURE:
        # A framework's SIGTERM handler (Lightning's, a DataLoader's) prints a traceback as
        # the other workers stop: the line that follows says which one is the cause.
        logger.warning(
            "restarting the workers (restart %d of %d) after: %s; a traceback a worker printed "
            "as the launcher stopped it (SIGTERM) is its stop, not the cause",
            restarts,
            limit,
            failure,
        )
    elif reason == RestartReason.MEMBERSHIP:
        logger.warning(
            "restarting the workers: the job now has %d node(s), %d worker(s); this node "
            "is group rank %d",
            info.group_world_size,
            info.world_size,
            info.group_rank,
        )


def _log_replace(
    w: Worker, failure: WorkerFailure, count: str, waited: bool, spares: list[Worker]
) -> None:
    """Say which worker is replaced (a spare that `waited` for a round, or one that trained)
    and what takes its place in the train loop: the first of `spares`, or a new process."""
    if waited:
        logger.warning(
            "replacing a hot spare (local rank %d, pid %d) that ended while it waited (%s): "
            "%s; the training workers are not touched",
            w.local_rank,
            w.pid,
            count,
            describe(failure),
        )
        return
    then = (
        f"hot spare pid {spares[0].pid} takes its place at the next round, and a new spare "
        "starts behind it once the group has made a step"
        if spares
        else "the other workers keep running the train loop"
    )
    # A spare a round took has the loop's rank, which the launcher is not told.
    name = who(w.rank) if w.rank >= 0 else f"a hot spare a round had taken (pid {w.pid})"
    logger.warning(
        "replacing %s alone (%s) after: %s %s; %s",
        name,
        count,
        who(w.rank),
        describe(failure),
        then,
    )


def _finite(x: float) -> float | None:
    """JSON has no infinity: an unlimited value is null."""
    return None if x == float("inf") else x
