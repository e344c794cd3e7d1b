"""The classic train loop's replacement, moment by moment: benchmarks/_loop_job.py (DDP, AdamW,
a DataLoader with workers, sync() sending the state) on 2 workers under elasticrun, default
flags, rank 1 SIGKILLed at step 20. From the kill: the agent's replacement (the events file's
``worker_replaced``: the failure seen to the new worker started, and the start itself), the new
worker's first line, ``train()`` called, its ``sync()`` begun and done, and the first step
after the kill; the survivor's ``sync()`` and first step too. Medians of the runs.

With ``--job imagenet``, torchelastic 0.1's imagenet example as bench_imagenet.py runs it (its
data indexed from a tree of 200,000 files); with ``--hot-spares N``, the kill waits until a
spare waits, and the new worker is the spare that takes the place.

    python benchmarks/loop_timeline.py [--runs 5] [--job imagenet] [--hot-spares 1]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench_imagenet import image_tree

from common import end_job, start_job, step_records, wait_until, waiting_spare

HERE = Path(__file__).resolve().parent
JOB = HERE / "_loop_job.py"
IMAGENET = HERE / "_imagenet_job.py"
KILL_AT = int(os.environ.get("KILL_AT", "20"))


def marks(out: Path, pid: int) -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    path = out / f"{pid}.marks"
    for line in path.read_text().splitlines() if path.exists() else []:
        ns, what = line.split()
        found.setdefault(what, []).append(int(ns))
    return found


def command(job: str, out: Path, events: Path, spares: int, tree: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "elastic_launch", "--standalone", "--nproc-per-node", "2"]
    cmd += ["--events-file", str(events), *(["--hot-spares", str(spares)] if spares else [])]
    if job == "imagenet":
        return [*cmd, str(IMAGENET), str(out), "--epochs", "1", "--image-folder", str(tree)]
    return [*cmd, str(JOB), "--out", str(out), "--epochs", "1"]


def once(job: str, spares: int, tree: Path | None) -> dict[str, float] | None:
    out = Path(tempfile.mkdtemp(prefix="bench-loop-timeline-"))
    events = out / "events.jsonl"
    proc = start_job(command(job, out, events, spares, tree), {"OMP_NUM_THREADS": "1"})
    try:
        if spares and wait_until(lambda: waiting_spare(events), 180) is None:
            return None  # a spare is measured ready, as it is meant to be
        victim = wait_until(
            lambda: next((r for r in step_records(out) if r[3] == 1 and r[1] >= KILL_AT), None), 180
        )
        if victim is None:
            return None
        os.kill(victim[4], signal.SIGKILL)
        kill = time.monotonic_ns()
        # A step in flight at the kill may still complete: the first after it is the next one.
        before = {r[4] for r in step_records(out) if r[0] <= kill}

        def after() -> list | None:
            rows = [r for r in step_records(out) if r[0] > kill and r[1] > victim[1]]
            return rows if {r[4] for r in rows} - before else None  # the new one stepped too

        first = wait_until(after, 120, interval=0.1)  # the moments are the job's own records
        if not first:
            return None
        return _timeline(out, events, kill, min(first)[0])
    finally:
        end_job(proc, out)


def _timeline(out: Path, events: Path, kill: int, first: int) -> dict[str, float]:
    """The moments from the kill: the new worker's (the one that steps after the kill and
    did not before: a replacement, or the hot spare that took the place) and the survivor's."""
    rows = step_records(out)
    before = {r[4] for r in rows if r[0] <= kill}
    new_pid = next(r[4] for r in sorted(rows) if r[0] > kill and r[4] not in before)
    survivor = next(r[4] for r in rows if r[3] == 0 and r[0] <= kill)
    new, old = marks(out, new_pid), marks(out, survivor)

    def at(ns: int) -> float:
        return (ns - kill) / 1e9

    found = {}
    replaced = [json.loads(x) for x in events.read_text().splitlines() if "worker_replaced" in x]
    if replaced and int(replaced[0]["pid"]) == new_pid:
        found["failure seen to new worker started"] = float(replaced[0]["recovery_seconds"])
        found["of which the start itself"] = float(replaced[0]["spawn_seconds"])
    found.update(
        {
            "new worker: first line": at(new["first_line"][0]),
            "new worker: train() called": at(new["train"][0]),
            "new worker: sync() begun": at(next(t for t in new["sync"] if t > kill)),
            "new worker: sync() done": at(next(t for t in new["synced"] if t > kill)),
            "survivor: sync() begun": at(next(t for t in old["sync"] if t > kill)),
            "survivor: sync() done": at(next(t for t in old["synced"] if t > kill)),
            "the first step after the kill": at(first),
        }
    )
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--job", choices=("loop", "imagenet"), default="loop")
    p.add_argument("--hot-spares", type=int, default=0)
    args = p.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-loop-timeline-tree-"))
    try:
        tree = image_tree(root / "train") if args.job == "imagenet" else None
        runs = [once(args.job, args.hot_spares, tree) for _ in range(args.runs)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    runs = [r for r in runs if r is not None]
    print(f"| moment (from the kill; median of {len(runs)} of {args.runs} runs) | seconds |")
    print("|---|---:|")
    for key in runs[0] if runs else []:
        print(f"| {key} | {statistics.median(r[key] for r in runs):.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
