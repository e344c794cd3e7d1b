"""What one node's workers are watched with: a heartbeat table in shared memory per worker,
NVML's GPU checks, and the watchdog thread that reads both and the workers' pidfds.

A worker can do anything to the file it beats into: cut it, overwrite it, put another at its
path. One table each keeps that to its own watch; the launcher never maps a table (reads go
through ``pread`` and are checked), so the watchdog reports that worker's heartbeat as broken
and every other worker's hang detection goes on."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import elastic_core
from elastic_core import GpuHealth, HeartbeatTable, Watchdog

from elastic_launch.agent.devices import open_gpu_health
from elastic_launch.agent.shm import own_name

if TYPE_CHECKING:
    from elastic_launch.agent.worker import Watcher
    from elastic_launch.processes.guardian import Guardian

logger = logging.getLogger(__name__)

#: Heartbeats are compared every 50 ms, so a fixed --hang-timeout is kept to within 100 ms even
#: on a busy node (reading a few slots costs microseconds).
HANG_CHECK_INTERVAL = 0.05


class Heartbeats:
    """One heartbeat table of one slot per local worker, by local rank."""

    def __init__(
        self,
        tables: Sequence[HeartbeatTable],
        renew: Callable[[int], HeartbeatTable] | None = None,
    ) -> None:
        self.tables = list(tables)
        self._renew = renew  # a new table for a worker, at a new path

    @classmethod
    @contextlib.contextmanager
    def create(
        cls,
        workers: int,
        name: Callable[[int], str],
        created: Callable[[str], None] = lambda path: None,
    ) -> Iterator[Heartbeats]:
        """`workers` tables, worker i's at ``name(i)`` (each path told to `created`); each file
        removed when the block ends."""
        with contextlib.ExitStack() as stack:

            def new(i: int) -> HeartbeatTable:
                table = stack.enter_context(HeartbeatTable.create(name(i), 1))
                created(table.path)
                return table

            yield cls([new(i) for i in range(workers)], new)

    def table(self, local_rank: int) -> HeartbeatTable:
        return self.tables[local_rank]

    def path(self, local_rank: int) -> str:
        return self.tables[local_rank].path

    def read(self, local_rank: int) -> elastic_core.SlotInfo | None:
        """Worker `local_rank`'s slot; None once the table is closed or the worker broke its
        file (the watchdog reports that)."""
        try:
            return self.tables[local_rank].read(0)
        except (ValueError, elastic_core.BadFileError, OSError):
            return None

    def reset(self, local_rank: int | None = None) -> None:
        """A good, empty table for worker `local_rank` (None: every worker) at its path,
        whatever the previous worker did to it; where what it left cannot be replaced (a
        directory), at a new path, which the next worker is given."""
        for i in range(len(self.tables)) if local_rank is None else [local_rank]:
            try:
                self.tables[i].reset()
            except (elastic_core.StateError, OSError) as e:
                if self._renew is None:
                    raise
                old = self.tables[i].path
                self.tables[i] = self._renew(i)
                logger.warning(
                    "the heartbeat file of local rank %d cannot be made again at %s (%s): it "
                    "moves to %s",
                    i,
                    old,
                    e,
                    self.tables[i].path,
                )


@dataclass(frozen=True)
class Monitors:
    heartbeats: Heartbeats
    gpu: GpuHealth | None
    watchdog: Watcher  # elastic_core.Watchdog, or a test double

    @property
    def gpu_count(self) -> int:
        return self.gpu.device_count if self.gpu is not None else 0


@contextlib.contextmanager
def watch(workers: int, gpu_check_interval: float, guardian: Guardian) -> Iterator[Monitors]:
    """The tables (their files removed by the guardian should the launcher be SIGKILLed), the
    GPU checks (none without a GPU, or with an interval of 0) and the watchdog, closed in
    reverse."""
    with contextlib.ExitStack() as stack:
        heartbeats = stack.enter_context(
            Heartbeats.create(workers, lambda _: own_name(), guardian.remove_path)
        )
        gpu = open_gpu_health(gpu_check_interval)
        watchdog = Watchdog(
            default_hang_timeout=0.0,
            hang_check_interval=HANG_CHECK_INTERVAL,
            gpu=gpu,
            gpu_check_interval=gpu_check_interval if gpu is not None else 0.0,
        )
        stack.enter_context(watchdog)
        yield Monitors(heartbeats, gpu, watchdog)
