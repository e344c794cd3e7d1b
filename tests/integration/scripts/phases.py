"""A small DDP job with one long phase without optimizer steps: legitimate work that must never
be taken for a hang, or a real hang that must be found.

    phases.py --out DIR --phase PHASE [--seconds S]

Every rank takes 5 steps, runs the phase, takes 5 more steps and exits 0. Each process writes
its pid to DIR/<rank>.pid first, so the test can end everything it started.

The busy phases work a quarter of the time (as a host thread feeding a GPU): five times the
CPU the detector takes for evidence of progress, and, for the workers a test runs side by
side, a load the machine carries without starving the tests running beside them.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

LEGITIMATE = ("first_step", "eval", "metric", "checkpoint")
HANGS = ("sigstop", "peer_stopped", "deadlock", "sleep")
WORK, REST = 0.025, 0.075  # seconds: a quarter of a core


def busy(until: float, work: Callable[[], object]) -> None:
    """Run `work` over and over until `until`, resting after each slice of WORK seconds of
    CPU time (counted on the process's clock, not the wall's: on a loaded machine a slice
    takes longer, and still does its share of work)."""
    while time.monotonic() < until:
        spent = time.process_time() + WORK
        while time.process_time() < spent and time.monotonic() < until:
            work()
        time.sleep(max(0.0, min(REST, until - time.monotonic())))


def deadlock() -> None:
    a, b = threading.Lock(), threading.Lock()
    both = threading.Barrier(2)

    def take(first: threading.Lock, second: threading.Lock) -> None:
        with first:
            both.wait()
            with second:
                pass

    threads = [
        threading.Thread(target=take, args=(a, b)),
        threading.Thread(target=take, args=(b, a)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def checkpoint(out: str, rank: int, until: float) -> None:
    """Throttled storage: 512 KiB every 0.25 s."""
    chunk = os.urandom(512 * 1024)
    with open(os.path.join(out, f"ckpt-{rank}.bin"), "wb") as f:
        while time.monotonic() < until:
            f.write(chunk)
            f.flush()
            time.sleep(0.25)
        os.fsync(f.fileno())
    os.remove(f.name)


def phase(args: argparse.Namespace, rank: int, model: Any, steps: Any, until: float) -> None:
    """The long phase between the two runs of steps."""
    import torch
    import torch.distributed as dist

    if args.phase == "eval":  # forward passes only
        with torch.no_grad():
            busy(until, lambda: model.module(torch.randn(512, 64)))
    elif args.phase == "metric":  # pure Python
        busy(until, lambda: sum(i * i for i in range(10_000)))
    elif args.phase == "checkpoint":
        checkpoint(args.out, rank, until)
    elif args.phase in ("sigstop", "peer_stopped"):
        if rank == dist.get_world_size() - 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        steps(1)  # the others block in the gradients' all_reduce
    elif args.phase == "deadlock":
        deadlock()
    elif args.phase == "sleep":
        time.sleep(10**6)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--phase", required=True, choices=[*LEGITIMATE, *HANGS])
    p.add_argument("--seconds", type=float, default=90.0)
    args = p.parse_args()
    rank = int(os.environ["RANK"])
    tmp = os.path.join(args.out, f".{rank}.pid")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(args.out, f"{rank}.pid"))

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def steps(n: int) -> None:
        for _ in range(n):
            opt.zero_grad()
            model(torch.randn(32, 64)).pow(2).mean().backward()
            opt.step()

    until = time.monotonic() + args.seconds
    if args.phase == "first_step":  # compilation or warm-up before the first step
        a = torch.randn(256, 256)
        busy(until, lambda: torch.tanh(a @ a))
    steps(5)
    phase(args, rank, model, steps, until)
    steps(5)
    dist.barrier()  # as the other test scripts: no rank tears down while another still uses it
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
