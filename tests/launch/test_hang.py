"""The automatic hang timeout: learned from the step interval the heartbeats show."""

from __future__ import annotations

import pytest
from elastic_launch.hang import StepIntervalLearner


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
