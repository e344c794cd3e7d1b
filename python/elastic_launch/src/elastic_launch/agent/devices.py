"""GPUs: what ``CUDA_VISIBLE_DEVICES`` says and what NVML counts, read in one place. CUDA is never
initialised in the launcher; NVML is elastic_core's (loaded at run time, absent without a GPU)."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from elastic_launch.net import digits

if TYPE_CHECKING:
    from elastic_core import GpuHealth

logger = logging.getLogger(__name__)

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"


def visible_devices(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The entries of ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs, blanks dropped), or None when
    it is unset (every GPU is visible)."""
    value = (os.environ if environ is None else environ).get(VISIBLE_ENV)
    if value is None:
        return None
    return [e.strip() for e in value.split(",") if e.strip()]


def nvml_gpu_count() -> int:
    """GPUs NVML sees (0 without NVML or a driver)."""
    import elastic_core

    gpu = elastic_core.GpuHealth(timeout=5.0)
    return gpu.device_count if gpu.state == elastic_core.GpuState.HEALTHY else 0


def usable_gpus(nvml_count: int | None = None) -> tuple[int, str | None]:
    """GPUs this process may use, counted by NVML and narrowed by ``CUDA_VISIBLE_DEVICES`` as
    CUDA reads it (entries in order, up to the first one that names no device: ``-1``, an index
    NVML does not have, one given twice, or text that is neither an index nor a GPU/MIG UUID),
    and, when such an entry stopped the count, a note that names it. Without NVML there is no
    GPU, whatever the variable says."""
    count = nvml_gpu_count() if nvml_count is None else nvml_count
    visible = visible_devices()
    if visible is None or count == 0:
        return count, None
    seen: set[str] = set()
    for entry in visible:
        why = None
        if entry == "-1":
            return len(seen), None  # CUDA's documented way to hide the rest
        if digits(entry):
            if int(entry) >= count:
                why = f"NVML sees {count} GPU(s), indices 0 to {count - 1}"
        elif not entry.startswith(("GPU-", "MIG-")):
            why = "it is neither a device index nor a GPU-/MIG- UUID"
        if why is None and entry in seen:
            why = "it names a device already listed"
        if why is not None:
            return len(seen), (
                f"{VISIBLE_ENV}='{os.environ.get(VISIBLE_ENV, '')}': entry '{entry}' names no "
                f"device ({why}); CUDA ignores it and every entry after it, so {len(seen)} "
                "GPU(s) are usable"
            )
        seen.add(entry)
    return min(len(seen), count), None


def nvml_index(local_rank: int, gpu_count: int) -> int | None:
    """The NVML index of the GPU a worker uses: its local rank, through ``CUDA_VISIBLE_DEVICES``
    when that lists indices; None when it cannot be told (a UUID) or there is no such GPU."""
    if gpu_count == 0:
        return None
    visible = visible_devices()
    if visible is None:
        return local_rank if local_rank < gpu_count else None
    if local_rank < len(visible) and digits(visible[local_rank]):
        index = int(visible[local_rank])
        return index if index < gpu_count else None
    return None


def single_device_env(local_rank: int) -> dict[str, str]:
    """``--virtual-local-rank``: the worker sees only its own GPU (as device 0)."""
    visible = visible_devices()
    if visible is None:
        return {VISIBLE_ENV: str(local_rank)}
    if local_rank >= len(visible):
        raise RuntimeError(
            f"local_rank {local_rank} exceeds the GPUs in {VISIBLE_ENV}="
            f"{os.environ.get(VISIBLE_ENV)}"
        )
    return {VISIBLE_ENV: visible[local_rank]}


def open_gpu_health(check_interval: float) -> GpuHealth | None:
    """NVML's GPU checks for a launch, or None when they are off (``--gpu-check-interval 0``)
    or NVML has no healthy GPU to watch (no driver, no GPU: not an error)."""
    import elastic_core

    if check_interval <= 0:
        return None
    gpu = elastic_core.GpuHealth(timeout=5.0)
    if gpu.state != elastic_core.GpuState.HEALTHY:
        logger.debug("GPU checks off: %s", gpu.detail)
        return None
    return gpu
