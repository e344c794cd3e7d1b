"""The workers' fence (:mod:`elastic_launch.processes.fence`): a worker stops itself once its
agent's place in the round is no longer certain, and is woken when it is again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable

from elastic_launch.processes import fence

WORKER = """
import sys, time
from elastic_launch.processes import fence
fence.start_watch(sys.argv[1])
print("watching", flush=True)
while True:
    time.sleep(0.01)
"""


def state_of(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def wait_for(what: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _switches(pid: int) -> int:
    """The main thread's voluntary context switches: they move on once a stopped process
    is continued (its sleep is waited again), however soon it stops again."""
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("voluntary_"))


def test_the_value_written_for_a_lease():
    assert fence.value_of(None) == fence.NO_FENCE
    assert fence.value_of(0.0) == fence.FENCED
    assert fence.value_of(100.0) == int((100.0 - fence.MARGIN) * 1e9)
    assert not fence.passed(fence.NO_FENCE, 10**18)
    assert fence.passed(fence.FENCED, 2)
    assert fence.passed(5, 5) and not fence.passed(6, 5)


def test_a_worker_stops_when_the_lease_is_not_certain_and_is_woken_when_it_is(tmp_path):
    path = str(tmp_path / "fence")
    writer = fence.FenceWriter(path)
    held: list[float | None] = [None]
    woken = []
    worker = subprocess.Popen(
        [sys.executable, "-c", WORKER, path], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )

    def wake() -> None:
        woken.append(time.monotonic())
        os.kill(worker.pid, signal.SIGCONT)

    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == b"watching"
        writer.start(lambda: held[0], wake)
        held[0] = time.monotonic() + 3600  # renewed: it runs
        writer.write()
        assert state_of(worker.pid) != "T"
        held[0] = 0.0  # the lease it entered the round with is gone
        wait_for(lambda: state_of(worker.pid) == "T")
        held[0] = time.monotonic() + 3600  # a renewal shows it held after all
        wait_for(lambda: bool(woken))
        wait_for(lambda: state_of(worker.pid) != "T")
        held[0] = time.monotonic() - 1  # the last renewal's hold has run out
        wait_for(lambda: state_of(worker.pid) == "T")
        assert writer.fenced()
        # Woken while the fence holds (by anyone: the agent ends a fenced worker with
        # SIGKILL): it reads again and stops again.
        before = _switches(worker.pid)
        os.kill(worker.pid, signal.SIGCONT)
        wait_for(lambda: state_of(worker.pid) == "T" and _switches(worker.pid) > before)
    finally:
        worker.kill()
        _, err = worker.communicate(timeout=10)
        writer.close()
    assert b"its agent has not renewed its place in the round" in err
    assert not os.path.exists(path), "the agent's file is removed"


def test_an_unreadable_fence_is_said_and_the_worker_runs(tmp_path, capsys):
    assert fence.start_watch(str(tmp_path / "missing")) is None
    assert "cannot be read" in capsys.readouterr().err


def test_what_a_worker_does_to_the_fence_file_costs_the_agent_nothing(tmp_path):
    """The agent writes through the descriptor it made the file with and never reads it: a
    worker that cuts it, replaces it with a directory or removes it changes what workers
    read, never the agent. (The file is the user's: a worker can write a fence into it and
    stop its node's workers, as it can signal them; no other node's.)"""
    path = tmp_path / "fence"
    writer = fence.FenceWriter(str(path))
    try:
        reader = os.open(path, os.O_RDONLY)
        try:
            os.truncate(path, 3)
            assert fence.read_value(reader) == fence.NO_FENCE, "cut short: no fence"
            writer._held_until = lambda: 0.0
            writer.write()
            assert fence.read_value(reader) == fence.FENCED, "written whole again"
        finally:
            os.close(reader)
        path.unlink()
        path.mkdir()  # a directory at its path
        writer.write()  # through its own descriptor: no error
        with open(path / "x", "w"):
            pass
    finally:
        writer.close()
    assert path.is_dir(), "close removes only the file it made"


def test_a_fence_that_cannot_be_read_fences_no_one(tmp_path):
    fd = os.open(tmp_path, os.O_RDONLY)  # a directory: pread fails
    try:
        assert fence.read_value(fd) is None
    finally:
        os.close(fd)


def test_fenced_workers_are_ended_with_sigkill(tmp_path):
    writer = fence.FenceWriter(str(tmp_path / "fence"))
    try:
        held: list[float | None] = [time.monotonic() + 3600]
        writer._held_until = lambda: held[0]
        writer.write()
        assert writer.signal_for(signal.SIGTERM) == signal.SIGTERM
        held[0] = 0.0
        writer.write()
        assert writer.signal_for(signal.SIGTERM) == signal.SIGKILL
        assert writer.signal_for(signal.SIGINT) == signal.SIGKILL
    finally:
        writer.close()
