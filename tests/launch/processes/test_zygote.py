"""The zygote: its message protocol, and a real zygote (no modules to import, so it is ready in
milliseconds) forking workers that become workers like any other."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elastic_launch.processes.preload import PreloadPlan
from elastic_launch.processes.spawn import FreshInterpreter, SpawnRequest, ZygoteFork
from elastic_launch.processes.worker_main import DEVNULL, KEEP
from elastic_launch.processes.zygote import Zygote, ZygoteUnavailableError, recv, send
from proc_util import children

SCRIPT = """
import json, os, signal, sys
with open(sys.argv[1], "w") as f:
    json.dump({"pid": os.getpid(), "sid": os.getsid(0), "argv": sys.argv, "cwd": os.getcwd(),
               "env": os.environ.get("PROBE"), "parent": os.environ.get("ELASTICRUN_PARENT_PID"),
               "name": __name__, "sigterm": int(signal.getsignal(signal.SIGTERM))}, f)
sys.exit(int(sys.argv[2]))
"""


def test_messages_carry_file_descriptors(tmp_path):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        send(a, {"op": "spawn", "id": 3}, [fd])
        message, fds = recv(b)
        assert message == {"op": "spawn", "id": 3} and len(fds) == 1
        os.write(fds[0], b"through the socket")
        os.close(fds[0])
        assert path.read_bytes() == b"through the socket"
        a.close()
        assert recv(b) == (None, []), "end of file: the other side is gone"
    finally:
        os.close(fd)
        b.close()


def test_a_message_over_the_limit_is_refused_before_sending():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b, pytest.raises(OSError, match="is over"):
        send(a, {"env": "x" * (2 << 20)})


@pytest.fixture(params=[0, 2], ids=["forked-on-request", "warm-spares"])
def zygote(request):
    """A zygote that forks each worker when asked, or hands it to one of 2 warm spares: every
    test of a worker holds for both."""
    z = Zygote([], spares=request.param)
    assert z.wait_ready(30), "the zygote never got ready"
    yield z
    z.close()


def spares(zygote: Zygote) -> set[int]:
    return {p for p, cmd in children(zygote.pid, zombies=False).items() if b"(warm spare)" in cmd}


def until(what: str, done, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while not (found := done()):
        assert time.monotonic() < deadline, f"no {what} within {timeout:g} s"
        time.sleep(0.005)
    return found


def test_a_forked_worker_is_a_worker(zygote, tmp_path, monkeypatch):
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    monkeypatch.chdir(tmp_path)
    log = os.open(tmp_path / "stdout.log", os.O_WRONLY | os.O_CREAT)
    env = {**os.environ, "PROBE": "yes"}
    pid = zygote.spawn(["--", str(script), str(out), "7"], env, log, DEVNULL)
    os.close(log)
    zygote.acknowledge(pid)
    status = zygote.wait_status(pid, 30)
    assert status is not None and os.waitstatus_to_exitcode(status) == 7
    seen = json.loads(out.read_text())
    assert seen["pid"] == pid and seen["sid"] == pid, "its own session"
    assert seen["argv"] == [str(script), str(out), "7"] and seen["name"] == "__main__"
    assert seen["env"] == "yes" and seen["cwd"] == str(tmp_path)
    assert seen["parent"] == str(zygote.pid), "it dies with the zygote"
    assert seen["sigterm"] == int(signal.SIG_DFL)


def test_a_stop_signal_sent_as_a_worker_is_forked_is_not_lost(zygote, tmp_path):
    """The zygote ignores SIGTERM; a child that took it before setting its own handlers back
    would sleep on (a job that fails as its workers start waited out the stop timeout)."""
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(60)\n")
    for _ in range(5):
        pid = zygote.spawn(["--", str(script)], dict(os.environ), DEVNULL, DEVNULL)
        os.kill(pid, signal.SIGTERM)  # at once: the child is still becoming a worker
        zygote.acknowledge(pid)
        status = zygote.wait_status(pid, 20)
        assert status is not None, "the worker slept on: the signal was lost"
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM


def test_a_dead_zygote_is_unavailable(zygote):
    os.kill(zygote.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not zygote.dead and time.monotonic() < deadline:
        time.sleep(0.01)
    with pytest.raises(ZygoteUnavailableError, match="exited"):
        zygote.spawn(["--", "x.py"], dict(os.environ), KEEP, KEEP)


def test_the_spawner_falls_back_to_fresh_interpreters_and_says_why(tmp_path, caplog):
    script, spawner = probe_spawner(tmp_path)
    try:
        assert spawner.forks and spawner.zygote is not None
        os.kill(spawner.zygote.pid, signal.SIGKILL)
        spawner.zygote._proc.wait(10)
        out = tmp_path / "out.json"
        request = SpawnRequest(0, ["--", str(script), str(out), "0"], dict(os.environ))
        process = spawner.spawn(request)
        assert process.reap(30) == (0, None)
        assert json.loads(out.read_text())["pid"] == process.pid
        assert not spawner.forks
        assert "fresh interpreters" in caplog.text
    finally:
        spawner.close()


def test_a_message_not_taken_within_its_deadline_is_a_timeout():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with a, b:
        # Nobody reads b: its buffer fills, then a send waits its deadline.
        with pytest.raises(TimeoutError, match=r"took no message within 0\.05 s"):
            _fill(a, {"pad": "x" * 60_000})
        message, _ = recv(b)
        assert message == {"pad": "x" * 60_000}, "what was taken arrives whole"


def _fill(sock: socket.socket, message: dict) -> None:
    """Send `message` until one is not taken within 0.05 s (TimeoutError)."""
    while True:
        send(sock, message, deadline=0.05)


def test_a_stopped_zygote_is_given_up_for_fresh_interpreters(tmp_path, caplog):
    """A zygote SIGSTOPped with its socket full: the spawn's send waits its deadline (it waited
    forever before), the spawner says why and starts a fresh interpreter."""
    script, spawner = probe_spawner(tmp_path)
    try:
        z = spawner.zygote
        assert z is not None and z.wait_ready(30)
        os.kill(z.pid, signal.SIGSTOP)
        with pytest.raises(TimeoutError):
            _fill(z._sock, {"op": "watched", "pid": 0, "pad": "x" * 60_000})
        out = tmp_path / "out.json"
        request = SpawnRequest(0, ["--", str(script), str(out), "0"], dict(os.environ))
        process = spawner.spawn(request)
        assert process.reap(30) == (0, None)
        assert json.loads(out.read_text())["pid"] == process.pid
        assert not spawner.forks and spawner.zygote is None, "the stopped zygote is gone"
        assert "took no message within" in caplog.text and "fresh interpreters" in caplog.text
    finally:
        spawner.close()


def probe_spawner(tmp_path: Path, modules: list[str] | None = None) -> tuple[Path, ZygoteFork]:
    """The probe script, and a spawner of it through a zygote importing `modules`."""
    from elastic_launch.processes.entrypoint import Entrypoint, Kind

    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    chosen = PreloadPlan(modules or [], zygote=True)
    return script, ZygoteFork(chosen, FreshInterpreter(Entrypoint(Kind.SCRIPT, str(script))))


def run_forked_probe(spawner: ZygoteFork, tmp_path: Path) -> None:
    """The probe script runs to exit 0 in a worker forked from `spawner`'s zygote."""
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    out = tmp_path / "out.json"
    process = spawner.spawn(SpawnRequest(0, ["--", str(script), str(out), "0"], dict(os.environ)))
    assert process.reaped_by_agent is False, "forked from the zygote"
    process.watched()
    assert process.reap(30) == (0, None)


def test_a_module_that_fails_to_import_is_reported_and_the_zygote_serves(tmp_path, caplog):
    from elastic_launch.processes.entrypoint import Entrypoint, Kind

    spawner = ZygoteFork(
        PreloadPlan(["no_such_module_here"], zygote=True),
        FreshInterpreter(Entrypoint(Kind.SCRIPT, sys.executable)),
    )
    try:
        run_forked_probe(spawner, tmp_path)
        assert "importing 'no_such_module_here' failed" in caplog.text
    finally:
        spawner.close()


def test_a_worker_environment_read_at_start_that_differs_is_not_forked(tmp_path, caplog):
    script, spawner = probe_spawner(tmp_path)
    try:
        out = tmp_path / "out.json"
        env = {**os.environ, "OMP_NUM_THREADS": "7", "PROBE": "fresh"}
        process = spawner.spawn(SpawnRequest(0, ["--", str(script), str(out), "0"], env))
        assert process.reaped_by_agent is True, "a fresh interpreter, not a fork"
        assert process.reap(30) == (0, None)
        assert json.loads(out.read_text())["env"] == "fresh"
        assert not spawner.forks
        assert "OMP_NUM_THREADS='7'" in caplog.text and "fresh interpreters" in caplog.text
    finally:
        spawner.close()


def test_a_spawn_goes_to_a_warm_spare_and_another_is_forked(tmp_path):
    z = Zygote([], spares=1)
    try:
        assert z.wait_ready(30)
        (spare,) = until("warm spare", lambda: spares(z))
        script = tmp_path / "probe.py"
        script.write_text(SCRIPT)
        out = tmp_path / "out.json"
        pid = z.spawn(["--", str(script), str(out), "3"], dict(os.environ), DEVNULL, DEVNULL)
        assert pid == spare, "the request went to the spare forked ahead of it"
        z.acknowledge(pid)
        status = z.wait_status(pid, 30)
        assert status is not None and os.waitstatus_to_exitcode(status) == 3
        seen = json.loads(out.read_text())
        assert seen["pid"] == pid and seen["sid"] == pid and seen["parent"] == str(z.pid)
        (again,) = until("new warm spare", lambda: spares(z))
        assert again != spare
    finally:
        z.close()


def test_warm_spares_end_with_the_zygote():
    z = Zygote([], spares=2)
    assert z.wait_ready(30)
    kept = until("2 warm spares", lambda: spares(z) if len(spares(z)) == 2 else None)
    z.close()  # the zygote killed: each spare reads end of file on its channel
    for pid in kept:
        until(f"end of spare {pid}", lambda pid=pid: not os.path.exists(f"/proc/{pid}/cmdline"))


def test_a_spare_killed_from_outside_is_reaped_and_spawns_fork_again(tmp_path):
    """A spare that dies unused is not forked anew (a cause that kills each new one would
    make the zygote fork without end); workers are forked on request instead."""
    z = Zygote([], spares=1)
    try:
        assert z.wait_ready(30)
        (spare,) = until("warm spare", lambda: spares(z))
        os.kill(spare, signal.SIGKILL)
        until("the spare reaped", lambda: not os.path.exists(f"/proc/{spare}"))
        script = tmp_path / "probe.py"
        script.write_text(SCRIPT)
        pid = z.spawn(["--", str(script), str(tmp_path / "o"), "0"], dict(os.environ), -1, -1)
        z.acknowledge(pid)
        status = z.wait_status(pid, 30)
        assert status is not None and os.waitstatus_to_exitcode(status) == 0
        assert spares(z) == set(), "no spare forked again after one died unused"
    finally:
        z.close()


def test_a_package_that_auto_added_and_that_starts_a_thread_is_left_out(
    tmp_path, caplog, monkeypatch
):
    """--preload auto adds the installed packages a script imports; one that starts a thread
    as it is imported would make forking unsafe: the zygote starts again without it (workers
    still fork, and import it themselves), and the warning names it."""
    from elastic_launch.processes.entrypoint import Entrypoint, Kind

    site = tmp_path / "site"
    (site / "threaded_pkg").mkdir(parents=True)
    (site / "threaded_pkg" / "__init__.py").write_text(
        "import threading, time\n"
        "threading.Thread(target=time.sleep, args=(600,), daemon=True, name='poller').start()\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(site))
    chosen = PreloadPlan(["json", "threaded_pkg"], zygote=True, optional=("threaded_pkg",))
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    spawner = ZygoteFork(chosen, FreshInterpreter(Entrypoint(Kind.SCRIPT, str(script))))
    try:
        run_forked_probe(spawner, tmp_path)
        assert spawner.chosen.modules == ["json"] and spawner.forks
        assert "the zygote starts again without threaded_pkg" in caplog.text
        assert "poller" in caplog.text, "the thread that made it unsafe is named"
    finally:
        spawner.close()


def test_load_gets_what_a_from_import_gets_from_a_lazy_package(tmp_path, monkeypatch):
    """transformers loads `Trainer` only when it is asked for (a module __getattr__): the
    zygote's `MODULE:NAME` asks, as `from MODULE import NAME` does; a NAME that is a submodule
    is imported."""
    from elastic_launch.learned import load

    pkg = tmp_path / "lazy_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(
        "import importlib\n"
        "def __getattr__(name):\n"
        "    if name == 'Heavy':\n"
        "        return importlib.import_module('lazy_pkg.heavy').Heavy\n"
        "    raise AttributeError(name)\n"
    )
    (pkg / "heavy.py").write_text("class Heavy: pass\n")
    (pkg / "part.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("lazy_pkg", "lazy_pkg.heavy", "lazy_pkg.part"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    load("lazy_pkg")
    assert "lazy_pkg.heavy" not in sys.modules
    load("lazy_pkg:Heavy")
    assert "lazy_pkg.heavy" in sys.modules
    load("lazy_pkg:part")
    assert "lazy_pkg.part" in sys.modules
    with pytest.raises(ImportError):
        load("lazy_pkg:nothing_of_that_name")


# ---- what comes over the zygote's socket is checked ------------------------------------------


def test_check_message_takes_well_formed_messages_and_names_the_rest():
    from elastic_launch.processes.zygote import check_message

    children = {41}
    assert check_message({"op": "spawned", "id": 0, "pid": 41}, children) == (
        "spawned",
        {"id": 0, "pid": 41},
    )
    assert check_message({"op": "exited", "pid": 41, "status": 256}, children)[0] == "exited"
    ready = {"op": "ready", "seconds": 1.5, "failed": {"m": "ImportError: x"}, "unsafe": None}
    ready |= {"pid": 4242}
    assert check_message(ready, set())[0] == "ready"
    for bad in (
        "a message that is not JSON",
        [1, 2],
        7,
        {"op": "exited", "pid": 41, "status": "x"},
        {"op": "exited", "pid": 41, "status": 1 << 20},
        {"op": "exited", "pid": True, "status": 0},
        {"op": "spawned", "id": "a", "pid": 41},
        {"op": "spawned", "id": 0, "pid": -1},
        {"op": "ready", "seconds": "soon", "failed": {}, "unsafe": None},
        {"op": "ready", "seconds": 1, "failed": {"m": 3}, "unsafe": None},
        {"op": "ready", "seconds": 1, "failed": {}, "unsafe": 5, "pid": 7},
        {"op": "ready", "seconds": 1, "failed": {}, "unsafe": None},  # no pid
        {"op": "ready", "seconds": 1, "failed": {}, "unsafe": None, "pid": 7, "learned": []},
        {"op": "ready", "seconds": 1, "failed": {}, "unsafe": None, "pid": 7, "learned": {}},
        {"op": "learning", "pid": "7"},
        {"op": "reboot"},
    ):
        assert isinstance(check_message(bad, children), str), bad
    assert "did not spawn" in check_message({"op": "exited", "pid": 1, "status": 0}, children)


#: What a preloaded module runs first to take the zygote's socket (as `s`): whatever it (or a
#: process it forks) then sends there.
TAKE_SOCKET = """
import json, os, socket, stat, time
for fd in os.listdir("/proc/self/fd"):
    try:
        if stat.S_ISSOCK(os.fstat(int(fd)).st_mode):
            s = socket.socket(fileno=os.dup(int(fd)))
            break
    except OSError:
        pass
"""

FORGER = (
    TAKE_SOCKET
    + """
for message in (b'"x"', b"[1, 2]", b"null", b"{not json", b"[" * 100000,
                json.dumps({"op": "exited", "pid": 1, "status": "x"}).encode(),
                json.dumps({"op": "spawned", "id": "a", "pid": -1}).encode(),
                json.dumps({"op": "ready", "seconds": "x", "failed": 3}).encode()):
    s.send(message)
"""
)


def _on_path(monkeypatch, folder: Path) -> None:
    """Modules in `folder` importable by the zygote."""
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])
    )


def test_forged_messages_on_the_zygotes_socket_cost_the_launcher_nothing(
    tmp_path, caplog, monkeypatch
):
    (tmp_path / "forger.py").write_text(FORGER)
    _on_path(monkeypatch, tmp_path)
    script = tmp_path / "probe.py"
    script.write_text(SCRIPT)
    z = Zygote(["forger"])
    try:
        assert z.wait_ready(60) and not z.dead, "the reader took every message and goes on"
        out = tmp_path / "out.json"
        pid = z.spawn(["--", str(script), str(out), "0"], dict(os.environ), KEEP, KEEP)
        z.acknowledge(pid)
        assert z.wait_status(pid, 30) == 0, "a worker that exited 0 is seen to exit 0"
        assert z._reader.is_alive()
        assert caplog.text.count("the zygote's socket carried") == 1, "said once"
    finally:
        z.close()


def test_a_zygote_whose_import_waits_is_not_waited_for(tmp_path, caplog, monkeypatch):
    """A package that blocks at import (no CPU time used): the first spawn waits until that is
    seen (ZYGOTE_STALL of no progress), not ZYGOTE_START_TIMEOUT; later spawns do not wait."""
    from elastic_launch.processes import spawn as spawn_module

    (tmp_path / "blocks.py").write_text("import time\ntime.sleep(600)\n")
    _on_path(monkeypatch, tmp_path)
    script, spawner = probe_spawner(tmp_path, ["blocks"])
    try:
        for n in range(2):
            out = tmp_path / f"out{n}.json"
            started = time.monotonic()
            process = spawner.spawn(
                SpawnRequest(0, ["--", str(script), str(out), "0"], {**os.environ})
            )
            waited = time.monotonic() - started
            assert waited < spawn_module.ZYGOTE_START_TIMEOUT / 2, "the bound is the stall's"
            assert process.reaped_by_agent, "a fresh interpreter"
            assert process.reap(60) == (0, None)
        assert (
            "used no CPU time and read nothing" in caplog.text
            and caplog.text.count("has not finished") == 1
        )
        assert spawner.zygote is not None, "kept: it is used once its imports are done"
    finally:
        spawner.close()


def test_a_zygote_stopped_after_its_imports_is_given_up_at_the_spawn_answer(tmp_path, caplog):
    script, spawner = probe_spawner(tmp_path)
    try:
        z = spawner.zygote
        assert z is not None and z.wait_ready(30)
        os.kill(z.pid, signal.SIGSTOP)  # its socket has room: the request is taken, never read
        out = tmp_path / "out.json"
        process = spawner.spawn(SpawnRequest(0, ["--", str(script), str(out), "0"], {**os.environ}))
        assert process.reaped_by_agent and process.reap(60) == (0, None)
        assert "did not answer a spawn request within" in caplog.text
        assert spawner.zygote is None, "the stopped zygote is gone (its late child with it)"
    finally:
        spawner.close()


WELL_FORMED_FORGER = (
    TAKE_SOCKET
    + """
# A 'spawned' for the first request, naming a process that is no worker.
s.send(json.dumps({"op": "spawned", "id": 0, "pid": int(os.environ["VICTIM_PID"])}).encode())
if os.fork() == 0:  # a process born at import: later, it says a live worker exited 0
    path = os.environ["LIVE_FILE"]
    for _ in range(1200):
        if os.path.exists(path) and open(path).read().strip():
            break
        time.sleep(0.05)
    s.send(json.dumps({"op": "exited", "pid": int(open(path).read()), "status": 0}).encode())
    open(path + ".sent", "w").close()
    os._exit(0)
"""
)


def test_well_formed_lies_on_the_zygotes_socket_are_dropped(tmp_path, caplog, monkeypatch):
    # Found by review: a 'spawned' naming any pid made the agent adopt (and later kill)
    # another job's process; an 'exited' for a live worker was taken as its end.
    (tmp_path / "forger.py").write_text(WELL_FORMED_FORGER)
    _on_path(monkeypatch, tmp_path)
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    live = tmp_path / "live"
    monkeypatch.setenv("VICTIM_PID", str(victim.pid))
    monkeypatch.setenv("LIVE_FILE", str(live))
    script = tmp_path / "long.py"
    script.write_text("import time\ntime.sleep(60)\n")
    z = Zygote(["forger"])
    try:
        assert z.wait_ready(60)
        pid = z.spawn(["--", str(script)], dict(os.environ), KEEP, KEEP)
        assert pid != victim.pid, "the zygote's own child, not the pid it was told"
        z.acknowledge(pid)
        live.write_text(str(pid))
        deadline = time.monotonic() + 60
        while not (tmp_path / "live.sent").exists():
            assert time.monotonic() < deadline, "the forger never sent"
            time.sleep(0.02)
        os.kill(pid, signal.SIGKILL)
        status = z.wait_status(pid, 30)
        assert status is not None and os.WIFSIGNALED(status), "its real end, not the lie"
        assert "the zygote's socket carried" in caplog.text
    finally:
        z.close()
        victim.kill()
        victim.wait(10)


def test_an_heirs_ready_must_name_a_child_of_the_zygote_that_forked_it_and_come_once():
    """The heir's pid comes with its first message: one naming any other process is forged,
    and so is a second 'ready'."""
    heir = Zygote.__new__(Zygote)
    heir.pid, heir._parent_pid, heir._ready = 0, os.getppid(), False  # this process: the heir
    assert heir._forged_ready("learning", os.getpid()) is None
    heir._parent_pid = 1
    assert "not the zygote's heir" in (heir._forged_ready("ready", os.getpid()) or "")
    started = Zygote.__new__(Zygote)
    started.pid, started._ready = 4242, False
    assert "not the zygote's" in (started._forged_ready("ready", 4243) or "")
    started._ready = True
    assert "a second 'ready'" in (started._forged_ready("ready", 4242) or "")


def test_a_learn_request_without_its_socket_is_dropped_and_the_zygote_serves(tmp_path):
    z = Zygote([])
    try:
        assert z.wait_ready(30)
        send(z._sock, {"op": "learn", "modules": ["json"], "differ": {}, "skip": []})
        pid = z.spawn(["--", "-c", "pass"], dict(os.environ), DEVNULL, DEVNULL)
        z.acknowledge(pid)
        assert z.wait_status(pid, 30) is not None, "it still forks workers"
    finally:
        z.close()


def test_a_worker_shares_the_zygotes_objects_untouched_and_still_flushes_its_files(
    tmp_path, monkeypatch
):
    """The zygote freezes its objects before it forks: a worker's collections and its end
    never touch them (they are not in its gc.get_objects()), yet a file a preloaded module
    opened as it was imported, written by the worker and never flushed, is written at its
    end, as is one the worker opened itself."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "opens_a_log.py").write_text(
        f"LOG = open({str(tmp_path / 'module.log')!r}, 'w')  # noqa: SIM115\n"
    )
    _on_path(monkeypatch, site)
    script = tmp_path / "writes.py"
    script.write_text(
        "import gc, json, sys\n"
        "import opens_a_log\n"
        "opens_a_log.LOG.write('from the worker')\n"
        "mine = open(sys.argv[2], 'w')\n"
        "mine.write('its own')\n"
        "seen = any(o is opens_a_log.LOG for o in gc.get_objects())\n"
        "with open(sys.argv[1], 'w') as f:\n"
        "    json.dump({'scanned': seen, 'objects': len(gc.get_objects())}, f)\n"
    )
    z = Zygote(["json", "opens_a_log"])
    try:
        assert z.wait_ready(30), "the zygote never got ready"
        out, own = tmp_path / "out.json", tmp_path / "own.log"
        pid = z.spawn(["--", str(script), str(out), str(own)], dict(os.environ), DEVNULL, DEVNULL)
        z.acknowledge(pid)
        status = z.wait_status(pid, 30)
        assert status is not None and os.waitstatus_to_exitcode(status) == 0
    finally:
        z.close()
    seen = json.loads(out.read_text())
    assert seen["scanned"] is False, "the zygote's objects are frozen: not the worker's to scan"
    assert (tmp_path / "module.log").read_text() == "from the worker"
    assert own.read_text() == "its own"
