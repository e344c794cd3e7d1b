"""``make gpu-check``: the real-job benchmark on this machine's GPUs, over NCCL.

The same scenarios and the same table as ``make bench``'s real_job section (bench_real_job.py),
each worker on a GPU of its own: 1 node x 2 workers, 2 nodes x 1 worker (each node its own
launcher, with its own GPU), the classic train loop on 2 workers. What differs from the CPU
runs is what differs on a GPU: the zygote forks workers that have not initialised CUDA, the
model and its gradients are on the GPU (DDP over NCCL; the checkpoints' and the sampler's CPU
tensors go over gloo, ``init_process_group("cpu:gloo,cuda:nccl")``), the memory tier copies
the state from the GPU on a side stream, the train loop aborts NCCL communicators stuck on a
dead peer, and NVML counts the GPUs through ``CUDA_VISIBLE_DEVICES``.

Exits 2 with a message that says what is missing where there are fewer than 2 usable GPUs,
no CUDA build of torch, or no NCCL; prints the table and saves it to
benchmarks/results/real_job_gpu.json otherwise. On an 8-GPU node it uses the first 2 (set
``CUDA_VISIBLE_DEVICES`` to choose).

    python benchmarks/gpu_check.py [--runs 5] [SCENARIO ...]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_real_job

from common import format_table, save

NEEDED = 2


def missing() -> tuple[str | None, tuple[str, ...]]:
    """What keeps this machine from the check (None: nothing), and the GPUs to use
    (``CUDA_VISIBLE_DEVICES`` entries)."""
    from elastic_launch.agent.devices import usable_gpus, visible_devices

    count, note = usable_gpus()
    if count < NEEDED:
        return (
            f"{count} usable GPU(s) found, {NEEDED} needed: NVML (libnvidia-ml.so.1, the driver) "
            f"counts the GPUs, narrowed by CUDA_VISIBLE_DEVICES"
            f"={os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')!s}"
            + (f" ({note})" if note else "")
            + "; run it on a machine with 2 or more NVIDIA GPUs and their driver"
        ), ()
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available():
        return (
            f"torch {torch.__version__} here has no CUDA (torch.version.cuda is "
            f"{torch.version.cuda}): install a CUDA build of torch into this environment, "
            "for example pip install torch --index-url https://download.pytorch.org/whl/cu126"
        ), ()
    if not dist.is_nccl_available():
        return f"torch {torch.__version__} here was built without NCCL", ()
    visible = visible_devices() or [str(i) for i in range(count)]
    return None, tuple(visible[:count])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("scenarios", nargs="*", help=", ".join(bench_real_job.SCENARIOS))
    p.add_argument("--runs", type=int, default=5, help="runs per scenario (default 5)")
    args = p.parse_args()
    unknown = [s for s in args.scenarios if s not in bench_real_job.SCENARIOS]
    if unknown:
        p.error(f"unknown scenario {unknown[0]!r}: choose from {list(bench_real_job.SCENARIOS)}")
    why, gpus = missing()
    if why is not None:
        print(f"gpu-check: {why}", file=sys.stderr)
        return 2
    os.environ["BENCH_REAL_JOB_RUNS"] = str(args.runs)
    print(f"# gpu-check on GPUs {','.join(gpus)} (CUDA_VISIBLE_DEVICES entries), NCCL\n")
    rows = bench_real_job.run(None, args.scenarios or None, gpus=gpus)
    print(format_table(rows))
    print(f"\n(saved to {save('real_job_gpu', rows)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
