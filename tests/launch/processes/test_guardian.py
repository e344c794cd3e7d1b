"""The guardian cleans up after a launcher that dies without cleaning up itself (SIGKILL), and
does nothing after one that says it is done."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from elastic_launch.processes.guardian import _sessions_of
from proc_util import alive, wait

LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    from elastic_launch.processes.guardian import Guardian
    g = Guardian()
    # A worker in its own session, which starts a process of its own.
    worker = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys, time\\n"
         "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\\n"
         "time.sleep(60)"],
        start_new_session=True,
    )
    g.watch_group(worker.pid)
    for path in sys.argv[1:]:
        g.remove_path(path)
    print(g.pid, worker.pid, flush=True)
    if os.environ.get("DONE"):
        worker.kill(); worker.wait()
        g.done()
        print("done", flush=True)
    time.sleep(60)
""")


def start(paths: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, int, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, *paths],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )
    assert proc.stdout is not None
    guardian, worker = (int(x) for x in proc.stdout.readline().split())
    return proc, guardian, worker


def test_a_killed_launcher_leaves_nothing_behind(tmp_path):
    leftover = tmp_path / "heartbeat"
    leftover.write_text("x")
    tree = tmp_path / "logs"
    (tree / "attempt_0").mkdir(parents=True)
    proc, guardian, worker = start([str(leftover), str(tree)])
    try:
        assert wait(lambda: len(_sessions_of({worker})) == 2, 30), "the worker's child never ran"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        # Measured at once on an idle machine; 20 s only tells an end from a hang under load.
        assert wait(lambda: not _sessions_of({worker}), 20), "processes outlived the launcher"
        assert wait(lambda: not leftover.exists() and not tree.exists(), 20)
        assert wait(lambda: not alive(guardian), 20), "the guardian stays no longer"
    finally:
        for pid in _sessions_of({worker}):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.stdout.close()


def test_a_launcher_that_is_done_is_left_alone(tmp_path):
    kept = tmp_path / "kept"
    kept.write_text("x")
    proc, guardian, _ = start([str(kept)], {"DONE": "1"})
    try:
        assert proc.stdout.readline().strip() == "done"
        assert wait(lambda: not alive(guardian), 5.0), "done: the guardian exits"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        time.sleep(0.2)
        assert kept.exists()
    finally:
        proc.kill()
        proc.stdout.close()


def test_a_path_with_a_newline_is_one_path(tmp_path):
    """Each message is one JSON line: a directory whose name holds a newline is removed, and
    the directory its first line names is not (a TMPDIR with a newline once split it in two)."""
    innocent = tmp_path / "data"
    innocent.mkdir()
    (innocent / "keep.txt").write_text("x")
    odd = tmp_path / "data\nlogs"
    odd.mkdir()
    proc, guardian, worker = start([str(odd)])
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait(lambda: not odd.exists(), 2.0), "the path with a newline was not removed"
        assert wait(lambda: not alive(guardian), 2.0)
        assert (innocent / "keep.txt").exists(), "another directory was removed"
    finally:
        for pid in _sessions_of({worker}):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.stdout.close()


def test_what_is_not_a_message_is_never_acted_on():
    from elastic_launch.processes.guardian import _Orders

    orders = _Orders()
    assert not orders.take(b'path /tmp/x\n{"op": "path", "arg": "/tmp/a\\nb"}\n{"op": "gro')
    assert orders.paths == ["/tmp/a\nb"], "the old plain line is ignored"
    assert not orders.take(b'up", "arg": 7}\n{"op": "group", "arg": "x"}\n')
    assert orders.groups == {7}, "a message split across reads; a bad one skipped"
    assert orders.take(b'{"op": "done", "arg": null}\n')


STOPPED = textwrap.dedent("""
    import os, signal, sys, time
    from elastic_launch.processes import guardian as module
    module.SEND_DEADLINE = 0.2
    g = module.Guardian()
    g.remove_path(sys.argv[1])
    first = g.pid
    os.kill(first, signal.SIGSTOP)  # stopped: its socket fills, and a send would block
    began = time.monotonic()
    while g.pid == first:  # paths nobody has: each message is 4 KiB
        g.remove_path("/nonexistent/" + "x" * 4096)
        assert time.monotonic() - began < 60, "never replaced"
    print(first, g.pid, flush=True)
    time.sleep(60)  # SIGKILLed by the test: the new guardian cleans up
""")


def test_a_stopped_guardian_is_replaced_and_the_new_one_cleans_up(tmp_path):
    """A SIGSTOPped guardian takes no message: at the send deadline the launcher replaces it
    and tells the new one again what it must clean up (it blocked forever in send() before)."""
    leftover = tmp_path / "heartbeat"
    leftover.write_text("x")
    proc = subprocess.Popen(
        [sys.executable, "-c", STOPPED, str(leftover)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        first, second = (int(x) for x in proc.stdout.readline().split())
        assert first != second and wait(lambda: not alive(first), 5.0), "the stuck one is gone"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait(lambda: not leftover.exists(), 5.0), "the new guardian was told the path"
        assert wait(lambda: not alive(second), 5.0)
    finally:
        proc.kill()
        proc.stdout.close()


def test_a_cgroup_to_kill_is_an_absolute_path_only():
    from elastic_launch.processes.guardian import _Orders

    orders = _Orders()
    orders.take(b'{"op": "cgroup", "arg": "relative/x"}\n{"op": "cgroup", "arg": 3}\n')
    orders.take(b'{"op": "cgroup", "arg": "/sys/fs/cgroup/elasticrun-1-abc"}\n')
    assert orders.cgroups == ["/sys/fs/cgroup/elasticrun-1-abc"]


def test_without_a_cgroup_v2_hierarchy_the_container_says_why(monkeypatch):
    from elastic_launch.processes import cgroup

    monkeypatch.setattr(cgroup, "_mount", lambda: None)
    container = cgroup.Container.make()
    assert container.path is None and container.env() == {}
    assert "no cgroup v2 hierarchy is mounted" in container.describe()
    assert "a daemon that left both can outlive the job" in container.describe()
    container.kill()  # nothing to do
