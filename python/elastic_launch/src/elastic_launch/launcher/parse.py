"""The launcher's values, one at a time: each parser takes what a flag, a ``PET_`` variable or
the Python API gave, and returns the value or a ConfigError that quotes it and says what to do.

:mod:`elastic_launch.launcher.options` names which parser each option uses.
"""

from __future__ import annotations

import logging
import math
import os
import re
import signal
from collections.abc import Iterable
from dataclasses import dataclass

from elastic_launch.agent.devices import usable_gpus
from elastic_launch.api import ConfigError, Std

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
#: Where no resource limit bounds the workers of a node (both unlimited): a sanity bound.
MAX_LOCAL_WORKERS = 1 << 16


def max_workers_per_node() -> tuple[int, str]:
    """How many workers (hot spares included) this node can run, and what sets the limit:
    the open-file limit, or the user's process limit. (Each worker beats into a table of its
    own: the core's slot limit per table does not bound them.)"""
    import resource

    limits: list[tuple[int, str]] = []
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY:
        limits.append(
            (
                max(1, (soft - FDS_OWN) // FDS_PER_WORKER),
                f"the open-file limit is {soft} (ulimit -n) and the launcher needs "
                f"{FDS_PER_WORKER} per worker",
            )
        )
    room = process_room()
    if room is not None:
        limits.append(room)
    return min(limits, default=(MAX_LOCAL_WORKERS, f"at most {MAX_LOCAL_WORKERS} per node"))


def process_room() -> tuple[int, str] | None:
    """How many processes the launcher may start on this node (half the user's process
    limit: a worker may start its own), and what says so; None where nothing bounds it (no
    limit, or root)."""
    import resource

    nproc, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if nproc == resource.RLIM_INFINITY or os.geteuid() == 0:
        return None
    return max(1, nproc // 2), f"the process limit is {nproc} (ulimit -u)"


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


def check_nproc(n: int, name: str = "nproc_per_node", spares: int = 0) -> None:
    """`n` workers and `spares` hot spares (each holds a worker's resources) fit this node;
    the error quotes both and says what limits them."""
    limit, why = max_workers_per_node()
    if n + spares > limit:
        total = f"'{n}' with {spares} hot spare(s)" if spares else f"'{n}'"
        raise ConfigError(
            f"{name} {total}: this node can run at most {limit} workers ({why}); give a "
            "smaller count, or raise the limit"
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


def parse_signals(value: str, name: str = "--signals-to-handle") -> list[signal.Signals]:
    """``--signals-to-handle``: comma-separated names such as SIGTERM,SIGUSR1."""
    out: list[signal.Signals] = []
    for item in (x.strip() for x in value.split(",")):
        if not item:
            continue
        try:
            sig = signal.Signals[item if item.startswith("SIG") else "SIG" + item]
        except KeyError:
            raise ConfigError(
                f"{name} '{value}': '{item}' is not a signal name; use names "
                "such as SIGTERM,SIGINT,SIGHUP,SIGUSR1"
            ) from None
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            raise ConfigError(f"{name}: {sig.name} cannot be handled or forwarded")
        out.append(sig)
    return out


def check_signals(value: str, name: str = "--signals-to-handle") -> str:
    """`value` once :func:`parse_signals` took it (the agent installs the handlers)."""
    parse_signals(value, name)
    return value


def parse_list(value: str) -> list[str]:
    """Comma-separated values, with ``,,`` standing for a literal comma (torch's rule)."""
    if not value:
        return []
    return [part.replace("\0", ",") for part in value.replace(",,", "\0").split(",") if part]


def parse_rdzv_conf(value: str, name: str = "--rdzv-conf") -> dict[str, str]:
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
                f"{name} '{value}': '{item}' is not key=value; write it like "
                "join_timeout=900,read_timeout=20"
            )
        if not val:
            raise ConfigError(f"{name} '{value}': option '{key}' needs a value")
        out[key] = val
    return out


def unquote(text: str) -> str:
    """`text` without one pair of matching quotes around it."""
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        return text[1:-1].strip()
    return text


def parse_preload(values: Iterable[str] | str, flag: str = "--preload") -> list[str]:
    """``--preload`` (comma-separated, repeatable): ``auto`` (the default: torch when the
    script imports it), module names imported on top of it, or ``none`` alone (fresh
    interpreters). Returns ``LaunchConfig.preload``: ``auto`` first unless ``none``."""
    out: list[str] = []
    off = False
    for value in [values] if isinstance(values, str) else values:
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
                    f"{flag} '{value}': '{name}' is not a module name; give names such as "
                    "torch,numpy, or auto, or none"
                )
            out.append(name)
    if off and out:
        raise ConfigError(
            f"{flag} none turns preloading off, but modules are named too ({','.join(out)}): "
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
    """The valid values of a number option: a parser (``Range(...)(value, name)``) that returns
    an int for a whole number, a float otherwise."""

    low: float
    high: float
    what: str  # the unit, for the error: "seconds", "a port"...
    integer: bool = False
    above: bool = False  # low itself is not valid

    def __call__(self, value: object, name: str) -> float:
        """`value` as a number in range, or a ConfigError that quotes it under `name` (the
        flag, the PET_ variable it came from, or the field)."""
        text = str(value).strip()
        try:
            x: float = int(text) if self.integer else float(text)
        except ValueError:
            x = math.nan
        too_low = x <= self.low if self.above else x < self.low
        if math.isnan(x) or math.isinf(x) or too_low or x > self.high:
            bound = f"more than {self.low:g}" if self.above else f"{self.low:g} or more"
            if self.high != math.inf:
                bound += f" and at most {self.high:g}"
            kind = "a whole number" if self.integer else "a number"
            raise ConfigError(f"{name} '{value}' is not valid: give {kind} of {self.what}, {bound}")
        return x


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


MAX_ROLE = 128
MAX_RUN_ID = 256


def check_run_id(run_id: str, name: str = "--rdzv-id") -> str:
    """A run id names the job's keys (``/elasticrun/<run id>/...``): a '/' would put them
    inside another job's, and control characters would garble every message naming it."""
    bad = next((c for c in run_id if c == "/" or ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None or len(run_id) > MAX_RUN_ID:
        what = f"it holds {bad!r}" if bad is not None else f"it is over {MAX_RUN_ID} characters"
        raise ConfigError(
            f"{name} {run_id!r}: {what}; give the job an id without '/' or control "
            f"characters, of at most {MAX_RUN_ID} characters (the scheduler's job id is a good one)"
        )
    return run_id


def check_role(role: str, name: str = "--role") -> str:
    """A role starts every line of its workers' output (``[role:rank]``): a control character
    in it (a newline) would let it forge lines of other workers, or of the launcher."""
    bad = next((c for c in role if ord(c) < 0x20 or ord(c) == 0x7F), None)
    if bad is not None or not role or len(role) > MAX_ROLE:
        what = f"it holds {bad!r}" if bad is not None else "it is empty or too long"
        raise ConfigError(
            f"{name} {role!r}: {what}; give a name of 1 to {MAX_ROLE} characters without "
            "control characters (the default is 'default')"
        )
    return role
