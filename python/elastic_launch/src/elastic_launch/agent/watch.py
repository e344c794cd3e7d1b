"""What one node's workers are watched with: the heartbeat table in shared memory (a slot per
worker), NVML's GPU checks, and the watchdog thread that reads both and the workers' pidfds."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from elastic_core import GpuHealth, HeartbeatTable, Watchdog

from elastic_launch.agent.devices import open_gpu_health
from elastic_launch.agent.shm import own_name

if TYPE_CHECKING:
    from elastic_launch.agent.worker import Watcher
    from elastic_launch.processes.guardian import Guardian

#: Heartbeats are compared every 50 ms, so a fixed --hang-timeout is kept to within 100 ms even
#: on a busy node (reading a few slots costs microseconds).
HANG_CHECK_INTERVAL = 0.05


@dataclass(frozen=True)
class Watch:
    table: HeartbeatTable
    gpu: GpuHealth | None
    watchdog: Watcher  # elastic_core.Watchdog, or a test double

    @property
    def gpu_count(self) -> int:
        return self.gpu.device_count if self.gpu is not None else 0


@contextlib.contextmanager
def watch(workers: int, gpu_check_interval: float, guardian: Guardian) -> Iterator[Watch]:
    """The table (its file removed by the guardian should the launcher be SIGKILLed), the GPU
    checks (none without a GPU, or with an interval of 0) and the watchdog, closed in reverse."""
    path = own_name()
    with contextlib.ExitStack() as stack:
        table = stack.enter_context(HeartbeatTable.create(path, workers))
        guardian.remove_path(table.path)
        gpu = open_gpu_health(gpu_check_interval)
        watchdog = Watchdog(
            default_hang_timeout=0.0,
            hang_check_interval=HANG_CHECK_INTERVAL,
            gpu=gpu,
            gpu_check_interval=gpu_check_interval if gpu is not None else 0.0,
        )
        stack.enter_context(watchdog)
        yield Watch(table, gpu, watchdog)
