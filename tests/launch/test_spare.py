"""Hot spares' scheduling: idle CPU while they prepare (elastic_launch.spare)."""

from __future__ import annotations

import os
import subprocess
import sys


def test_a_hot_spare_prepares_on_idle_cpu_and_then_every_thread_leaves_it():
    """SCHED_IDLE while a spare prepares (threads it starts inherit it); once it waits in the
    rendezvous, every thread goes back to SCHED_OTHER without a privilege."""
    probe = """
import os, threading
from elastic_launch import spare
spare.idle_while_spare()
started, stop = threading.Event(), threading.Event()
def work():
    started.set()
    stop.wait(30)
t = threading.Thread(target=work)
t.start()
started.wait(30)
tids = [int(x) for x in os.listdir("/proc/self/task")]
before = {os.sched_getscheduler(tid) for tid in tids}
spare.leave_idle()
after = {os.sched_getscheduler(tid) for tid in tids}
stop.set()
t.join(30)
print(len(tids), sorted(before) == [os.SCHED_IDLE], sorted(after) == [os.SCHED_OTHER])
"""
    for spare, expected in (("1", "2 True True"), ("0", "2 False True")):
        env = {**os.environ, "ELASTICRUN_HOT_SPARE": spare}
        done = subprocess.run(
            [sys.executable, "-c", probe],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.stdout.split() == expected.split(), done.stderr
