"""--preload: workers forked from a zygote behave as fresh ones, restarts included."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from launcher_util import run, wait_gone, worker_args

BASE = ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05"]


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.timeout(180)
def test_preloaded_workers_restart_and_see_what_fresh_ones_see(out, tmp_path):
    ev = tmp_path / "events.jsonl"
    result = run(
        [
            *BASE,
            "--preload",
            "torch",
            "--max-restarts",
            "1",
            "--events-file",
            str(ev),
            *worker_args(
                out,
                "--fail-rank",
                "1",
                "--fail-until",
                "1",
                "--how",
                "raise",
                "--steps",
                "5",
                "--dist",
            ),
        ],
        out,
        timeout=150,
    )
    assert result.returncode == 0, result.stderr
    started = [e for e in events(ev) if e["event"] == "group_started"]
    assert [e["forked"] for e in started] == [True, True]
    for tag in ("1-0", "1-1"):
        env = result.env(tag)
        argv = json.loads(env["argv"])
        assert argv[0].endswith("worker.py"), argv
        assert env["TORCHELASTIC_RESTART_COUNT"] == "1"
        d = json.loads((out / f"{tag}.dist.json").read_text())
        assert d["sum"] == 2.0 and d["launched"] is True
    assert "injected failure on rank 1 at restart 0" in result.stderr
    assert wait_gone(list(result.pids().values())) == []


@pytest.mark.timeout(120)
def test_forked_worker_failure_is_reported_with_its_exit_code(out):
    result = run(
        [
            *BASE,
            "--start-method",
            "forkserver",
            *worker_args(
                out,
                "--fail-rank",
                "0",
                "--fail-until",
                "1",
                "--how",
                "exit",
                "--exit-code",
                "9",
                "--sleep",
                "30",
            ),
        ],
        out,
    )
    assert result.returncode == 1
    assert "failure    : exit code 9" in result.stderr
    assert wait_gone(list(result.pids().values())) == []


@pytest.mark.timeout(120)
def test_a_preload_that_fails_to_import_falls_back(out):
    result = run([*BASE, "--preload", "no_such_module_xyz", *worker_args(out)], out)
    assert result.returncode == 0, result.stderr
    assert "importing 'no_such_module_xyz' failed in the zygote" in result.stderr


@pytest.mark.timeout(120)
def test_a_forked_worker_that_dies_at_once_is_reported(out, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("raise SystemExit(5)\n")
    result = run([*BASE, "--preload", "json", "--max-restarts", "2", str(bad)], out)
    assert result.returncode == 1
    assert "after 3 attempt(s), 2 restart(s)" in result.stderr
    assert "failure    : exit code 5" in result.stderr


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("module", "text", "why"),
    [
        (
            "starts_a_thread",
            "import threading, time\n"
            "threading.Thread(target=time.sleep, args=(60,), name='poller', daemon=True).start()\n",
            "--preload: the preloaded modules started 1 thread(s) (poller), which forked workers "
            "would not have",
        ),
        (
            "claims_cuda",  # no GPU here: the module says CUDA is initialised, as torch would
            "import torch\ntorch.cuda.is_initialized = lambda: True\n",
            "--preload: the preloaded modules initialised CUDA, which forked workers cannot use",
        ),
    ],
)
def test_a_zygote_unsafe_to_fork_from_falls_back_saying_why(out, tmp_path, module, text, why):
    (tmp_path / f"{module}.py").write_text(text)
    ev = tmp_path / "events.jsonl"
    result = run(
        [*BASE, "--preload", module, "--events-file", str(ev), *worker_args(out)],
        out,
        env={"PYTHONPATH": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    assert f"{why}; starting workers as fresh interpreters" in result.stderr
    started = [e for e in events(ev) if e["event"] == "group_started"]
    assert [e["forked"] for e in started] == [False]


@pytest.mark.timeout(60)
def test_a_program_that_is_not_python_starts_fresh_saying_why(out, tmp_path):
    ev = tmp_path / "events.jsonl"
    result = run(
        [*BASE, "--events-file", str(ev), "--no-python", "/bin/echo", "not python"],
        out,
    )
    assert result.returncode == 0, result.stderr
    assert (
        "--preload auto: '/bin/echo' is not run by Python (a program, or --no-python); its "
        "workers start as fresh processes"
    ) in result.stderr
    assert result.stdout.count("not python") == 2
    assert [e["forked"] for e in events(ev) if e["event"] == "group_started"] == [False]
