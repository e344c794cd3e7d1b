"""The classic metrics API (``torchelastic.metrics``) on elasticrun, as torchelastic v0.1.0rc1's
``test/metrics_test.py`` pins it, and torch's later names (``put_metric``, ``prof``) as torch
2.13's ``test/distributed/elastic/metrics/api_test.py`` does. Each test names the upstream test
it follows (written here; no code is copied)."""

from __future__ import annotations

import pytest
from elastic_launch.train_loop import metrics


class Recorder(metrics.MetricHandler):
    """Keeps the last value of each ``group.name``."""

    def __init__(self) -> None:
        self.values: dict[str, float] = {}

    def emit(self, metric_data: metrics.MetricData) -> None:
        self.values[f"{metric_data.group_name}.{metric_data.name}"] = metric_data.value


@pytest.fixture
def recorded(monkeypatch):
    """A recorder for the torchelastic group and the default; the handlers as they were after
    the test (the per-group table included, so later tests see no leftover group)."""
    monkeypatch.setattr(metrics, "_by_group", {})
    monkeypatch.setattr(metrics, "_default", metrics.NullMetricHandler())
    kept = Recorder()
    metrics.configure(kept, "torchelastic")
    metrics.configure(kept)
    return kept.values


def test_metrics_decorator(recorded):
    """upstream (0.1): test_metrics_decorator"""

    @metrics.profile("torchelastic")
    def func(a, b):
        return a + b

    assert func(3, 2) == 5
    assert "torchelastic.func.duration.ms" in recorded
    assert recorded["torchelastic.func.success"] == 1

    def abc(a, b):
        return a + b, a * b

    assert metrics.profile("torchelastic")(abc)(3, 2) == (5, 6)
    assert recorded["torchelastic.abc.success"] == 1

    @metrics.profile("torchelastic")
    def xyz():
        raise ValueError("thrown from xyz")

    with pytest.raises(ValueError, match="thrown from xyz"):
        xyz()
    assert "torchelastic.xyz.duration.ms" in recorded
    assert recorded["torchelastic.xyz.failure"] == 1
    assert "torchelastic.xyz.success" not in recorded


def test_default_metrics_go_nowhere_quietly(monkeypatch, capsys):
    """upstream (0.1): test_default_metrics: with no handler configured, a group's values
    reach the null handler and print nothing"""
    monkeypatch.setattr(metrics, "_by_group", {})
    monkeypatch.setattr(metrics, "_default", metrics.NullMetricHandler())
    stream = metrics.getStream("default")
    assert isinstance(stream.handler, metrics.NullMetricHandler)
    stream.add_value("torchelastic_test.counter", 2)
    metrics.put_metric("torchelastic_test.counter", 3)
    assert capsys.readouterr() == ("", "")


def test_override_default_metric_handler(recorded):
    """upstream (0.1): test_override_default_metric_handler"""
    stream = metrics.getStream("default")
    assert isinstance(stream, metrics.MetricStream) and stream.group_name == "default"
    stream.add_value("test.counter", 3)
    assert recorded["default.test.counter"] == 3


class Named:
    @metrics.prof
    def method(self) -> int:
        return 1

    @metrics.prof(group="agent")
    def failing(self) -> None:
        raise RuntimeError("no")


@metrics.prof
def module_function() -> int:
    return 2


def test_prof_names_the_metric_by_class_or_module(recorded):
    """upstream (torch): test_profile, test_get_metric_name"""
    kept = Recorder()
    metrics.configure(kept, "agent")
    assert Named().method() == 1 and module_function() == 2
    with pytest.raises(RuntimeError):
        Named().failing()
    assert recorded["torchelastic.Named.method.success"] == 1
    assert recorded["torchelastic.test_metrics.module_function.success"] == 1
    assert kept.values["agent.Named.failing.failure"] == 1
    assert metrics._get_metric_name(module_function) == "test_metrics.module_function"


def test_put_metric(recorded):
    """upstream (torch): test_put_metric"""
    metrics.put_metric("m1", 1)
    metrics.put_metric("m2", 2, "torchelastic")
    assert recorded["torchelastic.m1"] == 1 and recorded["torchelastic.m2"] == 2
    metrics.initialize_metrics()  # the classic hook: nothing to set up
