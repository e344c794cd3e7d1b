"""The automatic hang timeout: learned from the step interval the heartbeats show."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from elastic_launch.agent.activity import Activity, sample
from elastic_launch.agent.hang import Beat, HangMonitor, StepIntervalLearner


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


# ---- the monitor under auto: progress is a beat, CPU time or I/O -------------------------------

S = 1_000_000_000  # ns per second


class FakeProc:
    """The /proc counters of fake workers (session id -> Activity), changed by the test."""

    def __init__(self) -> None:
        self.now: dict[int, Activity] = {}

    def set(self, pid: int, cpu: float = 0.0, io: int = 0, stopped: bool = False) -> None:
        self.now[pid] = Activity(cpu, io, 1, stopped, False)

    def __call__(self, sessions):
        return {s: self.now[s] for s in sessions if s in self.now}


def monitor(proc: FakeProc, floor: float = 60.0) -> HangMonitor:
    return HangMonitor(None, floor=floor, factor=10.0, sampler=proc)


def run(mon: HangMonitor, beats: dict, seconds: int, start: int, busy=None, proc=None):
    """Tick once a second for `seconds`; `busy(pid, t)` moves the counters before each tick.
    Returns the first findings and the second they came at."""
    for t in range(start, start + seconds):
        if busy is not None:
            for pid in (100, 101):
                busy(proc, pid, t)
        found = mon.check([(0, 100), (1, 101)], beats, t * S)
        if found:
            return found, t
    return [], None


def beaten(step: int = 1, at: int = 1) -> dict:
    return {r: Beat(step, at * S, 0.0) for r in (0, 1)}


def test_a_quiet_node_is_hung_after_the_limit_and_the_report_says_why():
    proc = FakeProc()
    proc.set(100, cpu=3.0, io=5000)
    proc.set(101, cpu=3.0, io=5000)
    mon = monitor(proc)
    found, at = run(mon, beaten(at=1), 200, start=1)
    assert at is not None and 61 <= at <= 61 + 7, at  # the limit, plus the window and a sample
    assert {h.local_rank for h in found} == {0, 1}
    assert "no progress for" in found[0].detail and "no heartbeat since step 1" in found[0].detail
    assert "0.00 s of CPU time and 0 bytes of I/O" in found[0].detail
    assert "--hang-timeout-floor 60" in mon.limit_text()


@pytest.mark.parametrize(
    "work",
    [
        lambda proc, pid, t: proc.set(pid, cpu=t * 0.5),  # evaluation, metrics: CPU time
        lambda proc, pid, t: proc.set(pid, io=t * 1_000_000),  # a checkpoint write: I/O
    ],
    ids=["cpu", "io"],
)
def test_work_without_steps_is_progress(work):
    proc = FakeProc()
    mon = monitor(proc)
    found, _ = run(mon, beaten(at=1), 300, start=1, busy=work, proc=proc)
    assert found == []


def test_idle_background_threads_are_not_progress():
    # A worker blocked in gloo used 0.04 s of CPU time in 10 s here: under the evidence bar.
    proc = FakeProc()
    mon = monitor(proc)

    def idle(proc, pid, t):
        proc.set(pid, cpu=t * 0.004, io=0)

    found, at = run(mon, beaten(at=1), 200, start=1, busy=idle, proc=proc)
    assert found and at <= 61 + 7


def test_a_worker_waiting_for_a_busy_local_peer_is_not_hung():
    proc = FakeProc()
    mon = monitor(proc)

    def rank0_evaluates(proc, pid, t):
        proc.set(pid, cpu=t * 0.9 if pid == 100 else 1.0)

    found, _ = run(mon, beaten(at=1), 300, start=1, busy=rank0_evaluates, proc=proc)
    assert found == []


def test_a_stopped_worker_is_hung_even_when_its_peer_is_busy_and_is_named_first():
    proc = FakeProc()
    mon = monitor(proc)

    def one_stopped(proc, pid, t):
        if pid == 101:
            proc.set(pid, cpu=1.0, stopped=True)
        else:
            proc.set(pid, cpu=t * 0.9)

    found, _ = run(mon, beaten(at=1), 200, start=1, busy=one_stopped, proc=proc)
    assert [h.local_rank for h in found] == [1]
    assert "stopped" in found[0].detail


def test_beats_are_progress_and_teach_the_limit():
    proc = FakeProc()
    proc.set(100)
    proc.set(101)
    mon = monitor(proc, floor=5.0)
    for t in range(1, 40):
        found = mon.check([(0, 100), (1, 101)], beaten(step=t, at=t), t * S)
        assert found == []
    assert mon.limit() == pytest.approx(10.0)  # 10 x the 1 s step
    mon.new_attempt()
    assert mon.limit() == pytest.approx(10.0), "a restart keeps what was learned"


def test_workers_that_never_beat_or_set_their_own_limit_are_left_to_the_watchdog():
    proc = FakeProc()
    proc.set(100)
    proc.set(101)
    mon = monitor(proc, floor=5.0)
    beats = {0: Beat(0, 0, 0.0), 1: Beat(3, 1 * S, 900.0)}  # never beaten; quiet(900)
    found, _ = run(mon, beats, 100, start=1)
    assert found == []


def test_a_replaced_worker_starts_with_a_clean_record():
    proc = FakeProc()
    proc.set(100)
    proc.set(101)
    proc.set(102, cpu=0.0)
    mon = monitor(proc, floor=5.0)
    beats = beaten(at=1)
    for t in range(1, 5):
        assert mon.check([(0, 100), (1, 101)], beats, t * S) == []
    # rank 1 replaced by pid 102 at t=5; quiet time counts from then, not from t=1
    for t in range(5, 10):
        found = mon.check([(0, 100), (1, 102)], beats, t * S)
        assert all(h.local_rank != 1 for h in found)


def test_a_fixed_limit_is_the_watchdogs_and_off_is_zero():
    assert HangMonitor(30.0, 60, 10).watchdog_timeout() == 30.0
    assert HangMonitor(float("inf"), 60, 10).watchdog_timeout() == 0.0
    auto = HangMonitor(None, 60, 10)
    assert auto.watchdog_timeout() == 0.0 and auto.auto
    assert HangMonitor(30.0, 60, 10).check([(0, 1)], {0: Beat(1, 1, 0.0)}, 10**15) == []
    assert "--hang-timeout 30 s" in HangMonitor(30.0, 60, 10).advice(0)
    assert "elastic_core.quiet()" in HangMonitor(30.0, 60, 10).advice(900.0)


# ---- /proc, read for real -----------------------------------------------------------------------


def test_sample_reads_a_sessions_cpu_io_and_state():
    # 0.3 s of its own CPU (a busy machine may give less in 0.3 s of wall time), then I/O.
    code = "import time\nwhile time.process_time()<0.3: pass\nopen('/dev/null','w').write('x'*100000)\ntime.sleep(60)"
    p = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            a = sample([p.pid]).get(p.pid)
            if a and a.cpu_seconds >= 0.2 and a.io_bytes >= 100000:
                break
            time.sleep(0.05)
        assert a and a.processes == 1 and not a.stopped
        p.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not sample([p.pid])[p.pid].stopped:
            time.sleep(0.02)
        assert sample([p.pid])[p.pid].stopped
        assert sample([p.pid + 10**7]) == {}
    finally:
        p.kill()
        p.wait()
