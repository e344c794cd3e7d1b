"""The train loop's metrics, in the classic ``torchelastic.metrics`` shape: the loop publishes
``<name>.duration.ms`` values (``state_sync``, ``train_step``, ``rendezvous``, ``rollback``,
``outer_train_loop``, ``inner_train_loop``) and ``rollbacks`` counts to the handler configured
for their group (``torchelastic``); none is kept by default.

    from elastic_launch.train_loop import metrics
    metrics.configure(metrics.ConsoleMetricHandler())

The classic API is all here (``configure``, ``getStream``, ``MetricStream``,
``publish_metric``, ``profile``), with torch's later names (``put_metric``, ``prof``).

Under elasticrun with ``--events-file``, the loop also appends its rounds and rollbacks to that
file as ``train_loop_round`` and ``train_loop_rollback`` events (JSON lines, one write each), next
to the agent's own.
"""

from __future__ import annotations

import abc
import functools
import os
import sys
import time
from collections.abc import Callable
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


class MetricStream:
    """The values of one group, sent to its handler."""

    def __init__(self, group_name: str, handler: MetricHandler) -> None:
        self.group_name = group_name
        self.handler = handler

    def add_value(self, metric_name: str, metric_value: float) -> None:
        self.handler.emit(MetricData(time.time(), self.group_name, metric_name, metric_value))


def getStream(group: str) -> MetricStream:  # noqa: N802 - the classic name
    """The stream of `group`: its handler's, or the default one."""
    return MetricStream(group, _by_group.get(group, _default))


def publish_metric(metric_group: str, metric_name: str, metric_value: float) -> None:
    getStream(metric_group).add_value(metric_name, metric_value)


def put_metric(metric_name: str, metric_value: float, metric_group: str = GROUP) -> None:
    """torch's name: one value of `metric_group` (``torchelastic`` by default)."""
    getStream(metric_group).add_value(metric_name, metric_value)


def initialize_metrics() -> None:
    """The classic package's hook for site-wide handlers; there are none to set up."""


def _timed(key: str, group: str | None, fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn`, publishing ``key.success`` or ``key.failure`` and ``key.duration.ms`` per call."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.time()
        try:
            result = fn(*args, **kwargs)
        except Exception:
            publish_metric(group, f"{key}.failure", 1)  # type: ignore[arg-type]
            raise
        finally:
            publish_metric(group, f"{key}.duration.ms", get_elapsed_time_ms(start))  # type: ignore[arg-type]
        publish_metric(group, f"{key}.success", 1)  # type: ignore[arg-type]
        return result

    return wrapper


def profile(group: str | None = None) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The classic decorator: ``<function name>.success``/``.failure`` and ``.duration.ms`` in
    `group`, per call. ``@metrics.profile("torchelastic")``."""
    return lambda fn: _timed(fn.__name__, group, fn)


def prof(fn: Callable[..., Any] | None = None, group: str = GROUP) -> Any:
    """torch's decorator: as :func:`profile`, named ``Class.method`` (or ``module.function``).
    ``@metrics.prof`` or ``@metrics.prof(group="agent")``."""

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        return _timed(_get_metric_name(f), group, f)

    return wrap(fn) if fn is not None else wrap


def _get_metric_name(fn: Callable[..., Any]) -> str:
    """``Class.method`` for a method; ``module.function`` (the module's last part) else."""
    parts = fn.__qualname__.split(".")
    if len(parts) > 1:
        return fn.__qualname__
    module = getattr(fn, "__module__", None)
    return f"{module.split('.')[-1]}.{parts[0]}" if module else parts[0]


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
