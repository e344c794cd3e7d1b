"""Processes as /proc shows them, for the tests that check what a run leaves behind."""

from __future__ import annotations

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
