"""Hang detection's costs: what the beat hook adds to an optimizer step (beside torch's file
timer, torch's way to bound a step), and what the agent's evidence of progress costs it (one
pass over /proc for a node's workers, once a second under --hang-timeout auto)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import Row, python_json

HERE = Path(__file__).resolve().parent


def _sample_cost(workers: int, children: int, rounds: int = 200) -> float:
    """ms per elastic_launch.agent.activity.sample() over `workers` sessions of 1 + `children`
    processes each (a worker with its data-loader workers)."""
    from elastic_launch.agent.activity import sample

    code = (
        "import os, time\n"
        f"for _ in range({children}):\n"
        "    if os.fork() == 0:\n"
        "        break\n"
        "time.sleep(120)\n"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        for _ in range(workers)
    ]
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            seen = sample([p.pid for p in procs])
            if len(seen) == workers and all(a.processes == 1 + children for a in seen.values()):
                break
            time.sleep(0.05)
        t0 = time.perf_counter()
        for _ in range(rounds):
            sample([p.pid for p in procs])
        return (time.perf_counter() - t0) / rounds * 1000
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def run(cpp_build: Path) -> list[Row]:
    import elastic_core as ec

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "hb")
        with ec.HeartbeatTable.create(path, 1):
            step = python_json(
                HERE / "_hook_step.py",
                env={ec.HEARTBEAT_FILE_ENV: path, ec.HEARTBEAT_SLOT_ENV: "0"},
            )
    expires = python_json(HERE / "_expires.py")
    added = max(0.0, step["hooked_ns"] - step["plain_ns"])
    rows.append(
        Row(
            "hang",
            f"added to one optimizer step by the beat hook (step alone {step['plain_ns']:,.0f} ns)",
            added,
            expires["expires_ns"],
            "torch `with expires()` per step",
            "ns",
        )
    )
    for workers, children in ((8, 4), (64, 4)):
        ms = _sample_cost(workers, children)
        rows.append(
            Row(
                "hang",
                f"agent: evidence of {workers} workers x {1 + children} processes, one /proc pass "
                f"(once a second: {ms / 10:.2f}% of a core)",
                ms,
                None,
                "",
                "ms",
            )
        )
    return rows
