"""A training loop of collectives that resumes where the job left off: every step is an
all_reduce; rank 0 records the steps done in a file shared by the job, and a restarted group
goes on from there. Records its pid and environment like worker.py."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--state", required=True, help="file holding the steps done")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--step-time", type=float, default=0.02)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    tag = f"{os.environ['ELASTICRUN_ATTEMPT']}-{rank}"
    for name, text in (
        (f"{tag}.env.json", json.dumps(dict(os.environ))),
        (f"{tag}.pid", str(os.getpid())),
    ):
        tmp = os.path.join(args.out, f".{name}")
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, os.path.join(args.out, name))  # each file appears whole
    dist.init_process_group("gloo")
    start = 0
    if os.path.exists(args.state):
        with open(args.state) as f:
            start = int(f.read())
    t = torch.zeros(1)
    for step in range(start, args.steps):
        t.fill_(1.0)
        dist.all_reduce(t)
        if rank == 0:
            tmp = f"{args.state}.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(str(step + 1))
            os.replace(tmp, args.state)
        time.sleep(args.step_time)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
