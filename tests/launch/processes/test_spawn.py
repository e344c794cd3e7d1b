"""Processes as the agent handles them: signals reach the whole group, stopped ones too."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from elastic_launch.processes.spawn import PopenProcess


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


def _state(pid: int) -> str:
    for _ in range(100):
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return state
        time.sleep(0.01)
    return state
