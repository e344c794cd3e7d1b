"""A worker's end: torch's teardown order cannot deadlock it, and nothing is lost.

torch's own race (ProcessGroupGloo's destructor joining its work thread with the GIL held, while
that thread waits for the GIL to free a finished work) is reproduced every time by
scripts/gloo_teardown.py: torch's bad order (the group destroyed, then the DDP model dropped),
with each rank on one CPU and gloo's work threads idle-scheduled so that the work thread always
loses the race. Two plain python ranks hang in it; the same script under elasticrun ends (the
group a script destroys is kept until the process ends), and so does the good order. The
interpreter's own teardown, the race's other way in, is shown with a finalizer that never
returns: it hangs a plain interpreter every time and never a worker."""

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
GLOO = HERE / "scripts" / "gloo_teardown.py"
#: A teardown that does not deadlock takes milliseconds once training is over.
HUNG_AFTER = 20.0


def plain_ranks(out: Path, order: str) -> list[subprocess.Popen]:
    """The gloo script as two plain python processes (no launcher)."""
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        env["MASTER_PORT"] = port
        cmd = [sys.executable, str(GLOO), "--out", str(out), "--order", order]
        procs.append(subprocess.Popen(cmd, env=env))
    return procs


def pair_hangs(out: Path, order: str) -> bool:
    """Run the pair once: whether a rank is still in its teardown HUNG_AFTER s after it began
    (alive, no done-file); every process is ended here."""
    out.mkdir()
    procs = plain_ranks(out, order)
    try:
        for rank, proc in enumerate(procs):
            assert wait_for_file(out / f"teardown-{rank}", proc), "training never ended"
        ended = [wait_for_file(out / f"done-{r}", p, HUNG_AFTER) for r, p in enumerate(procs)]
        return any(not e and p.poll() is None for e, p in zip(ended, procs))
    finally:
        for p in procs:
            p.kill()
            p.wait(30)


@pytest.mark.timeout(400)
def test_torchs_bad_order_deadlocks_plain_ranks_and_the_good_order_does_not(tmp_path):
    """The reproduction (upstream: pytorch/pytorch issue 56297's blocking destructor, here with
    DDP's Reducer as the last holder): destroy_process_group() and then the model dropped
    hangs a rank in its teardown (5 of 5 pairs here on an idle machine; a busy CPU can hand
    the work thread the race, so up to 3 pairs are tried); the model dropped first never."""
    assert not pair_hangs(tmp_path / "good", "good"), "the good order ends"
    assert any(pair_hangs(tmp_path / f"bad{i}", "bad") for i in range(3)), "no deadlock in 3"


@pytest.mark.timeout(240)
def test_under_elasticrun_the_bad_order_ends(tmp_path):
    """The same script, the same bad order, as a job's workers: the group the script destroys
    is kept until the worker ends, so the Reducer never holds its last reference."""
    proc = start(["--standalone", "--nproc-per-node", "2", str(GLOO), "--out", str(tmp_path)])
    returncode, _, err = finish(proc, timeout=180)
    assert returncode == 0, err[-3000:]
    assert all((tmp_path / f"done-{rank}").exists() for rank in (0, 1))


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
