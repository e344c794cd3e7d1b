"""A worker's end: torch's teardown order cannot deadlock it, and nothing is lost.

torch's own race (ProcessGroupGloo's destructor joining its work thread with the GIL held, while
that thread waits for the GIL to free a finished work) was seen 1 in 50 forked DDP pairs; it is
not reproduced here on demand. What it needs is: the last reference to a group dropped by a
holder while the GIL is held, or the interpreter's teardown freeing objects at exit. The first
is shown never to happen in a worker (the group a script destroys is kept), the second with a
finalizer that never returns, which hangs a plain interpreter every time (the reproduction) and
never a worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from elastic_launch.net import free_port
from launcher_util import HERE, finish, start

SCRIPT = HERE / "scripts" / "teardown_order.py"


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 120) -> bool:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            return path.exists()
        time.sleep(0.05)
    return True


def test_a_plain_interpreter_hangs_in_its_teardown(tmp_path):
    """The reproduction: the same script under plain python never ends (its finalizer runs
    and blocks), so the group and the objects it holds are freed in an order nobody chose."""
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--out", str(tmp_path)], env=env)
    try:
        assert wait_for_file(tmp_path / "0.finalizing", proc), "the finalizer never ran"
        assert proc.poll() is None, "the interpreter's teardown went on past a stuck finalizer"
    finally:
        proc.kill()
        proc.wait(30)
    assert json.loads((tmp_path / "0.json").read_text()) == {"kept": False}


@pytest.mark.parametrize("preload", ["auto", "none"])
@pytest.mark.parametrize(("code", "nproc"), [(0, 2), (3, 1)])
def test_a_worker_ends_without_the_teardown_and_loses_nothing(tmp_path, preload, code, nproc):
    """Under elasticrun, forked (the default) or a fresh interpreter: the destroyed group is
    kept past its DDP model, the worker ends with its status, its exit handler ran, its
    buffered file is written, and the finalizer that would never return never runs. (A
    failing job is one worker: the launcher stops the others of a failed job at once.)"""
    proc = start(
        [
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--preload",
            preload,
            str(SCRIPT),
            "--out",
            str(tmp_path),
            "--exit-code",
            str(code),
        ]
    )
    returncode, _, err = finish(proc, timeout=180)
    assert returncode == (1 if code else 0), err[-3000:]
    if code:
        assert f"exit code {code}" in err
    for rank in range(nproc):
        assert json.loads((tmp_path / f"{rank}.json").read_text()) == {"kept": True}
        assert (tmp_path / f"{rank}.atexit").exists(), "exit handlers run"
        text = (tmp_path / f"{rank}.buffered").read_text()
        assert text == "written, never flushed by the script\n", "open files are flushed"
        assert not (tmp_path / f"{rank}.finalizing").exists(), "no teardown of the objects"
