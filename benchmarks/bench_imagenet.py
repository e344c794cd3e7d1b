"""torchelastic 0.1's imagenet example, shaped as it ships (benchmarks/_imagenet_job.py: a ResNet
built in the script, its data indexed as ImageFolder does (200 classes x 1,000 files), DDP, a
DataLoader with 2 worker processes, ``CoordinatorP2P``), on one node of 2 workers, rank 1
SIGKILLed before step 40: the kill to the survivors' next step, on the classic loop under
elasticrun with default flags and with ``--hot-spares 1``, beside torchrun restarting the same
job written as a DDP script with a checkpoint every step (torchrun's reliable mode,
``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``). Alternating, median of the runs; every run's final
parameters are compared with an uninterrupted run's. Then what a hot spare costs: its memory
while it waits, beside a training worker's, at two widths of the model.

    python benchmarks/bench_imagenet.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from common import Row, end_job, median, step_records, wait_until, waiting_spare

HERE = Path(__file__).resolve().parent
JOB = HERE / "_imagenet_job.py"
KILL_AT = 40
FLAGS = ["--standalone", "--nproc-per-node", "2"]
ELASTICRUN = [sys.executable, "-m", "elastic_launch", *FLAGS]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", *FLAGS, "--max-restarts", "2"]
VARIANTS = {
    "classic loop, default flags (no spare)": (ELASTICRUN, ["--mode", "loop"]),
    "classic loop, --hot-spares 1": ([*ELASTICRUN, "--hot-spares", "1"], ["--mode", "loop"]),
    "torchrun": (TORCHRUN, ["--mode", "ddp"]),
}
ENV = {"OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
RUN_TIMEOUT = 180  # a run that has not ended by then hangs: it counts as not recovered


#: The example indexes its data at its top (torchvision's ImageFolder): a tree of this many
#: classes x files (a sixth of ImageNet's 1.28 M; the images are made from their index).
TREE = (200, 1000)


def image_tree(root: Path, tree: tuple[int, int] = TREE) -> Path:
    """A directory per class with empty image files, which ImageFolder would list (`tree`:
    classes x files)."""
    classes, files = tree
    for c in range(classes):
        folder = root / f"n{c:08d}"
        folder.mkdir(parents=True)
        for i in range(files):
            (folder / f"img_{i:06d}.jpg").touch()
    return root


def once(
    launcher: list[str], mode: list[str], kill: bool = True, kill_at: int = KILL_AT
) -> tuple[float | None, str]:
    """Seconds from the kill to the first step after it (of the step the kill interrupted or
    later), and the final parameters' digest ("" if the run failed). With hot spares the kill
    waits until one waits in the rendezvous (it is measured ready, as it is meant to be)."""
    out = Path(tempfile.mkdtemp(prefix="bench-imagenet-"))
    events = out / "events.jsonl"
    spares = "--hot-spares" in launcher
    cmd = [*launcher, *(["--events-file", str(events)] if spares else []), str(JOB), str(out)]
    cmd += [*mode, *(["--kill-at", str(kill_at), "--armed"] if kill else [])]
    if not spares:
        (out / "arm").touch()
    with open(out / "console", "wb") as sink:
        proc = subprocess.Popen(
            cmd, stdout=sink, stderr=sink, env={**os.environ, **ENV}, start_new_session=True
        )
        try:
            if spares and wait_until(lambda: waiting_spare(events), RUN_TIMEOUT) is not None:
                (out / "arm").touch()
            code: int | None = proc.wait(RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            code = None
        finally:
            end_job(proc, out)
    try:
        if code != 0:
            tail = (out / "console").read_text(errors="replace")[-1500:]
            print(f"{launcher[2]} {mode}: a run failed (exit {code}): {tail}", file=sys.stderr)
            return None, ""
        digest = (out / "weights").read_text()
        if not kill:
            return 0.0, digest
        killed, step = map(int, (out / "killed").read_text().split())
        after = [t for t, number, *_ in step_records(out) if t > killed and number >= step]
        return (min(after) - killed) / 1e9, digest
    finally:
        shutil.rmtree(out, ignore_errors=True)


def recovery_rows(runs: int, tree: Path) -> list[Row]:
    data = ["--image-folder", str(tree)]
    _, reference = once(ELASTICRUN, ["--mode", "loop", *data], kill=False)
    found: dict[str, list[float]] = {name: [] for name in VARIANTS}
    exact: dict[str, int] = dict.fromkeys(VARIANTS, 0)
    for _ in range(runs):
        for name, (launcher, mode) in VARIANTS.items():
            seconds, digest = once(launcher, [*mode, *data])
            if seconds is not None:
                found[name].append(seconds)
                exact[name] += digest == reference
    theirs = found["torchrun"]
    rows = []
    for name in list(VARIANTS)[:2]:
        ours = found[name]
        note = (
            f"median of {len(ours)}/{runs}, parameters bitwise equal to an uninterrupted run "
            f"in {exact[name]}; torchrun {len(theirs)}/{runs}, bitwise in {exact['torchrun']}"
        )
        rows.append(
            Row(
                "imagenet (0.1)",
                f"0.1 imagenet example, rank 1 SIGKILLed: the kill to the survivors' next step, "
                f"{name}",
                median(ours) if ours else float("nan"),
                median(theirs) if theirs else None,
                "torchrun group restart",
                "s",
                note,
            )
        )
    return rows


def _memory(pid: int) -> dict[str, int]:
    """kB of `pid`'s memory: resident, and its own (private: not shared with the zygote)."""
    fields: dict[str, int] = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1])
    private = fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0)
    return {"rss": fields.get("Rss", 0), "private": private}


def spare_memory(width: int) -> tuple[dict[str, int], dict[str, int]] | None:
    """A waiting hot spare's memory and a training worker's, on the job at `width`."""
    out = Path(tempfile.mkdtemp(prefix="bench-imagenet-mem-"))
    events = out / "events.jsonl"
    cmd = [*ELASTICRUN, "--hot-spares", "1", "--events-file", str(events), str(JOB), str(out)]
    cmd += ["--width", str(width), "--epochs", "100"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, **ENV},
        start_new_session=True,
    )
    try:
        spare = wait_until(lambda: waiting_spare(events), 120)
        worker = wait_until(lambda: next((r[4] for r in step_records(out) if r[1] > 20), None), 120)
        if spare is None or worker is None:
            return None
        return _memory(spare), _memory(worker)
    finally:
        end_job(proc, out)
        shutil.rmtree(out, ignore_errors=True)


def memory_rows() -> list[Row]:
    rows = []
    for width in (16, 64):
        params = _parameters(width)
        found = spare_memory(width)
        if found is None:
            continue
        spare, worker = found
        rows.append(
            Row(
                "imagenet (0.1)",
                f"a waiting hot spare's own memory (ResNet at width {width}, about "
                f"{params / 1e6:.1f} M parameters; resident {spare['rss'] / 1024:.0f} MB)",
                spare["private"] / 1024,
                worker["private"] / 1024,
                "a training worker's own",
                "MB",
                "private memory, not shared with the zygote",
            )
        )
    return rows


def _parameters(width: int) -> int:
    """The parameters of the job's ResNet at `width`, as the job builds it."""
    from _imagenet_job import build_model

    return sum(p.numel() for p in build_model(width, 100).parameters())


def run(cpp_build: Path | None = None, runs: int | None = None) -> list[Row]:
    runs = runs or int(os.environ.get("BENCH_IMAGENET_RUNS", "5"))
    root = Path(tempfile.mkdtemp(prefix="bench-imagenet-tree-"))
    try:
        return recovery_rows(runs, image_tree(root / "train")) + memory_rows()
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
