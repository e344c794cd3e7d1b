"""A classic train-loop worker whose State holds a DistributedDataParallel model, rebuilt on
each round's group in ``sync`` (as torchelastic 0.1's imagenet example does). Every step
appends "monotonic_ns step world rank pid" to OUT/<pid>.steps."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from elastic_launch import train_loop
from torch.nn.parallel import DistributedDataParallel


class DdpState(train_loop.State):
    def __init__(self, out: Path) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Linear(64, 64)
        self.model: DistributedDataParallel | None = None
        self.x = torch.randn(16, 64)
        self.steps = 0
        self.world, self.rank = 1, 0
        self.log = open(out / f"{os.getpid()}.steps", "a", buffering=1)  # noqa: SIM115

    def sync(self, world_size: int, rank: int) -> None:
        self.world, self.rank = world_size, rank
        t = torch.tensor([self.steps])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        self.steps = int(t)
        for p in self.net.parameters():
            dist.broadcast(p.data, 0)
        # The model holds the round's group until the next sync replaces it.
        self.model = DistributedDataParallel(self.net)

    def step(self, sleep: float) -> None:
        assert self.model is not None
        time.sleep(sleep)
        self.model.zero_grad()
        self.model(self.x).square().mean().backward()  # DDP's all_reduce of the gradients
        with torch.no_grad():
            for p in self.net.parameters():
                p.sub_(0.001 * p.grad)
        self.steps += 1
        now = time.monotonic_ns()
        self.log.write(f"{now} {self.steps} {self.world} {self.rank} {os.getpid()}\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=100000)
    parser.add_argument("--sleep", type=float, default=0.01)
    args = parser.parse_args()

    def train_step(state: DdpState) -> DdpState:
        if state.steps >= args.steps:
            raise StopIteration
        state.step(args.sleep)
        return state

    train_loop.train(train_loop.from_environment("gloo"), train_step, DdpState(args.out))


if __name__ == "__main__":
    main()
