"""deploy/slurm/elasticrun.sbatch without a cluster: shellcheck, and its errors for bad
settings (which come before it asks Slurm for anything). The real runs are in test_slurm.py."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from test_manifests import tool

SBATCH = Path(__file__).resolve().parents[2] / "deploy" / "slurm" / "elasticrun.sbatch"


def test_the_sbatch_script_passes_shellcheck():
    result = subprocess.run(
        [tool("shellcheck"), str(SBATCH)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_shellcheck_would_catch_a_bad_script(tmp_path):
    bad = tmp_path / "bad.sh"
    bad.write_text("#!/bin/bash\nrm -rf $DIR/*\n")
    result = subprocess.run(
        [tool("shellcheck"), str(bad)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode != 0 and "SC2086" in result.stdout


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({}, [], "usage: sbatch [--nodes N]"),
        ({"ELASTICRUN_RDZV": "zookeeper"}, ["train.py"], "ELASTICRUN_RDZV='zookeeper' is not"),
        ({"ELASTICRUN_RDZV": "etcd"}, ["train.py"], "needs ELASTICRUN_ETCD=HOST:PORT"),
    ],
)
def test_bad_settings_are_clear_errors(env, args, message):
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("ELASTICRUN", "SLURM_"))}
    result = subprocess.run(
        ["bash", str(SBATCH), *args],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 2
    assert message in result.stderr, result.stderr
