"""elastic_sampler's benchmarks, beside torch's own:

- building and fully iterating one rank's share of the sampler (8 replicas) over 10^7 and 10^8
  samples: time and peak memory added, torch's DistributedSampler beside both permutation modes;
  and the constant-memory mode at 10^9 (the first 10^6 indices);
- how long a save of a 500 MB state blocks the training loop: CheckpointManager synchronously,
  in the background, and plain torch.save.
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import Row, run_json

HERE = Path(__file__).resolve().parent


def _iterate(kind: str, n: int, limit: int = 0) -> dict:
    return run_json(
        [sys.executable, str(HERE / "_sampler_child.py"), kind, str(n), "8", str(limit)],
        timeout=1800,
    )


def sampler_rows() -> list[Row]:
    rows = []
    sizes = [int(float(x)) for x in os.environ.get("BENCH_SAMPLER_SIZES", "1e7,1e8").split(",")]
    for n in sizes:
        theirs = _iterate("torch-sampler", n)
        for kind in ("torch", "feistel"):
            ours = _iterate(kind, n)
            label = f"{n:.0e} samples, 8 replicas, permutation={kind}"
            rows.append(
                Row(
                    "sampler",
                    f"{label}: time",
                    ours["seconds"],
                    theirs["seconds"],
                    "torch DistributedSampler",
                    "s",
                )
            )
            rows.append(
                Row(
                    "sampler",
                    f"{label}: peak memory",
                    ours["peak_mb"],
                    theirs["peak_mb"],
                    "torch DistributedSampler",
                    "MB",
                )
            )
    big = _iterate("feistel", 10**9, 10**6)
    rows.append(
        Row(
            "sampler",
            "1e9 samples, feistel: peak memory (first 1e6 indices)",
            big["peak_mb"],
            None,
            "",
            "MB",
            f"{big['seconds']:.1f} s",
        )
    )
    return rows


def save_rows() -> list[Row]:
    import torch
    from elastic_sampler import CheckpointManager

    directory = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    try:
        state = {f"layer{i}": torch.randn(125_000_000 // 8) for i in range(8)}  # 500 MB
        manager = CheckpointManager(directory, keep_last=1)
        plains = []
        for _ in range(3):
            t0 = time.perf_counter()
            torch.save(state, directory / "plain.pt")
            os.sync()
            plains.append(time.perf_counter() - t0)
            (directory / "plain.pt").unlink()
        plain = statistics.median(plains)
        t0 = time.perf_counter()
        manager.save(state, 1)
        sync = time.perf_counter() - t0
        # The first background save allocates its copy; later ones copy into the last one's
        # buffers (what a training job saving every N steps sees).
        blocked, totals = [], []
        for step in range(2, 6):
            t0 = time.perf_counter()
            manager.save(state, step, background=True)
            blocked.append(time.perf_counter() - t0)
            manager.wait()
            totals.append(time.perf_counter() - t0)
        manager.close()
        plain_name = "plain torch.save + sync (median of 3)"
        return [
            Row(
                "save",
                "500 MB save, synchronous (atomic, fsync, checksum)",
                sync,
                plain,
                plain_name,
                "s",
            ),
            Row(
                "save",
                "500 MB save, background, the first: training blocked",
                blocked[0],
                plain,
                plain_name,
                "s",
                f"written in {totals[0]:.2f} s in all",
            ),
            Row(
                "save",
                "500 MB save, background, later saves (median of 3): training blocked",
                statistics.median(blocked[1:]),
                plain,
                plain_name,
                "s",
                f"written in {statistics.median(totals[1:]):.2f} s in all",
            ),
        ]
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def run(cpp_build: Path) -> list[Row]:
    return sampler_rows() + save_rows()
