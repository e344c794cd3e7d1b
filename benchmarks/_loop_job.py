"""The real job of bench_real_job.py written for the classic train loop: examples/train_ddp.py's
model and data (a CNN in DistributedDataParallel on gloo, AdamW, a StepLR schedule, a
DataLoader with worker processes over ElasticDistributedSampler), as a ``State`` and a
``train_step``. A worker's death costs one replacement: the survivors keep their processes, and
on every new membership ``sync`` sends the state of the rank that has taken the most steps to
all and rebuilds the DDP model and the loader for the new world.

Every completed step appends "monotonic_ns step world rank pid" to OUT/<pid>.steps, and the
moments of a worker's start to OUT/<pid>.marks, "monotonic_ns what": its first line, train()
called, each sync() begun and done (benchmarks/loop_timeline.py reads them).

    elasticrun --standalone --nproc-per-node 2 benchmarks/_loop_job.py --out DIR
"""

# ruff: noqa: E402 - the first line's time is taken before the imports, which it measures

from __future__ import annotations

import time

FIRST_LINE_NS = time.monotonic_ns()  # before the imports: when the script began to run

import argparse
import io
import os
import sys
from pathlib import Path
from typing import Any

import numpy
import torch
import torch.nn.functional as F  # noqa: N812 - torch's convention
from elastic_launch import train_loop
from elastic_launch.train_loop import distributed as edist
from elastic_sampler import ElasticDistributedSampler, load_checkpoint
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from train_ddp import SmallCNN, SyntheticImages, bucket_per_parameter


class JobState(train_loop.State):
    """Model, optimizer, schedule and data position; the DDP wrapper and the loader are rebuilt
    on every new group (they belong to a group, the rest to the job)."""

    def __init__(self, args: argparse.Namespace) -> None:
        torch.manual_seed(args.seed)
        self.args = args
        self.device = torch.device("cpu")
        if args.backend == "nccl":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        self.net = SmallCNN(args.classes).to(self.device)
        self.optimizer = torch.optim.AdamW(self.net.parameters(), lr=args.lr, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.StepLR(self.optimizer, step_size=50, gamma=0.8)
        self.data = SyntheticImages(args.samples, args.classes, args.image_size, args.seed)
        self.step = 0
        self.since = 0  # steps since the sampler began iterating (what its state counts)
        self.sampler: ElasticDistributedSampler | None = None
        self.loader: DataLoader[Any] | None = None
        self.batches: Any = None
        self.model: DistributedDataParallel | None = None
        self.world, self.rank = 1, 0
        self.log = open(args.out / f"{os.getpid()}.steps", "a", buffering=1)  # noqa: SIM115
        self.marks = open(args.out / f"{os.getpid()}.marks", "a", buffering=1)  # noqa: SIM115
        self.mark("first_line", FIRST_LINE_NS)

    def mark(self, what: str, ns: int | None = None) -> None:
        self.marks.write(f"{time.monotonic_ns() if ns is None else ns} {what}\n")

    def job_state(self) -> dict[str, Any]:
        sampler = None
        if self.sampler is not None:
            sampler = self.sampler.state_dict(steps=self.since, batch_size=self.args.batch_size)
        return {
            "model": self.net.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "sampler": sampler,
            "step": self.step,
        }

    def sync(self, world_size: int, rank: int) -> None:
        """The rank with the most steps sends its state (a new worker has taken none)."""
        self.mark("sync")
        self.world, self.rank = world_size, rank
        source, _ = edist.all_gather_return_max_long(self.step)  # the lowest rank on ties
        data = None
        if rank == source:
            buffer = io.BytesIO()
            torch.save(self.job_state(), buffer)
            data = numpy.frombuffer(buffer.getbuffer(), dtype=numpy.uint8)
        received = edist.broadcast_binary(data, source)
        if rank == source:
            state = self.job_state()
        else:
            state = load_checkpoint(io.BytesIO(received.tobytes()), map_location=self.device)
        self.rebuild(state)
        self.mark("synced")

    def rebuild(self, state: dict[str, Any]) -> None:
        """The job's state applied; the DDP model and the loader made for this group."""
        self.net.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step = int(state["step"])
        self.batches = self.loader = self.model = None  # the old group's, dropped first
        on_gpu = {"device_ids": [self.device.index]} if self.device.type == "cuda" else {}
        self.model = DistributedDataParallel(self.net, **on_gpu, **bucket_per_parameter())
        self.sampler = ElasticDistributedSampler(
            self.data, num_replicas=self.world, rank=self.rank, seed=self.args.seed
        )
        if state["sampler"] is not None:
            self.sampler.load_state_dict(state["sampler"])
        workers = self.args.loader_workers
        self.loader = DataLoader(
            self.data,
            batch_size=self.args.batch_size,
            sampler=self.sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=self.device.type == "cuda",
        )
        self.batches, self.since = iter(self.loader), 0

    def next_batch(self) -> Any:
        """The next batch; at an epoch's end the next epoch's first (None: training is done)."""
        assert self.sampler is not None
        assert self.loader is not None
        for _ in range(2):
            try:
                return next(self.batches)
            except StopIteration:
                if self.sampler.epoch + 1 >= self.args.epochs:
                    return None
                self.sampler.set_epoch(self.sampler.epoch + 1)
                self.batches, self.since = iter(self.loader), 0
        return None


def train_step(state: JobState) -> JobState:
    started = time.monotonic()
    batch = state.next_batch()
    if batch is None:
        raise StopIteration
    assert state.model is not None
    images, labels, _ = batch
    x, y = images.to(state.device, non_blocking=True), labels.to(state.device, non_blocking=True)
    loss = F.cross_entropy(state.model(x), y)
    state.optimizer.zero_grad()
    loss.backward()
    state.optimizer.step()
    state.scheduler.step()
    state.step += 1
    state.since += 1
    time.sleep(max(0.0, state.args.step_time - (time.monotonic() - started)))
    state.log.write(
        f"{time.monotonic_ns()} {state.step} {state.world} {state.rank} {os.getpid()}\n"
    )
    return state


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=3200)
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--step-time", type=float, default=0.04)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    state = JobState(args)
    state.mark("train")
    train_loop.train(train_loop.from_environment(args.backend), train_step, state)


if __name__ == "__main__":
    main()
