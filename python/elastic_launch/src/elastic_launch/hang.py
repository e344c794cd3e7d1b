"""Automatic hang timeouts: learned from the step interval the heartbeats show.

The agent samples each worker's heartbeat slot on every monitor tick. Each time a worker's step
advances, the time since its previous observed beat divided by the steps taken is one interval
sample (exact when steps are slower than the sampling, an average over the steps otherwise). The
timeout is ``max(floor, factor x p99)`` over the recent samples of all local workers.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass
class _Last:
    step: int
    beat_ns: int


class StepIntervalLearner:
    def __init__(self, floor: float, factor: float, window: int = 512) -> None:
        self.floor = floor
        self.factor = factor
        self._samples: deque[float] = deque(maxlen=window)
        self._last: dict[int, _Last] = {}

    def observe(self, worker: int, step: int, last_beat_ns: int) -> None:
        if last_beat_ns == 0:
            return
        last = self._last.get(worker)
        self._last[worker] = _Last(step, last_beat_ns)
        if last is None or step <= last.step or last_beat_ns <= last.beat_ns:
            return
        self._samples.append((last_beat_ns - last.beat_ns) / 1e9 / (step - last.step))

    def reset(self) -> None:
        """A new attempt: the workers start over (the learned intervals are kept)."""
        self._last.clear()

    def p99(self) -> float | None:
        if not self._samples:
            return None
        ordered = sorted(self._samples)
        return ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]

    def timeout(self) -> float:
        p99 = self.p99()
        return self.floor if p99 is None else max(self.floor, self.factor * p99)
