"""A worker that saves a checkpoint in the background and ends without close() keeps the
checkpoint, however elasticrun started it: a fresh interpreter, forked from the zygote, or a
function forked from the launcher itself."""

from __future__ import annotations

import os
from pathlib import Path

import launch_targets
import pytest
from elastic_launch import LaunchConfig, launch
from elastic_sampler import CheckpointManager
from launcher_util import HERE, run

pytestmark = pytest.mark.slow


def _intact(directory: Path) -> None:
    # The script's state unpickles by calling `int` (scripts/save_and_exit.py): its own file.
    state, step = CheckpointManager(directory).load_latest(weights_only=False)
    assert step == 2 and state["slow"] == 7
    assert not [p for p in directory.iterdir() if ".tmp-" in p.name], "no temporary left"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("preload", [["--preload", "none"], []], ids=["fresh", "forked"])
def test_a_worker_exiting_without_close_keeps_its_background_save(tmp_path, preload):
    script = HERE / "scripts" / "save_and_exit.py"
    args = ["--standalone", "--nproc-per-node", "1", *preload, str(script), str(tmp_path)]
    result = run(args, tmp_path, timeout=100)
    assert result.returncode == 0, result.stderr
    assert "finishing the background save of checkpoint step 2" in result.stderr
    _intact(tmp_path)


@pytest.mark.timeout(120)
def test_a_forked_function_returning_without_close_keeps_its_background_save(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    config = LaunchConfig(nproc_per_node=2, monitor_interval=0.05, start_method="fork")
    results = launch(config, launch_targets.save_in_background_and_return, str(tmp_path))
    assert results == {0: 1, 1: 1}
    for rank in (0, 1):
        _intact(tmp_path / f"rank{rank}")
