"""Units of the launcher: the hang learner, error files, the summary, event handlers."""

from __future__ import annotations

import json

import pytest
from elastic_launch.api import FailureKind, RunResult, RunState, WorkerFailure
from elastic_launch.errors import read_error_file, record, write_error_file
from elastic_launch.events import Events, JsonLinesHandler, handler_for_name
from elastic_launch.hang import StepIntervalLearner
from elastic_launch.summary import format_summary


def test_learner_takes_the_floor_until_it_has_seen_steps():
    learner = StepIntervalLearner(floor=5.0, factor=10.0)
    assert learner.timeout() == 5.0
    t = 1_000_000_000
    for step in range(1, 101):
        learner.observe(0, step, t + step * 2_000_000_000)  # 2 s per step
    assert learner.p99() == pytest.approx(2.0)
    assert learner.timeout() == pytest.approx(20.0)
    learner.observe(0, 101, t + 101 * 2_000_000_000 + 1)  # a sample of many steps averages
    learner.reset()
    assert learner.timeout() == pytest.approx(20.0), "what was learned survives a restart"


def test_error_file_round_trip(tmp_path, monkeypatch):
    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    @record
    def main() -> None:
        raise KeyError("missing")

    with pytest.raises(KeyError):
        main()
    data = json.loads(path.read_text())
    assert data["message"]["message"] == "KeyError: 'missing'"
    assert "raise KeyError" in data["message"]["extraInfo"]["py_callstack"]
    assert int(data["message"]["extraInfo"]["timestamp"]) > 0
    parsed = read_error_file(str(path))
    assert parsed is not None and parsed.monotonic_ns is not None
    assert not write_error_file(RuntimeError("second")), "the first error is kept"


def test_torch_error_files_read_too(tmp_path):
    path = tmp_path / "e.json"
    path.write_text(json.dumps({"message": "plain", "timestamp": "12"}))
    parsed = read_error_file(str(path))
    assert parsed is not None and parsed.message == "plain" and parsed.timestamp == 12
    path.write_text("not json")
    assert read_error_file(str(path)) is None


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
        state=RunState.FAILED,
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
    assert "rank 0 (local rank 0): stopped by elasticrun after the root cause (SIGTERM)" in text


def test_events_json_lines(tmp_path):
    path = tmp_path / "ev.jsonl"
    events = Events("run1", [JsonLinesHandler(str(path)), handler_for_name("null")])
    events.emit("group_started", 3, workers=2)
    events.close()
    (line,) = path.read_text().splitlines()
    data = json.loads(line)
    assert data["event"] == "group_started" and data["attempt"] == 3 and data["workers"] == 2
    assert data["run_id"] == "run1"
