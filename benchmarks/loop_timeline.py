"""The classic train loop's replacement, moment by moment: benchmarks/_loop_job.py (DDP, AdamW,
a DataLoader with workers, sync() sending the state) on 2 workers under elasticrun, default
flags, rank 1 SIGKILLed at step 20. From the kill: the agent's replacement (the events file's
``worker_replaced``: the failure seen to the new worker started, and the start itself), the new
worker's first line, ``train()`` called, its ``sync()`` begun and done, and the first step
after the kill; the survivor's ``sync()`` and first step too. Medians of the runs.

    python benchmarks/loop_timeline.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import end_job, start_job, step_records, wait_until

HERE = Path(__file__).resolve().parent
JOB = HERE / "_loop_job.py"
KILL_AT = 20


def marks(out: Path, pid: int) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    path = out / f"{pid}.marks"
    for line in path.read_text().splitlines() if path.exists() else []:
        ns, what = line.split()
        found.setdefault(what, []).append(int(ns))
    return found


def once() -> dict[str, float] | None:
    out = Path(tempfile.mkdtemp(prefix="bench-loop-timeline-"))
    events = out / "events.jsonl"
    cmd = [sys.executable, "-m", "elastic_launch", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--events-file", str(events), str(JOB), "--out", str(out), "--epochs", "1"]
    proc = start_job(cmd, {"OMP_NUM_THREADS": "1"})
    try:
        victim = wait_until(
            lambda: next((r for r in step_records(out) if r[3] == 1 and r[1] >= KILL_AT), None), 180
        )
        if victim is None:
            return None
        os.kill(victim[4], signal.SIGKILL)
        kill = time.monotonic_ns()
        # A step in flight at the kill may still complete: the first after it is the next one.
        first = wait_until(
            lambda: [r for r in step_records(out) if r[0] > kill and r[1] > victim[1]], 120
        )
        if not first:
            return None
        data = next(
            json.loads(line)
            for line in events.read_text().splitlines()
            if "worker_replaced" in line
        )
        survivor = next(r[4] for r in step_records(out) if r[3] == 0)
        new, old = marks(out, int(data["pid"])), marks(out, survivor)

        def at(ns: int) -> float:
            return (ns - kill) / 1e9

        return {
            "failure seen to new worker started": float(data["recovery_seconds"]),
            "of which the start itself": float(data["spawn_seconds"]),
            "new worker: first line": at(new["first_line"][0]),
            "new worker: train() called": at(new["train"][0]),
            "new worker: sync() begun": at(new["sync"][0]),
            "new worker: sync() done": at(new["synced"][0]),
            "survivor: sync() begun": at(next(t for t in old["sync"] if t > kill)),
            "survivor: sync() done": at(next(t for t in old["synced"] if t > kill)),
            "the first step after the kill": at(min(first)[0]),
        }
    finally:
        end_job(proc, out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    runs = [r for r in (once() for _ in range(args.runs)) if r is not None]
    print(f"| moment (from the kill; median of {len(runs)} of {args.runs} runs) | seconds |")
    print("|---|---:|")
    for key in runs[0] if runs else []:
        print(f"| {key} | {statistics.median(r[key] for r in runs):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
