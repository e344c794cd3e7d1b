"""GPUs: CUDA_VISIBLE_DEVICES read in one place."""

from __future__ import annotations

import pytest
from elastic_launch.agent import devices


def test_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.visible_devices() is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", " 3, 1 ,,GPU-abc")
    assert devices.visible_devices() == ["3", "1", "GPU-abc"]
    assert devices.usable_gpus(nvml_count=8) == (3, None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,-1,2")
    assert devices.usable_gpus(nvml_count=8) == (1, None), "CUDA stops at -1"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert devices.usable_gpus(nvml_count=8) == (0, None)


@pytest.mark.parametrize(
    ("visible", "usable", "why"),
    [
        ("0,7,1", 1, "entry '7' names no device (NVML sees 2 GPU(s), indices 0 to 1)"),
        ("1,1", 1, "entry '1' names no device (it names a device already listed)"),
        ("0,gpu1", 1, "entry 'gpu1' names no device (it is neither a device index"),
        ("5", 0, "entry '5' names no device"),
    ],
)
def test_an_entry_that_names_no_device_is_reported(monkeypatch, visible, usable, why):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    count, note = devices.usable_gpus(nvml_count=2)
    assert count == usable
    assert note is not None and why in note and f"CUDA_VISIBLE_DEVICES='{visible}'" in note


def test_without_nvml_the_variable_adds_no_gpu(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    assert devices.usable_gpus(nvml_count=0) == (0, None)


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
