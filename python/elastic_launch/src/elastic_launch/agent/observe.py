"""What happened, as the agent sees it: the next happening of a running attempt, and the
:class:`~elastic_launch.agent.decide.Snapshot` a decision reads.

This is where the agent reads the world (the watchdog's events, the hang monitor, the heartbeat
slots, a worker's loop file and stacks, NVML before a start); the decision itself reads nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import elastic_core

from elastic_launch.agent.decide import Happening, Loop, Snapshot
from elastic_launch.agent.failures import FailureLog
from elastic_launch.agent.hang import HangMonitor, beats_of
from elastic_launch.agent.summary import describe
from elastic_launch.agent.worker import Finding, Worker, WorkerEvent
from elastic_launch.agent.workers import WorkerGroup
from elastic_launch.api import FailureKind, RestartBudget, WorkerFailure
from elastic_launch.cancel import CancelToken
from elastic_launch.rendezvous.api import RendezvousHandler

#: The failure a happening is, for its record and the job's message (FAILED: by its status).
_KINDS = {
    Happening.HUNG: FailureKind.HUNG,
    Happening.STILL_STUCK: FailureKind.HUNG,
    Happening.GPU_FAULT: FailureKind.GPU,
    Happening.GPU_UNUSABLE: FailureKind.GPU,
    Happening.SPAWN_FAILED: FailureKind.SPAWN,
}
NO_STACK = "(no Python stack: the worker did not answer)"


@dataclass
class Happened:
    """Something that happened: the inputs of one decision."""

    happening: Happening
    worker: Worker | None = None
    time_ns: int = 0
    detail: str = ""
    rank: int = -1  # without a worker (a spawn failure, an unusable GPU)
    local_rank: int = -1
    replacing: bool = False  # SPAWN_FAILED: a replacement's
    stack: str = ""  # HUNG: the worker's Python stacks
    failure: WorkerFailure | None = None  # what it is as a failure, set by the snapshot


class Observer:
    """Reads what happens to one node's workers (see the module's docstring)."""

    def __init__(
        self,
        group: WorkerGroup,
        rendezvous: RendezvousHandler,
        cancel: CancelToken,
        hangs: HangMonitor,
        failures: FailureLog,
    ) -> None:
        self.config = group.config
        self.group = group
        self.rdzv = rendezvous
        self.cancel = cancel
        self.hangs = hangs
        self.failures = failures
        self.host = group.host

    # ---- what happened ---------------------------------------------------------------------

    def next(self) -> Happened | None:
        """The next thing to decide on, if any comes within the monitor interval."""
        if self.cancel.cancelled:
            return Happened(Happening.SIGNAL)
        if self.rdzv.membership_changed():
            return Happened(Happening.MEMBERSHIP)
        event = self.group.next_event(self.config.monitor_interval)
        if event is not None:
            return self._of_event(event)
        hung = self._hung_under_auto()
        if hung is not None:
            return hung
        w = self.group.still_stuck()
        if w is not None:
            detail = "still stuck in a collective one hang period after its first finding"
            return Happened(Happening.STILL_STUCK, w, elastic_core.now_ns(), detail)
        return None

    def _of_event(self, event: WorkerEvent) -> Happened:
        w = event.worker
        if event.finding == Finding.EXITED:
            happening = Happening.EXITED_OK if w.exit_code == 0 else Happening.FAILED
            return Happened(happening, w, event.time_ns, event.detail)
        if event.finding == Finding.GPU:
            return Happened(Happening.GPU_FAULT, w, event.time_ns, event.detail)
        slot = self.group.beats().get(w.local_rank)
        own = slot.timeout_ms / 1000 if slot is not None else 0.0
        detail = f"{event.detail}; {self.hangs.advice(own)}"
        return Happened(Happening.HUNG, w, event.time_ns, detail, stack=self._stack(w))

    def _hung_under_auto(self) -> Happened | None:
        """Under ``--hang-timeout auto``, the worker the hang monitor judges hung."""
        if not self.hangs.auto:
            return None
        now = elastic_core.now_ns()
        live = [(w.local_rank, w.pid) for w in self.group.alive()]
        for hung in self.hangs.check(live, beats_of(self.group.beats()), now):
            w = self.group.get(hung.local_rank)
            if w is not None and w.spared_until_ns is None:
                detail = f"{hung.detail}; {self.hangs.advice(0)}"
                return Happened(Happening.HUNG, w, now, detail, stack=self._stack(w))
        return None

    def _stack(self, w: Worker) -> str:
        """A hung worker's Python stacks (in the train loop only its own are asked for: the
        others run on); none for a spared one, which is judged later."""
        if w.spared_until_ns is not None:
            return ""
        only = {w.local_rank} if self.group.in_train_loop() else None
        stacks = self.group.dump_stacks(self.config.stack_dump_timeout, only)
        return stacks.get(w.local_rank, NO_STACK)

    # ---- the snapshot ------------------------------------------------------------------------

    def snapshot(self, h: Happened, budget: RestartBudget) -> Snapshot:
        """What the decision on `h` reads; `h.failure` is built (not recorded)."""
        w = h.worker
        in_loop = self.group.in_train_loop()
        h.failure = self._failure_of(h)
        return Snapshot(
            h.happening,
            budget,
            failure=self._failure_text(h),
            signalled=w is not None and w.signal is not None,
            loop=w.train_loop() if w is not None else Loop.NONE,
            loop_budget=w.loop_budget() if w is not None else 0,
            loop_cap=self.config.loop_max_restarts,
            node_in_loop=in_loop,
            all_succeeded=self.group.succeeded,
            spared=w is not None and w.spared_until_ns is not None,
            waits_on_peer="torch/distributed/" in h.stack,
            spare_seconds=self.spare_seconds(w) if w is not None else float("inf"),
            replacing=h.replacing,
        )

    def spare_seconds(self, w: Worker) -> float:
        """How long a spared worker waits for its peer: its own limit, or the agent's."""
        beat = self.group.beats().get(w.local_rank)
        if beat is not None and beat.timeout_ms:
            return beat.timeout_ms / 1000
        return self.hangs.limit()

    def _failure_of(self, h: Happened) -> WorkerFailure | None:
        kind = _KINDS.get(h.happening)
        w = h.worker
        if h.happening == Happening.FAILED and w is not None:
            kind = FailureKind.SIGNAL if w.signal is not None else FailureKind.EXIT_CODE
        if kind is None:
            return None
        if w is None:
            return self.failures.new(kind, h.rank, h.local_rank, detail=h.detail)
        beat = self.group.beats().get(w.local_rank)
        last = beat.last_beat_ns if beat is not None else None
        failure = self.failures.of_worker(w, kind, h.time_ns, h.detail, last)
        failure.stack = h.stack
        return failure

    def _failure_text(self, h: Happened) -> str:
        """The failure in words, for the job's message should the decision end it."""
        if h.happening == Happening.SPAWN_FAILED and h.replacing:
            return f"a replacement for rank {h.rank} could not start: {h.detail}"
        f = h.failure
        line = f"rank {f.rank} {describe(f)}" if f is not None else ""
        if h.happening == Happening.GPU_UNUSABLE:
            return f"an unusable GPU on {self.host}: {line}"
        return line
