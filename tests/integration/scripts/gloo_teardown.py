"""torch's own teardown deadlock, made to happen every time: a DDP model on gloo, a few steps,
then the bad order (``destroy_process_group()``, then the model dropped).

The deadlock: the last reference to the group is the DDP Reducer's, freed by pybind with the
GIL held, so ``~ProcessGroupGloo`` joins its work thread with the GIL held; that thread is
freeing a finished work whose saved thread-local state holds a Python object (every backward
stashes one since torch 2.12) and waits for the GIL. It is a race that the work thread usually
wins; here each rank runs on one CPU and gloo's work threads only when the main thread blocks
(SCHED_IDLE), so the work thread is always still holding the finished work at that moment.

    gloo_teardown.py --out DIR [--order bad|good]   (RANK, WORLD_SIZE, MASTER_* from the env)

It writes DIR/teardown-RANK once training is over and the teardown begins, and DIR/done-RANK
after it."""

from __future__ import annotations

import argparse
import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.nn
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel


def idle_gloo_threads() -> int:
    """Gloo's work threads run only when nothing else on this CPU wants to."""
    n = 0
    for task in os.listdir("/proc/self/task"):
        if Path(f"/proc/self/task/{task}/comm").read_text().strip() == "pt_gloo_runloop":
            os.sched_setscheduler(int(task), os.SCHED_IDLE, os.sched_param(0))
            n += 1
    return n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--order", choices=["bad", "good"], default="bad")
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(192, 64), nn.ReLU(), nn.Linear(64, 10))
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    assert idle_gloo_threads() >= 2, "gloo's work threads were not found"
    for step in range(3):
        if step == 2:
            (args.out / f"teardown-{rank}").touch()
        loss = nn.functional.cross_entropy(
            ddp(torch.randn(16, 3, 8, 8)), torch.randint(0, 10, (16,))
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    if args.order == "bad":
        dist.destroy_process_group()
        del ddp, model, optimizer, loss
        gc.collect()
    else:
        del ddp, model, optimizer, loss
        gc.collect()
        dist.destroy_process_group()
    (args.out / f"done-{rank}").touch()


if __name__ == "__main__":
    main()
