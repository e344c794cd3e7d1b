"""elastic_launch: the ``elasticrun`` launcher, the elastic agent and rendezvous.

Python API (torch's ``elastic_launch``, same semantics)::

    from elastic_launch import LaunchConfig, launch

    results = launch(LaunchConfig(nproc_per_node=2, max_restarts=3), train, lr)  # by rank

Workers can mark custom loops as making progress with ``elastic_core.beat()``; loops built on a
``torch.optim`` optimizer beat on every step without any change.
"""

from __future__ import annotations

from elastic_launch.api import (
    ConfigError,
    FailureKind,
    LaunchConfig,
    LaunchError,
    LauncherStopped,
    RunResult,
    RunState,
    Std,
    WorkerFailedError,
    WorkerFailure,
)
from elastic_launch.errors import record


def launch(config: LaunchConfig, entrypoint: object, *args: object) -> dict[int, object]:
    """Launch `entrypoint` under `config`; see :func:`elastic_launch.launcher.launch`."""
    from elastic_launch.launcher import launch as _launch

    return _launch(config, entrypoint, *args)  # type: ignore[arg-type]


def __getattr__(name: str) -> str:
    # Looked up on demand: importlib.metadata costs ~40 ms of start-up.
    if name == "__version__":
        from importlib.metadata import version

        return version("elasticrun-launch")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ConfigError",
    "FailureKind",
    "LaunchConfig",
    "LaunchError",
    "LauncherStopped",
    "RunResult",
    "RunState",
    "Std",
    "WorkerFailedError",
    "WorkerFailure",
    "__version__",
    "launch",
    "record",
]
