"""A whole launch checked before anything starts: a LaunchConfig however it was built (the
command line, or Python), and the plan :func:`~elastic_launch.launcher.runner.run` follows.
Every error quotes the bad value and says what to do.
"""

from __future__ import annotations

import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_launch.api import ConfigError, LaunchConfig, Std
from elastic_launch.eventlog import EVENTS_FILE_ENV
from elastic_launch.launcher.options import check_numbers
from elastic_launch.launcher.parse import (
    check_memory_limit,
    check_nproc,
    check_role,
    check_run_id,
    parse_hang_timeout,
    parse_nnodes,
    parse_signals,
    process_room,
    random_id,
)
from elastic_launch.net import parse_bind
from elastic_launch.processes.entrypoint import Entrypoint
from elastic_launch.rendezvous.api import RendezvousParameters
from elastic_launch.rendezvous.registry import check_parameters


def check_types(config: LaunchConfig) -> None:
    """Every field has its declared type: a wrong one names the field and the type."""
    import dataclasses
    import typing

    hints = typing.get_type_hints(type(config))
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if not _is(value, hints[f.name]):
            raise ConfigError(
                f"LaunchConfig.{f.name} = {value!r} ({type(value).__name__}) is not valid: "
                f"it takes {_type_name(hints[f.name])}"
            )


def _is(value: object, hint: object) -> bool:
    """Whether `value` is of type `hint` (unions, None, and containers checked item by item;
    a bool is not a number)."""
    import types
    import typing

    origin = typing.get_origin(hint)
    if hint is typing.Any:
        return True
    if origin in (typing.Union, types.UnionType):
        return any(_is(value, h) for h in typing.get_args(hint))
    if hint in _SCALARS:
        return _SCALARS[hint](value)
    if origin is None:
        return isinstance(value, hint)  # type: ignore[arg-type]
    return isinstance(value, origin) and _items_are(value, typing.get_args(hint))


_SCALARS: dict[object, Callable[[object], bool]] = {
    type(None): lambda v: v is None,
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
}


def _items_are(value: Any, args: tuple[object, ...]) -> bool:
    """A container's items against its type arguments (a dict's keys and values)."""
    if not args:
        return True
    if isinstance(value, dict):
        return all(_is(k, args[0]) and _is(v, args[1]) for k, v in value.items())
    return all(_is(v, args[0]) for v in value)


def _type_name(hint: object) -> str:
    import types
    import typing

    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "None"
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(hint))
        return f"{origin.__name__}[{args}]"
    return getattr(hint, "__name__", str(hint))


@dataclass(frozen=True)
class LaunchPlan:
    """A launch, checked and parsed before anything is opened: what :func:`run` needs besides
    the config itself."""

    config: LaunchConfig
    entrypoint: Entrypoint
    run_id: str
    signals: list[signal.Signals]  # forwarded to the workers
    metrics: tuple[str, int] | None  # where /metrics is served
    health: tuple[str, int] | None  # where /healthz is served
    logs_requested: bool  # --redirects or --tee asked for log files
    rendezvous: RendezvousParameters
    worker_env: dict[str, str]  # what every worker gets besides torchrun's variables


def plan_launch(
    config: LaunchConfig, entrypoint: Entrypoint, own_rendezvous: bool = True
) -> LaunchPlan:
    """Check `config` and `entrypoint` and parse what is left to parse: every error comes
    before the first resource is opened. Without `own_rendezvous` (the caller made the
    handler, as torch's agent API does) the rendezvous settings are the handler's business."""
    check_config(config)
    run_id = config.run_id or random_id()
    signals = parse_signals(config.signals_to_handle)
    logs = _any_stream(config.redirects) or _any_stream(config.tee)
    env = {EVENTS_FILE_ENV: os.path.abspath(config.events_file)} if config.events_file else {}
    rendezvous = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        max_restarts=config.max_restarts,
        local_world_size=config.nproc_per_node,
        role=config.role,
        config=config.rdzv_configs,
        local_addr=config.local_addr,
        node_rank=config.node_rank,
        master_addr=config.master_addr,
        master_port=config.master_port,
    )
    if own_rendezvous:
        check_parameters(rendezvous)
    metrics = parse_bind(config.metrics_port, "--metrics-port") if config.metrics_port else None
    health = parse_bind(config.health_port, "--health-port") if config.health_port else None
    entrypoint.check(config.start_method)
    return LaunchPlan(config, entrypoint, run_id, signals, metrics, health, logs, rendezvous, env)


def _any_stream(setting: Std | dict[int, Std]) -> bool:
    """Whether ``--redirects``/``--tee`` sends any stream of any rank to a file."""
    return any(setting.values()) if isinstance(setting, dict) else bool(setting)


def warm_spares(config: LaunchConfig) -> int:
    """The warm spares the zygote keeps: as given, else one per local worker, as many as the
    process limit leaves room for beside the workers and hot spares."""
    if config.warm_spares is not None:
        return config.warm_spares
    room = process_room()
    used = config.nproc_per_node + config.hot_spares
    return (
        config.nproc_per_node
        if room is None
        else min(config.nproc_per_node, max(0, room[0] - used))
    )


def _check_warm_spares(config: LaunchConfig) -> None:
    """Warm spares asked for fit the process limit beside the workers and hot spares (they
    are processes of the zygote: no descriptor of the launcher's)."""
    room = process_room()
    if config.warm_spares is None or not config.preload or room is None:
        return
    used = config.nproc_per_node + config.hot_spares
    if used + config.warm_spares > room[0]:
        raise ConfigError(
            f"--warm-spares '{config.warm_spares}': beside {used} workers and hot spares this "
            f"node can start at most {room[0]} processes ({room[1]}); give at most "
            f"{max(0, room[0] - used)}, or raise the limit"
        )


def check_config(config: LaunchConfig) -> None:
    """Reject a bad LaunchConfig before anything starts: each error names the field."""
    check_types(config)
    check_run_id(config.run_id)
    check_role(config.role)
    parse_nnodes(f"{config.min_nodes}:{config.max_nodes}", "min_nodes:max_nodes")
    if config.nproc_per_node < 1:
        raise ConfigError(f"nproc_per_node {config.nproc_per_node}: need at least 1 worker")
    check_numbers(config)
    check_nproc(config.nproc_per_node, spares=config.hot_spares)
    _check_warm_spares(config)
    most = config.max_nodes * config.nproc_per_node
    if config.min_workers is not None and config.min_workers > most:
        raise ConfigError(
            f"--min-workers {config.min_workers}: the job has at most {most} workers (--nnodes "
            f"{config.min_nodes}:{config.max_nodes} x --nproc-per-node {config.nproc_per_node});"
            f" give 1 to {most}"
        )
    if config.hang_timeout is not None and config.hang_timeout != math.inf:
        parse_hang_timeout(repr(config.hang_timeout), "hang_timeout")
    if config.start_method not in ("spawn", "fork", "forkserver"):
        raise ConfigError(
            f"--start-method '{config.start_method}': choose spawn, fork or forkserver"
        )
    for name in config.preload:
        if name in ("none", "off") or (
            name != "auto" and not all(part.isidentifier() for part in name.split("."))
        ):
            raise ConfigError(
                f"LaunchConfig.preload {config.preload!r}: {name!r} is not a module name; give "
                "module names, 'auto' (torch when the entrypoint imports it; the default is "
                "['auto']), or [] for fresh interpreters"
            )
    parse_signals(config.signals_to_handle)
    if config.memory_checkpoint_limit is not None:
        check_memory_limit(config.memory_checkpoint_limit, "memory_checkpoint_limit")
