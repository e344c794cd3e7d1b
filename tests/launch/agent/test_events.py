"""Event handlers: JSON lines, the fan-out, and closing what was opened when one fails."""

from __future__ import annotations

import json

import pytest
from elastic_launch.agent.events import Events, JsonLinesHandler, handler_for_name
from elastic_launch.api import ConfigError


def test_events_json_lines(tmp_path):
    path = tmp_path / "ev.jsonl"
    events = Events("run1", [JsonLinesHandler(str(path)), handler_for_name("null")])
    events.emit("group_started", 3, workers=2)
    events.close()
    (line,) = path.read_text().splitlines()
    data = json.loads(line)
    assert data["event"] == "group_started" and data["attempt"] == 3 and data["workers"] == 2
    assert data["run_id"] == "run1"


def test_opening_closes_what_it_opened_when_one_handler_fails(tmp_path):
    import socket

    path = tmp_path / "ev.jsonl"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--metrics-port 127.0.0.1:{port} cannot be served"):
            Events.open("r", "null", str(path), ("127.0.0.1", port))
    assert path.exists()
    with pytest.raises(ConfigError, match=r"--events-file .* cannot be opened"):
        Events.open("r", "null", str(tmp_path / "missing" / "ev.jsonl"))
    with pytest.raises(ConfigError, match="--event-log-handler 'loud'"):
        Events.open("r", "loud")


def test_a_failing_handler_never_stops_the_others(tmp_path):
    class Broken:
        def emit(self, event):
            raise OSError("disk full")

        def close(self):
            pass

    path = tmp_path / "ev.jsonl"
    with Events("r", [Broken(), JsonLinesHandler(str(path))]) as events:
        events.emit("job_started", -1)
    assert json.loads(path.read_text())["event"] == "job_started"


def test_prometheus_counts_replaced_workers_and_their_recovery():
    import urllib.request

    events = Events.open("r", "null", None, ("127.0.0.1", 0))
    try:
        events.emit("worker_replaced", 0, rank=1, pid=7, recovery_seconds=0.02)
        (handler,) = [h for h in events.handlers if hasattr(h, "port")]
        url = f"http://127.0.0.1:{handler.port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as r:
            text = r.read().decode()
    finally:
        events.close()
    assert "elasticrun_workers_replaced_total 1.0" in text
    assert "elasticrun_recovery_seconds_count 1.0" in text


def test_the_agent_and_the_train_loop_write_one_record_format(tmp_path, monkeypatch):
    """Both writers of the events file go through elastic_launch.eventlog: the same fields in
    the same order, one line each."""
    from elastic_launch.train_loop import metrics

    path = tmp_path / "ev.jsonl"
    events = Events("run9", [JsonLinesHandler(str(path))])
    events.emit("group_started", 2, workers=2)
    monkeypatch.setenv("ELASTICRUN_EVENTS_FILE", str(path))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run9")
    monkeypatch.setenv("ELASTICRUN_ATTEMPT", "2")
    metrics.event("train_loop_round", round=4)
    events.close()
    agent, loop = (json.loads(line) for line in path.read_text().splitlines())
    head = ["event", "time", "run_id", "attempt", "pid"]
    assert list(agent)[:5] == head and list(loop)[:5] == head
    assert (agent["run_id"], agent["attempt"]) == (loop["run_id"], loop["attempt"]) == ("run9", 2)
    assert loop["event"] == "train_loop_round" and loop["round"] == 4
