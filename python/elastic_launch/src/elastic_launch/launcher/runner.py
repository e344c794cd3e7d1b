"""Running a job: the Python API behind ``elasticrun`` (:func:`launch`, :func:`run`).

:func:`run` is the one owner of everything a launch opens. Each resource is entered into an exit
stack the moment it exists, so that whichever step fails (a busy port, an unwritable directory, a
rendezvous error, a zygote that cannot start) and however the run ends (success, failure, a
signal, an exception), everything opened so far is released in reverse order: servers closed,
workers and the zygote ended, the rendezvous left, the heartbeat file and temporary directories
removed. Should the launcher itself be SIGKILLed, its guardian does the same.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

import elastic_core

from elastic_launch import compat
from elastic_launch.agent.agent import ElasticAgent
from elastic_launch.agent.events import Events
from elastic_launch.agent.summary import format_summary
from elastic_launch.agent.workers import WorkerGroup
from elastic_launch.api import (
    AgentState,
    LaunchConfig,
    LauncherStopped,
    RunResult,
    WorkerFailedError,
)
from elastic_launch.cancel import CancelToken, SignalRelay
from elastic_launch.eventlog import EVENTS_FILE_ENV
from elastic_launch.launcher.config import check_config, parse_bind, parse_signals, random_id
from elastic_launch.processes import preload
from elastic_launch.processes.entrypoint import Entrypoint, Kind
from elastic_launch.processes.guardian import Guardian
from elastic_launch.processes.logs import LogLayout
from elastic_launch.processes.spawn import FreshInterpreter, FunctionFork, Spawner, ZygoteFork
from elastic_launch.rendezvous import RendezvousHandler, RendezvousParameters, create_handler
from elastic_launch.rendezvous.team import TEAM_ENV, serve_team

logger = logging.getLogger(__name__)

HEARTBEAT_DIR = "/dev/shm"


def make_spawner(
    config: LaunchConfig,
    entrypoint: Entrypoint,
    cancel: CancelToken,
    guardian: Guardian | None = None,
) -> Spawner:
    """How this launch starts its workers: forked from a zygote (``--preload``, by default for
    every Python entrypoint, or ``fork``/``forkserver``), forked from the launcher for a
    function with ``fork``, else fresh interpreters (saying why when preloading was asked for).
    The zygote starts now, so that its imports overlap the rendezvous."""
    fresh = FreshInterpreter(entrypoint)
    if entrypoint.kind == Kind.FUNCTION and config.start_method == "fork":
        return FunctionFork()
    chosen = preload.plan(config.preload, entrypoint)
    forked_method = config.start_method == "forkserver" or (
        entrypoint.kind in (Kind.SCRIPT, Kind.MODULE) and config.start_method == "fork"
    )
    if entrypoint.is_python and (chosen.zygote or forked_method):
        return ZygoteFork(chosen.modules, fresh, cancel, guardian)
    if chosen.why_not:
        logger.warning("%s", chosen.why_not)
    return fresh


def rendezvous_parameters(config: LaunchConfig, run_id: str) -> RendezvousParameters:
    return RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        max_restarts=config.max_restarts,
        local_world_size=config.nproc_per_node,
        config=config.rdzv_configs,
        local_addr=config.local_addr,
        node_rank=config.node_rank,
        master_addr=config.master_addr,
        master_port=config.master_port,
    )


def _open_gpu(config: LaunchConfig) -> elastic_core.GpuHealth | None:
    if config.gpu_check_interval <= 0:
        return None
    gpu = elastic_core.GpuHealth(timeout=5.0)
    if gpu.state != elastic_core.GpuState.HEALTHY:
        logger.debug("GPU checks off: %s", gpu.detail)
        return None
    return gpu


@contextlib.contextmanager
def _file_timer(run_dir: str, run_id: str) -> Iterator[dict[str, str]]:
    """torch's file timer (``TORCHELASTIC_ENABLE_FILE_TIMER=1``), for scripts that use
    ``expires()``; it is the only thing that makes the launcher import torch. Yields the
    workers' extra environment."""
    if not compat.file_timer_requested():
        yield {}
        return
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerServer

    path = compat.file_timer_path(os.path.join(run_dir, f"watchdog_timer_{random_id()}"))
    server = FileTimerServer(path, run_id, max_interval=0.1, daemon=True)
    server.start()
    try:
        yield {compat.FILE_TIMER_FILE_ENV: path}
    finally:
        server.stop()


def _logs_requested(config: LaunchConfig) -> bool:
    redirects = config.redirects if isinstance(config.redirects, dict) else {0: config.redirects}
    tee = config.tee if isinstance(config.tee, dict) else {0: config.tee}
    return any(redirects.values()) or any(tee.values())


def run(
    config: LaunchConfig,
    entrypoint: Entrypoint,
    on_agent: Callable[[ElasticAgent], Any] | None = None,
) -> RunResult:
    """Run `entrypoint` on this node under `config` until the job succeeds, fails or is
    stopped. Raises ConfigError for bad settings before starting anything, and the rendezvous'
    errors (LaunchError) when the job cannot be formed. `on_agent` sees the agent before it
    runs (tests, embedding)."""
    check_config(config)
    entrypoint.check(config.start_method)
    run_id = config.run_id or random_id()
    with contextlib.ExitStack() as stack:
        cancel = CancelToken()
        stack.enter_context(SignalRelay(cancel, parse_signals(config.signals_to_handle)))
        guardian = stack.enter_context(Guardian())
        layout = stack.enter_context(LogLayout(config.log_dir, run_id, _logs_requested(config)))
        if layout.temporary and not layout.kept:
            guardian.remove_path(layout.temporary)
        metrics = parse_bind(config.metrics_port, "--metrics-port") if config.metrics_port else None
        events = stack.enter_context(
            Events.open(run_id, config.event_log_handler, config.events_file, metrics)
        )
        table = stack.enter_context(
            elastic_core.HeartbeatTable.create(
                f"{HEARTBEAT_DIR}/elasticrun-{os.getpid()}-{os.urandom(4).hex()}",
                config.nproc_per_node,
            )
        )
        guardian.remove_path(table.path)
        gpu = _open_gpu(config)
        watchdog = stack.enter_context(
            elastic_core.Watchdog(
                default_hang_timeout=0.0,
                # Heartbeats are compared every 50 ms, so a fixed --hang-timeout is kept to
                # within 100 ms even on a busy node (reading a few slots costs microseconds).
                hang_check_interval=0.05,
                gpu=gpu,
                gpu_check_interval=config.gpu_check_interval if gpu is not None else 0.0,
            )
        )
        spawner = make_spawner(config, entrypoint, cancel, guardian)
        stack.callback(spawner.close)
        extra_env = stack.enter_context(_file_timer(layout.run_dir, run_id))
        team = stack.enter_context(
            serve_team(
                config, run_id, layout.run_dir, can_serve=not isinstance(spawner, FunctionFork)
            )
        )
        extra_env = {**extra_env, TEAM_ENV: team.team.to_env()}
        if config.events_file:  # the train loop adds its rounds and rollbacks
            extra_env[EVENTS_FILE_ENV] = os.path.abspath(config.events_file)
        rdzv: RendezvousHandler = create_handler(rendezvous_parameters(config, run_id))
        stack.callback(rdzv.shutdown, cancel)
        group = stack.enter_context(
            WorkerGroup(
                config,
                entrypoint,
                run_id,
                layout,
                table,
                watchdog,
                spawner,
                gpu_count=gpu.device_count if gpu is not None else 0,
                guardian=guardian,
                extra_env=extra_env,
                host=socket.gethostname(),
            )
        )
        agent = ElasticAgent(
            config,
            group,
            rdzv,
            events,
            run_id=run_id,
            entrypoint=entrypoint.name,
            cancel=cancel,
            gpu=gpu,
            log_dir=layout.run_dir if layout.kept and layout.keep_logs else None,
            team=team,
        )
        if config.health_port:
            from elastic_launch.agent.health import HealthServer

            host, port = parse_bind(config.health_port, "--health-port")
            stack.enter_context(HealthServer(host, port, agent.health))
        if on_agent is not None:
            on_agent(agent)
        return agent.run()
    raise AssertionError("unreachable")  # pragma: no cover - the with block returns


def launch(
    config: LaunchConfig, entrypoint: str | Callable[..., Any], *args: Any
) -> dict[int, Any]:
    """Launch `entrypoint` on ``config.nproc_per_node`` workers, like torch's ``elastic_launch``.

    `entrypoint` is a function (called with `args` in each worker; it must be importable by
    reference unless ``start_method='fork'``) or a program (``sys.executable`` with a script,
    a ``.py`` path, or any binary) run with `args`. Returns the return values by global rank
    (None for programs). Raises WorkerFailedError when the job fails and LauncherStopped when a
    signal stopped it.
    """
    ep = Entrypoint.for_launch(entrypoint, args)
    result = run(config, ep)
    if result.state == AgentState.SUCCEEDED:
        return result.return_values
    if result.state == AgentState.STOPPED:
        raise LauncherStopped(result.signal or 0)
    raise WorkerFailedError(format_summary(ep.name, result), result)
