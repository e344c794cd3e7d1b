"""Worker of bench_launch: the same script under torchrun, elasticrun and by hand.

Writes CLOCK_MONOTONIC times (comparable across processes) into --out: <restart>-<rank>.first
when the first all_reduce completes; crash.t / hang.t when it injects a failure.
"""

from __future__ import annotations

import argparse
import os
import signal
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--mode", choices=["launch", "crash", "hang"], default="launch")
p.add_argument("--file-timer", action="store_true", help="wrap steps in torch's expires()")
p.add_argument("--hang-timeout", type=float, default=2.0)
args = p.parse_args()

rank = int(os.environ["RANK"])
restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def stamp(name: str) -> None:
    path = os.path.join(args.out, name)
    with open(path + ".tmp", "w") as f:
        f.write(str(time.monotonic_ns()))
    os.replace(path + ".tmp", path)


dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
stamp(f"{restarts}-{rank}.first")
if args.mode == "launch" or restarts > 0:
    dist.barrier()
    dist.destroy_process_group()
    raise SystemExit(0)

if args.mode == "crash":
    dist.barrier()
    if rank == 1:
        stamp("crash.t")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(120)

# mode hang: optimizer steps (elasticrun beats on each), then rank 1 stops making progress.
if args.file_timer:
    from torch.distributed.elastic.timer import FileTimerClient, configure, expires

    configure(FileTimerClient(os.environ["TORCHELASTIC_TIMER_FILE"]))
model = torch.nn.Linear(4, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(1000):
    ctx = expires(after=args.hang_timeout) if args.file_timer else None
    if ctx:
        ctx.__enter__()
    loss = model(torch.randn(8, 4)).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    if rank == 1 and step == 20:
        stamp("hang.t")
        time.sleep(600)  # hung inside the step (and inside expires() with the file timer)
    if ctx:
        ctx.__exit__(None, None, None)
    time.sleep(0.01)
time.sleep(600)
