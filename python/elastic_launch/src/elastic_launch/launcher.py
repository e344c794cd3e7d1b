"""Running a job: the Python API behind ``elasticrun`` (:func:`launch`, :func:`run`)."""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable
from typing import Any

from elastic_launch.agent import ElasticAgent
from elastic_launch.api import (
    ConfigError,
    LaunchConfig,
    LauncherStopped,
    RunResult,
    RunState,
    WorkerFailedError,
)
from elastic_launch.config import check_positive, parse_bind, random_id
from elastic_launch.events import (
    EventHandler,
    Events,
    JsonLinesHandler,
    PrometheusHandler,
    handler_for_name,
)
from elastic_launch.rendezvous import RendezvousParameters, create_handler
from elastic_launch.summary import format_summary
from elastic_launch.workers import Entrypoint

logger = logging.getLogger(__name__)

_PYTHON_FLAGS_WITH_VALUE = {"-W", "-X", "-Q"}


def entrypoint_for(target: str | Callable[..., Any], args: tuple[Any, ...]) -> Entrypoint:
    """Torch's entrypoint convention: a function, or a program with its arguments. A Python
    interpreter with a script or ``-m module`` runs through the bootstrap, so that it gets the
    beat hook and stack dumps like any elasticrun worker."""
    if callable(target):
        return Entrypoint("function", target, fn_args=args)
    argv = [str(a) for a in args]
    if target.endswith(".py"):
        return Entrypoint("script", target, argv)
    if os.path.basename(target).startswith("python"):
        i = 0
        while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
            i += 2 if argv[i] in _PYTHON_FLAGS_WITH_VALUE else 1
        if i < len(argv) - 1 and argv[i] == "-m":
            return Entrypoint("module", argv[i + 1], argv[i + 2 :])
        if i < len(argv):
            return Entrypoint("script", argv[i], argv[i + 1 :])
    return Entrypoint("binary", target, argv)


def check_config(config: LaunchConfig) -> None:
    """Reject a bad LaunchConfig before anything starts."""
    if not 1 <= config.min_nodes <= config.max_nodes:
        raise ConfigError(
            f"nodes: need 1 <= min_nodes <= max_nodes (got {config.min_nodes}:{config.max_nodes})"
        )
    if config.nproc_per_node < 1:
        raise ConfigError(f"nproc_per_node {config.nproc_per_node}: need at least 1 worker")
    if config.max_restarts < 0:
        raise ConfigError(f"max_restarts {config.max_restarts}: must be 0 or more")
    check_positive(config.monitor_interval, "--monitor-interval")
    check_positive(config.shutdown_timeout, "--shutdown-timeout", allow_zero=True)
    check_positive(config.hang_timeout_floor, "--hang-timeout-floor")
    check_positive(config.hang_timeout_factor, "--hang-timeout-factor")
    check_positive(config.gpu_check_interval, "--gpu-check-interval", allow_zero=True)
    if config.start_method not in ("spawn", "fork", "forkserver"):
        raise ConfigError(
            f"--start-method '{config.start_method}': choose spawn, fork or forkserver"
        )


def check_entrypoint(ep: Entrypoint) -> None:
    """A missing script or program is reported before any worker starts."""
    if ep.kind == "script" and not os.path.isfile(str(ep.target)):
        raise ConfigError(
            f"training script '{ep.target}' does not exist (looked in {os.getcwd()}); check "
            "the path, or pass -m for a module"
        )
    if ep.kind == "binary":
        target = str(ep.target)
        found = shutil.which(target) if os.sep not in target else target
        if not found or not os.access(found, os.X_OK):
            raise ConfigError(
                f"program '{target}' is not an executable file or on PATH (with --no-python "
                "the script is run directly: it needs execute permission and a #! line)"
            )
    if ep.kind == "module":
        import importlib.util

        try:
            spec = importlib.util.find_spec(str(ep.target))
        except (ImportError, ValueError):
            spec = None
        if spec is None:
            raise ConfigError(
                f"module '{ep.target}' cannot be found (from {os.getcwd()}); check its name "
                "and that its package is installed"
            )


def _event_handlers(config: LaunchConfig) -> list[EventHandler]:
    handlers = [handler_for_name(config.event_log_handler)]
    if config.events_file:
        handlers.append(JsonLinesHandler(config.events_file))
    if config.metrics_port:
        host, port = parse_bind(config.metrics_port, "--metrics-port")
        handlers.append(PrometheusHandler(host, port))
    return handlers


def run(config: LaunchConfig, entrypoint: Entrypoint) -> RunResult:
    """Run `entrypoint` on this node under `config` until the job succeeds, fails or is
    stopped. Raises ConfigError for bad settings before starting anything."""
    check_config(config)
    check_entrypoint(entrypoint)
    run_id = config.run_id or random_id()
    rdzv = create_handler(
        RendezvousParameters(
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
    )
    handlers = _event_handlers(config)
    events = Events(run_id, handlers)
    health = None
    try:
        agent = ElasticAgent(config, entrypoint, rdzv, events, run_id)
        if config.health_port:
            from elastic_launch.health import HealthServer

            host, port = parse_bind(config.health_port, "--health-port")
            health = HealthServer(host, port, agent.health)
        return agent.run()
    finally:
        if health is not None:
            health.close()
        events.close()


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
    ep = entrypoint_for(entrypoint, args)
    result = run(config, ep)
    if result.state == RunState.SUCCEEDED:
        return result.return_values
    if result.state == RunState.STOPPED:
        raise LauncherStopped(result.signal or 0)
    raise WorkerFailedError(format_summary(ep.name, result), result)
