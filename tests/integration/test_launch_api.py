"""The Python API: LaunchConfig and launch(), with torch's elastic_launch semantics."""

from __future__ import annotations

import os
import subprocess
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


MAIN_SCRIPT = """
import os
import sys
from elastic_launch import LaunchConfig, launch

def train(x):
    return int(os.environ["RANK"]) * x

if __name__ == "__main__":
    print(launch(LaunchConfig(nproc_per_node=2, start_method=sys.argv[1]), train, 3))
"""


@pytest.mark.parametrize("start_method", ["spawn", "forkserver", "fork"])
def test_a_function_of_the_callers_main_runs_under_every_start_method(tmp_path, start_method):
    script = tmp_path / "main_fn.py"
    script.write_text(MAIN_SCRIPT)
    result = subprocess.run(
        [sys.executable, str(script), start_method],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().splitlines()[-1] == "{0: 0, 1: 3}"


def test_a_function_of_an_interactive_main_fails_at_once_naming_the_fix(tmp_path):
    code = (
        "from elastic_launch import LaunchConfig, launch\n"
        "def train():\n    return 1\n"
        "launch(LaunchConfig(nproc_per_node=2, max_restarts=3), train)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode != 0
    assert "is defined in an interactive session (or python -c)" in result.stderr
    assert "start_method='fork'" in result.stderr
