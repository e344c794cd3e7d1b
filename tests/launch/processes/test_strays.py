"""Processes of a job outside its cgroup: found by the mark in the environment they started
with, ended and named (by the launcher at the end, by the guardian after a SIGKILL); a
cgroup a worker made inside the job's is removed with it; the zygote starts inside.

A plain directory with an empty ``cgroup.procs`` stands for the workers' cgroup where only
the mark is looked at: nothing here needs root, except the zygote's cgroup (skipped
without)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from elastic_launch.processes import cgroup, guardian
from elastic_launch.processes.guardian import end_strays, find_strays, remove_cgroup
from proc_util import alive, wait

SLEEPER = "import time; time.sleep(60)"
#: A daemon as a worker starts one: setsid, a double fork; it prints the grandchild's pid.
DAEMON = textwrap.dedent("""
    import os, time
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            print(os.getpid(), flush=True)
            time.sleep(60)
        os._exit(0)
    os.wait()
""")


@pytest.fixture
def started():
    """Starts `python -c CODE` with extra environment; every one (and every pid it reports)
    is killed at teardown."""
    procs: list[subprocess.Popen[str]] = []
    pids: list[int] = []

    def start(code: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            text=True,
        )
        procs.append(proc)
        return proc

    start.pids = pids  # type: ignore[attr-defined]
    yield start
    for pid in pids + [p.pid for p in procs]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for p in procs:
        p.wait(10)
        if p.stdout:
            p.stdout.close()


@pytest.fixture
def fake_cgroup(tmp_path: Path) -> Path:
    d = tmp_path / "elasticrun-1-abc"
    d.mkdir()
    (d / "cgroup.procs").write_text("")
    return d


def test_the_mark_is_the_guardians():
    assert guardian.JOB_MARK == cgroup.CGROUP_ENV


@pytest.mark.timeout(60)
def test_marked_processes_outside_the_cgroup_and_what_they_forked_are_ended(started, fake_cgroup):
    """The marked process outside is found and ended, and the daemon it started (a new
    session, reparented: nothing links it to the job but its environment) too; a marked
    process inside (the kernel's kill ends those), one unmarked, and one with the mark of
    another cgroup are left alone."""
    mark = {cgroup.CGROUP_ENV: str(fake_cgroup)}
    outside = started(DAEMON + SLEEPER, mark)
    daemon = int(outside.stdout.readline())
    started.pids.append(daemon)
    inside = started(SLEEPER, mark)
    (fake_cgroup / "cgroup.procs").write_text(f"{inside.pid}\n")
    others = [
        started(SLEEPER),
        started(SLEEPER, {cgroup.CGROUP_ENV: f"{fake_cgroup}-other"}),
        started(SLEEPER, {cgroup.CGROUP_ENV: f"{fake_cgroup}/below"}),
    ]
    assert wait(lambda: {outside.pid, daemon} <= {s.pid for s in find_strays(str(fake_cgroup))}, 10)
    ended = end_strays(str(fake_cgroup))
    assert {s.pid for s in ended} == {outside.pid, daemon}
    assert wait(lambda: not alive(outside.pid) and not alive(daemon), 10)
    assert all(alive(p.pid) for p in [inside, *others]), "only the job's processes outside"
    said = next(s for s in ended if s.pid == daemon).describe(str(fake_cgroup))
    assert said.startswith(f"pid {daemon} ({sys.executable} -c")
    assert f"outside the workers' cgroup {fake_cgroup} (in " in said


def test_nothing_marked_outside_is_nothing_ended(fake_cgroup):
    assert end_strays(str(fake_cgroup), timeout=5) == []


def test_a_cgroup_is_removed_with_those_made_inside_it(tmp_path):
    top = tmp_path / "job"
    (top / "a" / "b").mkdir(parents=True)
    (top / "c").mkdir()
    assert remove_cgroup(str(top), timeout=5)
    assert not top.exists()


def test_a_cgroup_that_does_not_empty_is_given_up_at_its_timeout(tmp_path):
    top = tmp_path / "job"
    (top / "a").mkdir(parents=True)
    (top / "a" / "held").write_text("")  # a plain directory's file: never removable by rmdir
    assert not remove_cgroup(str(top), timeout=0.05)


LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    from elastic_launch.processes.guardian import Guardian
    g = Guardian()
    g.kill_cgroup(sys.argv[1])
    assert g.cgroup == sys.argv[1]
    stray = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "ELASTICRUN_CGROUP": sys.argv[1]},
        start_new_session=True,
    )
    print(g.pid, stray.pid, flush=True)
    time.sleep(60)
""")


@pytest.mark.timeout(60)
def test_the_guardian_of_a_killed_launcher_ends_and_names_a_stray(fake_cgroup):
    """The launcher told its guardian the job's cgroup, and is SIGKILLed: the guardian ends
    the marked process outside (in a session of its own, in no group it was told) and names
    it on the launcher's stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(fake_cgroup)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    pids: list[int] = [proc.pid]
    try:
        assert proc.stdout is not None
        pids += [int(x) for x in proc.stdout.readline().split()]
        _, stray = pids[1:]
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait(lambda: not alive(stray), 20), "the stray outlived the launcher"
        for made in fake_cgroup.iterdir():  # cgroup.kill too: a plain directory empties
            made.unlink()
        _, err = proc.communicate(timeout=30)  # the guardian holds stderr until it ends
        assert not fake_cgroup.exists(), "then the guardian removes it"
        assert f"elasticrun guardian: ended pid {stray} (" in err
        assert f"outside the workers' cgroup {fake_cgroup}" in err
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.communicate(timeout=30)


def test_as_root_a_container_that_cannot_be_made_is_a_warning(monkeypatch, caplog):
    monkeypatch.setattr(cgroup, "_mount", lambda: None)
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert cgroup.Container.make().path is None
    assert "no cgroup for the workers (no cgroup v2 hierarchy is mounted)" in caplog.text
    caplog.clear()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cgroup.Container.make().path is None
    assert caplog.text == "", "without root, none was to be expected: the debug log says why"


@pytest.mark.timeout(60)
def test_the_zygote_starts_in_the_jobs_cgroup_with_its_mark():
    from elastic_launch.processes.zygote import Zygote

    container = cgroup.Container.make()
    if container.path is None:
        pytest.skip(container.why)
    zygote = None
    try:
        zygote = Zygote(["json"], cgroup_path=container.path)
        assert zygote.wait_ready(30)
        members = (Path(container.path) / "cgroup.procs").read_text().split()
        assert str(zygote.pid) in members
        with open(f"/proc/{zygote.pid}/environ", "rb") as f:
            environ = f.read().split(b"\0")
        assert f"{cgroup.CGROUP_ENV}={container.path}".encode() in environ
    finally:
        if zygote is not None:
            zygote.close()
        container.kill()


def test_a_cgroup_directory_is_named_as_proc_names_it():
    from elastic_launch.processes.cgroup import _mount
    from elastic_launch.processes.guardian import _hierarchy_path

    assert _hierarchy_path("/tmp/not-a-cgroup") is None
    mount = _mount()
    if mount is None:
        pytest.skip("no cgroup v2 hierarchy is mounted")
    assert _hierarchy_path(f"{mount}/elasticrun-1-abc/below") == "/elasticrun-1-abc/below"
    assert _hierarchy_path(f"{mount}-other/x") is None


def test_the_empty_cgroups_of_gone_launchers_are_swept(tmp_path):
    from elastic_launch.processes import cgroup

    gone = subprocess.Popen(["true"])
    gone.wait(10)
    mine = f"elasticrun-{os.getpid()}-abcdef"
    stale = f"elasticrun-{gone.pid}-012345"
    busy = f"elasticrun-{gone.pid}-0000aa"
    for name in (mine, stale, busy, "other-cgroup"):
        (tmp_path / name).mkdir()
    (tmp_path / busy / "child").mkdir()  # not empty: rmdir refuses, as for a live cgroup
    assert cgroup.sweep(str(tmp_path)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([mine, busy, "other-cgroup"])
