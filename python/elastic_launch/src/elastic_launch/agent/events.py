"""Events and metrics of the agent: what happened to the job, and how fast it recovered.

Every event goes to each configured handler: ``null``, ``console`` (the log), a JSON-lines file
(``--events-file``) and Prometheus (``--metrics-port``). Events:

``job_started``, ``state_changed`` (state, previous: the agent's
:class:`~elastic_launch.api.AgentState` names), ``rendezvous_done``, ``group_started`` (attempt,
spawn_seconds), ``worker_failed`` (rank, kind, exit_code/signal, detection_seconds: failure to
detection, when the failure time is known), ``membership_changed``, ``group_stopped``
(stop_seconds), ``group_restarted`` (recovery_seconds: detection to the restarted group's workers
all running), ``group_ready`` (seconds to every worker's first beat), ``worker_replaced`` (a
train-loop worker started in a dead one's place: rank, local_rank, pid, restarts,
recovery_seconds; ``hot_spare`` when a spare took the place and this one starts behind it),
``hot_spare_started`` (local_rank, pid), ``job_succeeded``, ``job_failed``, ``job_stopped``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from elastic_launch import eventlog
from elastic_launch.agent.http_server import SmallHttpServer
from elastic_launch.api import ConfigError

logger = logging.getLogger(__name__)


@dataclass
class AgentEvent:
    name: str
    run_id: str
    attempt: int
    data: dict[str, Any] = field(default_factory=dict)
    time: float = field(default_factory=time.time)

    def to_json(self) -> str:
        """The event as the events file records it (:mod:`elastic_launch.eventlog`)."""
        return eventlog.record(self.name, self.run_id, self.attempt, self.data, self.time)


class EventHandler(Protocol):
    def emit(self, event: AgentEvent) -> None: ...

    def close(self) -> None: ...


class NullHandler:
    def emit(self, event: AgentEvent) -> None:
        pass

    def close(self) -> None:
        pass


class ConsoleHandler:
    def emit(self, event: AgentEvent) -> None:
        details = " ".join(f"{k}={v}" for k, v in event.data.items())
        logger.warning("[event] %s attempt=%d %s", event.name, event.attempt, details)

    def close(self) -> None:
        pass


class JsonLinesHandler:
    """Appends one record per event to the events file (safe to tail)."""

    def __init__(self, path: str) -> None:
        try:
            self._file = eventlog.EventsFile(path)
        except OSError as e:
            raise ConfigError(f"--events-file '{path}' cannot be opened: {e.strerror}") from None

    def emit(self, event: AgentEvent) -> None:
        self._file.write(event.name, event.run_id, event.attempt, event.data, event.time)

    def close(self) -> None:
        self._file.close()


class PrometheusHandler:
    """Serves the agent's metrics on HOST:PORT/metrics (prometheus-client)."""

    def __init__(self, host: str, port: int) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

        self.registry = CollectorRegistry()
        r = self.registry
        self.restarts = Counter("elasticrun_restarts", "Worker group restarts", registry=r)
        self.replaced = Counter(
            "elasticrun_workers_replaced",
            "Train-loop workers replaced alone (the others kept running)",
            registry=r,
        )
        self.failures = Counter(
            "elasticrun_worker_failures", "Worker failures by kind", ["kind"], registry=r
        )
        buckets = (0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300)
        self.detection = Histogram(
            "elasticrun_failure_detection_seconds",
            "From a failure to its detection (when the failure time is known)",
            buckets=buckets,
            registry=r,
        )
        self.recovery = Histogram(
            "elasticrun_recovery_seconds",
            "From a failure's detection to the restarted group's (or the replacement's) "
            "workers running",
            buckets=buckets,
            registry=r,
        )
        self.attempt = Gauge("elasticrun_attempt", "Current attempt number", registry=r)
        self.workers = Gauge("elasticrun_workers_running", "Workers running", registry=r)
        self.server = SmallHttpServer(
            host,
            port,
            {"/metrics": lambda: (200, CONTENT_TYPE_LATEST, generate_latest(r))},
            "--metrics-port",
        )

    @property
    def port(self) -> int:
        return self.server.port

    def emit(self, event: AgentEvent) -> None:
        self.attempt.set(event.attempt)
        d = event.data
        if event.name == "worker_failed":
            self.failures.labels(kind=d.get("kind", "unknown")).inc()
            if d.get("detection_seconds") is not None:
                self.detection.observe(d["detection_seconds"])
        elif event.name == "group_restarted":
            self.restarts.inc()
            self.recovery.observe(d["recovery_seconds"])
        elif event.name == "worker_replaced":
            self.replaced.inc()
            self.recovery.observe(d["recovery_seconds"])
        elif event.name == "group_started":
            self.workers.set(d.get("workers", 0))
        elif event.name in ("group_stopped", "job_succeeded", "job_failed", "job_stopped"):
            self.workers.set(0)

    def close(self) -> None:
        self.server.close()


class Events:
    """Fans each event out to every handler; a failing handler is logged, never fatal."""

    def __init__(self, run_id: str, handlers: list[EventHandler]) -> None:
        self.run_id = run_id
        self.handlers = handlers

    def emit(self, name: str, attempt: int, **data: Any) -> None:
        event = AgentEvent(name, self.run_id, attempt, data)
        for h in self.handlers:
            try:
                h.emit(event)
            except Exception:
                logger.exception("event handler %r failed on %s", h, name)

    def close(self) -> None:
        for h in self.handlers:
            h.close()

    def __enter__(self) -> Events:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @classmethod
    def open(
        cls,
        run_id: str,
        log_handler: str = "null",
        events_file: str | None = None,
        metrics: tuple[str, int] | None = None,
    ) -> Events:
        """The handlers a launch asks for, opened one by one; if one cannot be, those opened
        already are closed before the error goes up."""
        handlers: list[EventHandler] = []
        try:
            handlers.append(handler_for_name(log_handler))
            if events_file:
                handlers.append(JsonLinesHandler(events_file))
            if metrics is not None:
                handlers.append(PrometheusHandler(*metrics))
        except BaseException:
            for h in handlers:
                h.close()
            raise
        return cls(run_id, handlers)


def handler_for_name(name: str) -> EventHandler:
    """``--event-log-handler`` (torchrun's flag): ``null`` or ``console``."""
    if name == "null":
        return NullHandler()
    if name == "console":
        return ConsoleHandler()
    raise ConfigError(
        f"--event-log-handler '{name}' is not supported: use 'null' or 'console' (and "
        "--events-file / --metrics-port for files and Prometheus)"
    )
