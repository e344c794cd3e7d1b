"""A worker for bench_train_loop.py: the same ~10 ms step, run three ways.

- ``--mode loop``: the classic train loop (elastic_launch.train_loop) under elasticrun;
- ``--mode plain``: a torchrun-style script (RANK/WORLD_SIZE from the environment, one
  process group for its life) under elasticrun or torchrun, restarted as a group;
- ``--mode overhead``: under elasticrun, the same steps timed in a plain ``for`` loop and then
  through ``train()``, in one process group (no snapshot: the user's own cost is not counted).

Every completed step appends "monotonic_ns step world rank pid" to OUT/<pid>.steps.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

STEP_SLEEP = 0.008  # with the model and the all_reduce: about 10 ms a step on this machine


class Model:
    def __init__(self) -> None:
        torch.manual_seed(0)
        self.net = torch.nn.Linear(256, 256)
        self.x = torch.randn(32, 256)

    def step(self) -> None:
        time.sleep(STEP_SLEEP)
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
    model, log = Model(), Log(args.out)
    for step in range(args.steps):
        model.step()
        log.record(step, dist.get_world_size(), dist.get_rank())


def loop(args: argparse.Namespace) -> None:
    from elastic_launch import train_loop

    class BenchState(train_loop.State):
        def __init__(self) -> None:
            self.model, self.log, self.steps = Model(), Log(args.out), 0
            self.world, self.rank = 1, 0

        def sync(self, world_size: int, rank: int) -> None:
            self.world, self.rank = world_size, rank
            t = torch.tensor([self.steps])
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            self.steps = int(t)
            for p in self.model.net.parameters():
                dist.broadcast(p.data, 0)

    def train_step(state: BenchState) -> BenchState:
        if state.steps >= args.steps:
            raise StopIteration
        state.model.step()
        state.steps += 1
        state.log.record(state.steps, state.world, state.rank)
        return state

    train_loop.train(train_loop.from_environment("gloo"), train_step, BenchState())


def overhead(args: argparse.Namespace) -> None:
    """The first train_step runs the plain loop (timed) in the group the loop formed; the
    next `steps` go through train(), timed from the first one's start to the last one's end."""
    from elastic_launch import train_loop

    model = Model()
    times: dict[str, float] = {}

    class Bare(train_loop.State):
        done = -1

    def train_step(state: Bare) -> Bare:
        if state.done < 0:  # the plain loop, once, in the group formed
            for _ in range(20):
                model.step()  # warm up
            t0 = time.perf_counter()
            for _ in range(args.steps):
                model.step()
            times["plain_s"] = time.perf_counter() - t0
        elif state.done == 0:
            times["first"] = time.perf_counter()
        elif state.done == args.steps:
            times["loop_s"] = time.perf_counter() - times["first"]
            raise StopIteration
        if state.done >= 0:
            model.step()
        state.done += 1
        return state

    train_loop.train(train_loop.from_environment("gloo"), train_step, Bare())
    result = {"plain_s": times["plain_s"], "loop_s": times["loop_s"], "steps": args.steps}
    (args.out / f"overhead-{os.getpid()}.json").write_text(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--mode", choices=("loop", "plain", "overhead"), required=True)
    parser.add_argument("--steps", type=int, default=600)
    args = parser.parse_args()
    {"loop": loop, "plain": plain, "overhead": overhead}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
