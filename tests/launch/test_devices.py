"""GPUs: CUDA_VISIBLE_DEVICES read in one place."""

from __future__ import annotations

import pytest
from elastic_launch import devices


def test_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.visible_devices() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 3, 1 ,,GPU-abc")
    assert devices.visible_devices() == ["3", "1", "GPU-abc"]
    assert devices.visible_gpu_count(nvml_count=8) == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,2")
    assert devices.visible_gpu_count(nvml_count=8) == 1, "CUDA stops at -1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.visible_gpu_count(nvml_count=8) == 0


def test_nvml_index_of_a_local_rank(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.nvml_index(1, 4) == 1 and devices.nvml_index(5, 4) is None
    assert devices.nvml_index(0, 0) is None, "no GPU checks"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-abc")
    assert devices.nvml_index(0, 4) == 3
    assert devices.nvml_index(1, 4) is None, "a UUID cannot be told"


def test_one_device_per_worker(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.single_device_env(2) == {"CUDA_VISIBLE_DEVICES": "2"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    assert devices.single_device_env(1) == {"CUDA_VISIBLE_DEVICES": "5"}
    with pytest.raises(
        RuntimeError, match="local_rank 2 exceeds the GPUs in CUDA_VISIBLE_DEVICES=4,5"
    ):
        devices.single_device_env(2)
