"""This attempt's failures on this node: what the summary, ``RunResult.failures`` and the
``worker_failed`` events say.

A failure is built from what the watchdog saw (when, the exit status), the worker's error file
(its exception and traceback) and, for a hang, its last beat; it is recorded (kept, and emitted
as an event) only once the agent has decided to act on it.
"""

from __future__ import annotations

import os
import signal
import time
from typing import TYPE_CHECKING, Any

import elastic_core

from elastic_launch.agent.summary import describe
from elastic_launch.api import FailureKind, WorkerFailure, root_cause
from elastic_launch.errors import read_error_file

if TYPE_CHECKING:
    from elastic_launch.agent.events import Events
    from elastic_launch.agent.worker import Worker


class FailureLog:
    """The failures of the current attempt (``attempt`` is set by :meth:`new_attempt`)."""

    def __init__(self, events: Events, host: str) -> None:
        self.events = events
        self.host = host
        self.attempt = -1
        self.all: list[WorkerFailure] = []

    def new_attempt(self, attempt: int) -> None:
        self.attempt = attempt
        self.all = []

    @property
    def ranks(self) -> set[int]:
        """The local ranks that have a failure recorded."""
        return {f.local_rank for f in self.all}

    def root_line(self) -> str:
        """The root cause in one line (``rank 1 exit code 3``)."""
        f = root_cause(self.all)
        return f"rank {f.rank} {describe(f)}" if f is not None else "unknown failure"

    def root_time_ns(self) -> int | None:
        f = root_cause(self.all)
        return f.time_ns if f is not None else None

    # ---- building ------------------------------------------------------------------------------

    def new(
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

    def of_worker(
        self,
        w: Worker,
        kind: FailureKind,
        time_ns: int,
        detail: str,
        last_beat_ns: int | None = None,
    ) -> WorkerFailure:
        """What is known of worker `w`'s failure: its status, its error file and, for a hang,
        when it last beat (from then on it was hung)."""
        failure = self.new(
            kind,
            w.rank,
            w.local_rank,
            w.pid,
            time_ns,
            exit_code=w.exit_code,
            signal=w.signal,
            detail=detail,
            error_file=w.error_file if os.path.exists(w.error_file) else "",
            stdout_log=w.stdout_log,
            stderr_log=w.stderr_log,
        )
        data = read_error_file(w.error_file)
        if data is not None:
            failure.message = data.message
            failure.traceback = data.traceback if data.show_traceback else ""
            failure.failed_at_ns = data.monotonic_ns
        if kind == FailureKind.HUNG:
            failure.failed_at_ns = last_beat_ns or None
        return failure

    # ---- recording -------------------------------------------------------------------------------

    def record(self, failure: WorkerFailure) -> WorkerFailure:
        """Keep `failure` and emit ``worker_failed`` (with the time from the failure to its
        detection, when the failure time is known)."""
        detection = (
            max(0.0, (failure.time_ns - failure.failed_at_ns) / 1e9)
            if failure.failed_at_ns
            else None
        )
        self.all.append(failure)
        self.events.emit(
            "worker_failed",
            self.attempt,
            rank=failure.rank,
            local_rank=failure.local_rank,
            kind=failure.kind.value,
            exit_code=failure.exit_code,
            signal=failure.signal,
            detection_seconds=detection,
            detail=failure.detail,
        )
        return failure

    def stopped(self, w: Worker, sig: int) -> None:
        """Worker `w` was running and the launcher stopped it (after the root cause): kept, not
        emitted (it is no failure of its own)."""
        sent = signal.Signals(sig).name
        how = f"{sent}, then SIGKILL" if w.signal == signal.SIGKILL else sent
        self.all.append(
            self.new(
                FailureKind.STOPPED,
                w.rank,
                w.local_rank,
                w.pid,
                exit_code=w.exit_code,
                signal=w.signal,
                detail=how,
            )
        )
