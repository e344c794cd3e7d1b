"""Steps lost per failure, and the time back to training, beside torchrun in one run:
examples/train_ddp.py as 2 nodes x 2 workers on this machine (c10d rendezvous on the first
node), a disk checkpoint every 50 steps. Under elasticrun every step is also kept in each
node's memory; under torchrun the same script keeps only the disk's (its usual checkpoint).

Faults, at a random step (the same one for both launchers): a worker SIGKILLed (rank 3), and
the second node SIGKILLed (its launcher and workers) with a replacement node started at once.
Measured from the job's records: the steps lost (completed steps trained again), the time from
the kill to the first step trained after it, and whether the final weights are bitwise those of
a fault-free run.

    python benchmarks/bench_steps_lost.py [--seed 0]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import tempfile
from pathlib import Path

from _job_run import STEPS, JobRun, Outcome

from common import Row


def same_weights(a: Path, b: Path) -> bool:
    import torch

    if not b.exists():
        return False
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def run(seed: int = 0) -> list[Row]:
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="bench-steps-lost-"))
    rows = []
    try:
        reference = JobRun(root, "reference", "elasticrun").run(None)
        if any(reference.returncodes):
            raise RuntimeError(f"the fault-free run failed: {reference.log}")
        for fault in ("worker", "node"):
            kill_at = rng.randint(10, STEPS - 15)
            got: dict[str, Outcome] = {}
            for launcher in ("elasticrun", "torchrun"):
                job = JobRun(root, f"{launcher}-{fault}", launcher)
                try:
                    got[launcher] = job.run(fault, kill_at)
                except RuntimeError as e:  # reported, not raised: the other figures stand
                    print(f"{launcher} did not recover from the {fault} fault: {e}")
                    got[launcher] = Outcome([], None, None, None, None, job.weights, str(e))
            ours, theirs = got["elasticrun"], got["torchrun"]
            exact = {k: same_weights(reference.weights, v.weights) for k, v in got.items()}
            what = "a worker SIGKILLed" if fault == "worker" else "a node SIGKILLed and replaced"
            note = (
                f"killed at step {kill_at}; resumed at {ours.resumed} (elasticrun), "
                f"{theirs.resumed} (torchrun); final weights bitwise equal to the fault-free "
                f"run: elasticrun {'yes' if exact['elasticrun'] else 'NO'}, torchrun "
                f"{'yes' if exact['torchrun'] else 'NO'}"
            )
            rows.append(
                Row(
                    "steps_lost",
                    f"2 nodes x 2 workers, {what}: steps lost",
                    float(ours.lost if ours.lost is not None else -1),
                    float(theirs.lost if theirs.lost is not None else -1),
                    "torchrun, disk checkpoint every 50 steps",
                    "steps",
                    note,
                )
            )
            rows.append(
                Row(
                    "steps_lost",
                    f"2 nodes x 2 workers, {what}: the kill to the first step after it",
                    ours.recovery_s or -1.0,
                    theirs.recovery_s or -1.0,
                    "torchrun",
                    "s",
                    f"killed at step {kill_at}",
                )
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    for row in run(args.seed):
        print(
            f"{row.metric}: {row.ours:g} {row.unit} vs {row.baseline_name} {row.baseline:g} "
            f"- {row.note}"
        )
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
