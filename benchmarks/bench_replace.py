"""Replacing one worker: SIGKILL of one worker -> its replacement's first line of user
code, while the other worker runs on untouched (the worker group's replace(), driven as the agent
would drive it). The baseline is what torchrun can do, a restart of the whole group (and
elasticrun's own group restart beside it): the same kill, the same script, to the restarted
rank's first line."""

from __future__ import annotations

import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Row, end_job, python_json, start_job

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_replace_worker.py"
ELASTICRUN = [sys.executable, "-m", "elastic_launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _wait(path: Path, timeout: float = 120) -> list[int] | None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            return None
        time.sleep(0.0005)
    return [int(x) for x in path.read_text().split()]


def group_restart(launcher: list[str], trials: int, extra: list[str] | None = None) -> list[float]:
    """SIGKILL rank 1 under `launcher` (restarts the whole group) -> the new rank 1's first
    line, `trials` times in one job."""
    out = Path(tempfile.mkdtemp(prefix="bench-replace-"))
    cmd = [
        *launcher,
        "--standalone",
        "--nproc-per-node",
        "2",
        "--max-restarts",
        str(trials),
        *(extra or []),
        str(WORKER),
    ]
    proc = start_job(cmd, {"BENCH_OUT": str(out), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    seconds = []
    t_kill = 0
    try:
        for restart in range(trials + 1):
            stamps = [_wait(out / f"{r}-{restart}.first") for r in (0, 1)]
            if restart:
                if stamps[1] is None:
                    break
                seconds.append((stamps[1][0] - t_kill) / 1e9)
            if restart == trials or stamps[1] is None:
                break
            t_kill = time.monotonic_ns()
            os.kill(stamps[1][1], signal.SIGKILL)
    finally:
        end_job(proc, WORKER)
        shutil.rmtree(out, ignore_errors=True)
    return seconds


def replace(trials: int, preload: list[str]) -> tuple[list[float], bool]:
    out = Path(tempfile.mkdtemp(prefix="bench-replace-"))
    try:
        result = python_json(HERE / "_replace_driver.py", str(out), str(trials), *preload)
    finally:
        subprocess.run(["pkill", "-9", "-f", str(WORKER)], check=False)
        shutil.rmtree(out, ignore_errors=True)
    return result["seconds"], result["survivor_untouched"]


def run(cpp_build: Path) -> list[Row]:
    trials = int(os.environ.get("BENCH_REPLACE_TRIALS", "5"))
    torch_group = statistics.median(group_restart(TORCHRUN, trials))
    ours_group = statistics.median(group_restart(ELASTICRUN, trials))
    fresh, fresh_ok = replace(trials, [])
    forked, forked_ok = replace(trials, ["--preload", "torch"])
    untouched = (
        "the other worker untouched" if fresh_ok and forked_ok else "THE OTHER WORKER WAS HIT"
    )
    return [
        Row(
            "replace",
            "SIGKILL of one worker to its replacement's first line (fresh interpreter)",
            statistics.median(fresh),
            torch_group,
            "torchrun group restart",
            "s",
            f"median of {trials}, {untouched}",
        ),
        Row(
            "replace",
            "the same, forked from the zygote (--preload torch)",
            statistics.median(forked),
            torch_group,
            "torchrun group restart",
            "s",
            f"median of {trials}",
        ),
        Row(
            "replace",
            "for comparison: elasticrun's group restart, same measure",
            ours_group,
            torch_group,
            "torchrun group restart",
            "s",
            f"median of {trials}",
        ),
    ]


if __name__ == "__main__":
    import json

    print(json.dumps([r.__dict__ for r in run(Path("build/cpp"))], indent=1))
