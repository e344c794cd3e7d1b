"""A worker that ends the way torch's teardown can deadlock, and that Python's teardown would
never finish: it destroys its process group while a DDP model still holds it, drops the model
afterwards (torch's bad order), and leaves behind an object whose finalizer never returns, an
unclosed file with buffered data, and an exit handler.

    teardown_order.py --out DIR [--exit-code N]
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


class NeverFinalized:
    """Its finalizer says so, then blocks forever: an interpreter that tears down its objects
    at exit hangs. (What it calls is bound now: names are gone by then.)"""

    def __init__(self, marker: str) -> None:
        self.marker = marker
        self.read, self.blocking = os.read, os.pipe()
        self.touch = os.open, os.close, os.O_WRONLY | os.O_CREAT

    def __del__(self) -> None:
        open_, close, flags = self.touch
        close(open_(self.marker, flags, 0o644))
        self.read(self.blocking[0], 1)  # its write end is open: never returns


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--exit-code", type=int, default=0)
    args = p.parse_args()
    rank = os.environ["RANK"]
    dist.init_process_group("gloo")
    group = dist.group.WORLD
    model = DistributedDataParallel(torch.nn.Linear(8, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    dist.barrier()
    dist.destroy_process_group()  # torch's bad order: the group first...
    del model, opt  # ...then the DDP model that holds it
    gc.collect()
    from elastic_launch import teardown

    kept = any(g is group for g in teardown.kept())
    with open(os.path.join(args.out, f"{rank}.json"), "w") as f:
        json.dump({"kept": kept}, f)
    atexit.register(lambda: open(os.path.join(args.out, f"{rank}.atexit"), "w").close())
    globals()["unclosed"] = open(os.path.join(args.out, f"{rank}.buffered"), "w")  # noqa: SIM115
    globals()["unclosed"].write("written, never flushed by the script\n")
    globals()["stuck"] = NeverFinalized(os.path.join(args.out, f"{rank}.finalizing"))
    return args.exit_code


if __name__ == "__main__":
    sys.exit(main())
