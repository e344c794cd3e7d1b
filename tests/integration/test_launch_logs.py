"""Logs: per attempt and rank, never overwritten; tee with a host prefix; console filters."""

from __future__ import annotations

import os
import socket
import stat
from pathlib import Path

from launcher_util import run, worker_args

BASE = ["--standalone", "--nproc-per-node", "2", "--monitor-interval", "0.05"]


def run_dir(logs: Path) -> Path:
    (d,) = [p for p in logs.iterdir() if p.is_dir()]  # beside it: the learned imports
    return d


def test_layout_one_directory_per_attempt_and_rank(out, tmp_path):
    logs = tmp_path / "logs"
    result = run(
        [
            *BASE,
            "--max-restarts",
            "1",
            "--log-dir",
            str(logs),
            "--redirects",
            "3",
            *worker_args(out, "--fail-rank", "0", "--fail-until", "1", "--print", "hello"),
        ],
        out,
    )
    assert result.returncode == 0, result.stderr
    d = run_dir(logs)
    for attempt in (0, 1):
        for rank in (0, 1):
            stdout = (d / f"attempt_{attempt}" / str(rank) / "stdout.log").read_text()
            stderr = (d / f"attempt_{attempt}" / str(rank) / "stderr.log").read_text()
            if (attempt, rank) == (0, 1):
                continue  # stopped when rank 0 failed, perhaps before it printed
            assert f"hello rank {rank}" in stdout
            assert f"hello err rank {rank}" in stderr
    # The failed attempt keeps its traceback and error file: nothing was overwritten.
    assert "injected failure on rank 0 at restart 0" in (d / "attempt_0/0/stderr.log").read_text()
    assert (d / "attempt_0/0/error.json").exists()
    assert not (d / "attempt_1/0/error.json").exists()
    assert "hello" not in result.stdout, "redirected output does not reach the console"


def test_redirect_map_per_local_rank(out, tmp_path):
    logs = tmp_path / "logs"
    result = run(
        [*BASE, "--log-dir", str(logs), "-r", "0:1,1:2", *worker_args(out, "--print", "hi")], out
    )
    assert result.returncode == 0, result.stderr
    d = run_dir(logs) / "attempt_0"
    assert (d / "0" / "stdout.log").exists() and not (d / "0" / "stderr.log").exists()
    assert (d / "1" / "stderr.log").exists() and not (d / "1" / "stdout.log").exists()
    assert "hi rank 1" in result.stdout, "rank 1's stdout still reaches the console"
    assert "hi err rank 0" in result.stderr


def test_tee_prefixes_lines_with_host_and_rank(out, tmp_path):
    logs = tmp_path / "logs"
    result = run(
        [*BASE, "--log-dir", str(logs), "--tee", "3", *worker_args(out, "--print", "teed")], out
    )
    assert result.returncode == 0, result.stderr
    host = socket.gethostname()
    assert f"[{host}:default0]:teed rank 0" in result.stdout
    assert f"[{host}:default1]:teed rank 1" in result.stdout
    assert f"[{host}:default1]:teed err rank 1" in result.stderr
    assert "teed rank 1" in (run_dir(logs) / "attempt_0" / "1" / "stdout.log").read_text()


def test_local_ranks_filter_and_duplicate_filters(out, tmp_path):
    logs = tmp_path / "logs"
    result = run(
        [
            *BASE,
            "--log-dir",
            str(logs),
            "--tee",
            "3",
            "--local-ranks-filter",
            "1",
            "--duplicate-stdout-filters",
            "keep,,me,teed",
            *worker_args(out, "--print", "teed"),
        ],
        out,
    )
    assert result.returncode == 0, result.stderr
    assert "teed rank 1" in result.stdout
    assert "teed rank 0" not in result.stdout, "rank 0 is filtered from the console"
    assert "teed rank 0" in (run_dir(logs) / "attempt_0" / "0" / "stdout.log").read_text()
    filtered = (run_dir(logs) / "attempt_0" / "filtered_stdout.log").read_text()
    assert "teed rank 0" in filtered and "teed rank 1" in filtered


def test_log_dir_dev_null_keeps_nothing(out):
    result = run(
        [*BASE, "--log-dir", os.devnull, "--redirects", "3", *worker_args(out, "--print", "x")], out
    )
    assert result.returncode == 0, result.stderr


def test_module_no_python_run_path_and_macro(out, tmp_path):
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(
        "import os, sys, json\nprint(json.dumps({'argv': sys.argv, 'name': __name__}))\n"
    )
    result = run([*BASE, "-m", "mypkg.train", "--rank", "${local_rank}"], out, cwd=str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert '"--rank", "0"' in result.stdout and '"--rank", "1"' in result.stdout
    assert '"name": "__main__"' in result.stdout
    assert str(pkg / "train.py") in result.stdout, "argv[0] is the module's file, as with -m"

    script = tmp_path / "tool.sh"
    script.write_text('#!/bin/sh\necho "binary $RANK $1"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    result = run([*BASE, "--no-python", str(script), "arg${local_rank}"], out)
    assert result.returncode == 0, result.stderr
    assert "binary 0 arg0" in result.stdout and "binary 1 arg1" in result.stdout

    py = tmp_path / "runpath.py"
    # One string per print: the two workers share the console, and `python -u` writes each of
    # print's arguments apart, so that two workers' words could interleave.
    py.write_text("import sys; print(f'runpath {sys.argv[1:]} {__name__}')\n")
    result = run([*BASE, "--run-path", str(py), "x"], out)
    assert result.returncode == 0, result.stderr
    assert "runpath ['x'] __main__" in result.stdout


def test_virtual_local_rank(out):
    result = run([*BASE, "--virtual-local-rank", *worker_args(out)], out)
    assert result.returncode == 0, result.stderr
    for rank in (0, 1):
        env = result.env(f"0-{rank}")
        assert env["LOCAL_RANK"] == "0"
        assert env["CUDA_VISIBLE_DEVICES"] == str(rank)
        assert env["RANK"] == str(rank)
