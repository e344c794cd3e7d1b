"""The agent's fence for its workers (:mod:`elastic_launch.processes.fence`): its file in the
node's shared memory (removed however the launcher ends), and what it is told."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from elastic_launch.agent import shm
from elastic_launch.processes.fence import FenceWriter

if TYPE_CHECKING:
    from elastic_launch.agent.workers import WorkerGroup
    from elastic_launch.processes.guardian import Guardian
    from elastic_launch.rendezvous.api import RendezvousHandler


@contextlib.contextmanager
def fence(guardian: Guardian) -> Iterator[FenceWriter]:
    """A fence file, not started yet (:meth:`FenceWriter.start` with :func:`held_until_of`
    and :func:`waker`)."""
    path = shm.own_name("fence")
    guardian.remove_path(path)
    writer = FenceWriter(path)
    try:
        yield writer
    finally:
        writer.close()


def held_until_of(rdzv: RendezvousHandler) -> Callable[[], float | None]:
    """The handler's :meth:`held_until` (ours); a handler that has none never fences."""
    held = getattr(rdzv, "held_until", None)
    return held if callable(held) else lambda: None


def waker(group: WorkerGroup) -> Callable[[], None]:
    """What wakes the group's workers that stopped themselves at a fence."""

    def wake() -> None:
        try:
            pids = [w.pid for w in group.alive()]
        except RuntimeError:  # the group changed as it was read (the agent's thread): next time
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGCONT)

    return wake
