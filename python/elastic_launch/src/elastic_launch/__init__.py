"""elastic_launch: the ``elasticrun`` launcher, the elastic agent and rendezvous.

Python API (torch's ``elastic_launch``, same semantics)::

    from elastic_launch import LaunchConfig, launch

    results = launch(LaunchConfig(nproc_per_node=2, max_restarts=3), train, lr)  # by rank

Workers can mark custom loops as making progress with ``elastic_core.beat()``; loops built on a
``torch.optim`` optimizer beat on every step without any change.

The parts, top to bottom (each imports only those below it):

- ``launcher``: the command line, the checking of settings, ``run()`` (owns a launch's resources)
- ``agent``: the node's agent, its decisions, the worker group, hang and health
- ``train_loop``: the classic torchelastic loop (runs in the workers)
- ``rendezvous``: how nodes (and the loop's workers) agree on a round
- ``processes``: spawning workers, the zygote, the worker's own side, the guardian
- the foundation: ``api`` (interfaces, data classes, errors), ``cancel`` (deadlines and
  cancellation), ``compat`` (torchrun's environment contract), ``errors`` (error files,
  ``@record``), ``net``, ``teardown`` (how a worker lets go of its process groups and ends)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_launch.api import (
        AgentState,
        ConfigError,
        FailureKind,
        LaunchConfig,
        LaunchError,
        LauncherStopped,
        RunResult,
        Std,
        WorkerFailedError,
        WorkerFailure,
        WorkerState,
    )
    from elastic_launch.errors import record
    from elastic_launch.train_loop import (
        Coordinator,
        NonRetryableException,
        State,
        StopException,
        WorkerStats,
        train,
    )

# Names are imported on first use: workers import this package (through worker_main) before
# their script, and every import here would be paid at each worker start.
_LAZY = {
    "AgentState": "api",
    "ConfigError": "api",
    "FailureKind": "api",
    "LaunchConfig": "api",
    "LaunchError": "api",
    "LauncherStopped": "api",
    "RunResult": "api",
    "Std": "api",
    "WorkerFailedError": "api",
    "WorkerFailure": "api",
    "WorkerState": "api",
    "record": "errors",
    # The classic torchelastic train loop.
    "Coordinator": "train_loop",
    "CoordinatorP2P": "train_loop",
    "NonRetryableException": "train_loop",
    "SimpleWorkerStats": "train_loop",
    "State": "train_loop",
    "StopException": "train_loop",
    "UserMethodError": "train_loop",
    "WorkerStats": "train_loop",
    "train": "train_loop",
}


def launch(config: LaunchConfig, entrypoint: Any, *args: Any) -> dict[int, Any]:
    """Launch `entrypoint` under `config`; see :func:`elastic_launch.launcher.runner.launch`."""
    from elastic_launch.launcher.runner import launch as _launch

    return _launch(config, entrypoint, *args)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"elastic_launch.{_LAZY[name]}"), name)
    if name == "__version__":
        from elastic_launch._version import __version__

        return __version__
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AgentState",
    "ConfigError",
    "Coordinator",
    "CoordinatorP2P",
    "FailureKind",
    "LaunchConfig",
    "LaunchError",
    "LauncherStopped",
    "NonRetryableException",
    "RunResult",
    "SimpleWorkerStats",
    "State",
    "Std",
    "StopException",
    "UserMethodError",
    "WorkerFailedError",
    "WorkerFailure",
    "WorkerState",
    "WorkerStats",
    "__version__",
    "launch",
    "record",
    "train",
]
