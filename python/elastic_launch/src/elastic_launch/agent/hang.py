"""Hang detection: a fixed limit on heartbeats, or (``--hang-timeout auto``) a learned limit on
the absence of any progress.

- **Fixed** (``--hang-timeout SECONDS``, or a worker's own timeout from
  ``elastic_core.quiet()``/``set_hang_timeout``): a worker that has not beaten for the limit is
  hung. The C++ watchdog checks it every 100 ms at most.
- **auto** (the default): a worker is hung when it has shown no progress of any kind for the
  limit: no heartbeat (an optimizer step, ``elastic_core.beat()``), and in its processes less
  than :data:`CPU_EVIDENCE` of a core of CPU time and less than :data:`IO_EVIDENCE` bytes of I/O
  over every :data:`WINDOW`, and none of them waiting on a device (state D). Evaluation, metric
  computation, a checkpoint write and a slow first step all use CPU time or do I/O; a worker that
  is stopped, deadlocked, asleep or blocked in a collective whose peer is any of those does not.
  A quiet worker is held hung only when the whole node is quiet too (a worker waiting in a
  collective for a local peer that evaluates is waiting, not hung), or when it is stopped. The
  limit is ``max(floor, factor x p99)`` of the step intervals the heartbeats showed, learned
  for the whole life of the agent (restarts keep it). A hang is found within the limit plus
  :data:`WINDOW` and :data:`SAMPLE_INTERVAL` of its last activity. A worker that has never
  beaten is not judged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import elastic_core

from elastic_launch.agent.activity import Activity, sample

CPU_EVIDENCE = 0.05  # of one core over WINDOW: an idle process blocked in gloo uses ~0.004
IO_EVIDENCE = 64 * 1024  # bytes over WINDOW
WINDOW = 5.0  # seconds the evidence is judged over (CPU time comes in 10 ms ticks)
SAMPLE_INTERVAL = 1.0  # seconds between reads of /proc


@dataclass
class _Last:
    step: int
    beat_ns: int


class StepIntervalLearner:
    """The step interval the heartbeats show. Each time a worker's step advances, the time since
    its previous observed beat divided by the steps taken is one sample (exact when steps are
    slower than the sampling, an average over the steps otherwise)."""

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


@dataclass(frozen=True)
class Beat:
    """What the agent reads from a worker's heartbeat slot."""

    step: int
    last_beat_ns: int  # 0: never beaten
    own_timeout: float  # seconds the worker set for itself (0: none)
    beating: bool = True  # False once the worker detached (it is finishing)


def beats_of(slots: Mapping[int, Any]) -> dict[int, Beat]:
    """The heartbeat slots of the live workers (``elastic_core.SlotInfo`` by local rank), as
    :meth:`HangMonitor.check` reads them."""
    return {
        lr: Beat(
            b.step,
            b.last_beat_ns,
            b.timeout_ms / 1000,
            beating=b.state == elastic_core.SlotState.BEATING,
        )
        for lr, b in slots.items()
    }


@dataclass
class _Watched:
    pid: int
    beat_ns: int = 0
    step: int = 0
    progress_ns: int = 0  # the last evidence of progress
    at_progress: Activity | None = None  # the counters then, for the report
    samples: deque[tuple[int, Activity]] = field(default_factory=deque)
    now: Activity | None = None


@dataclass(frozen=True)
class Hung:
    """A worker judged hung under ``auto``, with the evidence."""

    local_rank: int
    quiet_seconds: float
    detail: str


Sampler = Callable[[Collection[int]], dict[int, Activity]]


class HangMonitor:
    """One agent's hang detection (see the module's docstring)."""

    def __init__(
        self,
        fixed: float | None,
        floor: float,
        factor: float,
        sampler: Sampler = sample,
    ) -> None:
        self.fixed = fixed  # seconds, inf (off) or None (auto)
        self.learner = StepIntervalLearner(floor, factor)
        self._sampler = sampler
        self._watched: dict[int, _Watched] = {}
        self._next_sample_ns = 0

    @property
    def auto(self) -> bool:
        return self.fixed is None

    def new_attempt(self) -> None:
        """The workers start over; what was learned stays."""
        self.learner.reset()
        self._watched.clear()
        self._next_sample_ns = 0

    def limit(self) -> float:
        """Seconds without progress (auto) or beats (fixed) after which a worker is hung; inf
        when off."""
        return self.fixed if self.fixed is not None else self.learner.timeout()

    def watchdog_timeout(self) -> float:
        """The limit the C++ watchdog applies to heartbeats: the fixed one, or 0 (off) under
        auto, where :meth:`check` judges instead."""
        if self.fixed is None or self.fixed == float("inf"):
            return 0.0
        return self.fixed

    def limit_text(self) -> str:
        """The limit and the flag that sets it, for a failure report."""
        if self.fixed is not None:
            return f"the limit is --hang-timeout {self.fixed:g} s"
        p99 = self.learner.p99()
        learned = (
            f"{self.learner.factor:g} x p99 step interval {p99:.2f} s"
            if p99 is not None
            else "no step interval learned yet"
        )
        return (
            f"the limit is {self.limit():.0f} s under --hang-timeout auto: "
            f"max(--hang-timeout-floor {self.learner.floor:g} s, {learned})"
        )

    def advice(self, own_timeout: float) -> str:
        """What a user can change, after a hang report."""
        if own_timeout:
            return (
                f"the limit is the worker's own {own_timeout:g} s (elastic_core.quiet() or "
                "set_hang_timeout() in the script)"
            )
        return (
            f"{self.limit_text()}; raise it with --hang-timeout SECONDS (or 'off'), or mark a "
            "long phase in the script with `with elastic_core.quiet(seconds):`"
        )

    def check(
        self, workers: Iterable[tuple[int, int]], beats: dict[int, Beat], now_ns: int
    ) -> list[Hung]:
        """Under auto, the workers (``(local_rank, pid)`` of the live ones) judged hung now, the
        likeliest cause first; always empty otherwise. Call it on every monitor tick."""
        live = dict(workers)
        if self.fixed is not None:
            return []
        for local_rank, beat in beats.items():
            if local_rank in live:
                self.learner.observe(local_rank, beat.step, beat.last_beat_ns)
        for local_rank in list(self._watched):
            if self._watched[local_rank].pid != live.get(local_rank):
                del self._watched[local_rank]  # gone, or replaced
        for local_rank, pid in live.items():
            w = self._watched.setdefault(local_rank, _Watched(pid, progress_ns=now_ns))
            seen = beats.get(local_rank)
            if seen is not None and seen.last_beat_ns > w.beat_ns:
                w.beat_ns, w.step = seen.last_beat_ns, seen.step
                self._progress(w, max(w.progress_ns, min(seen.last_beat_ns, now_ns)))
        if now_ns >= self._next_sample_ns:
            self._next_sample_ns = now_ns + int(SAMPLE_INTERVAL * 1e9)
            self._sample(now_ns)
        limit = self.limit()
        limit_ns = limit * 1e9
        node_progress = max((w.progress_ns for w in self._watched.values()), default=now_ns)
        node_quiet = now_ns - node_progress > limit_ns
        found = []
        for local_rank, w in self._watched.items():
            slot = beats.get(local_rank)
            if slot is None or not slot.beating or slot.last_beat_ns == 0 or slot.own_timeout:
                continue  # never beaten, finishing, or its own limit (the watchdog checks it)
            quiet_ns = now_ns - w.progress_ns
            if quiet_ns > limit_ns and (node_quiet or self._stopped(local_rank)):
                found.append(Hung(local_rank, quiet_ns / 1e9, self._evidence(w, now_ns)))
        # A stopped worker is the likeliest cause; then the one quiet the longest.
        found.sort(key=lambda h: (not self._stopped(h.local_rank), -h.quiet_seconds))
        return found

    def _stopped(self, local_rank: int) -> bool:
        now = self._watched[local_rank].now
        return now is not None and now.stopped

    # ---- evidence ------------------------------------------------------------------------------

    def _progress(self, w: _Watched, at_ns: int) -> None:
        w.progress_ns = at_ns
        w.at_progress = w.now

    def _sample(self, now_ns: int) -> None:
        if not self._watched:
            return
        counters = self._sampler([w.pid for w in self._watched.values()])
        window_ns = int(WINDOW * 1e9)
        for w in self._watched.values():
            act = counters.get(w.pid)
            if act is None:
                continue
            w.now = act
            if w.at_progress is None:
                w.at_progress = act
            w.samples.append((now_ns, act))
            while len(w.samples) > 1 and now_ns - w.samples[1][0] >= window_ns:
                w.samples.popleft()  # keep the newest sample at least WINDOW old
            then_ns, then = w.samples[0]
            span = (now_ns - then_ns) / 1e9
            if act.io_wait or (not act.stopped and span >= WINDOW and _busy(then, act, span)):
                self._progress(w, now_ns)

    def _evidence(self, w: _Watched, now_ns: int) -> str:
        quiet = (now_ns - w.progress_ns) / 1e9
        parts = [f"no progress for {quiet:.1f} s: no heartbeat since step {w.step}"]
        if w.now is not None and w.at_progress is not None:
            cpu = max(0.0, w.now.cpu_seconds - w.at_progress.cpu_seconds)
            io = max(0, w.now.io_bytes - w.at_progress.io_bytes)
            parts.append(
                f"{cpu:.2f} s of CPU time and {_size(io)} of I/O in its {w.now.processes} "
                f"process(es) over that time (progress needs {CPU_EVIDENCE:.0%} of a core or "
                f"{_size(IO_EVIDENCE)} per {WINDOW:g} s)"
            )
            if w.now.stopped:
                parts.append("the worker is stopped (SIGSTOP or a debugger)")
        return "; ".join(parts)


def _busy(then: Activity, now: Activity, span: float) -> bool:
    cpu = now.cpu_seconds - then.cpu_seconds
    io = now.io_bytes - then.io_bytes
    return cpu >= CPU_EVIDENCE * span or io >= IO_EVIDENCE * span / WINDOW


def _size(n: int) -> str:
    return f"{n / 1024:.0f} KiB" if n >= 1024 else f"{n} bytes"
