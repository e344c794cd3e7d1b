"""GPUs: what ``CUDA_VISIBLE_DEVICES`` says and what NVML counts, read in one place. CUDA is never
initialised in the launcher; NVML is elastic_core's (loaded at run time, absent without a GPU)."""

from __future__ import annotations

import os
from collections.abc import Mapping

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


def visible_gpu_count(nvml_count: int | None = None) -> int:
    """GPUs this process may use: ``CUDA_VISIBLE_DEVICES`` if set (CUDA stops at the first
    ``-1``), capped by what NVML counts; else NVML's count."""
    count = nvml_gpu_count() if nvml_count is None else nvml_count
    visible = visible_devices()
    if visible is None:
        return count
    usable = visible[: visible.index("-1")] if "-1" in visible else visible
    return min(len(usable), count) if count else len(usable)


def nvml_index(local_rank: int, gpu_count: int) -> int | None:
    """The NVML index of the GPU a worker uses: its local rank, through ``CUDA_VISIBLE_DEVICES``
    when that lists indices; None when it cannot be told (a UUID) or there is no such GPU."""
    if gpu_count == 0:
        return None
    visible = visible_devices()
    if visible is None:
        return local_rank if local_rank < gpu_count else None
    if local_rank < len(visible) and visible[local_rank].isdigit():
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
