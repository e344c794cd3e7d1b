"""Parsing and checking of launcher settings. Every error quotes the bad value and says what to do.

Shared by the command line (:mod:`elastic_launch.cli`) and the Python API, so that a value means
the same thing in both.
"""

from __future__ import annotations

import math
import os
import re
import signal
from collections.abc import Iterable

from elastic_launch.api import ConfigError, LaunchConfig, Std
from elastic_launch.devices import visible_gpu_count


def parse_nnodes(value: str) -> tuple[int, int]:
    """``"N"`` or ``"MIN:MAX"`` with 1 <= MIN <= MAX."""
    parts = value.split(":")
    try:
        if len(parts) not in (1, 2):
            raise ValueError
        lo, hi = (int(parts[0]), int(parts[-1]))
    except ValueError:
        raise ConfigError(
            f"--nnodes '{value}' is not a node count: give N or MIN:MAX, for example 2 or 1:4"
        ) from None
    if lo < 1 or hi < lo:
        raise ConfigError(
            f"--nnodes '{value}': need 1 <= MIN <= MAX (got MIN={lo}, MAX={hi}); "
            "for example --nnodes 1:4"
        )
    return lo, hi


def cpu_count() -> int:
    return len(os.sched_getaffinity(0))


def parse_nproc_per_node(value: str) -> int:
    """An integer > 0, or ``cpu``, ``gpu``, ``auto`` (GPUs if any, else CPUs)."""
    text = value.strip().lower()
    if text == "cpu":
        return cpu_count()
    if text in ("gpu", "cuda"):
        n = visible_gpu_count()
        if n == 0:
            raise ConfigError(
                f"--nproc-per-node {value}: no GPU found (NVML reports none, or no NVIDIA "
                "driver is loaded); give a number, or 'cpu'"
            )
        return n
    if text == "auto":
        return visible_gpu_count() or cpu_count()
    if text == "xpu":
        raise ConfigError(
            "--nproc-per-node xpu: Intel XPUs are not supported by elasticrun; give a number"
        )
    try:
        n = int(text)
    except ValueError:
        raise ConfigError(
            f"--nproc-per-node '{value}' is not valid: give a number > 0, or auto, cpu, gpu"
        ) from None
    if n < 1:
        raise ConfigError(f"--nproc-per-node {value}: need at least 1 worker per node")
    return n


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


def std_for(setting: Std | dict[int, Std], local_rank: int) -> Std:
    if isinstance(setting, dict):
        return setting.get(local_rank, Std.NONE)
    return setting


def parse_ranks_filter(value: str) -> set[int] | None:
    """``--local-ranks-filter``: comma-separated local ranks; empty means all."""
    text = value.strip()
    if not text:
        return None
    try:
        ranks = {int(x) for x in text.split(",")}
    except ValueError:
        raise ConfigError(
            f"--local-ranks-filter '{value}' is not valid: give comma-separated local ranks, "
            "for example 0,1,2"
        ) from None
    if any(r < 0 for r in ranks):
        raise ConfigError(f"--local-ranks-filter '{value}': local ranks are 0 or more")
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
    """``--rdzv-conf key=value,key=value``; values stay strings, each backend checks its keys."""
    out: dict[str, str] = {}
    text = value.strip()
    if not text:
        return out
    for item in text.split(","):
        key, sep, val = item.partition("=")
        key, val = key.strip(), val.strip()
        if not key or not sep:
            raise ConfigError(
                f"--rdzv-conf '{value}': '{item}' is not key=value; write it like "
                "join_timeout=600,last_call_timeout=30"
            )
        if not val:
            raise ConfigError(f"--rdzv-conf '{value}': option '{key}' needs a value")
        out[key] = val
    return out


def parse_endpoint(value: str, flag: str, default_port: int | None = None) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` (or ``host`` when there is a default port)."""
    text = value.strip()
    host, port_text = text, ""
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ConfigError(f"{flag} '{value}': an IPv6 address needs a closing ']'")
        host, rest = text[1:close], text[close + 1 :]
        if rest and not rest.startswith(":"):
            raise ConfigError(f"{flag} '{value}' is not host:port")
        port_text = rest[1:]
    elif text.count(":") == 1:
        host, port_text = text.split(":")
    elif text.count(":") > 1:
        raise ConfigError(f"{flag} '{value}': write an IPv6 address in brackets, [::1]:29400")
    if not host:
        raise ConfigError(f"{flag} '{value}' has no host: write it like node0:29400")
    if not port_text:
        if default_port is None:
            raise ConfigError(f"{flag} '{value}' has no port: write it like {host}:29400")
        return host, default_port
    if not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(f"{flag} '{value}': port '{port_text}' is not a number from 0 to 65535")
    return host, int(port_text)


def parse_bind(value: str, flag: str) -> tuple[str, int]:
    """``PORT`` (on 127.0.0.1) or ``HOST:PORT`` for the servers the launcher runs."""
    if value.isdigit():
        port = int(value)
        if port > 65535:
            raise ConfigError(f"{flag} '{value}' is not a port number (0 to 65535)")
        return "127.0.0.1", port
    return parse_endpoint(value, flag)


def parse_preload(values: Iterable[str]) -> list[str]:
    """``--preload torch,numpy`` (repeatable): importable module names."""
    out: list[str] = []
    for value in values:
        for name in (x.strip() for x in value.split(",")):
            if not name:
                continue
            if not all(part.isidentifier() for part in name.split(".")):
                raise ConfigError(
                    f"--preload '{value}': '{name}' is not a module name; give names such as "
                    "torch,numpy"
                )
            out.append(name)
    return out


def parse_hang_timeout(value: str) -> float | None:
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
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(
            f"--hang-timeout '{value}' is not valid: give seconds (for example 300), 'auto' "
            "to learn it from the step time, or 'off'"
        )
    return seconds


def random_id() -> str:
    """A random UUID4 string, without importing uuid (~10 ms of launcher start-up)."""
    b = bytearray(os.urandom(16))
    b[6] = (b[6] & 0x0F) | 0x40
    b[8] = (b[8] & 0x3F) | 0x80
    h = b.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def check_positive(value: float, flag: str, allow_zero: bool = False) -> float:
    if math.isnan(value) or value < 0 or (value == 0 and not allow_zero):
        bound = "0 or more" if allow_zero else "more than 0"
        raise ConfigError(f"{flag} {value!r}: must be {bound}")
    return value


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
    parse_signals(config.signals_to_handle)
