"""Run the benchmarks: our code beside torchrun's (or torch's own primitive), in one run.

    python benchmarks/run.py [--cpp-build build/cpp] [SECTION ...]

Prints a Markdown table (the README's) with the ratio of each pair, and writes
benchmarks/results/<section>.json. Never fails on speed: figures are reported, not asserted.
"""

from __future__ import annotations

import argparse
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_example01
import bench_frameworks
import bench_hang
import bench_imagenet
import bench_launch
import bench_memory_tier
import bench_rdzv_scale
import bench_real_job
import bench_rendezvous
import bench_replace
import bench_sampler
import bench_slurm
import bench_steps_lost
import bench_train_loop
import hostile_load

import bench_core
from common import REPO, format_table, save

SECTIONS = {
    "core": bench_core.run,
    "launch": bench_launch.run,
    "hang": bench_hang.run,
    "replace": bench_replace.run,
    "rendezvous": bench_rendezvous.run,
    "rdzv_scale": bench_rdzv_scale.run,  # N=32,128; more: bench_rdzv_scale.py --n
    "sampler": bench_sampler.run,
    "memory_tier": bench_memory_tier.run,
    "steps_lost": bench_steps_lost.run,
    "real_job": bench_real_job.run,  # runs per scenario: BENCH_REAL_JOB_RUNS (default 5)
    "train_loop": bench_train_loop.run,
    "imagenet": bench_imagenet.run,  # torchelastic 0.1's example: no spare, a hot spare
    "example01": bench_example01.run,  # the 0.1 example as it ships, through a wrapper
    "frameworks": bench_frameworks.run,  # Lightning, Accelerate (make bench installs them)
    "slurm": bench_slurm.run,
    "hostile": hostile_load.run,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "sections", nargs="*", metavar="SECTION", help=f"one of {sorted(SECTIONS)} (default: all)"
    )
    parser.add_argument(
        "--cpp-build",
        type=Path,
        default=REPO / "build" / "cpp",
        help="the CMake build directory with the C++ benchmark programs",
    )
    args = parser.parse_args()
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        parser.error(f"unknown section {unknown[0]!r}: choose from {sorted(SECTIONS)}")
    bench = args.cpp_build / "cpp" / "bench" / "bench_beat"
    if not bench.exists():
        parser.error(
            f"no C++ benchmark programs in '{args.cpp_build}': run `make bench`, or "
            "build the C++ tree and pass --cpp-build"
        )
    print(
        f"# {platform.node()}: {platform.machine()}, {platform.python_version()}, "
        f"{len(__import__('os').sched_getaffinity(0))} cores\n"
    )
    for name in args.sections or list(SECTIONS):
        rows = SECTIONS[name](args.cpp_build)
        print(f"## {name}\n")
        print(format_table(rows))
        print(f"\n(saved to {save(name, rows)})\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
