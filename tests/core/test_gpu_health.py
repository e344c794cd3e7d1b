"""GPU health through the real dlopen path, against the fake libnvidia-ml.so.1."""

from __future__ import annotations

import time

import elastic_core as ec
import pytest


def test_missing_library_is_not_available(monkeypatch):
    monkeypatch.delenv(ec.NVML_LIBRARY_ENV, raising=False)
    gpu = ec.GpuHealth("/nonexistent/libnvidia-ml.so.1")
    assert gpu.state == ec.GpuState.NOT_AVAILABLE
    assert "/nonexistent/libnvidia-ml.so.1" in gpu.detail
    assert gpu.device_count == 0
    assert gpu.check(0).state == ec.GpuState.NOT_AVAILABLE


def test_default_library_on_this_machine_is_not_available(monkeypatch):
    monkeypatch.delenv(ec.NVML_LIBRARY_ENV, raising=False)
    gpu = ec.GpuHealth()
    assert gpu.library_path == "libnvidia-ml.so.1"
    assert gpu.state in (ec.GpuState.NOT_AVAILABLE, ec.GpuState.HEALTHY)


def test_environment_variable_names_the_library(fake_nvml, nvml_script, monkeypatch):
    monkeypatch.setenv(ec.NVML_LIBRARY_ENV, str(fake_nvml))
    gpu = ec.GpuHealth()
    assert gpu.library_path == str(fake_nvml)
    assert gpu.state == ec.GpuState.HEALTHY
    assert gpu.device_count == 2
    assert all(r.state == ec.GpuState.HEALTHY for r in gpu.check_all())


@pytest.mark.parametrize(
    ("script", "device", "fault", "text"),
    [
        ("lost 1", 1, ec.GpuFault.LOST, "GPU 1 is lost"),
        ("xid 79 0", 0, ec.GpuFault.XID, "XID 79 (GPU has fallen off the bus)"),
        ("ecc 2 0", 0, ec.GpuFault.ECC, "2 uncorrectable ECC error"),
        ("remap_failure 1", 1, ec.GpuFault.ROW_REMAP, "failed to remap"),
        ("retired 0", 0, ec.GpuFault.RETIRED_PAGES, "retired memory pages"),
        ("thermal 0", 0, ec.GpuFault.THERMAL, "heat"),
        ("hw_slowdown 1", 1, ec.GpuFault.HW_SLOWDOWN, "hardware slowdown"),
    ],
)
def test_faults(fake_nvml, nvml_script, script, device, fault, text):
    gpu = ec.GpuHealth(str(fake_nvml))
    assert gpu.check(device).state == ec.GpuState.HEALTHY
    nvml_script.write_text(script + "\n")
    report = gpu.check(device)
    assert report.state == ec.GpuState.UNHEALTHY
    assert fault in report.faults
    assert text in report.detail
    assert gpu.check(1 - device).state == ec.GpuState.HEALTHY


def test_nvml_init_that_never_returns_does_not_block(fake_nvml, nvml_script):
    nvml_script.write_text("init_hang 1500\n")
    start = time.monotonic()
    gpu = ec.GpuHealth(str(fake_nvml), timeout=0.2)
    assert time.monotonic() - start < 1.2, "gave up at its timeout, not when NVML returned"
    assert gpu.state == ec.GpuState.UNKNOWN
    assert "nvmlInit did not return within 200 ms" in gpu.detail
    assert gpu.check(0, timeout=0.1).state == ec.GpuState.UNKNOWN


def test_watchdog_reports_gpu_faults(fake_nvml, nvml_script, procs):
    gpu = ec.GpuHealth(str(fake_nvml))
    child = procs.python("import time; time.sleep(120)")
    with ec.Watchdog(gpu=gpu, gpu_check_interval=0.02) as wd:
        wd.watch(3, child.pid, gpu=0)
        assert wd.poll(timeout=0.2) is None
        nvml_script.write_text("xid 79 0\n")
        event = wd.poll(timeout=10)
        assert event is not None
        assert event.kind == ec.EventKind.GPU_UNHEALTHY
        assert event.worker == 3
        assert event.gpu == 0
        assert "XID 79" in event.detail
