"""A PyTorch Lightning job (benchmarks/_lightning_job.py: a Trainer, DDP on CPU, AdamW, a
DataLoader worker, ModelCheckpoint every step, fit(ckpt_path=last)) on one node of 2 workers,
rank 1 SIGKILLed at step 30: the kill to the restarted group's first step, elasticrun (default
flags: --preload auto has the zygote import torch, torch._dynamo and Lightning) beside torchrun
in the same run. `make bench` installs Lightning; the tests do not need it.

    python benchmarks/bench_lightning.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from common import Row, end_job, median

HERE = Path(__file__).resolve().parent
JOB = HERE / "_lightning_job.py"
FLAGS = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
LAUNCHERS = {
    "elasticrun": [sys.executable, "-m", "elastic_launch", *FLAGS],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", *FLAGS],
}


#: A run that has not ended by then hangs (torchrun's did in 1 of 4 runs of this job): it
#: counts as not recovered, and its launcher and workers are killed.
RUN_TIMEOUT = 180


def once(launcher: list[str]) -> float | None:
    """Seconds from the kill to the first step of the restarted group, or None (it failed or
    hung)."""
    out = Path(tempfile.mkdtemp(prefix="bench-lightning-"))
    with open(out / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [*launcher, str(JOB), str(out)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            code: int | None = proc.wait(RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            end_job(proc, out)
    killed = out / "killed"
    after = [
        int(line.split()[0])
        for path in out.glob("*.steps")
        for line in path.read_text().splitlines()
        if int(line.split()[3]) >= 1
    ]
    if code != 0 or not killed.exists() or not after:
        what = "hung" if code is None else f"exit {code}"
        tail = (out / "stderr").read_text(errors="replace")[-1500:]
        print(f"{launcher[2]}: a run failed ({what}): {tail}", file=sys.stderr)
        return None
    return (min(after) - int(killed.read_text())) / 1e9


def measure(runs: int) -> dict[str, list[float | None]]:
    """Each launcher `runs` times, alternating, so that both see the machine alike."""
    found: dict[str, list[float | None]] = {name: [] for name in LAUNCHERS}
    for _ in range(runs):
        for name, launcher in LAUNCHERS.items():
            found[name].append(once(launcher))
    return found


def run(cpp_build: Path | None = None, runs: int | None = None) -> list[Row]:
    runs = runs or int(os.environ.get("BENCH_LIGHTNING_RUNS", "5"))
    found = measure(runs)
    ok = {name: [v for v in vs if v is not None] for name, vs in found.items()}
    ours, theirs = ok["elasticrun"], ok["torchrun"]
    note = (
        f"median of {len(ours)}/{runs} recovered; torchrun {len(theirs)}/{runs}; "
        "1 x 2, DDP on CPU, AdamW, a DataLoader worker, ModelCheckpoint every step"
    )
    return [
        Row(
            "lightning",
            "PyTorch Lightning Trainer, rank 1 SIGKILLed: the kill to the restarted group's "
            "first step",
            median(ours) if ours else float("nan"),
            median(theirs) if theirs else None,
            "torchrun",
            "s",
            note,
        )
    ]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None)
    args = p.parse_args()
    from common import format_table

    print(format_table(run(runs=args.runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
