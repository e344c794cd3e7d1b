"""elastic_core: the native core of elasticrun.

Workers call :func:`beat` on every step (elasticrun installs that call on every optimizer step,
so most scripts need no change). Supervisors create a :class:`HeartbeatTable`, start workers, and
watch them with a :class:`Watchdog`, which reports each death, hang or GPU fault as an
:class:`Event`. :class:`LocalBarrier` and :class:`TcpBarrier` synchronise processes within and
across nodes, and fail with an error naming the participant at fault instead of hanging.
"""

from __future__ import annotations

import atexit

from elastic_core._core import (
    ABI_VERSION,
    HEARTBEAT_FILE_ENV,
    HEARTBEAT_SLOT_ENV,
    LIBRARY_VERSION,
    NVML_LIBRARY_ENV,
    BadFileError,
    BarrierAbortedError,
    ElasticError,
    Event,
    EventKind,
    GpuFault,
    GpuHealth,
    GpuReport,
    GpuState,
    Heartbeat,
    HeartbeatTable,
    InvalidArgumentError,
    LocalBarrier,
    NotAvailableError,
    NotFoundError,
    PeerError,
    SlotInfo,
    SlotState,
    StateError,
    TcpBarrier,
    WaitTimeoutError,
    Watchdog,
    beat,
    copy_crc32c,
    copy_crc32c_chunks,
    copy_crc32c_gather,
    crc32c,
    current_step,
    detach,
    die_with_parent,
    hang_timeout,
    heartbeat_slot,
    now_ns,
    set_hang_timeout,
)
from elastic_core._phases import quiet

# The package and the C++ library share one version (cpp/VERSION); importlib.metadata would cost
# ~40 ms of start-up in every worker.
__version__ = LIBRARY_VERSION

# A worker that finishes normally is not "hung" while its interpreter winds down.
atexit.register(detach)

__all__ = [
    "ABI_VERSION",
    "HEARTBEAT_FILE_ENV",
    "HEARTBEAT_SLOT_ENV",
    "LIBRARY_VERSION",
    "NVML_LIBRARY_ENV",
    "BadFileError",
    "BarrierAbortedError",
    "ElasticError",
    "Event",
    "EventKind",
    "GpuFault",
    "GpuHealth",
    "GpuReport",
    "GpuState",
    "Heartbeat",
    "HeartbeatTable",
    "InvalidArgumentError",
    "LocalBarrier",
    "NotAvailableError",
    "NotFoundError",
    "PeerError",
    "SlotInfo",
    "SlotState",
    "StateError",
    "TcpBarrier",
    "WaitTimeoutError",
    "Watchdog",
    "__version__",
    "beat",
    "copy_crc32c",
    "copy_crc32c_chunks",
    "copy_crc32c_gather",
    "crc32c",
    "current_step",
    "detach",
    "die_with_parent",
    "hang_timeout",
    "heartbeat_slot",
    "now_ns",
    "quiet",
    "set_hang_timeout",
]
