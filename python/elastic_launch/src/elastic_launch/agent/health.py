"""``/healthz``: the agent's state as JSON over HTTP (``--health-port [HOST:]PORT``).

200 while the agent's state is healthy (everything but failed, stopping and stopped: see
:class:`elastic_launch.api.AgentState`); 503 otherwise. The JSON carries the state's name.
Served by :class:`~elastic_launch.agent.http_server.SmallHttpServer`, bounded whatever its
clients do.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from elastic_launch.agent.http_server import SmallHttpServer


class HealthServer:
    def __init__(self, host: str, port: int, state: Callable[[], dict[str, Any]]) -> None:
        def page() -> tuple[int, str, bytes]:
            body = state()
            payload = json.dumps(body, default=str).encode()
            return 200 if body.get("healthy") else 503, "application/json", payload

        self.server = SmallHttpServer(
            host, port, {"/healthz": page, "/health": page}, "--health-port"
        )

    @property
    def port(self) -> int:
        return self.server.port

    def close(self) -> None:
        self.server.close()

    def __enter__(self) -> HealthServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
