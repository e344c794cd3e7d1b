"""A GPU fault (from the fake NVML, through the real dlopen path) restarts the group."""

from __future__ import annotations

import time

import pytest
from launcher_util import start, worker_args


@pytest.mark.timeout(120)
def test_gpu_fault_restarts_the_group(out, fake_nvml, tmp_path):
    script = tmp_path / "nvml"
    script.write_text("devices 2\n")
    proc = start(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--gpu-check-interval",
            "0.05",
            "--monitor-interval",
            "0.05",
            *worker_args(out, "--sleep", "120"),  # the fault ends them, not the time
        ],
        env={"ELASTIC_NVML_LIBRARY": str(fake_nvml), "ELASTIC_FAKE_NVML_SCRIPT": str(script)},
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / "0-1.pid").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        script.write_text("devices 2\nxid 79 1\n")  # GPU 1 falls off the bus
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "rank 1 GPU fault: GPU 1 reported XID 79 (GPU has fallen off the bus)" in err
    # The XID stays (the device needs a reset): the restarted group fails on it again.
    assert proc.returncode == 1
    assert "failure    : GPU fault: before starting attempt 1: GPU 1 reported XID 79" in err
