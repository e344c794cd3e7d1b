"""Nothing a job starts outlives it: not a daemon of a worker that moves itself out of the
workers' cgroup (to its parent, or to a sibling it makes), nor one in a cgroup it makes inside
it, nor one a package imported by the zygote (``--preload auto``) starts, whether the job ends
normally, by a SIGTERM or by a SIGKILL of the launcher (then its guardian ends them). Where the
launcher had to find a process outside the cgroup, it says so.

Moving a process between cgroups needs root (or a delegated hierarchy): without it, or without
a cgroup v2 subtree to make, these are skipped."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from launcher_util import HERE, alive, finish, kill_all, start, wait_for, wait_gone

BASE = ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05"]
ESCAPING = HERE / "scripts" / "escaping_daemon.py"
ENDS = ["exit", "SIGTERM", "SIGKILL"]


@pytest.fixture(autouse=True)
def _cgroups() -> None:
    from elastic_launch.processes.cgroup import Container

    probe = Container.make()
    if probe.path is None:
        pytest.skip(probe.why)
    probe.kill()


def _end(proc: subprocess.Popen[str], end: str, go: Path) -> str:
    """End the job as `end` says; what the launcher (and its guardian) wrote to stderr."""
    if end == "exit":
        go.touch()
    else:
        os.kill(proc.pid, getattr(signal, end))
    _, _, err = finish(proc, 90)
    return err


def _remove_cgroup(path: str, pids: list[int]) -> None:
    """Remove a cgroup a test's daemon made, once what it held is gone (`pids` killed)."""
    kill_all(pids)
    wait_gone(pids, 10)
    deadline = time.monotonic() + 10
    while os.path.isdir(path) and time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            os.rmdir(path)
        time.sleep(0.02)


@dataclass
class Escape:
    """What the daemon of a job run by :func:`escaping` said, and what the launcher said."""

    daemon: int = 0
    workers: str = ""  # the workers' cgroup it left
    went: str = ""  # the cgroup it is in now
    err: str = ""


@contextlib.contextmanager
def escaping(out: Path, how: str, end: str) -> Iterator[Escape]:
    """A job whose rank 0 starts a daemon that leaves as `how` says, ended as `end` says.
    Everything it started is ended when the block is left, whatever happened in it."""
    said, go = out / "daemon.txt", out / "go"
    proc = start([*BASE, str(ESCAPING), str(said), str(go), how])
    seen = Escape()
    try:
        assert wait_for(said.exists, 60), "the daemon never started"
        lines = said.read_text().splitlines()
        if lines[0].startswith("refused"):
            pytest.skip(f"a worker cannot move itself here ({lines[0]})")
        seen.daemon, seen.workers, seen.went = int(lines[0]), lines[1], lines[2]
        assert alive(seen.daemon)
        inside = seen.went.startswith(seen.workers + "/")
        assert inside == (how == "child") and seen.went != seen.workers
        seen.err = _end(proc, end, go)
        yield seen
    finally:
        kill_all([proc.pid])
        if seen.daemon:
            kill_all([seen.daemon])
            if how != "parent":  # what the launcher did not remove (it failed)
                _remove_cgroup(seen.went, [seen.daemon])
            if how == "child":
                _remove_cgroup(seen.workers, [])


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("end", ENDS)
@pytest.mark.parametrize("how", ["parent", "sibling"])
def test_a_daemon_that_leaves_the_workers_cgroup_is_ended_and_named(out, how, end):
    """Rank 0's daemon moves itself to the parent of the workers' cgroup, or to a sibling
    cgroup it makes: it carries the job's mark, so the launcher (its guardian after a
    SIGKILL) finds it outside, ends it, and names it."""
    with escaping(out, how, end) as seen:
        assert wait_gone([seen.daemon], 30) == [], f"the daemon outlived the job ({how}, {end})"
        assert f"pid {seen.daemon} " in seen.err, seen.err[-3000:]
        assert "outside the workers' cgroup" in seen.err
        if how == "sibling":
            assert os.path.isdir(seen.went), "a cgroup that is not the job's is left alone"


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("end", ENDS)
def test_a_daemon_in_a_cgroup_made_inside_the_workers_ends_and_both_are_removed(out, end):
    """A cgroup made inside the workers' is part of the job: what it holds ends with the job
    (the kernel's kill reaches the whole subtree) and both are removed, nothing left
    behind."""
    with escaping(out, "child", end) as seen:
        assert wait_gone([seen.daemon], 30) == [], f"the daemon outlived the job ({end})"
        assert wait_for(lambda: not os.path.exists(seen.workers), 30), f"{seen.went} was left"
        assert "outside the workers' cgroup" not in seen.err, "it never left the job's subtree"


PACKAGE = textwrap.dedent("""
    import os, sys, time

    _OUT = os.environ.get("ESCAPEPKG_OUT")
    if _OUT:
        middle = os.fork()
        if middle == 0:
            os.setsid()
            if os.fork() == 0:
                null = os.open(os.devnull, os.O_RDWR)
                for fd in (0, 1, 2):
                    os.dup2(null, fd)
                name = os.path.join(_OUT, f"pkg-daemon-{os.getpid()}")
                with open(name + ".who", "w") as f:
                    f.write(os.path.basename(sys.argv[0]))
                with open(name + ".tmp", "w") as f:
                    f.write(str(os.getpid()))
                os.replace(name + ".tmp", name + ".pid")
                time.sleep(600)
            os._exit(0)
        os.waitpid(middle, 0)
""")

JOB = textwrap.dedent("""
    import os, sys, time
    import escapepkg  # at the top: --preload auto imports it in the zygote

    deadline = time.monotonic() + 300
    while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
        time.sleep(0.02)
""")


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("end", ENDS)
def test_a_daemon_a_preloaded_package_starts_ends_with_the_job(out, tmp_path, end):
    """A package the script imports at its top is imported by the zygote (``--preload
    auto``); the daemon it starts there (setsid, a double fork) is inside the job's cgroup,
    since the zygote joins it before it imports anything, and ends with the job."""
    site = tmp_path / "site"
    (site / "escapepkg").mkdir(parents=True)
    (site / "escapepkg" / "__init__.py").write_text(PACKAGE)
    job, go = tmp_path / "job" / "job.py", out / "go"  # not beside the package: not its own
    job.parent.mkdir()
    job.write_text(JOB)
    path = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    env = {"PYTHONPATH": path, "ESCAPEPKG_OUT": str(out)}
    proc = start([*BASE, "--preload", "auto", str(job), str(go)], env=env)
    daemons: list[int] = []
    try:
        assert wait_for(lambda: list(out.glob("pkg-daemon-*.pid")), 60), "no daemon started"
        daemons = [int(p.read_text()) for p in out.glob("pkg-daemon-*.pid")]
        importers = {p.read_text() for p in out.glob("pkg-daemon-*.who")}
        assert importers == {"zygote.py"}, "the zygote imported the package, no worker did"
        assert all(alive(d) for d in daemons)
        _end(proc, end, go)
        assert wait_gone(daemons, 30) == [], f"the zygote's daemon outlived the job ({end})"
    finally:
        kill_all([proc.pid, *daemons])
