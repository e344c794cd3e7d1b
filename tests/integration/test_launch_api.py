"""The Python API: LaunchConfig and launch(), with torch's elastic_launch semantics."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import launch_targets
import pytest
from elastic_launch import LaunchConfig, WorkerFailedError, launch

HERE = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def importable(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", f"{HERE}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")


def config(**kw) -> LaunchConfig:
    return LaunchConfig(nproc_per_node=2, monitor_interval=0.05, **kw)


@pytest.mark.parametrize("method", ["spawn", "fork", "forkserver"])
def test_function_return_values_by_global_rank(method):
    assert launch(config(start_method=method), launch_targets.square_rank, 10) == {0: 10, 1: 11}


def test_closure_with_fork():
    secret = 41

    def closure() -> int:
        return secret + int(os.environ["RANK"])

    assert launch(config(start_method="fork"), closure) == {0: 41, 1: 42}


def test_failure_raises_with_the_root_cause():
    with pytest.raises(WorkerFailedError) as info:
        launch(config(max_restarts=1), launch_targets.fail_on_rank_one)
    err = info.value
    assert err.result.restarts == 1
    root = err.result.root_cause
    assert root is not None and root.rank == 1
    assert root.message == "ValueError: rank one says no"
    assert "fail_on_rank_one" in root.traceback
    assert "Root cause" in str(err)


def test_program_entrypoint_like_torch(tmp_path):
    script = tmp_path / "hello.py"
    marker = tmp_path / "ran"
    script.write_text(f"import os; open({str(marker)!r} + os.environ['RANK'], 'w').write('ok')\n")
    assert launch(config(), sys.executable, "-u", str(script)) == {0: None, 1: None}
    assert (tmp_path / "ran0").exists() and (tmp_path / "ran1").exists()
