"""The records of one node's workers: a :class:`Worker` per process of the attempt, what happens
to it (:class:`Happened`), and the errors and reports of the group.

Only the worker group (:mod:`elastic_launch.agent.workers`) changes a :class:`Worker`; the agent
reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import IO, Any, Protocol

import elastic_core

from elastic_launch import untrusted
from elastic_launch.agent.decide import Happening, Loop
from elastic_launch.api import WorkerState
from elastic_launch.processes.spawn import Process
from elastic_launch.rendezvous import team


class Watcher(Protocol):
    """What the group needs of a watchdog (``elastic_core.Watchdog`` has it)."""

    def watch(
        self,
        worker: int,
        pid: int,
        table: elastic_core.HeartbeatTable | None = None,
        slot: int | None = None,
        hang_timeout: float = 0.0,
        gpu: int | None = None,
    ) -> None: ...

    def unwatch(self, worker: int) -> bool: ...

    def set_hang_timeout(self, worker: int, seconds: float) -> bool: ...

    def poll(self, timeout: float | None = None) -> Any: ...


@dataclass
class Worker:
    """One worker process of the current attempt (read-only outside the group)."""

    local_rank: int
    rank: int
    process: Process
    started_ns: int
    rank_dir: str
    error_file: str
    stack_file: str
    stdout_log: str | None
    stderr_log: str | None
    result_file: str | None = None
    loop_file: str = ""  # where it says it runs the train loop (team.LOOP_FILE_ENV)
    generation: int = 0  # 0, then 1, 2... for replacements within the attempt
    hot_spare: bool = False  # started to wait for a round (prepared on idle CPU)
    state: WorkerState = WorkerState.RUNNING
    exited: bool = False  # the process is gone (and reaped)
    exit_code: int | None = None
    signal: int | None = None
    exited_ns: int | None = None  # when its exit was seen (CLOCK_MONOTONIC)
    # Spared (hung inside a collective, waiting for a peer that is judged first): judged again
    # at `spared_until_ns` unless it beats again (its last beat was `spared_beat_ns`).
    spared_until_ns: int | None = None
    spared_beat_ns: int = 0
    spare_ns: int = 0
    _files: list[IO[bytes]] = field(default_factory=list, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def train_loop(self) -> Loop:
        """What the worker said of the train loop (its loop file)."""
        said, _ = self._loop_file()
        return Loop(said)

    def loop_budget(self) -> int:
        """The failure budget of the train loop this worker runs (0: not said)."""
        return self._loop_file()[1]

    def _loop_file(self) -> tuple[str, int]:
        try:
            text = untrusted.read(self.loop_file, 64).decode("ascii", "replace")
        except OSError:
            return "", 0
        return team.read_loop_file(text)


@dataclass
class Happened:
    """Something that happened to a worker (a live worker of this attempt: the group drops what
    the watchdog says of a replaced or earlier one) or to the node: the inputs of one
    decision. What it is as a failure is the decision's to say."""

    happening: Happening
    worker: Worker | None = None
    time_ns: int = 0
    detail: str = ""
    rank: int = -1  # without a worker (a spawn failure, an unusable GPU)
    local_rank: int = -1
    replacing: bool = False  # SPAWN_FAILED: a replacement's
    stack: str = ""  # HUNG: the worker's Python stacks


@dataclass(frozen=True)
class Stopped:
    """What :meth:`WorkerGroup.stop_all` did to the workers that were running."""

    stopped: list[Worker]  # ended by its signal (or the SIGKILL after it)
    ended: list[Worker]  # failed on their own just before it (their exit was still queued)


class SpawnError(RuntimeError):
    """A worker could not be started; `local_rank` says which."""

    def __init__(self, local_rank: int, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.local_rank = local_rank


class UnusableGpu(RuntimeError):  # noqa: N818 - a finding, like SpawnError
    """Before a start: the GPU of worker `local_rank` needs a reset (a lost GPU, a critical
    XID), so starting on it again cannot succeed."""

    def __init__(self, local_rank: int, detail: str) -> None:
        super().__init__(detail)
        self.local_rank = local_rank
