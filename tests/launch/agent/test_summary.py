"""The failure summary: the root cause first, the other workers after, paths that exist."""

from __future__ import annotations

import dataclasses

from elastic_launch.agent.summary import format_summary
from elastic_launch.api import AgentState, FailureKind, RunResult, WorkerFailure, root_cause


def failure(rank: int, kind: FailureKind, t: int, **kw) -> WorkerFailure:
    return WorkerFailure(
        kind=kind,
        rank=rank,
        local_rank=rank,
        pid=100 + rank,
        attempt=2,
        host="h",
        time_ns=t,
        wall_time=0.0,
        **kw,
    )


def test_summary_puts_the_first_failure_first():
    result = RunResult(
        state=AgentState.FAILED,
        failures=[
            failure(0, FailureKind.STOPPED, 5, detail="SIGTERM", signal=15),
            failure(2, FailureKind.EXIT_CODE, 3, exit_code=1, message="E: late"),
            failure(1, FailureKind.SIGNAL, 1, signal=9),
        ],
        attempts=3,
        restarts=2,
        log_dir="/logs",
    )
    text = format_summary("train.py", result)
    root = text.split("Root cause (first failure):")[1].split("Other workers:")[0]
    assert "rank       : 1" in root and "killed by SIGKILL (signal 9)" in root
    assert "rank 2 (local rank 2): exit code 1" in text
    assert (
        "rank 0 (local rank 0): stopped by elasticrun after the root cause (SIGTERM; killed by SIGTERM (signal 15))"
        in text
    )


def test_root_cause_leaves_out_the_workers_the_launcher_stopped():
    stopped = failure(0, FailureKind.STOPPED, 1, detail="SIGTERM")
    late = failure(1, FailureKind.EXIT_CODE, 5, exit_code=2)
    assert root_cause([stopped, late]) is late
    assert root_cause([stopped]) is None
    result = RunResult(state=AgentState.FAILED, failures=[stopped], attempts=1)
    text = format_summary("job", result)
    assert "elasticrun: job FAILED" in text and "state failed" in text
    assert "logs under" not in text, "no log directory is kept: none is named"


def test_paths_that_are_gone_are_not_shown(tmp_path):
    kept = tmp_path / "stderr.log"
    kept.write_text("x")
    f = failure(
        1,
        FailureKind.EXIT_CODE,
        1,
        exit_code=1,
        stderr_log=str(kept),
        stdout_log=str(tmp_path / "gone.log"),
        error_file=str(tmp_path / "gone.json"),
    )
    text = format_summary("job", RunResult(state=AgentState.FAILED, failures=[f], attempts=1))
    assert f"logs       : {kept}" in text
    assert "gone.log" not in text and "gone.json" not in text


def test_a_hot_spare_is_named_as_one_not_by_rank_minus_one():
    """A spare has no rank the launcher knows (a round gives it the loop's)."""
    spare = dataclasses.replace(failure(2, FailureKind.SIGNAL, 2, signal=9), rank=-1, pid=7)
    result = RunResult(
        state=AgentState.FAILED,
        failures=[failure(1, FailureKind.SIGNAL, 1, signal=9), spare],
        attempts=1,
    )
    text = format_summary("job", result)
    assert "a hot spare (local rank 2): killed by SIGKILL" in text and "rank -1" not in text
    result = RunResult(state=AgentState.FAILED, failures=[spare], attempts=1)
    assert "rank       : none (a hot spare) (local rank 2, pid 7)" in format_summary("j", result)
