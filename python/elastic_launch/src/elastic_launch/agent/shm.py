"""What a launcher keeps in the node's shared memory (its heartbeat table, its memory-tier
directory), how those are named, and the sweep of what launchers that are gone left there.

A launcher removes its own on every exit path, and its guardian does should the launcher be
SIGKILLed alone. A scheduler's ``kill -9 -PGID`` or the OOM killer takes the guardian with
it; what they leave holds memory until reboot (a memory-tier directory holds a copy of the
model state). Each name carries its launcher's pid and the kernel's start time of that process,
so that the next launcher of the same user can tell a launcher that is gone (no such process,
or the pid is another process's now) from one that runs, and removes only the former's."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from elastic_launch.api import ConfigError

logger = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
#: Where to keep them instead (a tmpfs of its own, or a test's directory).
SHM_DIR_ENV = "ELASTICRUN_SHM_DIR"
#: elasticrun-PID-START-HEX (a table) or elasticrun-PID-START-KIND-HEX (the memory tier, the
#: fence); names without START are from launchers that did not record it: those count by their
#: pid alone.
_NAME = re.compile(r"^elasticrun-(?P<pid>\d+)-(?:(?P<start>\d+)-)?(?:[a-z]+-)?[0-9a-f]{8}$")


def start_time(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat); None if there is
    no such process, or only its zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def shm_dir() -> str:
    """$ELASTICRUN_SHM_DIR, else /dev/shm; a ConfigError if it is not an absolute path to a
    directory."""
    value = os.environ.get(SHM_DIR_ENV)
    if value is None:
        return SHM_DIR
    if not os.path.isabs(value) or not os.path.isdir(value):
        raise ConfigError(
            f"{SHM_DIR_ENV}={value!r} is not an absolute path to a directory: give one "
            f"(a tmpfs mount is best), or unset it to use {SHM_DIR}"
        )
    return value


def own_name(kind: str = "") -> str:
    """A new name in the shared-memory directory for this launcher's `kind` ("" for its
    table, "memory")."""
    pid = os.getpid()
    middle = f"{kind}-" if kind else ""
    return f"{shm_dir()}/elasticrun-{pid}-{start_time(pid)}-{middle}{os.urandom(4).hex()}"


@dataclass(frozen=True)
class Swept:
    """What a sweep removed."""

    entries: int
    size: int  # bytes


def _gone(pid: int, start: int | None) -> bool:
    now = start_time(pid)
    return now is None or (start is not None and now != start)


def _size(path: Path) -> int:
    if not path.is_dir() or path.is_symlink():
        return path.lstat().st_size
    total = 0
    for entry in path.rglob("*"):
        with contextlib.suppress(OSError):
            total += entry.lstat().st_size
    return total


def sweep(directory: str | None = None) -> Swept:
    """Remove what launchers of this user that are gone left in `directory` (the
    shared-memory directory): never another user's, never a running launcher's. Says what it
    freed."""
    directory = shm_dir() if directory is None else directory
    entries = size = 0
    try:
        found = list(os.scandir(directory))
    except OSError:
        return Swept(0, 0)
    for entry in found:
        match = _NAME.match(entry.name)
        if match is None:
            continue
        try:
            if entry.stat(follow_symlinks=False).st_uid != os.getuid():
                continue
            start = match["start"]
            if not _gone(int(match["pid"]), None if start is None else int(start)):
                continue
            path = Path(entry.path)
            freed = _size(path)
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(path)
            else:
                path.unlink()
        except OSError as e:  # removed meanwhile, or not ours to remove: left as it is
            logger.debug("leftover %s: %s", entry.path, e)
            continue
        entries, size = entries + 1, size + freed
    if entries:
        amount = f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"
        logger.warning(
            "removed %d leftover(s) of elasticrun launchers that are gone from %s (%s of "
            "shared memory freed)",
            entries,
            directory,
            amount,
        )
    return Swept(entries, size)
