"""What ``ps``, ``pgrep -f`` and ``/proc/PID/{cmdline,environ}`` show for a forked worker.

A child forked from the zygote would show the zygote's command line and its environment there,
so that ``pgrep -f train.py`` finds nothing and a tool reading ``/proc/PID/environ`` finds no
``RANK``. The kernel shows the memory areas the command line and the environment were passed
in; the zygote starts with room in both (a blank argument, a blank variable), and each forked
worker writes its own command line (the one a fresh interpreter would have) and environment
there. Linux only; elsewhere, or without room, nothing is written.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

#: Room the zygote is started with: for a worker's command line, and for its environment.
ARGV_ROOM = 16 * 1024
ENV_ROOM_VAR = "ELASTICRUN_ZYGOTE_ROOM"
ENV_ROOM = 16 * 1024


def room_argument() -> str:
    """The zygote's last argument: blank, ignored by it, kept as room for workers' titles."""
    return " " * ARGV_ROOM


def room_environment() -> dict[str, str]:
    return {ENV_ROOM_VAR: " " * ENV_ROOM}


def _areas() -> tuple[int, int, int, int] | None:
    """(arg_start, arg_end, env_start, env_end) of this process, from /proc/self/stat."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # After the command name, fields start at the 3rd; arg_start is the 48th.
        return tuple(int(x) for x in fields[45:49])  # type: ignore[return-value]
    except (OSError, IndexError, ValueError):
        return None


def _fill(start: int, end: int, items: list[bytes]) -> bool:
    """Write NUL-terminated `items` (the whole ones that fit) over [start, end), NUL-padded."""
    import ctypes

    size = end - start
    if size <= 0:
        return False
    data = b""
    for item in items:
        if len(data) + len(item) + 1 <= size:
            data += item + b"\0"
    ctypes.memmove(start, data.ljust(size, b"\0"), size)
    return True


def set_title(argv: list[str], env: Mapping[str, str] | None = None) -> bool:
    """Show `argv` (and `env`, if given) as this process's command line (and environment);
    True when written. The environment only after the process's own was rebuilt
    (``os.environ`` cleared and set): libc's copies then live elsewhere, and the original area
    is free to overwrite."""
    areas = _areas()
    if areas is None:
        return False
    arg_start, arg_end, env_start, env_end = areas
    with contextlib.suppress(OSError, ValueError):
        wrote = _fill(arg_start, arg_end, [os.fsencode(a) for a in argv])
        if env is not None:
            pairs = [os.fsencode(k) + b"=" + os.fsencode(v) for k, v in env.items()]
            wrote = _fill(env_start, env_end, pairs) and wrote
        return wrote
    return False
