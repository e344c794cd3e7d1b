"""elastic_core: the native core of elasticrun.

Workers call :func:`beat` on every step (elasticrun installs that call on every optimizer step,
so most scripts need no change). Supervisors create a :class:`HeartbeatTable`, start workers, and
watch them with a :class:`Watchdog`, which reports each death, hang or GPU fault as an
:class:`Event`. :class:`LocalBarrier` and :class:`TcpBarrier` synchronise processes within and
across nodes, and fail with an error naming the participant at fault instead of hanging.
"""

from __future__ import annotations

import atexit
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _dist_version

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
    detach,
    heartbeat_slot,
    now_ns,
    set_hang_timeout,
)

try:
    __version__ = _dist_version("elasticrun-core")
except PackageNotFoundError:  # imported from a build tree
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
    "detach",
    "heartbeat_slot",
    "now_ns",
    "set_hang_timeout",
]
