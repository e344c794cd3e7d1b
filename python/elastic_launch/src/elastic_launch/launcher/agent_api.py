"""torch's agent API (``torch.distributed.elastic.agent.server``) over elasticrun's agent: code
that builds a ``WorkerSpec`` and runs a ``LocalElasticAgent`` changes only its imports.

    from elastic_launch.launcher.agent_api import (
        LocalElasticAgent, RendezvousParameters, WorkerSpec, get_rendezvous_handler)

    params = RendezvousParameters("c10d", "localhost:29400", "job1", min_nodes=1, max_nodes=2)
    spec = WorkerSpec(role="trainer", local_world_size=4, entrypoint=train, args=(lr,),
                      rdzv_handler=get_rendezvous_handler(params), max_restarts=3)
    result = LocalElasticAgent(spec, start_method="spawn").run()   # RunResult
    spec.rdzv_handler.shutdown()

These are views: :meth:`LocalElasticAgent.run` is one run of elasticrun's agent
(:func:`~elastic_launch.launcher.runner.run`), with its hang detection, per-worker
replacement and summaries. The spec's handler may be one from :func:`get_rendezvous_handler`
(any elasticrun backend), elasticrun's own, or any handler in torch's shape, torch's own
included (:mod:`elastic_launch.rendezvous.torch_shaped`). ``master_addr``/``master_port`` in
the spec set the workers' MASTER_ADDR/MASTER_PORT on every backend.
"""

from __future__ import annotations

import abc
import enum
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_launch import api
from elastic_launch.api import AgentState, ConfigError, Std, process_failures
from elastic_launch.errors import ProcessFailure
from elastic_launch.launcher.api import take_logs_specs
from elastic_launch.launcher.options import torch_default
from elastic_launch.launcher.rendezvous_api import (
    RendezvousHandle,
    RendezvousParameters,
    backend_of,
    get_rendezvous_handler,
    node_handler,
)
from elastic_launch.rendezvous import api as rdzv
from elastic_launch.rendezvous.torch_shaped import EXIT_BARRIER_TIMEOUT

DEFAULT_ROLE = "default"

__all__ = [
    "DEFAULT_ROLE",
    "DefaultLogsSpecs",
    "LocalElasticAgent",
    "RendezvousParameters",
    "RunResult",
    "SimpleElasticAgent",
    "Std",
    "Worker",
    "WorkerGroup",
    "WorkerSpec",
    "WorkerState",
    "get_rendezvous_handler",
]


class WorkerState(str, enum.Enum):
    """torch's states of a worker group (their values are torch's); elasticrun's own are the
    agent's (:class:`~elastic_launch.api.AgentState`) and each worker's
    (:class:`~elastic_launch.api.WorkerState`)."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"

    @staticmethod
    def is_running(state: WorkerState) -> bool:
        return state in (WorkerState.HEALTHY, WorkerState.UNHEALTHY)


# ---- the spec and the views --------------------------------------------------------------------


@dataclass
class WorkerSpec:
    """torch's ``WorkerSpec``: what a node runs. `entrypoint` is a function or a program
    (``fn`` is torch's older name for a function)."""

    role: str
    local_world_size: int
    rdzv_handler: Any
    fn: Callable[..., Any] | None = None
    entrypoint: Callable[..., Any] | str | None = None
    args: tuple[Any, ...] = ()
    max_restarts: int = torch_default("max-restarts")
    monitor_interval: float = torch_default("monitor-interval")
    master_port: int | None = None
    master_addr: str | None = None
    local_addr: str | None = None
    event_log_handler: str = torch_default("event-log-handler")
    numa_options: Any = None
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = torch_default("virtual-local-rank")

    def __post_init__(self) -> None:
        if self.local_world_size <= 0:
            raise ValueError(f"WorkerSpec.local_world_size {self.local_world_size}: give 1 or more")
        if self.monitor_interval <= 0:
            raise ValueError(f"WorkerSpec.monitor_interval {self.monitor_interval}: give > 0")
        if self.fn is not None and self.entrypoint is None:
            self.entrypoint = self.fn
        if self.entrypoint is None:
            raise ValueError("WorkerSpec needs an entrypoint: a function, or a program")

    def get_entrypoint_name(self) -> str:
        if isinstance(self.entrypoint, str):
            return os.path.basename(self.entrypoint)
        return getattr(self.entrypoint, "__name__", repr(self.entrypoint))


@dataclass
class Worker:
    """One worker of a run, torch's view of elasticrun's
    (:class:`~elastic_launch.agent.worker.Worker`): its ranks and process id."""

    local_rank: int
    global_rank: int = -1
    role_rank: int = -1
    world_size: int = -1
    role_world_size: int = -1
    id: Any = None


class WorkerGroup:
    """The node's workers of a run, torch's view of elasticrun's
    (:class:`~elastic_launch.agent.workers.WorkerGroup`), filled in when the run ends."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.workers = [Worker(local_rank=i) for i in range(spec.local_world_size)]
        self.store: Any = None
        self.group_rank: int | None = None
        self.group_world_size: int | None = None
        self.state = WorkerState.INIT
        self.master_addr: str | None = None
        self.master_port: int | None = None


@dataclass
class RunResult:
    """torch's ``RunResult``: the state, return values and failures, by global rank; made from
    elasticrun's (:class:`~elastic_launch.api.RunResult`) by :meth:`of`."""

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, ProcessFailure] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED

    @staticmethod
    def of(result: api.RunResult) -> RunResult:
        """torch's view of elasticrun's result (the failures as torch's ProcessFailures): the
        return values of a job that succeeded, else the failures (a stopped run raises
        before: torch's agent raises then too)."""
        if result.state == AgentState.SUCCEEDED:
            return RunResult(WorkerState.SUCCEEDED, dict(result.return_values))
        return RunResult(WorkerState.FAILED, {}, process_failures(result))


@dataclass
class DefaultLogsSpecs:
    """torch's ``DefaultLogsSpecs``: where the workers' logs go and which streams."""

    log_dir: str | None = None
    redirects: Std | dict[int, Std] = Std.NONE
    tee: Std | dict[int, Std] = Std.NONE
    local_ranks_filter: set[int] | None = None

    @property
    def root_log_dir(self) -> str | None:
        return self.log_dir


# ---- an agent of one's own ---------------------------------------------------------------------


class SimpleElasticAgent(abc.ABC):
    """torch's base for an agent of one's own: elasticrun's rendezvous, restart budget and exit
    barrier, around the worker life a subclass implements (``_start_workers``,
    ``_stop_workers``, ``_monitor_workers``, ``_shutdown``), as torch's documents it. Ranks
    are assigned before ``_start_workers`` sees the group; workers get no agent store
    (``worker_group.store`` is None: elasticrun's workers meet on rank 0's own)."""

    def __init__(self, spec: WorkerSpec, exit_barrier_timeout: float = EXIT_BARRIER_TIMEOUT):
        self._worker_group = WorkerGroup(spec)
        self._remaining_restarts = spec.max_restarts
        self._exit_barrier_timeout = exit_barrier_timeout
        self._total_execution_time = 0
        self._rdzv: rdzv.RendezvousHandler | None = None

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        return self._worker_group

    @abc.abstractmethod
    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        """Start the group's workers; their ids by local rank."""

    @abc.abstractmethod
    def _stop_workers(self, worker_group: WorkerGroup, is_restart: bool = False) -> None:
        """Stop the group's workers."""

    @abc.abstractmethod
    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        """How the group's workers are doing."""

    @abc.abstractmethod
    def _shutdown(
        self, death_sig: signal.Signals = signal.SIGTERM, is_restart: bool = False
    ) -> None:
        """Release what the agent holds; called once when :meth:`run` ends."""

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Rendezvous, start, monitor, restart within the budget, until the group succeeds or
        fails; a ``SignalException`` (:class:`~elastic_launch.api.LauncherStopped`) raised
        meanwhile shuts down with its signal and goes on."""
        start = time.monotonic()
        try:
            result = self._invoke_run(role)
        except api.LauncherStopped as e:
            self._shutdown(signal.Signals(e.sigval))
            raise
        except BaseException:
            self._shutdown()
            raise
        self._total_execution_time = int(time.monotonic() - start)
        self._shutdown()
        return result

    def _invoke_run(self, role: str) -> RunResult:
        group = self._worker_group
        self._initialize_workers(group)
        while True:
            time.sleep(group.spec.monitor_interval)
            result = self._monitor_workers(group)
            group.state = result.state
            if result.state == WorkerState.SUCCEEDED:
                self._handler().mark_done()
                return result
            if result.state in (WorkerState.UNHEALTHY, WorkerState.FAILED):
                if self._remaining_restarts <= 0:
                    self._stop_workers(group)
                    group.state = WorkerState.FAILED
                    self._handler().set_closed(rdzv.CloseReason.FAILED, "restarts exhausted")
                    return result
                self._remaining_restarts -= 1
                self._restart_workers(group, rdzv.RestartReason.FAILURE)
            elif result.state == WorkerState.HEALTHY and self._handler().membership_changed():
                self._restart_workers(group, rdzv.RestartReason.MEMBERSHIP)
            elif result.state not in (WorkerState.HEALTHY, WorkerState.UNHEALTHY):
                raise RuntimeError(f"[{role}] worker group in {result.state.name} state")

    def _handler(self) -> rdzv.RendezvousHandler:
        if self._rdzv is None:
            self._rdzv = node_handler(self._worker_group.spec, self._exit_barrier_timeout)
        return self._rdzv

    def _initialize_workers(
        self, group: WorkerGroup, reason: rdzv.RestartReason = rdzv.RestartReason.START
    ) -> None:
        self._rendezvous(group, reason)
        for local_rank, worker_id in self._start_workers(group).items():
            group.workers[local_rank].id = worker_id
        group.state = WorkerState.HEALTHY

    def _restart_workers(self, group: WorkerGroup, reason: rdzv.RestartReason) -> None:
        self._stop_workers(group, is_restart=True)
        group.state = WorkerState.STOPPED
        self._initialize_workers(group, reason)

    def _rendezvous(self, group: WorkerGroup, reason: rdzv.RestartReason) -> None:
        """Join the next round; the group's ranks, sizes and master address from it."""
        info = self._handler().next_rendezvous(reason)
        group.group_rank, group.group_world_size = info.group_rank, info.group_world_size
        group.master_addr, group.master_port = info.master_addr, info.master_port
        role_offset = info.rank_offset if info.role_rank_offset is None else info.role_rank_offset
        role_world = info.world_size if info.role_world_size is None else info.role_world_size
        group.workers = [
            Worker(i, info.rank_offset + i, role_offset + i, info.world_size, role_world)
            for i in range(group.spec.local_world_size)
        ]


# ---- the agent ---------------------------------------------------------------------------------


class LocalElasticAgent:
    """torch's ``LocalElasticAgent``: runs the spec's workers on this node until the job
    succeeds or fails. One run of elasticrun's agent each time :meth:`run` is called."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: Any = None,
        start_method: str = "spawn",
        exit_barrier_timeout: float = EXIT_BARRIER_TIMEOUT,
        log_line_prefix_template: str | None = None,
    ) -> None:
        if spec.numa_options is not None:
            raise ConfigError(
                f"WorkerSpec.numa_options {spec.numa_options!r} is not supported by elasticrun; "
                "bind workers with numactl in the script, or leave it out"
            )
        self.spec = spec
        self.logs_specs = logs_specs
        self.start_method = start_method
        self.exit_barrier_timeout = exit_barrier_timeout
        self.log_line_prefix_template = log_line_prefix_template
        self._group = WorkerGroup(spec)

    def get_worker_group(self, role: str = DEFAULT_ROLE) -> WorkerGroup:
        return self._group

    def run(self, role: str = DEFAULT_ROLE) -> RunResult:
        """Run the workers; raises ``SignalException`` (:class:`~elastic_launch.api.
        LauncherStopped`) when a signal stops them, as torch's agent does."""
        from elastic_launch.launcher.runner import run
        from elastic_launch.processes.entrypoint import Entrypoint

        spec = self.spec
        handler = node_handler(spec, self.exit_barrier_timeout)
        if self.log_line_prefix_template:
            os.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = self.log_line_prefix_template
        agents: list[Any] = []
        self._group.state = WorkerState.HEALTHY
        result = run(
            self._config(),
            Entrypoint.for_launch(spec.entrypoint, tuple(spec.args)),  # type: ignore[arg-type]
            on_agent=agents.append,
            rdzv=handler,
        )
        self._update_group(agents[0] if agents else None, result)
        if result.state == AgentState.STOPPED:
            raise api.LauncherStopped(result.signal or 0)
        return RunResult.of(result)

    def _config(self) -> api.LaunchConfig:
        spec, h = self.spec, self.spec.rdzv_handler
        params = h.params if isinstance(h, RendezvousHandle) else None
        config = api.LaunchConfig(
            min_nodes=params.min_nodes if params else 1,
            max_nodes=params.max_nodes if params else 1,
            nproc_per_node=spec.local_world_size,
            run_id=str(h.get_run_id()),
            role=spec.role,
            rdzv_backend=backend_of(h),
            max_restarts=spec.max_restarts,
            monitor_interval=spec.monitor_interval,
            start_method=self.start_method,
            local_addr=spec.local_addr,
            event_log_handler=spec.event_log_handler,
            duplicate_stdout_filters=list(spec.duplicate_stdout_filters or []),
            duplicate_stderr_filters=list(spec.duplicate_stderr_filters or []),
            virtual_local_rank=spec.virtual_local_rank,
        )
        if self.logs_specs is not None:
            take_logs_specs(config, self.logs_specs)
        return config

    def _update_group(self, agent: Any, result: api.RunResult) -> None:
        g = self._group
        g.state = {
            AgentState.SUCCEEDED: WorkerState.SUCCEEDED,
            AgentState.STOPPED: WorkerState.STOPPED,
        }.get(result.state, WorkerState.FAILED)
        info = agent.group.startup.info if agent is not None else None
        if info is None:
            return
        g.group_rank, g.group_world_size = info.group_rank, info.group_world_size
        g.master_addr, g.master_port = info.master_addr, info.master_port
        role_offset = info.rank_offset if info.role_rank_offset is None else info.role_rank_offset
        role_world = info.world_size if info.role_world_size is None else info.role_world_size
        pids = {w.local_rank: w.process.pid for w in agent.group.workers}
        g.workers = [
            Worker(
                local_rank=i,
                global_rank=info.rank_offset + i,
                role_rank=role_offset + i,
                world_size=info.world_size,
                role_world_size=role_world,
                id=pids.get(i),
            )
            for i in range(self.spec.local_world_size)
        ]
