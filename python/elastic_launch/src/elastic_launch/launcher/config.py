"""Parsing and checking of launcher settings. Every error quotes the bad value and says what to do.

Shared by the command line (:mod:`elastic_launch.launcher.cli`) and the Python API, so that a
value means the same thing in both.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from elastic_launch.agent.devices import usable_gpus
from elastic_launch.api import ConfigError, LaunchConfig, Std
from elastic_launch.eventlog import EVENTS_FILE_ENV
from elastic_launch.net import parse_bind
from elastic_launch.processes.entrypoint import Entrypoint
from elastic_launch.rendezvous.api import RendezvousParameters
from elastic_launch.rendezvous.registry import check_parameters

logger = logging.getLogger("elasticrun")


class NnodesError(ConfigError, RuntimeError):
    """A malformed ``--nnodes`` (a RuntimeError too, as torchrun raises)."""


def parse_nnodes(value: str, name: str = "--nnodes") -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` with 1 <= MIN <= MAX (at most :data:`MAX_NODES`)."""
    parts = value.split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        lo, hi = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise NnodesError(
            f"{name} '{value}' is not a node count: give N or MIN:MAX, for example 2 or 1:4"
        ) from None
    if lo < 1 or hi < lo or hi > MAX_NODES:
        raise ConfigError(
            f"{name} '{value}': need 1 <= MIN <= MAX <= {MAX_NODES} (got MIN={lo}, MAX={hi}); "
            "for example 1:4"
        )
    return lo, hi


MAX_NODES = 1_000_000  # beyond any cluster; a bound so a typo is an error, not a wait forever
# Descriptors the agent holds per worker (its pidfd, two output pipes, two log files, the
# process handle's) and for itself: what --nproc-per-node is checked against.
FDS_PER_WORKER = 6
FDS_OWN = 64


def max_workers_per_node() -> tuple[int, str]:
    """How many workers this node can run, and what sets the limit: the heartbeat table's
    slots, the open-file limit, or the user's process limit."""
    import resource

    limits = [(4096, "the heartbeat table holds 4096 workers")]
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        limits.append(
            (
                max(1, (soft - FDS_OWN) // FDS_PER_WORKER),
                f"the open-file limit is {soft} (ulimit -n) and the launcher needs "
                f"{FDS_PER_WORKER} per worker",
            )
        )
    nproc, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if nproc != resource.RLIM_INFINITY and os.geteuid() != 0:
        limits.append((max(1, nproc // 2), f"the process limit is {nproc} (ulimit -u)"))
    return min(limits)


def number(
    value: object,
    name: str,
    *,
    integer: bool = False,
    low: float = 0.0,
    high: float = math.inf,
    above: bool = False,
    what: str = "seconds",
) -> float:
    """A finite number in ``[low, high]`` (``(low, high]`` when `above`), or a ConfigError that
    quotes `value` under `name` (the flag, or the PET_ variable it came from)."""
    text = str(value).strip()
    try:
        x = int(text) if integer else float(text)
    except ValueError:
        x = math.nan
    too_low = x <= low if above else x < low
    if math.isnan(x) or math.isinf(x) or too_low or x > high:
        bound = f"more than {low:g}" if above else f"{low:g} or more"
        if high != math.inf:
            bound += f" and at most {high:g}"
        kind = "a whole number" if integer else "a number"
        raise ConfigError(f"{name} '{value}' is not valid: give {kind} of {what}, {bound}")
    return x


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def parse_nproc_per_node(value: str, name: str = "--nproc-per-node") -> int:
    """An integer from 1 to what the node can run, or ``cpu``, ``gpu``, ``auto`` (GPUs if
    any, else CPUs)."""
    text = value.strip().lower()
    if text == "cpu":
        return cpu_count()
    if text in ("gpu", "cuda", "auto"):
        n, note = usable_gpus()
        if n == 0 and text == "auto":
            if note:
                logger.warning("%s '%s': %s; counting CPUs instead", name, value, note)
            return cpu_count()
        if n == 0:
            found = note or "NVML reports none, or no NVIDIA driver is loaded"
            raise ConfigError(f"{name} '{value}': no GPU found ({found}); give a number, or 'cpu'")
        if note:
            logger.warning("%s '%s': %s", name, value, note)
        return n
    if text == "xpu":
        raise ConfigError(
            f"{name} '{value}': Intel XPUs are not supported by elasticrun; give a number"
        )
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(
            f"{name} '{value}' is not valid: give a number > 0, or auto, cpu, gpu"
        ) from None
    if n < 1:
        raise ConfigError(f"{name} '{value}': need at least 1 worker per node")
    check_nproc(n, name)
    return n


def check_nproc(n: int, name: str = "nproc_per_node") -> None:
    limit, why = max_workers_per_node()
    if n > limit:
        raise ConfigError(
            f"{name} '{n}': this node can run at most {limit} workers ({why}); give a smaller "
            "count, or raise the limit"
        )


_STD_ONE = re.compile(r"^[0-3]$")
_STD_MAP = re.compile(r"^(\d+:[0-3],)*(\d+:[0-3])$")


def parse_std(value: str, flag: str) -> Std | dict[int, Std]:
    """``--redirects``/``--tee``: ``0``-``3`` for every rank, or ``RANK:N,...`` per local rank
    (1 = stdout, 2 = stderr, 3 = both)."""
    text = value.strip()
    if _STD_ONE.match(text):
        return Std(int(text))
    if _STD_MAP.match(text):
        mapping: dict[int, Std] = {}
        for item in text.split(","):
            rank, std = item.split(":")
            mapping[int(rank)] = Std(int(std))
        return mapping
    raise ConfigError(
        f"{flag} '{value}' is not valid: give 0 (none), 1 (stdout), 2 (stderr) or 3 (both) for "
        f"every local rank, or LOCAL_RANK:N pairs such as 0:3,1:2"
    )


def parse_ranks_filter(value: str, name: str = "--local-ranks-filter") -> set[int] | None:
    """``--local-ranks-filter``: comma-separated local ranks; empty means all."""
    text = value.strip()
    if not text:
        return None
    try:
        ranks = {int(x) for x in text.split(",")}
    except ValueError:
        raise ConfigError(
            f"{name} '{value}' is not valid: give comma-separated local ranks, for example 0,1,2"
        ) from None
    if any(r < 0 for r in ranks):
        raise ConfigError(f"{name} '{value}': local ranks are 0 or more")
    return ranks


def parse_signals(value: str) -> list[signal.Signals]:
    """``--signals-to-handle``: comma-separated names such as SIGTERM,SIGUSR1."""
    out: list[signal.Signals] = []
    for name in (x.strip() for x in value.split(",")):
        if not name:
            continue
        try:
            sig = signal.Signals[name if name.startswith("SIG") else "SIG" + name]
        except KeyError:
            raise ConfigError(
                f"--signals-to-handle '{value}': '{name}' is not a signal name; use names "
                "such as SIGTERM,SIGINT,SIGHUP,SIGUSR1"
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise ConfigError(f"--signals-to-handle: {sig.name} cannot be handled or forwarded")
        out.append(sig)
    return out


def parse_list(value: str) -> list[str]:
    """Comma-separated values, with ``,,`` standing for a literal comma (torch's rule)."""
    if not value:
        return []
    return [part.replace("\0", ",") for part in value.replace(",,", "\0").split(",") if part]


def parse_rdzv_conf(value: str) -> dict[str, str]:
    """``--rdzv-conf key=value,key=value``; values stay strings, each backend checks its keys.
    A pair of quotes around the whole (``'a=1,b=2'``) or around a value (``a='1'``), which a
    shell or a YAML file leaves in place, is taken off."""
    out: dict[str, str] = {}
    text = unquote(value.strip())
    if not text:
        return out
    for item in text.split(","):
        key, sep, val = item.partition("=")
        key, val = key.strip(), unquote(val.strip())
        if not key or not sep:
            raise ConfigError(
                f"--rdzv-conf '{value}': '{item}' is not key=value; write it like "
                "join_timeout=900,read_timeout=20"
            )
        if not val:
            raise ConfigError(f"--rdzv-conf '{value}': option '{key}' needs a value")
        out[key] = val
    return out


def unquote(text: str) -> str:
    """`text` without one pair of matching quotes around it."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1].strip()
    return text


def parse_preload(values: Iterable[str]) -> list[str]:
    """``--preload`` (comma-separated, repeatable): ``auto`` (the default: torch when the
    script imports it), module names imported on top of it, or ``none`` alone (fresh
    interpreters). Returns ``LaunchConfig.preload``: ``auto`` first unless ``none``."""
    out: list[str] = []
    off = False
    for value in values:
        for name in (x.strip() for x in value.split(",")):
            if not name:
                continue
            if name.lower() in ("none", "off"):
                off = True
                continue
            if name.lower() == "auto":
                continue
            if not all(part.isidentifier() for part in name.split(".")):
                raise ConfigError(
                    f"--preload '{value}': '{name}' is not a module name; give names such as "
                    "torch,numpy, or auto, or none"
                )
            out.append(name)
    if off and out:
        raise ConfigError(
            f"--preload none turns preloading off, but modules are named too ({','.join(out)}): "
            "give either none or the modules"
        )
    return [] if off else ["auto", *out]


MAX_SECONDS = 1e9  # the longest duration the core takes (about 31 years)


def parse_hang_timeout(value: str, name: str = "--hang-timeout") -> float | None:
    """``--hang-timeout``: seconds (> 0), ``auto`` (None), or ``0``/``off`` (disabled: inf)."""
    text = value.strip().lower()
    if text == "auto":
        return None
    if text in ("0", "off", "none"):
        return float("inf")
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds <= MAX_SECONDS:
        raise ConfigError(
            f"{name} '{value}' is not valid: give seconds (more than 0 and at most "
            f"{MAX_SECONDS:g}; for example 300), 'auto' to learn it, or 'off'"
        )
    return seconds


def random_id() -> str:
    """A random UUID4 string, without importing uuid (~10 ms of launcher start-up)."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


@dataclass(frozen=True)
class Range:
    """The valid values of one of LaunchConfig's numbers, shared by the command line and the
    Python API (the flag's name and its PET_ variable come from the field's)."""

    field: str
    low: float
    high: float
    what: str  # the unit, for the error: "seconds", "a port"...
    integer: bool = False
    above: bool = False  # low itself is not valid

    def check(self, value: object, name: str | None = None) -> float:
        return number(
            value,
            name or self.field,
            integer=self.integer,
            low=self.low,
            high=self.high,
            above=self.above,
            what=self.what,
        )


RANGES: dict[str, Range] = {
    r.field: r
    for r in (
        Range("max_restarts", 0, 1_000_000, "restarts", integer=True),
        Range("monitor_interval", 0, 60, "seconds", above=True),
        Range("node_rank", 0, MAX_NODES - 1, "a node rank", integer=True),
        Range("master_port", 1, 65535, "a port", integer=True),
        Range("shutdown_timeout", 0, 86_400, "seconds"),
        Range("hang_timeout_floor", 0, MAX_SECONDS, "seconds", above=True),
        Range("hang_timeout_factor", 0, 1_000_000, "times the step interval", above=True),
        Range("stack_dump_timeout", 0, 3600, "seconds"),
        Range("gpu_check_interval", 0, 86_400, "seconds"),
        Range("min_workers", 1, 1 << 31, "a number of workers", integer=True),
        Range("loop_max_restarts", 0, 1_000_000, "restarts", integer=True),
        Range("warm_spares", 0, 4096, "a number of workers", integer=True),
    )
}

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
    "t": 1 << 40,
    "tib": 1 << 40,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
}


def parse_size(value: object, name: str) -> int:
    """Bytes: a whole number with an optional unit (KiB, MiB, GiB, TiB, or KB, MB, GB, TB),
    or a ConfigError that quotes `value` under `name`."""
    text = str(value).strip()
    m = re.fullmatch(r"([0-9]+)\s*([A-Za-z]*)", text)  # ASCII digits: not '²'
    if m is None or m.group(2).lower() not in _SIZE_UNITS:
        raise ConfigError(
            f"{name} '{value}' is not valid: give bytes as a whole number with an optional "
            "unit, such as 512MiB or 8GiB"
        )
    return int(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]


def check_memory_limit(value: object, name: str) -> int:
    """The bytes one rank's memory-tier checkpoints may take (two copies of its state)."""
    n = parse_size(value, name)
    if n < 1 << 20:
        raise ConfigError(
            f"{name} '{value}' is {n} bytes: give at least 1MiB (a rank's memory tier holds "
            "two copies of its checkpoint; size it for twice the state, as 8GiB)"
        )
    return n


def check_range(field_name: str, value: object, name: str | None = None) -> float:
    """`value` for LaunchConfig's `field_name`, checked against :data:`RANGES`."""
    return RANGES[field_name].check(value, name)


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


MAX_RUN_ID = 256


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


MAX_ROLE = 128


def check_run_id(run_id: str) -> None:
    """A run id names the job's keys (``/elasticrun/<run id>/...``): a '/' would put them
    inside another job's, and control characters would garble every message naming it."""
    bad = next((c for c in run_id if c == "/" or ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None or len(run_id) > MAX_RUN_ID:
        what = f"it holds {bad!r}" if bad is not None else f"it is over {MAX_RUN_ID} characters"
        raise ConfigError(
            f"--rdzv-id {run_id!r}: {what}; give the job an id without '/' or control "
            f"characters, of at most {MAX_RUN_ID} characters (the scheduler's job id is a good one)"
        )


def check_role(role: str) -> None:
    """A role starts every line of its workers' output (``[role:rank]``): a control character
    in it (a newline) would let it forge lines of other workers, or of the launcher."""
    bad = next((c for c in role if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None or not role or len(role) > MAX_ROLE:
        what = f"it holds {bad!r}" if bad is not None else "it is empty or too long"
        raise ConfigError(
            f"--role {role!r}: {what}; give a name of 1 to {MAX_ROLE} characters without "
            "control characters (the default is 'default')"
        )


def check_config(config: LaunchConfig) -> None:
    """Reject a bad LaunchConfig before anything starts: each error names the field."""
    check_types(config)
    check_run_id(config.run_id)
    check_role(config.role)
    parse_nnodes(f"{config.min_nodes}:{config.max_nodes}", "min_nodes:max_nodes")
    if config.nproc_per_node < 1:
        raise ConfigError(f"nproc_per_node {config.nproc_per_node}: need at least 1 worker")
    check_nproc(config.nproc_per_node)
    for name in RANGES:
        value = getattr(config, name)
        if value is not None:
            check_range(name, value)
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
