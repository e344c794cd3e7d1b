"""What happened, as the agent sees it: the next happening of a running attempt, the
:class:`~elastic_launch.agent.decide.Snapshot` a decision reads, and the record of a failure
once the decision has said what failure it is.

This is where the agent reads the world (the watchdog's events, the hang monitor, the heartbeat
slots, a worker's loop file, error file and stacks); the decision itself reads nothing, and
the observer decides nothing: a failure's kind is the decision's.
"""

from __future__ import annotations

import elastic_core

from elastic_launch.agent.decide import Happening, Loop, Snapshot
from elastic_launch.agent.failures import FailureLog
from elastic_launch.agent.hang import HangMonitor, beats_of
from elastic_launch.agent.summary import ended
from elastic_launch.agent.worker import Happened, Worker
from elastic_launch.agent.workers import WorkerGroup
from elastic_launch.api import FailureKind, RestartBudget, WorkerFailure
from elastic_launch.cancel import CancelToken
from elastic_launch.rendezvous.api import RendezvousHandler

NO_STACK = "(no Python stack: the worker did not answer)"
#: How a happening reads in the job's message (FAILED: by how the process ended).
_SAID = {
    Happening.HUNG: "hung",
    Happening.STILL_STUCK: "hung",
    Happening.BROKE_HEARTBEAT: "broke its heartbeat",
    Happening.GPU_FAULT: "GPU fault",
    Happening.GPU_UNUSABLE: "GPU fault",
    Happening.SPAWN_FAILED: "could not start",
}


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
        happened = self.group.next_event(self.config.monitor_interval)
        if happened is not None:
            return self._of_event(happened)
        hung = self._hung_under_auto()
        if hung is not None:
            return hung
        w = self.group.still_stuck()
        if w is not None:
            detail = "still stuck in a collective one hang period after its first finding"
            return Happened(Happening.STILL_STUCK, w, elastic_core.now_ns(), detail)
        return None

    def _of_event(self, h: Happened) -> Happened:
        """A hang, with the evidence: the advice on its limit and the worker's stacks."""
        w = h.worker
        if h.happening != Happening.HUNG or w is None:
            return h
        slot = self.group.beats().get(w.local_rank)
        own = slot.timeout_ms / 1000 if slot is not None else 0.0
        h.detail = f"{h.detail}; {self.hangs.advice(own)}"
        h.stack = self._stack(w)
        return h

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
        """What the decision on `h` reads."""
        w = h.worker
        return Snapshot(
            h.happening,
            budget,
            failure=self._said(h),
            signalled=w is not None and w.signal is not None,
            loop=w.train_loop() if w is not None else Loop.NONE,
            loop_budget=w.loop_budget() if w is not None else 0,
            loop_cap=self.config.loop_max_restarts,
            node_in_loop=self.group.in_train_loop(),
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

    def failure(self, h: Happened, kind: FailureKind) -> WorkerFailure:
        """The record of `h` as the failure the decision said it is: the worker's status, its
        error file and, for a hang, when it last beat."""
        w = h.worker
        if w is None:
            return self.failures.new(kind, h.rank, h.local_rank, detail=h.detail)
        beat = self.group.beats().get(w.local_rank)
        last = beat.last_beat_ns if beat is not None else None
        failure = self.failures.of_worker(w, kind, h.time_ns, h.detail, last)
        failure.stack = h.stack
        return failure

    def _said(self, h: Happened) -> str:
        """The happening in words, for the job's message should the decision end it."""
        if h.happening == Happening.SPAWN_FAILED and h.replacing:
            return f"a replacement for rank {h.rank} could not start: {h.detail}"
        w = h.worker
        if h.happening == Happening.FAILED and w is not None:
            what = ended(w.signal, w.exit_code, h.detail)
        elif h.happening in _SAID:
            what = f"{_SAID[h.happening]}: {h.detail}"
        else:
            return ""
        line = f"rank {w.rank if w is not None else h.rank} {what}"
        if h.happening == Happening.GPU_UNUSABLE:
            return f"an unusable GPU on {self.host}: {line}"
        return line
