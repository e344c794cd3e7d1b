"""Events (JSON lines), Prometheus metrics and /healthz while a job fails and recovers."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import pytest
from launcher_util import free_port, start, worker_args


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.timeout(120)
def test_events_metrics_and_health(out, tmp_path):
    events_file, go = tmp_path / "events.jsonl", tmp_path / "go"  # attempt 1 ends on go
    health, metrics = free_port(), free_port()
    proc = start(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            "--monitor-interval",
            "0.05",
            "--events-file",
            str(events_file),
            "--health-port",
            str(health),
            "--metrics-port",
            f"127.0.0.1:{metrics}",
            *worker_args(
                out,
                *("--fail-rank", "1", "--fail-until", "1", "--how", "raise"),
                "--wait-file",
                str(go),
            ),
        ]
    )
    try:
        deadline = time.monotonic() + 60
        state = {}
        while time.monotonic() < deadline:
            if (out / "1-0.pid").exists() and (out / "1-1.pid").exists():
                code, body = get(f"http://127.0.0.1:{health}/healthz")
                state = json.loads(body)
                if code == 200 and state.get("attempt") == 1 and state.get("state") == "running":
                    break
            time.sleep(0.05)
        assert state["state"] == "running"
        assert state["restarts"] == 1
        assert [w["rank"] for w in state["workers"]] == [0, 1]
        assert all(w["running"] for w in state["workers"])
        assert get(f"http://127.0.0.1:{health}/nope")[0] == 404
        _, text = get(f"http://127.0.0.1:{metrics}/metrics")
        assert "elasticrun_restarts_total 1.0" in text
        assert 'elasticrun_worker_failures_total{kind="exit_code"} 1.0' in text
        assert "elasticrun_recovery_seconds_count 1.0" in text
        go.touch()  # the workers of attempt 1 end
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    events = [json.loads(line) for line in events_file.read_text().splitlines()]
    names = [e["event"] for e in events]
    assert names[0] == "job_started"
    assert names[-1] == "job_succeeded"
    for name in ("group_started", "worker_failed", "group_stopped", "group_restarted"):
        assert name in names
    failed = next(e for e in events if e["event"] == "worker_failed")
    assert failed["rank"] == 1 and failed["kind"] == "exit_code" and failed["attempt"] == 0
    assert 0 <= failed["detection_seconds"] < 30, "failure (the exception) to detection"
    restarted = next(e for e in events if e["event"] == "group_restarted")
    assert restarted["attempt"] == 1 and restarted["recovery_seconds"] > 0
