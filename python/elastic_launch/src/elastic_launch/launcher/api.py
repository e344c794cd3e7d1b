"""torch's launcher API (``torch.distributed.launcher.api``) on elasticrun: a script that uses
``elastic_launch``, ``launch_agent`` or ``LaunchConfig`` changes only its import.

    from elastic_launch.launcher.api import LaunchConfig, elastic_launch

    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=4, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0")
    outputs = elastic_launch(config, train)(lr)        # {global rank: return value}

:class:`LaunchConfig` has torch's defaults where they differ from the command line's
(``role="default_role"``, ``rdzv_backend="etcd"``, ``max_restarts=3``: each option's
:class:`~elastic_launch.launcher.options.TorchDefault`; a rendezvous timeout of 900 s) and
takes torch's extra fields (``logs_specs``, ``rdzv_timeout``, ``log_line_prefix_template``,
``metrics_cfg``). A failed job raises a ``ChildFailedError``
(:class:`~elastic_launch.api.WorkerFailedError`, which ``except ChildFailedError`` catches with
torch's own class too, when torch is there), a signal :class:`SignalException`.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_launch import api
from elastic_launch.api import AgentState, ConfigError, Std, WorkerFailedError
from elastic_launch.errors import ChildFailedError, ProcessFailure
from elastic_launch.launcher.options import torch_default

__all__ = [
    "ChildFailedError",
    "LaunchConfig",
    "ProcessFailure",
    "SignalException",
    "elastic_launch",
    "launch_agent",
]

#: torch's launcher: the rendezvous' overall timeout when none is given.
DEFAULT_RDZV_TIMEOUT = 900

#: torch's name for the exception of a launch stopped by a signal (``sigval`` is its number).
SignalException = api.LauncherStopped


@dataclass
class LaunchConfig(api.LaunchConfig):
    """torch's ``LaunchConfig``: elasticrun's, with torch's defaults and extra fields."""

    logs_specs: object = None  # torch's DefaultLogsSpecs (log_dir, redirects, tee), or None
    role: str = torch_default("role")
    rdzv_backend: str = torch_default("rdzv-backend")
    rdzv_timeout: int = -1  # seconds; -1: rdzv_configs' "timeout", else 900
    max_restarts: int = torch_default("max-restarts")
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    numa_options: object = None

    def __post_init__(self) -> None:
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        elif "timeout" not in self.rdzv_configs and "join_timeout" not in self.rdzv_configs:
            self.rdzv_configs["timeout"] = DEFAULT_RDZV_TIMEOUT
        if self.numa_options is not None:
            raise ConfigError(
                f"LaunchConfig.numa_options {self.numa_options!r} is not supported by "
                "elasticrun; bind workers with numactl in the script, or leave it out"
            )
        if self.logs_specs is not None:
            take_logs_specs(self, self.logs_specs)


def take_logs_specs(config: api.LaunchConfig, specs: object) -> None:
    """torch's logs specs (``DefaultLogsSpecs``, torch's or ours), read by attribute: where
    logs go, which streams, which local ranks."""
    root = getattr(specs, "root_log_dir", None) or getattr(specs, "_root_log_dir", None)
    if isinstance(root, str):
        config.log_dir = root
    for name in ("redirects", "tee"):
        value = getattr(specs, name, getattr(specs, f"_{name}", None))
        if isinstance(value, dict):
            setattr(config, name, {int(k): Std(int(v)) for k, v in value.items()})
        elif value is not None:
            setattr(config, name, Std(int(value)))
    ranks = getattr(specs, "local_ranks_filter", getattr(specs, "_local_ranks_filter", None))
    if ranks is not None:
        config.local_ranks_filter = set(ranks)


class elastic_launch:  # noqa: N801 - torch's name
    """``elastic_launch(config, entrypoint)(*args)``: run `entrypoint` on this node's workers
    until the job succeeds: the return values by global rank (None for a program)."""

    def __init__(self, config: api.LaunchConfig, entrypoint: Callable[..., Any] | str) -> None:
        self._config = config
        self._entrypoint = entrypoint

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args))


def launch_agent(
    config: api.LaunchConfig, entrypoint: Callable[..., Any] | str | None, args: list[Any]
) -> dict[int, Any]:
    """torch's ``launch_agent``: run the workers; their return values by global rank. Raises a
    ``ChildFailedError`` when the job fails and :data:`SignalException` when a signal stops
    it."""
    from elastic_launch.agent.summary import format_summary
    from elastic_launch.launcher.runner import run
    from elastic_launch.processes.entrypoint import Entrypoint

    if entrypoint is None:
        raise ConfigError("launch_agent needs an entrypoint: a function, or a program")
    name = _get_entrypoint_name(entrypoint, args)
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = config.signals_to_handle  # as torch's does
    template = getattr(config, "log_line_prefix_template", None)
    if template:
        os.environ["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = template
    ep = Entrypoint.for_launch(entrypoint, tuple(args))
    result = run(config, ep)
    if result.state == AgentState.SUCCEEDED:
        return result.return_values
    if result.state == AgentState.STOPPED:
        raise SignalException(result.signal or 0)
    raise torch_catchable()(format_summary(ep.name, result), result, name)


@functools.lru_cache(maxsize=1)
def torch_catchable() -> type[WorkerFailedError]:
    """The failure torch's launcher raises: elasticrun's, which torch's own
    ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError`` catches too (a script
    that only swapped its import still catches torch's name). Without torch, elasticrun's."""
    try:
        from torch.distributed.elastic.multiprocessing import errors
    except ImportError:
        return WorkerFailedError
    doc = "A failed job: elasticrun's WorkerFailedError and torch's ChildFailedError at once."
    body = {"__module__": __name__, "__doc__": doc}
    return type("ChildFailedError", (WorkerFailedError, errors.ChildFailedError), body)


def _get_entrypoint_name(entrypoint: Callable[..., Any] | str | None, args: list[Any]) -> str:
    """What a failure names, as torch's: a function's name; with the Python interpreter, the
    first argument that is no option (the script); any other program, itself."""
    if callable(entrypoint):
        return getattr(entrypoint, "__name__", repr(entrypoint))
    if isinstance(entrypoint, str):
        if entrypoint == sys.executable:
            return next((str(a) for a in args if not str(a).startswith("-")), "")
        return entrypoint
    return ""
