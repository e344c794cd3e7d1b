"""Jobs written for the frameworks people use, on one node of 2 workers, rank 1 SIGKILLed at
step 30: the kill to the restarted group's first step, elasticrun (default flags: --preload
auto has the zygote import torch, torch._dynamo and the framework) beside torchrun in the same
run. The jobs: PyTorch Lightning (benchmarks/_lightning_job.py: a Trainer, DDP on CPU, AdamW, a
DataLoader worker, ModelCheckpoint every step, fit(ckpt_path=last)), Hugging Face Accelerate
(benchmarks/_accelerate_job.py: an Accelerator, save_state every step, load_state to resume)
and a transformers ``Trainer`` (benchmarks/_trainer_job.py: a small GPT-2 built from a config,
a checkpoint every step, train(resume_from_checkpoint=last)). `make bench` installs them
(transformers into build/hf, beside torch 2.13.0: $ELASTICRUN_BENCH_HF names the folder); the
tests do not need them.

    python benchmarks/bench_frameworks.py [--runs 5]
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
JOBS = {
    "PyTorch Lightning Trainer (DDP, ModelCheckpoint every step, fit(ckpt_path=last))": (
        HERE / "_lightning_job.py"
    ),
    "Hugging Face Accelerate (an Accelerator, save_state every step, load_state)": (
        HERE / "_accelerate_job.py"
    ),
    "Hugging Face transformers Trainer (a GPT-2 from a config, DDP, a checkpoint every step, "
    "resume_from_checkpoint=last)": HERE / "_trainer_job.py",
}
#: Where `make bench` installs transformers (beside torch 2.13.0, not into the venv).
HF_TARGET = os.environ.get("ELASTICRUN_BENCH_HF", str(HERE.parent / "build" / "hf"))
FLAGS = ["--standalone", "--nproc-per-node", "2", "--max-restarts", "2"]
LAUNCHERS = {
    "elasticrun": [sys.executable, "-m", "elastic_launch", *FLAGS],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", *FLAGS],
}


#: A run that has not ended by then hangs (torchrun's did in 1 of 4 runs of this job): it
#: counts as not recovered, and its launcher and workers are killed.
RUN_TIMEOUT = 180


def once(launcher: list[str], job: Path) -> float | None:
    """Seconds from the kill to the first step of the restarted group, or None (it failed or
    hung)."""
    out = Path(tempfile.mkdtemp(prefix="bench-frameworks-"))
    path = os.pathsep.join(filter(None, [HF_TARGET, os.environ.get("PYTHONPATH")]))
    with open(out / "stderr", "wb") as err:
        proc = subprocess.Popen(
            [*launcher, str(job), str(out)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env={**os.environ, "PYTHONPATH": path},
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


def measure(job: Path, runs: int) -> dict[str, list[float | None]]:
    """Each launcher `runs` times on `job`, alternating, so that both see the machine alike."""
    found: dict[str, list[float | None]] = {name: [] for name in LAUNCHERS}
    for _ in range(runs):
        for name, launcher in LAUNCHERS.items():
            found[name].append(once(launcher, job))
    return found


def run(cpp_build: Path | None = None, runs: int | None = None) -> list[Row]:
    runs = runs or int(os.environ.get("BENCH_FRAMEWORK_RUNS", "5"))
    rows = []
    for what, job in JOBS.items():
        found = measure(job, runs)
        ours, theirs = ([v for v in found[n] if v is not None] for n in LAUNCHERS)
        note = (
            f"median of {len(ours)}/{runs} recovered; torchrun {len(theirs)}/{runs}; "
            "1 x 2 on CPU, AdamW, a DataLoader worker"
        )
        rows.append(
            Row(
                "frameworks",
                f"{what}, rank 1 SIGKILLed: the kill to the restarted group's first step",
                median(ours) if ours else float("nan"),
                median(theirs) if theirs else None,
                "torchrun",
                "s",
                note,
            )
        )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=None)
    args = p.parse_args()
    from common import format_table

    print(format_table(run(runs=args.runs)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
