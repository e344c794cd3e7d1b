"""A worker for bench_train_loop.py: the same ~10 ms step, run three ways.

- ``--mode loop``: the classic train loop (elastic_launch.train_loop) under elasticrun;
- ``--mode plain``: a torchrun-style script (RANK/WORLD_SIZE from the environment, one
  process group for its life) under elasticrun or torchrun, restarted as a group;
- ``--ddp``: the step through a DistributedDataParallel model and a torch.optim optimizer;
- ``--mode overhead``: under elasticrun, the same steps timed in a plain ``for`` loop and then
  through ``train()``, in one process group (no snapshot: the user's own cost is not counted).

Every completed step appends "monotonic_ns step world rank pid" to OUT/<pid>.steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import elastic_core
import torch
import torch.distributed as dist

STEP_SLEEP = 0.008  # with the model and the all_reduce: about 10-14 ms a step on this machine
BLOCK = 50  # steps in a row of one kind, in the overhead mode


class Model:
    """The step: by hand (all_reduce of each gradient), or (`ddp`) as most scripts write it, a
    DistributedDataParallel model and a torch.optim optimizer, rebuilt on each new group."""

    def __init__(self, ddp: bool = False) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Linear(256, 256)
        self.x = torch.randn(32, 256)
        self.ddp: torch.nn.Module | None = None
        self.opt = torch.optim.SGD(self.net.parameters(), lr=0.001) if ddp else None

    def wrap(self) -> None:
        """On a new group: the DDP model over it (the optimizer keeps the parameters)."""
        if self.opt is not None:
            from torch.nn.parallel import DistributedDataParallel

            self.ddp = DistributedDataParallel(self.net)

    def step(self) -> None:
        time.sleep(STEP_SLEEP)
        if self.ddp is not None and self.opt is not None:
            self.opt.zero_grad()
            self.ddp(self.x).square().mean().backward()
            self.opt.step()
            return
        self.net.zero_grad()
        self.net(self.x).square().mean().backward()
        for p in self.net.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.data.sub_(0.001 * p.grad)


class Log:
    def __init__(self, out: Path) -> None:
        self.f = open(out / f"{os.getpid()}.steps", "a", buffering=1)  # noqa: SIM115

    def record(self, step: int, world: int, rank: int) -> None:
        self.f.write(f"{time.monotonic_ns()} {step} {world} {rank} {os.getpid()}\n")


def plain(args: argparse.Namespace) -> None:
    dist.init_process_group("gloo")
    model, log = Model(args.ddp), Log(args.out)
    model.wrap()
    for step in range(args.steps):
        model.step()
        log.record(step, dist.get_world_size(), dist.get_rank())


def loop(args: argparse.Namespace) -> None:
    from elastic_launch import train_loop

    class BenchState(train_loop.State):
        def __init__(self) -> None:
            self.model, self.log, self.steps = Model(args.ddp), Log(args.out), 0
            self.world, self.rank = 1, 0

        def sync(self, world_size: int, rank: int) -> None:
            self.world, self.rank = world_size, rank
            t = torch.tensor([self.steps])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.steps = int(t)
            for p in self.model.net.parameters():
                dist.broadcast(p.data, 0)
            self.model.wrap()

    def train_step(state: BenchState) -> BenchState:
        if state.steps >= args.steps:
            raise StopIteration
        state.model.step()
        state.steps += 1
        state.log.record(state.steps, state.world, state.rank)
        return state

    train_loop.train(train_loop.from_environment("gloo"), train_step, BenchState())


def overhead(args: argparse.Namespace) -> None:
    """Blocks of BLOCK steps in a plain ``for`` loop (inside one train_step call, in the group
    the loop formed) alternate with BLOCK steps through train(): each step's interval is
    recorded, and the medians compared (alternating keeps the machine's drift out). With
    `--empty` the steps do nothing: what is left is the loop's own cost."""
    from elastic_launch import train_loop

    model = Model()
    work = model.step if not args.empty else (lambda: None)
    block = BLOCK if not args.empty else 1000
    plain_s: list[float] = []
    loop_s: list[float] = []
    previous: list[float | None] = [None]  # the entry time of the last single loop step

    class Bare(train_loop.State):
        done = 0

    def train_step(state: Bare) -> Bare:
        now = time.perf_counter()
        if state.done >= 2 * args.steps:
            raise StopIteration
        if previous[0] is not None:
            loop_s.append(now - previous[0])
        if state.done % (2 * block) == 0:  # a plain block
            t = time.perf_counter()
            for _ in range(block):
                work()
                elastic_core.beat()  # as a torch.optim step's hook does under elasticrun
                t2 = time.perf_counter()
                plain_s.append(t2 - t)
                t = t2
            state.done += block
            previous[0] = None  # the next interval starts after the block: not a loop step's
            return state
        work()
        state.done += 1
        previous[0] = now
        return state

    train_loop.train(train_loop.from_environment("gloo"), train_step, Bare())
    result = {
        "plain_ms": statistics.median(plain_s) * 1e3,
        "loop_ms": statistics.median(loop_s) * 1e3,
        "steps": len(loop_s),
    }
    (args.out / f"overhead-{os.getpid()}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=("loop", "plain", "overhead"), required=True)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--empty", action="store_true", help="overhead: steps that do nothing")
    parser.add_argument("--ddp", action="store_true", help="a DDP model and a torch.optim step")
    args = parser.parse_args()
    {"loop": loop, "plain": plain, "overhead": overhead}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
