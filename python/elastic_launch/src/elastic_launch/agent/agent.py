"""The elastic agent: one per node. A small loop over three steps::

    rendezvous -> attempt (start the workers, watch them) -> finish (stop, then restart or end)

The agent owns no resource: the launcher opens them (log directory, heartbeat table, watchdog,
spawner, rendezvous handler, servers) and hands them over; the worker group owns the workers.
Its life is an :class:`~elastic_launch.api.AgentState`, changed in one place
(:meth:`ElasticAgent._transition`), which also emits the ``state_changed`` event; ``/healthz``
and the failure summary show the same names. The agent never imports torch.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import os
import signal
import socket
import time
from typing import Any

import elastic_core

from elastic_launch.agent.events import Events
from elastic_launch.agent.hang import Beat, HangMonitor
from elastic_launch.agent.summary import describe
from elastic_launch.agent.workers import Finding, SpawnError, Worker, WorkerEvent, WorkerGroup
from elastic_launch.api import (
    AgentState,
    FailureKind,
    LaunchConfig,
    RunResult,
    WorkerFailure,
    WorkerState,
    root_cause,
)
from elastic_launch.cancel import NEVER, CancelToken
from elastic_launch.errors import read_error_file
from elastic_launch.rendezvous.api import (
    CloseReason,
    JobClosed,
    RendezvousClosedError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RestartReason,
)
from elastic_launch.rendezvous.team import FATAL, RUNNING, TeamService

logger = logging.getLogger(__name__)


class Outcome(enum.Enum):
    """How an attempt ended."""

    SUCCEEDED = "succeeded"  # every worker exited with 0
    FAILED = "failed"  # a worker failed (exit, signal, hang, GPU, could not start)
    MEMBERSHIP = "membership"  # nodes came or went
    CANCELLED = "cancelled"  # a signal to the launcher
    UNUSABLE = "unusable"  # a GPU needs a reset: this node cannot go on
    FATAL = "fatal"  # a train-loop worker failed for good, or its replacements ran out


class ElasticAgent:
    """Runs one node's share of a job until it succeeds, fails for good, or is stopped."""

    def __init__(
        self,
        config: LaunchConfig,
        group: WorkerGroup,
        rendezvous: RendezvousHandler,
        events: Events,
        *,
        run_id: str,
        entrypoint: str,
        cancel: CancelToken = NEVER,
        gpu: elastic_core.GpuHealth | None = None,
        log_dir: str | None = None,
        host: str | None = None,
        hangs: HangMonitor | None = None,
        team: TeamService | None = None,
    ) -> None:
        self.config = config
        self.group = group
        self.rdzv = rendezvous
        self.events = events
        self.run_id = run_id
        self.entrypoint = entrypoint
        self.cancel = cancel
        self.gpu = gpu
        self.log_dir = log_dir
        self.host = host or socket.gethostname()
        self.team = team  # the train loop's rendezvous (started when a worker needs it)
        self._state = AgentState.INIT
        self.attempt = -1
        self.restarts = 0  # the job's restarts (its rendezvous counts them) + replacements
        self.replacements = 0  # train-loop workers replaced alone on this node
        self.failures: list[WorkerFailure] = []
        self.hangs = hangs or HangMonitor(
            config.hang_timeout, config.hang_timeout_floor, config.hang_timeout_factor
        )
        self._detected_ns: int | None = None  # when the last attempt's end was seen
        self._restart_reason = RestartReason.START
        self._kept = False  # train-loop workers kept running across a new round of the nodes
        self._fatal = ""  # why the job ends at once (Outcome.FATAL)
        # Train-loop workers found hung while waiting in a collective: local rank -> (pid, its
        # last beat then, when it is judged after all).
        self._spared: dict[int, tuple[int, int, int]] = {}
        self._spare_ns = 0  # how long they are spared

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
        now = elastic_core.now_ns()
        beats = self.group.beats()
        workers = []
        for w in self.group.workers:
            b = beats.get(w.local_rank)
            workers.append(
                {
                    "rank": w.rank,
                    "local_rank": w.local_rank,
                    "pid": w.pid,
                    "state": w.state.value,
                    "running": not w.exited,
                    "exit_code": w.exit_code,
                    "step": b.step if b else None,
                    "seconds_since_beat": (now - b.last_beat_ns) / 1e9
                    if b and b.last_beat_ns
                    else None,
                }
            )
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
            "workers": workers,
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
            outcome = self._resume(info) if self._kept else self._attempt(info)
            step = self._finish(outcome)
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
        except RendezvousError as e:
            if self.cancel.cancelled:
                return self._stopped()
            self._transition(AgentState.FAILED, reason=str(e))
            raise
        except Exception:
            if self.cancel.cancelled:
                return self._stopped()
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
        if self._kept:
            return info  # the same workers go on: neither an attempt nor a restart
        self.attempt += 1
        self.restarts = info.restart_count + self.replacements
        if reason == RestartReason.FAILURE:
            logger.warning(
                "restarting the workers (restart %d of %d) after: %s",
                self.restarts,
                self.config.max_restarts,
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
        return info

    def _attempt(self, info: RendezvousInfo) -> Outcome:
        """Start this node's workers for round `info` and watch them until the attempt ends."""
        self.failures = []
        self.hangs.new_attempt()
        self.group.set_hang_timeout(self.hangs.watchdog_timeout())
        self._transition(AgentState.STARTING, round=info.round)
        t0 = elastic_core.now_ns()
        if self._gpus_unusable(info):
            return Outcome.UNUSABLE
        try:
            self.group.start_all(info, self.attempt, self.restarts)
        except SpawnError as e:
            if self.cancel.cancelled:
                return Outcome.CANCELLED
            self._spawn_failed(e, info.rank_offset + e.local_rank)
            return Outcome.FAILED
        started = elastic_core.now_ns()
        # Asked after the spawns: a zygote found unready or unsafe by the first one is gone.
        forked = self.group.spawner.forks
        self.events.emit(
            "group_started",
            self.attempt,
            workers=len(self.group.workers),
            world_size=info.world_size,
            nodes=info.group_world_size,
            group_rank=info.group_rank,
            restarts=self.restarts,
            spawn_seconds=(started - t0) / 1e9,
            forked=forked,
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
        self._transition(AgentState.RUNNING)
        return self._monitor()

    def _resume(self, info: RendezvousInfo) -> Outcome:
        """A new round of the nodes while this node's train-loop workers keep running: they
        re-form their own group (:mod:`elastic_launch.rendezvous.team`); replacements join
        this round."""
        self._kept = False
        self.group.follow(info)
        self._transition(AgentState.RUNNING, round=info.round, kept=len(self.group.alive()))
        return self._monitor()

    def _in_train_loop(self) -> bool:
        """Whether this node's workers run the train loop (one said so: the script is the
        same for all), so that a dead one is replaced alone."""
        return any(w.train_loop() in (RUNNING, FATAL) for w in self.group.workers)

    def _replace(self, w: Worker, failure: WorkerFailure) -> Outcome | None:
        """A train-loop worker died: start one in its place and leave the others running
        (they roll back and re-form without it, or with its replacement)."""
        if w.train_loop() == FATAL:
            self._fatal = f"rank {w.rank} {describe(failure)}"
            return Outcome.FATAL
        if self.restarts >= self.config.max_restarts:
            self._fatal = (
                f"restarts exhausted ({self.config.max_restarts}); rank {w.rank} "
                f"{describe(failure)}"
            )
            return Outcome.FATAL
        self.restarts += 1
        self.replacements += 1
        logger.warning(
            "replacing rank %d alone (restart %d of %d) after: rank %d %s; the other workers "
            "keep running the train loop",
            w.rank,
            self.restarts,
            self.config.max_restarts,
            w.rank,
            describe(failure),
        )
        t0 = elastic_core.now_ns()
        try:
            new = self.group.replace(w.local_rank)
        except SpawnError as e:
            self._spawn_failed(e, w.rank)
            self._fatal = f"a replacement for rank {w.rank} could not start: {e}"
            return Outcome.FATAL
        # Those spared while waiting for a peer get a full period from now, when that peer
        # (if it was this one) is gone and their collective fails.
        for local_rank, (pid, last, _) in list(self._spared.items()):
            self._spared[local_rank] = (pid, last, elastic_core.now_ns() + self._spare_ns)
        self.events.emit(
            "worker_replaced",
            self.attempt,
            rank=new.rank,
            local_rank=new.local_rank,
            pid=new.pid,
            generation=new.generation,
            restarts=self.restarts,
            spawn_seconds=(elastic_core.now_ns() - t0) / 1e9,
            recovery_seconds=(elastic_core.now_ns() - failure.time_ns) / 1e9,
        )
        return None

    def _spare(self, w: Worker, stack: str) -> bool:
        """A train-loop worker found hung inside a collective waits for a peer: the peer is
        judged first (here or on its node), and its death ends the wait. This one gets one more
        hang period; still stuck after it (:meth:`_check_spared`), it is replaced too."""
        if not _waits_on_peers(stack):
            return False
        beat = self.group.beats().get(w.local_rank)
        limit = self.hangs.limit()
        if beat is not None and beat.timeout_ms:
            limit = beat.timeout_ms / 1000
        if limit == float("inf"):
            return False
        last = beat.last_beat_ns if beat is not None else 0
        self._spare_ns = int(limit * 1e9)
        self._spared[w.local_rank] = (w.pid, last, elastic_core.now_ns() + self._spare_ns)
        logger.warning(
            "rank %d is stuck in a collective: it waits for a peer, which is judged first; it "
            "is replaced only if it is still stuck in %.0f s",
            w.rank,
            limit,
        )
        return True

    def _check_spared(self) -> Outcome | None:
        """Spared workers that beat again are well; those still stuck are replaced."""
        if not self._spared:
            return None
        beats = self.group.beats()
        now = elastic_core.now_ns()
        for local_rank, (pid, last, deadline) in list(self._spared.items()):
            w = self.group.get(local_rank)
            beat = beats.get(local_rank)
            if w is None or w.pid != pid or w.exited or (beat and beat.last_beat_ns != last):
                del self._spared[local_rank]
                continue
            if now < deadline:
                continue
            del self._spared[local_rank]
            self.group.mark_failed(w)
            detail = "still stuck in a collective one hang period after its first finding"
            failure = self._record_failure(
                w, FailureKind.HUNG, WorkerEvent(Finding.HUNG, w, now, detail)
            )
            return self._replace(w, failure)
        return None

    def _monitor(self) -> Outcome:
        ready = False
        while True:
            if self.cancel.cancelled:
                return Outcome.CANCELLED
            if self.rdzv.membership_changed():
                return Outcome.MEMBERSHIP
            event = self.group.next_event(self.config.monitor_interval)
            if event is not None and event.finding == Finding.HUNG:
                slot = self.group.beats().get(event.worker.local_rank)
                own = slot.timeout_ms / 1000 if slot is not None else 0.0
                advice = self.hangs.advice(own)
                event = dataclasses.replace(event, detail=f"{event.detail}; {advice}")
            if event is not None:
                outcome = self._on_event(event)
                if outcome is not None:
                    return outcome
            outcome = self._check_hangs() or self._check_spared()
            if outcome is not None:
                return outcome
            if self.team is not None and self.team.pending and self._in_train_loop():
                self.team.ensure()  # a worker runs the loop: it waits for its rendezvous
            if not ready and self.group.all_beating():
                ready = True
                first = min(w.started_ns for w in self.group.workers)
                self.events.emit(
                    "group_ready", self.attempt, seconds=(elastic_core.now_ns() - first) / 1e9
                )

    def _on_event(self, event: WorkerEvent) -> Outcome | None:
        w = event.worker
        if event.finding == Finding.EXITED:
            if w.exit_code == 0:
                return Outcome.SUCCEEDED if self.group.succeeded else None
            failure = self._record_failure(w, _exit_kind(w), event)
            if self._in_train_loop():  # w among them: a fatal one ends the job
                return self._replace(w, failure)
            return Outcome.FAILED
        if event.finding == Finding.HUNG:
            if w.local_rank in self._spared:
                return None  # spared already: _check_spared judges it
            in_loop = self._in_train_loop()
            # In the loop only this worker is judged: only its stack is asked for.
            only = {w.local_rank} if in_loop else None
            stacks = self.group.dump_stacks(self.config.stack_dump_timeout, only)
            stack = stacks.get(w.local_rank, "(no Python stack: the worker did not answer)")
            if in_loop and self._spare(w, stack):
                return None
            self.group.mark_failed(w)
            failure = self._record_failure(w, FailureKind.HUNG, event)
            failure.stack = stack
            if in_loop:
                return self._replace(w, failure)
            return Outcome.FAILED
        self.group.mark_failed(w)  # its GPU: the node's round is redone (a reset may be due)
        self._record_failure(w, FailureKind.GPU, event)
        return Outcome.FAILED

    def _finish(self, outcome: Outcome) -> RunResult | tuple[RestartReason, str]:
        """End the attempt: the job's result, or why and how to go on."""
        if outcome == Outcome.SUCCEEDED:
            self.group.close()
            values = self.group.return_values()
            self.rdzv.mark_done()
            self._transition(AgentState.SUCCEEDED)
            return self._result(AgentState.SUCCEEDED, values)
        if outcome == Outcome.CANCELLED:
            return self._stopped()
        if outcome == Outcome.FATAL:
            self.rdzv.set_closed(CloseReason.FAILED, self._fatal)
            self._stop_workers(signal.SIGTERM)
            return self._failed(f"the job failed: {self._fatal}")
        if outcome == Outcome.MEMBERSHIP and self._in_train_loop():
            # Nodes came or went: the nodes' round is redone, the train loop's workers keep
            # running and re-form their group by themselves.
            self._kept = True
            self.events.emit(
                "membership_changed", self.attempt, waiting=self.rdzv.num_nodes_waiting()
            )
            self._restart_reason = RestartReason.MEMBERSHIP
            return RestartReason.MEMBERSHIP, ""
        if outcome == Outcome.UNUSABLE:
            detail = f"an unusable GPU on {self.host}: {self._root_line()}"
            self.rdzv.set_closed(CloseReason.FAILED, detail)
            return self._failed(f"the job failed: {detail}")
        self._detected_ns = elastic_core.now_ns()
        if outcome == Outcome.FAILED:
            own = root_cause(self.failures)
            if own is not None:
                self._detected_ns = own.time_ns
        self._transition(AgentState.RESTARTING, outcome=outcome.value)
        self._stop_workers(signal.SIGTERM)
        if self.cancel.cancelled:
            return self._stopped()
        if outcome == Outcome.FAILED:
            lost = self.rdzv.lost_members(self.cancel)
            if not lost:
                self._restart_reason = RestartReason.FAILURE
                return RestartReason.FAILURE, self._root_line()
            logger.warning(
                "node(s) %s left the job (their agent is gone): a membership change, not a "
                "failure of this node's workers",
                ", ".join(lost),
            )
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
        running = {w.local_rank for w in self.group.alive() if w.state == WorkerState.RUNNING}
        stopped = self.group.stop_all(sig, self.config.shutdown_timeout, self.cancel)
        failed = {f.local_rank for f in self.failures}
        for w in stopped:
            if w.local_rank in failed:
                continue
            sent = signal.Signals(sig).name
            how = f"{sent}, then SIGKILL" if w.signal == signal.SIGKILL else sent
            self.failures.append(
                self._failure(
                    FailureKind.STOPPED,
                    w.rank,
                    w.local_rank,
                    w.pid,
                    exit_code=w.exit_code,
                    signal=w.signal,
                    detail=how,
                )
            )
        # A worker that ended on its own just before the stop (its exit was still queued)
        # reports its own status, not "stopped by elasticrun".
        for w in self.group.workers:
            own = w.local_rank in running and w.state == WorkerState.FAILED
            if own and w.local_rank not in failed:
                seen = w.exited_ns or elastic_core.now_ns()
                self._record_failure(w, _exit_kind(w), WorkerEvent(Finding.EXITED, w, seen, ""))
        self.group.close()
        self.events.emit(
            "group_stopped", self.attempt, stop_seconds=(elastic_core.now_ns() - t0) / 1e9
        )

    def _result(
        self, state: AgentState, values: dict[int, Any] | None = None, signal: int | None = None
    ) -> RunResult:
        return RunResult(
            state=state,
            return_values=values or {},
            failures=list(self.failures),
            attempts=self.attempt + 1,
            restarts=self.restarts,
            signal=signal,
            log_dir=self.log_dir,
        )

    # ---- failures ------------------------------------------------------------------------------

    def _root_line(self) -> str:
        f = root_cause(self.failures)
        return f"rank {f.rank} {describe(f)}" if f is not None else "unknown failure"

    def _failure(
        self,
        kind: FailureKind,
        rank: int,
        local_rank: int,
        pid: int = 0,
        time_ns: int | None = None,
        **details: Any,
    ) -> WorkerFailure:
        """A failure of this attempt on this host, seen at `time_ns` (default: now)."""
        now = elastic_core.now_ns()
        seen = now if time_ns is None else time_ns
        return WorkerFailure(
            kind=kind,
            rank=rank,
            local_rank=local_rank,
            pid=pid,
            attempt=self.attempt,
            host=self.host,
            time_ns=seen,
            wall_time=time.time() - (now - seen) / 1e9,
            **details,
        )

    def _record_failure(self, w: Worker, kind: FailureKind, event: WorkerEvent) -> WorkerFailure:
        failure = self._failure(
            kind,
            w.rank,
            w.local_rank,
            w.pid,
            event.time_ns,
            exit_code=w.exit_code,
            signal=w.signal,
            detail=event.detail,
            error_file=w.error_file if os.path.exists(w.error_file) else "",
            stdout_log=w.stdout_log,
            stderr_log=w.stderr_log,
        )
        data = read_error_file(w.error_file)
        if data is not None:
            failure.message = data.message
            failure.traceback = data.traceback
            failure.failed_at_ns = data.monotonic_ns
        if kind == FailureKind.HUNG:
            beat = self.group.beats().get(w.local_rank)
            failure.failed_at_ns = beat.last_beat_ns if beat else None
        detection = (
            max(0.0, (event.time_ns - failure.failed_at_ns) / 1e9) if failure.failed_at_ns else None
        )
        self.failures.append(failure)
        self.events.emit(
            "worker_failed",
            self.attempt,
            rank=w.rank,
            local_rank=w.local_rank,
            kind=kind.value,
            exit_code=w.exit_code,
            signal=w.signal,
            detection_seconds=detection,
            detail=failure.detail,
        )
        return failure

    def _spawn_failed(self, error: SpawnError, rank: int) -> None:
        self.failures.append(
            self._failure(
                FailureKind.SPAWN,
                rank,
                error.local_rank,
                detail=str(error),
            )
        )
        self.events.emit(
            "worker_failed",
            self.attempt,
            local_rank=error.local_rank,
            kind=FailureKind.SPAWN.value,
            detail=str(error),
        )

    def _gpus_unusable(self, info: RendezvousInfo) -> bool:
        """Before (re)starting: a GPU a worker would use is unhealthy (a lost GPU or a
        critical XID needs a reset); starting on it again cannot succeed."""
        if self.gpu is None:
            return False
        reports = {r.device: r for r in self.gpu.check_all(timeout=5.0)}
        for local_rank in range(self.config.nproc_per_node):
            device = self.group.gpu_of(local_rank)
            report = reports.get(device) if device is not None else None
            if report is None or report.state != elastic_core.GpuState.UNHEALTHY:
                continue
            self.failures.append(
                self._failure(
                    FailureKind.GPU,
                    info.rank_offset + local_rank,
                    local_rank,
                    detail=f"before starting attempt {self.attempt}: {report.detail}",
                )
            )
            return True
        return False

    def _check_hangs(self) -> Outcome | None:
        """Under ``--hang-timeout auto``, judge the workers' progress (hang.py)."""
        if not self.hangs.auto:
            return None
        beats = {
            lr: Beat(
                b.step,
                b.last_beat_ns,
                b.timeout_ms / 1000,
                beating=b.state == elastic_core.SlotState.BEATING,
            )
            for lr, b in self.group.beats().items()
        }
        now = elastic_core.now_ns()
        live = [(w.local_rank, w.pid) for w in self.group.alive()]
        for hung in self.hangs.check(live, beats, now):
            w = self.group.get(hung.local_rank)
            if w is not None and hung.local_rank not in self._spared:
                detail = f"{hung.detail}; {self.hangs.advice(0)}"
                return self._on_event(WorkerEvent(Finding.HUNG, w, now, detail))
        return None


def _waits_on_peers(stack: str) -> bool:
    """Whether a worker's Python stack is inside a torch.distributed call (a collective or a
    store wait): blocked by a peer rather than stuck on its own."""
    return "torch/distributed/" in stack


def _finite(x: float) -> float | None:
    """JSON has no infinity: an unlimited value is null."""
    return None if x == float("inf") else x


def _exit_kind(w: Worker) -> FailureKind:
    """How a worker that ended on its own failed: by a signal, or with an exit code."""
    return FailureKind.SIGNAL if w.signal is not None else FailureKind.EXIT_CODE
