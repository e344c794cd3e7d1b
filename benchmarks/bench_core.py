"""The core's benchmarks, each beside torch's equivalent, measured in the same run.

- one heartbeat from C++ and from Python, beside torch's file timer `expires()`;
- death-detection latency, beside a 0.1 s polling loop (torchrun's monitor interval);
- barrier round trip for 2 and 4 processes, beside `torch.distributed.barrier()` on gloo and a
  TCPStore add/wait barrier.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import elastic_core as ec

from common import Row, free_port, median, percentile, python_json, run_json

HERE = Path(__file__).resolve().parent


def beat_cost(cpp_build: Path) -> list[Row]:
    cpp = run_json([str(cpp_build / "cpp" / "bench" / "bench_beat")])
    path = f"/dev/shm/elastic-bench-{uuid.uuid4().hex[:8]}"
    with ec.HeartbeatTable.create(path, 1):
        py = python_json(
            HERE / "_beat_python.py",
            env={ec.HEARTBEAT_FILE_ENV: path, ec.HEARTBEAT_SLOT_ENV: "0"},
        )
    expires = python_json(HERE / "_expires.py")
    torch_timer = expires["expires_ns"]
    name = "torch `with expires()` (file timer)"
    fails = expires["tight_loop_fails_after"]
    failure = f"; torch's fails after {fails} calls in a tight loop" if fails else ""
    return [
        Row(
            "beat",
            "one beat, C++",
            cpp["beat_ns"],
            torch_timer,
            name,
            "ns",
            f"clock read alone {cpp['clock_ns']:.0f} ns",
        ),
        Row(
            "beat",
            "one beat, Python `elastic_core.beat()`",
            py["beat_ns"],
            torch_timer,
            name,
            "ns",
            f"never blocks{failure}",
        ),
    ]


def _spawn_sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "60"])


def death_latency(trials: int = 30) -> list[Row]:
    ours: list[float] = []
    with ec.Watchdog() as wd:
        for i in range(trials):
            child = _spawn_sleeper()
            wd.watch(i, child.pid)
            time.sleep(0.005)
            t0 = ec.now_ns()
            os.kill(child.pid, signal.SIGKILL)
            event = wd.poll(timeout=10)
            assert event is not None
            assert event.pid == child.pid
            ours.append((event.time_ns - t0) / 1e6)
            child.wait()
    polled: list[float] = []
    for _ in range(max(10, trials // 2)):
        child = _spawn_sleeper()
        killed_at: list[int] = []

        def kill(pid: int = child.pid, record: list[int] = killed_at) -> None:
            record.append(time.monotonic_ns())
            os.kill(pid, signal.SIGKILL)

        killer = threading.Timer(random.uniform(0.0, 0.1), kill)
        killer.start()
        while child.poll() is None:  # torchrun's agent loop: check, sleep monitor_interval
            time.sleep(0.1)
        polled.append((time.monotonic_ns() - killed_at[0]) / 1e6)
        killer.join()
    return [
        Row(
            "death",
            "death detected after SIGKILL (median)",
            median(ours),
            median(polled),
            "0.1 s polling loop (torchrun monitor)",
            "ms",
        ),
        Row(
            "death",
            "death detected after SIGKILL (worst)",
            max(ours),
            max(polled),
            "0.1 s polling loop (torchrun monitor)",
            "ms",
            f"p99 {percentile(ours, 0.99):.2f} ms over {trials}",
        ),
    ]


def _barrier_python(kind: str, world: int, rounds: int) -> float:
    address = ""
    owner = None
    if kind == "elastic":
        address = f"/dev/shm/elastic-bench-bar-{uuid.uuid4().hex[:8]}"
        owner = ec.LocalBarrier.create(address, world)
    else:
        address = f"127.0.0.1:{free_port()}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(HERE / "_barrier_worker.py"),
                kind,
                str(r),
                str(world),
                str(rounds),
                address,
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for r in range(world)
    ]
    try:
        out, _ = procs[0].communicate(timeout=300)
        for p in procs[1:]:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        if owner is not None:
            owner.close()
    import json

    return json.loads(out.strip().splitlines()[-1])["round_ns"] / 1000


def barrier_round_trip(cpp_build: Path) -> list[Row]:
    rows = []
    for world in (2, 4):
        cpp = run_json([str(cpp_build / "cpp" / "bench" / "bench_barrier"), str(world)])
        cpp_us = cpp["round_ns"] / 1000
        py_us = _barrier_python("elastic", world, 20000)
        gloo_us = _barrier_python("gloo", world, 500)
        store_us = _barrier_python("store", world, 200)
        rows += [
            Row(
                "barrier",
                f"barrier round, {world} processes, C++",
                cpp_us,
                gloo_us,
                "torch.distributed.barrier() on gloo",
                "us",
            ),
            Row(
                "barrier",
                f"barrier round, {world} processes, Python",
                py_us,
                gloo_us,
                "torch.distributed.barrier() on gloo",
                "us",
            ),
            Row(
                "barrier",
                f"barrier round, {world} processes, C++",
                cpp_us,
                store_us,
                "TCPStore add/wait barrier (torch elastic)",
                "us",
            ),
        ]
    return rows


def run(cpp_build: Path) -> list[Row]:
    return beat_cost(cpp_build) + death_latency() + barrier_round_trip(cpp_build)
