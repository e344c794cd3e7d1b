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

import dataclasses
import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

from elastic_launch import api
from elastic_launch.api import AgentState, ConfigError, Std, process_failures
from elastic_launch.cancel import NEVER, CancelToken
from elastic_launch.errors import ProcessFailure
from elastic_launch.launcher.api import take_logs_specs
from elastic_launch.launcher.options import torch_default
from elastic_launch.rendezvous import api as rdzv
from elastic_launch.rendezvous.registry import adapt, create_handler
from elastic_launch.rendezvous.torch_shaped import EXIT_BARRIER_TIMEOUT, TorchShapedRendezvous

DEFAULT_ROLE = "default"

__all__ = [
    "DEFAULT_ROLE",
    "DefaultLogsSpecs",
    "LocalElasticAgent",
    "RendezvousParameters",
    "RunResult",
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


# ---- the rendezvous ----------------------------------------------------------------------------


class RendezvousParameters:
    """torch's ``RendezvousParameters(backend, endpoint, run_id, min_nodes, max_nodes,
    local_addr=None, **kwargs)``: the keyword arguments are the backend's configuration (what
    ``--rdzv-conf`` gives on the command line)."""

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not backend:
            raise ValueError("RendezvousParameters: give a backend name (c10d, etcd, static...)")
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(
                f"RendezvousParameters: min_nodes {min_nodes} and max_nodes {max_nodes}: need "
                "1 <= min_nodes <= max_nodes"
            )
        self.backend, self.endpoint, self.run_id = backend, endpoint, run_id
        self.min_nodes, self.max_nodes, self.local_addr = min_nodes, max_nodes, local_addr
        self.config = kwargs

    def ours(self, local_world_size: int = 1, role: str = "", max_restarts: int = 0) -> Any:
        """elasticrun's parameters, once the node's workers are known."""
        config = {k: v for k, v in self.config.items() if v is not None}
        return rdzv.RendezvousParameters(
            backend=self.backend,
            endpoint=self.endpoint,
            run_id=self.run_id,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            local_world_size=local_world_size,
            config=config,
            local_addr=self.local_addr,
            max_restarts=max_restarts,
            role=role,
            node_rank=int(config.get("rank", 0)),
        )

    def get(self, key: str, default: Any = None) -> Any:
        return self.ours().get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        value: bool | None = self.ours().get_as_bool(key, default)
        return value

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        value: int | None = self.ours().get_as_int(key, default)
        return value


class RendezvousHandle:
    """What :func:`get_rendezvous_handler` returns: a handler in torch's shape whose
    elasticrun handler is made when an agent first runs with it (a node joins with its worker
    count and role, which the spec gives). Shut it down once done, as torch's."""

    def __init__(self, params: RendezvousParameters) -> None:
        self.params = params
        self.handler: rdzv.RendezvousHandler | None = None

    def bind(self, local_world_size: int, role: str, max_restarts: int) -> rdzv.RendezvousHandler:
        if self.handler is None:
            self.handler = create_handler(self.params.ours(local_world_size, role, max_restarts))
        return self.handler

    def get_backend(self) -> str:
        return self.params.backend

    def get_run_id(self) -> str:
        return self.params.run_id

    def next_rendezvous(self) -> Any:
        raise NotImplementedError(
            "elasticrun's rendezvous hands out no torch store: run it through "
            "LocalElasticAgent(spec).run(), which joins the rounds"
        )

    def is_closed(self) -> bool:
        return self.handler is not None and self.handler.is_closed()

    def set_closed(self) -> None:
        if self.handler is not None:
            self.handler.set_closed(rdzv.CloseReason.FAILED, "closed through the agent API")

    def num_nodes_waiting(self) -> int:
        return self.handler.num_nodes_waiting() if self.handler is not None else 0

    def shutdown(self) -> bool:
        if self.handler is not None:
            self.handler.shutdown()
        return True


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandle:
    """torch's ``registry.get_rendezvous_handler``: any registered backend by name."""
    return RendezvousHandle(params)


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
        handler = self._handler()
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

    def _handler(self) -> rdzv.RendezvousHandler:
        spec = self.spec
        h = spec.rdzv_handler
        if isinstance(h, RendezvousHandle):
            handler = h.bind(spec.local_world_size, spec.role, spec.max_restarts)
        else:
            params = rdzv.RendezvousParameters(
                backend=_backend_of(h),
                endpoint="",
                run_id=str(h.get_run_id()),
                min_nodes=1,
                max_nodes=1,
                local_world_size=spec.local_world_size,
                local_addr=spec.local_addr,
                max_restarts=spec.max_restarts,
                role=spec.role,
            )
            handler = adapt(params, h)
        if isinstance(handler, TorchShapedRendezvous):
            handler.exit_barrier_timeout = self.exit_barrier_timeout
        if spec.master_addr is not None or spec.master_port is not None:
            override = MasterOverride(handler, spec.master_addr, spec.master_port)
            return cast(rdzv.RendezvousHandler, override)
        return handler

    def _config(self) -> api.LaunchConfig:
        spec, h = self.spec, self.spec.rdzv_handler
        params = h.params if isinstance(h, RendezvousHandle) else None
        config = api.LaunchConfig(
            min_nodes=params.min_nodes if params else 1,
            max_nodes=params.max_nodes if params else 1,
            nproc_per_node=spec.local_world_size,
            run_id=str(h.get_run_id()),
            role=spec.role,
            rdzv_backend=_backend_of(h),
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


def _backend_of(handler: Any) -> str:
    name = getattr(handler, "get_backend", None)
    return str(name()) if callable(name) else type(handler).__name__


class MasterOverride:
    """A handler whose rounds give the spec's MASTER_ADDR/MASTER_PORT (torch's
    ``master_addr``/``master_port`` override), on any backend; everything else is the inner
    handler's (delegated, so that a method the interface gains is never left out)."""

    def __init__(self, inner: rdzv.RendezvousHandler, addr: str | None, port: int | None) -> None:
        self.inner, self.addr, self.port = inner, addr, port

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being made): never recurse
            raise AttributeError(name)
        return getattr(self.inner, name)

    def next_rendezvous(
        self,
        reason: rdzv.RestartReason = rdzv.RestartReason.START,
        *,
        cancel: CancelToken = NEVER,
        failure: str = "",
    ) -> rdzv.RendezvousInfo:
        info = self.inner.next_rendezvous(reason, cancel=cancel, failure=failure)
        return dataclasses.replace(
            info,
            master_addr=info.master_addr if self.addr is None else self.addr,
            master_port=info.master_port if self.port is None else self.port,
        )


rdzv.RendezvousHandler.register(MasterOverride)
