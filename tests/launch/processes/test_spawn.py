"""Processes as the agent handles them: signals reach the whole group, stopped ones too."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from elastic_launch.processes.spawn import ForkedProcess, PopenProcess


def test_a_stopped_worker_ends_at_its_sigterm_not_after_the_grace():
    popen = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
    )
    try:
        process = PopenProcess(popen)
        process.signal_group(signal.SIGSTOP)
        assert _state(popen.pid) == "T"
        began = time.monotonic()
        process.signal_group(signal.SIGTERM)
        assert popen.wait(timeout=10) == -signal.SIGTERM
        assert time.monotonic() - began < 5, "it acted on SIGTERM once continued"
    finally:
        if popen.poll() is None:
            popen.kill()
            popen.wait()


def test_a_stop_sent_before_a_forked_worker_has_its_own_group_still_reaches_it():
    """A zygote answers with the worker's pid as soon as it forked; the worker makes its own
    session a moment later. A group stop sent in between went nowhere (no such group), and the
    worker ran until the SIGKILL at the end of the grace (30 s)."""
    r, w = os.pipe()
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    pid = os.fork()
    if pid == 0:  # as a zygote's worker: stop signals blocked until it has its own group
        os.read(r, 1)
        os.setsid()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        time.sleep(60)
        os._exit(0)
    signal.pthread_sigmask(signal.SIG_SETMASK, held)
    status = None
    try:
        ForkedProcess(pid).signal_group(signal.SIGTERM)  # before the worker's setsid
        os.write(w, b"x")
        _, status = os.waitpid(pid, 0)
    finally:
        os.close(r)
        os.close(w)
        if status is None:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


def _state(pid: int) -> str:
    for _ in range(100):
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return state
        time.sleep(0.01)
    return state
