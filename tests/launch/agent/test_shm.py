"""The launcher's names in shared memory, and the sweep of what launchers that are gone left
there: only this user's, never a running launcher's (its pid and start time tell)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
from elastic_launch.agent import shm
from elastic_launch.api import ConfigError


def dead_pid() -> int:
    """The pid of a process that has ended (and been reaped)."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


def test_a_name_carries_the_pid_and_the_start_time_of_its_launcher():
    name = os.path.basename(shm.own_name("memory"))
    pid, start, kind, _ = name.removeprefix("elasticrun-").split("-")
    assert (int(pid), int(start), kind) == (os.getpid(), shm.start_time(os.getpid()), "memory")


def test_the_sweep_removes_only_what_launchers_of_this_user_that_are_gone_left(tmp_path, caplog):
    me, started, dead = os.getpid(), shm.start_time(os.getpid()), dead_pid()

    def make(name: str, directory: bool = False, size: int = 1000) -> str:
        path = tmp_path / name
        if directory:
            path.mkdir()
            (path / "slot").write_bytes(b"x" * size)
        else:
            path.write_bytes(b"x" * size)
        return name

    gone = {
        make(f"elasticrun-{dead}-12345-0badc0de"),  # its launcher is gone
        make(f"elasticrun-{dead}-12345-memory-0badc0de", directory=True),
        make(f"elasticrun-{me}-{started + 1}-c0ffee00"),  # the pid is another process's now
        make(f"elasticrun-{dead}-deadbeef"),  # a name without the start time, its pid gone
    }
    kept = {
        make(f"elasticrun-{me}-{started}-c0ffee01"),  # a running launcher's
        make(f"elasticrun-{me}-{started}-memory-c0ffee02", directory=True),
        make(f"elasticrun-{me}-c0ffee03"),  # no start time: its pid runs, so it is kept
        make(f"elasticrun-{dead}-12345-notours"),  # not a name of ours
        make("elasticrun-barrier"),
    }
    other = make(f"elasticrun-{dead}-12345-feedf00d")
    os.chown(tmp_path / other, 65534, 65534)  # another user's: never touched
    kept.add(other)
    with caplog.at_level(logging.WARNING):
        swept = shm.sweep(str(tmp_path))
    assert set(os.listdir(tmp_path)) == kept
    assert swept == shm.Swept(len(gone), 4000)
    assert f"removed 4 leftover(s) of elasticrun launchers that are gone from {tmp_path}" in (
        caplog.text
    )


def test_a_sweep_with_nothing_to_remove_says_nothing(tmp_path, caplog):
    with caplog.at_level(logging.DEBUG):
        assert shm.sweep(str(tmp_path)) == shm.Swept(0, 0)
        assert shm.sweep(str(tmp_path / "absent")) == shm.Swept(0, 0)
    assert "removed" not in caplog.text


def test_the_directory_can_be_another_and_a_bad_one_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTICRUN_SHM_DIR", str(tmp_path))
    assert shm.own_name().startswith(f"{tmp_path}/elasticrun-{os.getpid()}-")
    for bad in ("relative/dir", str(tmp_path / "absent")):
        monkeypatch.setenv("ELASTICRUN_SHM_DIR", bad)
        with pytest.raises(ConfigError, match=f"ELASTICRUN_SHM_DIR='{bad}' is not an absolute"):
            shm.sweep()
