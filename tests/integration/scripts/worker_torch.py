"""The parts of worker.py that use torch, in a module of their own: worker.py does not import
torch, so that `--preload auto` forks its workers from a zygote without torch (1.5 s of CPU a
launch saved), except for the few tests that train or run a collective (`--steps`, `--dist`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def all_reduce(args: argparse.Namespace, tag: str) -> None:
    dist.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    with open(os.path.join(args.out, f"{tag}.dist.json"), "w") as f:
        json.dump(
            {
                "sum": t.item(),
                "launched": dist.is_torchelastic_launched(),
                "world": dist.get_world_size(),
                "rank": dist.get_rank(),
            },
            f,
        )


def train(
    args: argparse.Namespace, failing: bool, rank: int, restarts: int, fail: Callable[..., None]
) -> None:
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for step in range(args.steps):
        if failing and step == args.fail_at_step:
            fail(args, rank, restarts)
        loss = model(torch.randn(8, 4)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(args.step_time)


def end(args: argparse.Namespace) -> None:
    """After the collective: leave the group together."""
    dist.barrier()
    dist.destroy_process_group()
