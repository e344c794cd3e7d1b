"""``make gpu-check`` on a machine without what it needs: one clear line that says what is
missing, exit status 2, nothing started. (With 2 GPUs it runs benchmarks/bench_real_job.py on
them; that is run by a person on a GPU machine, not here.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


def check(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"} | env
    return subprocess.run(
        [sys.executable, str(CHECK), *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.timeout(150)
def test_without_nvml_it_says_no_gpu_was_found(tmp_path):
    result = check(ELASTIC_NVML_LIBRARY=str(tmp_path / "no-libnvidia-ml.so.1"))
    assert result.returncode == 2
    assert "gpu-check: 0 usable GPU(s) found, 2 needed" in result.stderr
    assert result.stdout == ""


@pytest.mark.timeout(150)
def test_gpus_hidden_by_cuda_visible_devices_are_not_counted(fake_nvml, nvml_script):
    nvml_script.write_text("devices 2\n")
    result = check(ELASTIC_NVML_LIBRARY=str(fake_nvml), CUDA_VISIBLE_DEVICES="1")
    assert result.returncode == 2
    assert "1 usable GPU(s) found, 2 needed" in result.stderr
    assert "CUDA_VISIBLE_DEVICES=1" in result.stderr


@pytest.mark.timeout(150)
def test_two_gpus_and_a_cpu_build_of_torch_say_which_torch_to_install(fake_nvml, nvml_script):
    nvml_script.write_text("devices 2\n")
    result = check(ELASTIC_NVML_LIBRARY=str(fake_nvml))
    assert result.returncode == 2
    assert "has no CUDA" in result.stderr and "install a CUDA build of torch" in result.stderr


@pytest.mark.timeout(150)
def test_an_unknown_scenario_is_a_usage_error():
    result = check("nodes")
    assert result.returncode == 2
    assert "unknown scenario 'nodes'" in result.stderr
