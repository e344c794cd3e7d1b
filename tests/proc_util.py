"""Processes as /proc shows them, for the tests that check what a run leaves behind."""

from __future__ import annotations

import time

from elastic_launch.processes.guardian import cmdline, processes


def children(pid: int, zombies: bool = True) -> dict[int, bytes]:
    """{pid: command line} of `pid`'s children; without `zombies`, only the living (a zombie
    has ended; its parent has not reaped it yet)."""
    found = {}
    for p in processes():
        if p.ppid == pid and (zombies or p.alive):
            line = cmdline(p.pid)
            if line is not None:  # gone meanwhile
                found[p.pid] = line
    return found


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def wait(what, timeout: float) -> bool:  # type: ignore[no-untyped-def]
    """Whether `what()` came true within `timeout` seconds (looked at every 20 ms)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if what():
            return True
        time.sleep(0.02)
    return what()
