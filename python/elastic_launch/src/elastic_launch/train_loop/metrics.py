"""The train loop's metrics, in the classic ``torchelastic.metrics`` shape: the loop publishes
``<name>.duration.ms`` values (``state_sync``, ``train_step``, ``rendezvous``, ``rollback``,
``outer_train_loop``, ``inner_train_loop``) and ``rollbacks`` counts to the handler configured
for their group (``torchelastic``); none is kept by default.

    from elastic_launch.train_loop import metrics
    metrics.configure(metrics.ConsoleMetricHandler())

Under elasticrun with ``--events-file``, the loop also appends its rounds and rollbacks to that
file as ``train_loop_round`` and ``train_loop_rollback`` events (JSON lines, one write each), next
to the agent's own.
"""

from __future__ import annotations

import abc
import os
import sys
import time
from typing import Any, NamedTuple

from elastic_launch import eventlog

GROUP = "torchelastic"


class MetricData(NamedTuple):
    timestamp: float
    group_name: str
    name: str
    value: float


class MetricHandler(abc.ABC):
    @abc.abstractmethod
    def emit(self, metric_data: MetricData) -> None: ...


class NullMetricHandler(MetricHandler):
    def emit(self, metric_data: MetricData) -> None:
        pass


class ConsoleMetricHandler(MetricHandler):
    """``[timestamp][group]: name=value`` on stderr."""

    def emit(self, metric_data: MetricData) -> None:
        print(
            f"[{metric_data.timestamp:.3f}][{metric_data.group_name}]: "
            f"{metric_data.name}={metric_data.value}",
            file=sys.stderr,
            flush=True,
        )


class ListMetricHandler(MetricHandler):
    """Keeps every value (tests, and scripts that report them their own way)."""

    def __init__(self) -> None:
        self.values: list[MetricData] = []

    def emit(self, metric_data: MetricData) -> None:
        self.values.append(metric_data)


_default: MetricHandler = NullMetricHandler()
_by_group: dict[str, MetricHandler] = {}


def configure(handler: MetricHandler, group: str | None = None) -> None:
    """Send the metrics of `group` (all groups when None) to `handler`."""
    global _default
    if group is None:
        _default = handler
    else:
        _by_group[group] = handler


def publish_metric(metric_group: str, metric_name: str, metric_value: float) -> None:
    handler = _by_group.get(metric_group, _default)
    handler.emit(MetricData(time.time(), metric_group, metric_name, metric_value))


def get_elapsed_time_ms(start_time_in_seconds: float) -> int:
    """Milliseconds since `start_time_in_seconds` (a ``time.time()`` value)."""
    return int((time.time() - start_time_in_seconds) * 1000)


def event(name: str, **data: Any) -> None:
    """Append an event to elasticrun's events file, if the launcher keeps one (the same record
    as the agent's: :mod:`elastic_launch.eventlog`)."""
    path = os.environ.get(eventlog.EVENTS_FILE_ENV)
    if not path:
        return
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    try:
        attempt = int(os.environ.get("ELASTICRUN_ATTEMPT", "0"))
        eventlog.append(path, name, run_id, attempt, **data)
    except (OSError, ValueError):
        pass  # the events are a report, never a reason to fail training
