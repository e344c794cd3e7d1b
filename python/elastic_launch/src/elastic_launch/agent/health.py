"""``/healthz``: the agent's state as JSON over HTTP (``--health-port [HOST:]PORT``).

200 while the agent's state is healthy (everything but failed, stopping and stopped: see
:class:`elastic_launch.api.AgentState`); 503 otherwise. The JSON carries the state's name.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from elastic_launch.api import ConfigError
from elastic_launch.cancel import join
from elastic_launch.net import host_port


class HealthServer:
    def __init__(self, host: str, port: int, state: Callable[[], dict[str, Any]]) -> None:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] not in ("/healthz", "/health"):
                    self.send_error(404, "try /healthz")
                    return
                body = state()
                payload = json.dumps(body, default=str).encode()
                self.send_response(200 if body.get("healthy") else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # no access log on the console

        server_class = ThreadingHTTPServer
        if ":" in host:  # an IPv6 address

            class _V6(ThreadingHTTPServer):
                address_family = socket.AF_INET6

            server_class = _V6
        try:
            self.server = server_class((host, port), Handler)
        except OSError as e:
            raise ConfigError(
                f"--health-port {host_port(host, port)} cannot be served: {e.strerror}; choose "
                "a free port"
            ) from None
        self.server.daemon_threads = True
        self.thread = threading.Thread(
            target=self.server.serve_forever, name="elasticrun-health", daemon=True
        )
        self.thread.start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        join(self.thread, 5, "the health server thread")

    def __enter__(self) -> HealthServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
