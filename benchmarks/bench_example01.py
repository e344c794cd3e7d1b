"""torchelastic 0.1's imagenet example as it ships (benchmarks/example01/upstream/main.py,
pytorch/elastic v0.1.0rc1, unmodified), started through a wrapper as many people start training
(benchmarks/example01/run.py: its stand-ins on sys.path, a helper imported, the example run with
runpy), so that --preload auto's reading of the wrapper finds no torch. Default flags, 2 workers
on one node, ``--model_arch resnet18`` (a ResNet-18 of torchvision's layout, 8 channels wide
in its first stage: see example01/README.md); rank 1 SIGKILLed as its step 41 (or 9) begins.
Measured: the kill to the survivors' next step, without a spare and with ``--hot-spares 1``
(killed after 40 steps once the spare waits; after 8 as it comes), beside torchrun restarting
the re-creation written as a DDP script with a checkpoint every step (torchrun cannot run the
classic loop; benchmarks/_imagenet_job.py --mode ddp), killed at the same step. Every run's
workers' final parameters are compared with each other and with a fault-free run's; the
survivors' pids are checked to train on.

    python benchmarks/bench_example01.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench_imagenet import TORCHRUN, image_tree, once

from common import Row, end_job, median, step_records, wait_until, waiting_spare

HERE = Path(__file__).resolve().parent
WRAPPER = HERE / "example01" / "run.py"
ELASTICRUN = [sys.executable, "-m", "elastic_launch", "--standalone", "--nproc-per-node", "2"]
ENV = {"OMP_NUM_THREADS": "1"}
RUN_TIMEOUT = 240
#: The example's tree: 200 classes x 40 files (125 steps of 2 x 32 images in its one epoch).
TREE = (200, 40)


@dataclass
class Outcome:
    seconds: float | None  # the kill to the survivors' next step (None: the run failed)
    digests: set[str]  # the workers' final parameters
    kept_pids: bool  # the survivor trained on in its own process


def example(data: Path, kill_at: int, spares: bool, wait_spare: bool) -> Outcome:
    """One run of the example under elasticrun."""
    out = Path(tempfile.mkdtemp(prefix="bench-example01-"))
    events = out / "events.jsonl"
    cmd = [*ELASTICRUN, "--max-restarts", "3", "--events-file", str(events)]
    cmd += ["--hot-spares", "1"] if spares else []
    cmd += [str(WRAPPER), "--input_path", str(data), "--model_arch", "resnet18"]
    env = {**os.environ, **ENV, "EXAMPLE01_OUT": str(out), "EXAMPLE01_KILL_AT": str(kill_at)}
    if not wait_spare:
        (out / "arm").touch()
    with open(out / "console", "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=sink, env=env, start_new_session=True)
        try:
            if wait_spare and wait_until(lambda: waiting_spare(events), RUN_TIMEOUT, 0.1):
                (out / "arm").touch()
            code: int | None = proc.wait(RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            end_job(proc, out)
    try:
        digests = {p.read_text() for p in out.glob("weights.*")}
        if code != 0 or not digests:
            tail = (out / "console").read_text(errors="replace")[-1500:]
            print(f"example01: a run failed (exit {code}): {tail}", file=sys.stderr)
            return Outcome(None, set(), False)
        if not kill_at:
            return Outcome(0.0, digests, True)
        killed, step = map(int, (out / "killed").read_text().split())
        records = step_records(out)
        before = {pid for t, _, _, _, pid in records if t < killed}
        # A survivor may record the step it was finishing as the kill came: its next step
        # is the first past `step`; a new process's first step is past the kill.
        after = [
            (t, pid)
            for t, n, _, _, pid in records
            if t > killed and (n > step or pid not in before)
        ]
        kept = bool(before & {pid for _, pid in after})
        return Outcome((min(after)[0] - killed) / 1e9, digests, kept)
    finally:
        shutil.rmtree(out, ignore_errors=True)


VARIANTS = {
    "no spare, killed after 40 steps": (40, False, False),
    "no spare, killed after 8 steps": (8, False, False),
    "--hot-spares 1, killed after 40 steps (the spare waits)": (40, True, True),
    "--hot-spares 1, killed after 8 steps": (8, True, False),
}


def rows(runs: int, data: Path, recreation: Path) -> list[Row]:
    reference = example(data, 0, False, False).digests
    found: dict[str, list[Outcome]] = {name: [] for name in VARIANTS}
    theirs: dict[int, list[float]] = {40: [], 8: []}
    for _ in range(runs):
        for name, (kill_at, spares, wait) in VARIANTS.items():
            found[name].append(example(data, kill_at, spares, wait))
        ddp = ["--mode", "ddp", "--image-folder", str(recreation)]
        for kill_at, seconds_found in theirs.items():
            seconds, _ = once(TORCHRUN, ddp, True, kill_at)
            if seconds is not None:
                seconds_found.append(seconds)
    table = []
    for name, (kill_at, _, _) in VARIANTS.items():
        done = [o for o in found[name] if o.seconds is not None]
        ours = [o.seconds for o in done if o.seconds is not None]
        killed = {d for o in done for d in o.digests}
        baseline = theirs[kill_at]
        note = (
            f"median of {len(ours)}/{runs}; the workers' parameters agree in every run "
            f"({'one digest across all runs' if len(killed) == 1 else f'{len(killed)} digests'}"
            f"{', equal to' if killed == reference else ', not'} the fault-free run's); "
            f"survivors kept their pids in {sum(o.kept_pids for o in done)}/{len(done)}; "
            f"torchrun {len(baseline)}/{runs} (the re-creation, DDP, a checkpoint every step)"
        )
        table.append(
            Row(
                "imagenet (0.1)",
                "0.1 imagenet example as it ships, started through a runpy wrapper, rank 1 "
                f"SIGKILLed: the kill to the survivors' next step, {name}",
                median(ours) if ours else float("nan"),
                median(baseline) if baseline else None,
                "torchrun group restart",
                "s",
                note,
            )
        )
    return table


def run(cpp_build: Path | None = None, runs: int | None = None) -> list[Row]:
    runs = runs or int(os.environ.get("BENCH_EXAMPLE01_RUNS", "5"))
    root = Path(tempfile.mkdtemp(prefix="bench-example01-tree-"))
    try:
        return rows(runs, image_tree(root / "train", TREE), image_tree(root / "recreation"))
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None)
    args = p.parse_args()
    from common import format_table

    print(format_table(run(runs=args.runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
