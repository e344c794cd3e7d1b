"""The watchdog from Python: deaths, hangs, callbacks, iteration and clean shutdown."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import elastic_core as ec
import pytest

SLEEPER = "import time; time.sleep(120)"


@pytest.mark.parametrize("mode", ["pidfd", "poll"])
def test_sigkilled_child_is_reported_exited(procs, mode):
    with ec.Watchdog(death_detection=mode) as wd:
        assert wd.death_detection == mode
        child = procs.python(SLEEPER)
        wd.watch(5, child.pid)
        child.kill()
        event = wd.poll(timeout=10)
        assert event is not None
        assert event.kind == ec.EventKind.EXITED
        assert event.worker == 5
        assert event.pid == child.pid
        assert event.signal == signal.SIGKILL
        assert event.exit_code is None
        assert "SIGKILL" in event.detail
        # The watchdog did not reap: Popen still gets the status.
        assert child.wait(timeout=10) == -signal.SIGKILL


def test_exit_code_is_reported(procs):
    with ec.Watchdog() as wd:
        child = procs.python("raise SystemExit(7)")
        wd.watch(0, child.pid)
        event = wd.poll(timeout=30)
        assert event is not None
        assert event.exit_code == 7
        assert event.signal is None
        assert "exited with code 7" in event.detail


def test_child_that_stops_beating_is_reported_hung(procs, shm_path):
    path = shm_path("hang")
    table = ec.HeartbeatTable.create(path, 2)
    child = procs.python(
        """
        import elastic_core, time
        for step in range(5):
            elastic_core.beat()
            time.sleep(0.01)
        time.sleep(120)   # hung
        """,
        env={ec.HEARTBEAT_FILE_ENV: path, ec.HEARTBEAT_SLOT_ENV: "1"},
    )
    deadline = time.monotonic() + 60  # its five beats, however slowly they come
    while table.read(1).step < 5:
        assert time.monotonic() < deadline and child.poll() is None, "it never beat 5 times"
        time.sleep(0.01)
    with ec.Watchdog() as wd:
        wd.watch(1, child.pid, table, hang_timeout=0.3)
        event = wd.poll(timeout=30)
        assert event is not None
        assert event.kind == ec.EventKind.HUNG
        assert event.worker == 1
        assert event.step == 5
        assert event.time_ns - table.read(1).last_beat_ns >= 300_000_000
        assert "has not beaten for" in event.detail
        assert wd.poll(timeout=0.5) is None, "one report per hang"
        child.kill()
        event = wd.poll(timeout=10)
        assert event is not None
        assert event.kind == ec.EventKind.EXITED
    table.close()


def test_callback_runs_and_queue_iterates(procs):
    seen: list[ec.Event] = []
    lock = threading.Lock()

    def on_event(event: ec.Event) -> None:
        with lock:
            seen.append(event)

    wd = ec.Watchdog(callback=on_event)
    children = [procs.python(f"raise SystemExit({i})") for i in (1, 2, 3)]
    for i, child in enumerate(children):
        wd.watch(i, child.pid)
    wd.start()
    got = []
    for event in wd:
        got.append(event)
        if len(got) == 3:
            break
    wd.close()
    assert sorted(e.exit_code for e in got) == [1, 2, 3]
    with lock:
        assert sorted(e.worker for e in seen) == [0, 1, 2]


def test_a_failing_callback_is_reported_and_does_not_stop_the_watchdog(procs, monkeypatch):
    reported: list[str] = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: reported.append(repr(u.exc_value)))

    def broken(event: ec.Event) -> None:
        raise RuntimeError("callback bug")

    with ec.Watchdog(callback=broken) as wd:
        for i in range(2):
            child = procs.python("pass")
            wd.watch(i, child.pid)
        assert wd.poll(timeout=30) is not None
        assert wd.poll(timeout=30) is not None
    assert reported == ["RuntimeError('callback bug')"] * 2


def test_iteration_ends_when_stopped():
    wd = ec.Watchdog()
    wd.start()
    timer = threading.Timer(0.2, wd.stop)
    timer.start()
    assert list(wd) == []
    timer.join()
    assert not wd.running


def fds() -> set[tuple[str, str]]:
    """This process's open files: (number, what it points to)."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own, or one closed meanwhile
            found.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
    return found


def threads() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def test_start_stop_leaks_no_fd_thread_or_file(procs, shm_path):
    fds_before, threads_before = fds(), threads()
    path = shm_path("leak")
    for _ in range(5):
        table = ec.HeartbeatTable.create(path, 2)
        child = procs.python(SLEEPER)
        wd = ec.Watchdog(callback=lambda e: None)
        wd.watch(0, child.pid, table, hang_timeout=1.0)
        wd.start()
        assert threads() - threads_before, "the watchdog runs a thread"
        child.kill()
        assert wd.poll(timeout=10) is not None
        child.wait(timeout=10)
        child.stdout.close()
        child.stderr.close()
        wd.close()
        table.close()
    # What the test opened and started is gone: files and threads of this process that were
    # not there before (another test's may end meanwhile; a thread's end is waited for).
    deadline = time.monotonic() + 10
    while threads() - threads_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert fds() - fds_before == set()
    assert threads() - threads_before == set()
    assert not os.path.exists(path)


def test_bad_arguments_are_clear_errors(procs):
    wd = ec.Watchdog()
    with pytest.raises(ec.InvalidArgumentError, match="worker id -1 is negative"):
        wd.watch(-1, os.getpid())
    with pytest.raises(ec.InvalidArgumentError, match="pid 0 is not a process id"):
        wd.watch(0, 0)
    child = procs.python("pass")
    child.wait(timeout=30)
    with pytest.raises(ec.NotFoundError, match=f"no process with pid {child.pid}"):
        wd.watch(0, child.pid)
    with pytest.raises(ValueError, match="death_detection='fast'"):
        ec.Watchdog(death_detection="fast")
    with pytest.raises(ValueError, match="default_hang_timeout=-1"):
        ec.Watchdog(default_hang_timeout=-1)
    with pytest.raises(TypeError, match="callback must be callable"):
        ec.Watchdog(callback=42)
    wd.watch(0, os.getpid())
    with pytest.raises(ec.StateError, match="already watched"):
        wd.watch(0, os.getpid())
    wd.start()
    with pytest.raises(ec.StateError, match="already running"):
        wd.start()
    wd.close()
    with pytest.raises(ValueError, match="closed"):
        wd.watch(1, os.getpid())


def test_poll_honours_its_timeout():
    with ec.Watchdog() as wd:
        start = time.monotonic()
        assert wd.poll(timeout=0.2) is None
        assert time.monotonic() - start >= 0.19
