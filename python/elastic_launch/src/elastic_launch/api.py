"""Interfaces, data classes and errors of elastic_launch.

:class:`LaunchConfig` is what the ``elasticrun`` command line builds and what
:func:`elastic_launch.launch` takes; it mirrors torch's ``LaunchConfig`` field for field where
torch has one, plus elasticrun's own (hang detection, preload, events, health).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from elastic_launch.errors import NOT_AVAILABLE, ChildFailedError, ProcessFailure

#: Launcher exit codes (documented in the README).
EXIT_OK = 0
EXIT_FAILED = 1  # the job failed: a worker failed with no restart left, or rendezvous failed
EXIT_USAGE = 2  # bad command line or configuration
EXIT_SIGNAL_BASE = 128  # stopped by signal N: exit code 128 + N


class Std(enum.IntFlag):
    """Which standard streams of a worker go to its log files (torch's ``Std``)."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


def std_for(setting: Std | dict[int, Std], local_rank: int) -> Std:
    """What `setting` (``--redirects``/``--tee``: one for all, or by local rank) gives
    `local_rank`."""
    if isinstance(setting, dict):
        return setting.get(local_rank, Std.NONE)
    return setting


@dataclass
class LaunchConfig:
    """How to launch and supervise one node's workers.

    Field names and defaults follow torch's ``LaunchConfig``; times are in seconds.
    """

    min_nodes: int = 1
    max_nodes: int = 1
    nproc_per_node: int = 1
    run_id: str = ""
    role: str = "default"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "embedded"
    # Values are strings from the command line; from Python any value whose str() is the
    # option's text (torch's launcher takes {"rank": 0}).
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    max_restarts: int = 0
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_dir: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    local_ranks_filter: set[int] | None = None
    duplicate_stdout_filters: list[str] = field(default_factory=list)
    duplicate_stderr_filters: list[str] = field(default_factory=list)
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    local_addr: str | None = None
    signals_to_handle: str = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
    shutdown_timeout: float = 30.0
    virtual_local_rank: bool = False
    event_log_handler: str = "null"
    # elasticrun's own
    hang_timeout: float | None = None  # seconds; None: automatic (learned step time)
    hang_timeout_floor: float = 60.0  # automatic mode: never below this
    hang_timeout_factor: float = 10.0  # automatic mode: k x p99 step interval
    # Bytes one rank's memory-tier checkpoints may take (two copies); None: no limit.
    memory_checkpoint_limit: int | None = None
    # Module names the zygote imports; "auto": torch when the entrypoint imports it (the
    # default). Empty: no zygote, fresh interpreters (--preload none).
    preload: list[str] = field(default_factory=lambda: ["auto"])
    events_file: str | None = None
    metrics_port: str | None = None  # "PORT" or "HOST:PORT"
    health_port: str | None = None  # "PORT" or "HOST:PORT"
    stack_dump_timeout: float = 2.0  # how long to wait for hung workers' stacks
    gpu_check_interval: float = 5.0  # seconds between NVML checks; 0: none
    min_workers: int | None = None  # the train loop goes on with this many (None: all)
    # The most restarts a train-loop script's failure budget (max_failures, which its workers
    # report) may give the job beyond max_restarts: a worker cannot raise its own budget.
    loop_max_restarts: int = 100
    # Workers the zygote keeps forked ahead of need, so that a start or restart skips the
    # fork (about 2 MB each, the rest shared with the zygote). None: one per local worker.
    warm_spares: int | None = None
    # Train-loop workers per node started ahead of need: each runs the script up to train()
    # and waits in the workers' rendezvous to take a dead worker's place at the next round.
    hot_spares: int = 0


class FailureKind(str, enum.Enum):
    """Why a worker failed."""

    EXIT_CODE = "exit_code"  # exited with a non-zero status
    SIGNAL = "signal"  # killed by a signal
    HUNG = "hung"  # stopped beating for longer than its hang timeout
    HEARTBEAT = "heartbeat"  # broke its heartbeat file (cut, overwrote or replaced it)
    GPU = "gpu"  # a GPU it uses became unhealthy
    SPAWN = "spawn"  # could not be started
    STOPPED = "stopped"  # stopped by the launcher after another worker failed

    @classmethod
    def of_end(cls, signalled: bool) -> FailureKind:
        """How a worker that ended on its own failed: by a signal, or by its exit status."""
        return cls.SIGNAL if signalled else cls.EXIT_CODE


@dataclass
class WorkerFailure:
    """One failed worker, with what is known about why."""

    kind: FailureKind
    rank: int
    local_rank: int
    pid: int
    attempt: int
    host: str
    time_ns: int  # when the watchdog saw it (CLOCK_MONOTONIC)
    wall_time: float  # the same moment as a Unix time
    exit_code: int | None = None
    signal: int | None = None
    detail: str = ""
    message: str = ""  # the exception message, from the error file
    traceback: str = ""  # the Python traceback, from the error file
    stack: str = ""  # for hangs: the Python stacks the worker dumped
    error_file: str = ""
    stdout_log: str | None = None
    stderr_log: str | None = None
    failed_at_ns: int | None = None  # when the failure happened, if known


class AgentState(str, enum.Enum):
    """The agent's life. Its `.value` is what events (``state_changed``), ``/healthz`` and the
    failure summary show."""

    INIT = "init"  # setting up (log directory, servers, the zygote)
    RENDEZVOUS = "rendezvous"  # waiting for the round (or as a spare)
    STARTING = "starting"  # starting this node's workers
    RUNNING = "running"  # the workers run
    RESTARTING = "restarting"  # stopping the workers to start a new attempt
    STOPPING = "stopping"  # stopping the workers for good (a signal)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # by a signal to the launcher

    @property
    def terminal(self) -> bool:
        return self in (AgentState.SUCCEEDED, AgentState.FAILED, AgentState.STOPPED)

    @property
    def healthy(self) -> bool:
        """What ``/healthz`` answers 200 for: everything but failing and being stopped."""
        return self not in (AgentState.FAILED, AgentState.STOPPING, AgentState.STOPPED)


class WorkerState(str, enum.Enum):
    """One worker's life within an attempt (shown by ``/healthz``)."""

    RUNNING = "running"
    SUCCEEDED = "succeeded"  # exited with 0
    FAILED = "failed"  # exited otherwise, hung, or its GPU failed
    STOPPED = "stopped"  # stopped by the launcher


@dataclass(frozen=True)
class RestartBudget:
    """The job's restarts as a value: how many are spent of how many (``--max-restarts``). A
    group restart and a train-loop worker's replacement alike spend one, through the
    rendezvous, which keeps the one count (:meth:`RendezvousHandler.spend_restart`)."""

    spent: int
    limit: int

    def spend(self) -> RestartBudget | None:
        """The budget after one more restart, or None when none is left."""
        return RestartBudget(self.spent + 1, self.limit) if self.spent < self.limit else None

    def at_least(self, limit: int) -> RestartBudget:
        """This budget with its limit raised to `limit` (a train loop's own failure budget)."""
        return RestartBudget(self.spent, max(self.limit, limit))

    def exhausted(self, failure: str = "") -> str:
        """Why the job fails when :meth:`spend` finds nothing left (`failure`: what failed)."""
        detail = f"restarts exhausted ({self.limit})"
        return f"{detail}; {failure}" if failure else detail


def root_cause(failures: list[WorkerFailure]) -> WorkerFailure | None:
    """The first failure, workers the launcher stopped left out: what the summary leads with."""
    own = [f for f in failures if f.kind != FailureKind.STOPPED]
    return min(own, key=lambda f: f.time_ns) if own else None


@dataclass
class RunResult:
    """The outcome of a launch."""

    state: AgentState
    return_values: dict[int, Any] = field(default_factory=dict)  # by global rank
    failures: list[WorkerFailure] = field(default_factory=list)  # of the last attempt
    attempts: int = 0
    restarts: int = 0
    signal: int | None = None
    log_dir: str | None = None
    message: str = ""  # why the job ended, when no local failure says it

    @property
    def root_cause(self) -> WorkerFailure | None:
        """The first failure of the last attempt (workers the launcher stopped excluded)."""
        return root_cause(self.failures)


class LaunchError(Exception):
    """Base of elastic_launch's errors."""


class ConfigError(LaunchError, ValueError):
    """A bad flag, value or setting; the message quotes it and says what to do (raised in a
    worker, the launcher shows the message without a traceback)."""

    show_traceback = False


class WorkerFailedError(ChildFailedError, LaunchError):
    """The job failed: a worker failed and no restart was left. Carries the run's result
    (`result`, with :attr:`RunResult.root_cause`); as torch's ``ChildFailedError``, `failures`
    are the failed processes by global rank, and :meth:`get_first_failure` the root cause."""

    def __init__(self, message: str, result: RunResult, name: str = "") -> None:
        self.result = result
        self.name = name
        self.failures = process_failures(result)
        Exception.__init__(self, message)

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        if self.failures:
            return super().get_first_failure()
        # No worker of this node failed (another node's did, or the rendezvous): a placeholder
        # that says so, for code that expects one.
        none = ProcessFailure(-1, 0, 1, NOT_AVAILABLE)
        none.message = self.result.message or str(self)
        return -1, none


def process_failures(result: RunResult) -> dict[int, ProcessFailure]:
    """The failures of `result` as torch's ProcessFailures, by global rank (a rank's first)."""
    out: dict[int, ProcessFailure] = {}
    # torch's failures are the processes that failed, not those it stopped after them; a
    # node whose workers were all stopped (the job failed elsewhere) gives those.
    own = [f for f in result.failures if f.kind != FailureKind.STOPPED] or result.failures
    for f in sorted(own, key=lambda f: f.time_ns):
        if f.rank in out:
            continue
        code = -f.signal if f.signal else (f.exit_code if f.exit_code is not None else 1)
        pf = ProcessFailure(f.local_rank, f.pid, code, f.error_file or NOT_AVAILABLE)
        if pf.error_file == NOT_AVAILABLE and f.message:
            # The file was read when the failure was seen; the run's log directory, a
            # temporary one, is gone since: what it held is given as torch reads it.
            pf.error_file = f.error_file or NOT_AVAILABLE
            pf.message = {
                "message": f.message,
                "extraInfo": {"py_callstack": f.traceback, "timestamp": str(int(f.wall_time))},
            }
            pf.error_file_data = {"message": pf.message}
            pf.timestamp = int(f.wall_time)
        elif pf.error_file == NOT_AVAILABLE:
            pf.timestamp = int(f.wall_time)
            if f.kind != FailureKind.EXIT_CODE and f.detail:
                pf.message = f"{f.kind.value}: {f.detail}"
        out[f.rank] = pf
    return out


class LauncherStopped(LaunchError):  # noqa: N818 - torch calls its equivalent SignalException
    """The launcher was asked to stop by a signal; workers were stopped (torch's
    ``SignalException``: ``sigval`` is the signal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"stopped by signal {signum}")
        self.signum = signum

    @property
    def sigval(self) -> int:
        return self.signum


class Cancelled(LaunchError):  # noqa: N818 - a state, like asyncio.CancelledError
    """A wait was cancelled (by a signal to the launcher, whose number it carries)."""

    def __init__(self, signum: int | None = None) -> None:
        super().__init__(f"cancelled by signal {signum}" if signum else "cancelled")
        self.signum = signum
