"""Processes as /proc shows them, for the tests that check what a run leaves behind."""

from __future__ import annotations

import os


def children(pid: int, zombies: bool = True) -> dict[int, bytes]:
    """{pid: command line} of `pid`'s children; without `zombies`, only the living (a zombie
    has ended; its parent has not reaped it yet)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid and (zombies or fields[0] not in ("Z", "X")):
            found[int(entry)] = cmdline
    return found
