"""``/healthz``: the agent's state as JSON, 200 while healthy, 503 otherwise."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

import pytest
from elastic_launch.agent.health import HealthServer
from elastic_launch.api import ConfigError


def get(port: int, path: str = "/healthz") -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}") if e.code == 503 else {}


def test_state_and_status_follow_the_agent():
    state = {"state": "running", "healthy": True}
    with HealthServer("127.0.0.1", 0, lambda: dict(state)) as server:
        assert get(server.port) == (200, state)
        state.update(state="failed", healthy=False)
        assert get(server.port) == (503, state)
        assert get(server.port, "/other")[0] == 404


def test_a_busy_port_is_named():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--health-port 127.0.0.1:{port} cannot be served"):
            HealthServer("127.0.0.1", port, dict)
