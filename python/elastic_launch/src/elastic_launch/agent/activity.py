"""What a worker's processes are doing, read from /proc: the evidence of progress that is not a
heartbeat.

Every worker leads its own session (data-loader workers and `subprocess` children stay in it),
so one pass over /proc gives, per worker, the CPU time and I/O of everything it runs. A worker
that evaluates, computes metrics or writes a checkpoint uses CPU time or does I/O; a worker that
is stopped, deadlocked, asleep or waiting for a peer that does neither uses neither.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

_TICKS = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Activity:
    """The counters of one worker's processes at one moment."""

    cpu_seconds: float  # user + system, with the reaped children's
    io_bytes: int  # bytes read and written through system calls (files, pipes, sockets)
    processes: int
    stopped: bool  # every process is stopped (SIGSTOP, a debugger)
    io_wait: bool  # some process waits in the kernel for a device (state D)


def sample(sessions: Collection[int], proc: str = "/proc") -> dict[int, Activity]:
    """One pass over `proc`: the activity of each session in `sessions` (a session's id is its
    leader's pid). Sessions with no process left are absent."""
    wanted = set(sessions)
    cpu: dict[int, float] = {}
    io: dict[int, int] = {}
    count: dict[int, int] = {}
    stopped: dict[int, bool] = {}
    io_wait: dict[int, bool] = {}
    try:
        entries = os.listdir(proc)
    except OSError:
        return {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
        except (OSError, IndexError):
            continue  # gone meanwhile
        # After the command name: state ppid pgrp session ... utime(11) stime cutime cstime.
        try:
            session = int(fields[3])
        except (IndexError, ValueError):
            continue
        if session not in wanted:
            continue
        state = fields[0]
        if state in (b"Z", b"X"):
            continue
        ticks = sum(int(x) for x in fields[11:15])
        cpu[session] = cpu.get(session, 0.0) + ticks / _TICKS
        io[session] = io.get(session, 0) + _io_bytes(f"{proc}/{entry}/io")
        count[session] = count.get(session, 0) + 1
        stopped[session] = stopped.get(session, True) and state in (b"T", b"t")
        io_wait[session] = io_wait.get(session, False) or state == b"D"
    return {s: Activity(cpu[s], io[s], count[s], stopped[s], io_wait[s]) for s in count}


def _io_bytes(path: str) -> int:
    try:
        with open(path, "rb") as f:
            total = 0
            for line in f:
                if line.startswith((b"rchar:", b"wchar:")):
                    total += int(line.split()[1])
            return total
    except (OSError, ValueError, IndexError):
        return 0  # another user's process, or gone meanwhile
