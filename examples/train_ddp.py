"""A small, real DDP training job for elasticrun: synthetic ImageNet-like images, a small CNN,
AdamW with a learning-rate schedule, a DataLoader with worker processes, gloo on CPU, and
checkpoints that let a restarted group resume where the last one stopped: the shape of a job
users run (the benchmarks measure recovery on it).

    elasticrun --standalone --nproc-per-node 2 --max-restarts 3 examples/train_ddp.py

It is an ordinary torchrun script: it reads RANK/WORLD_SIZE from the environment and calls
``init_process_group()``; elasticrun adds hang detection (a beat on every optimizer step) and
restarts without any change here. elastic_sampler makes the resume exact: the sampler continues
the epoch where the checkpoint says (on any number of workers), every step is kept in the
node's memory (a failure loses no completed step) and checkpoints on disk are atomic, checked,
and written in the background. ``--crash-at-step`` and ``--hang-at-step`` inject a
failure on the first attempt, to watch the recovery. Progress is shown with tqdm; after a
resume the bar starts at the resumed step, so its rate is the new run's.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's convention
from elastic_sampler import (
    CheckpointManager,
    ElasticDistributedSampler,
    broadcast_latest,
    restore_latest,
)
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

HOLD_SECONDS = 120  # --hold-at-step: the longest a test may take to release a hold


class SyntheticImages(Dataset[tuple[torch.Tensor, int, int]]):
    """ImageNet-like samples (3 x size x size, `classes` labels) made from a seed: each class
    has a fixed pattern, and every sample is its pattern plus noise, so the task is learnable."""

    def __init__(self, samples: int, classes: int, size: int, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        coarse = torch.randn(classes, 3, 4, 4, generator=g)  # smooth, learnable patterns
        self.patterns = F.interpolate(coarse, size=(size, size), mode="bilinear")
        self.labels = torch.randint(0, classes, (samples,), generator=g)
        self.seed = seed

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(self.labels[index])
        noise = torch.randn(self.patterns.shape[1:], generator=g)
        return self.patterns[label] + noise, label, index


class SmallCNN(nn.Module):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
        )
        self.head = nn.Linear(64, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


def training_state(job: Job, epoch_steps: int) -> dict[str, object]:
    """Everything a restarted (or resized) job needs to continue exactly where this one is."""
    return {
        "model": job.model.module.state_dict(),
        "optimizer": job.optimizer.state_dict(),
        "scheduler": job.scheduler.state_dict(),
        "sampler": job.sampler.state_dict(steps=epoch_steps, batch_size=job.args.batch_size),
        "step": job.step,
    }


def bucket_per_parameter() -> dict[str, Any]:
    """DDP arguments that give each parameter a gradient bucket of its own, from the first step
    on (torch >= 2.13; earlier: none). DDP puts every parameter in one bucket for a process's
    first step and regroups them after it; with more than 2 ranks, a gradient's elements are
    then summed across ranks in another order, and a resumed job's weights differ from an
    uninterrupted one's in their last bits. With a bucket per parameter they do not."""
    if "bucket_cap_mb_list" in inspect.signature(DistributedDataParallel).parameters:
        return {"bucket_cap_mb_list": [0]}
    return {}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.003, help="AdamW's, decayed 0.8x every 50 steps")
    p.add_argument(
        "--loader-workers",
        type=int,
        default=2,
        help="DataLoader worker processes per training worker (0: load in the worker itself)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    p.add_argument(
        "--checkpoint-every",
        type=int,
        default=20,
        help="steps between checkpoints on disk (every step is kept in memory)",
    )
    p.add_argument(
        "--backend",
        choices=("gloo", "nccl"),
        default="gloo",
        help="nccl: the model on the GPU of the worker's local rank (CPU tensors go over gloo)",
    )
    add_test_flags(p)
    return p.parse_args()


def add_test_flags(p: argparse.ArgumentParser) -> None:
    """Faults to inject, and records the tests and benchmarks read."""
    p.add_argument(
        "--crash-at-step",
        type=int,
        default=None,
        help="on the first attempt, the last rank kills itself at this global step",
    )
    p.add_argument(
        "--hang-at-step",
        type=int,
        default=None,
        help="on the first attempt, the last rank stops making progress here",
    )
    p.add_argument(
        "--hold-at-step",
        type=lambda v: {int(s) for s in v.split(",")},
        default=set(),
        help="every rank waits after these global steps (comma-separated) until --hold-dir has "
        f"a file step-N, {HOLD_SECONDS} s at most: a test orders a fault after an event",
    )
    p.add_argument("--hold-dir", type=Path, default=None, help="where --hold-at-step looks")
    p.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="seconds each step takes at least (a slower model: to watch a run, or to stop, "
        "kill or cut off its parts by hand while it trains)",
    )
    p.add_argument(
        "--replicas",
        action="store_true",
        help="every rank saves its own copy, kept on a peer node too, as a sharded state "
        "(ZeRO, FSDP) would be: CheckpointManager(replicas=1) and restore_latest",
    )
    p.add_argument(
        "--record-samples",
        type=Path,
        default=None,
        help="directory: 'EPOCH STEP IDS' per step trained; a saver's 'kept STEP' once sealed",
    )
    p.add_argument(
        "--final-weights",
        type=Path,
        default=None,
        help="where rank 0 saves the final model weights",
    )


@dataclass
class Job:
    """One worker's part of the training: what it trains, and where it reports."""

    args: argparse.Namespace
    rank: int
    local_rank: int
    world: int
    attempt: int
    sampler: ElasticDistributedSampler
    loader: DataLoader[tuple[torch.Tensor, int, int]]
    model: DistributedDataParallel
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    checkpoints: CheckpointManager
    record: IO[str] | None = None
    step: int = 0
    in_flight: int | None = None  # the step whose copy save() started last

    def save(self, epoch_steps: int) -> None:
        """The first worker of each node keeps the step in the node's memory (so that a node's
        loss loses no step while another node lives); rank 0 also writes it to disk in the
        background when due, and at every epoch's end (0 epoch steps: the next epoch's
        start). Every rank holds the same state under DDP: one copy per node is enough. With
        --replicas every rank saves, as each would its own shard."""
        if self.local_rank != 0 and not self.args.replicas:
            return
        state = training_state(self, epoch_steps)
        writes = self.rank == 0 or self.args.replicas
        persist = (epoch_steps == 0 or None) if writes else False
        self.checkpoints.save(state, self.step, background=True, persist=persist)
        # save() waited for the previous step's copy (and, with --replicas, its exchange).
        self.kept(self.in_flight)
        self.in_flight = self.step

    def trained(self, epoch: int, ids: torch.Tensor) -> None:
        """Records step `self.step` as trained, with its samples."""
        self.write(f"{epoch} {self.step} {','.join(map(str, ids.tolist()))}\n")

    def kept(self, step: int | None) -> None:
        """Records that `step`'s copy is sealed: a failure can no longer take it back (a
        completed step, docs/checkpoints.md). Said by the ranks that save, one step late."""
        if step is not None:
            self.write(f"kept {step}\n")

    def write(self, line: str) -> None:
        if self.record is not None:
            self.record.write(line)
            self.record.flush()


def resume(job: Job) -> None:
    """Every rank resumes from the newest intact checkpoint (sent by the rank that has it,
    should the directory be local to each node)."""
    if job.args.replicas:  # each rank's own state, from wherever it survived
        latest = restore_latest(job.checkpoints)
    else:
        latest = broadcast_latest(job.checkpoints, keep=job.local_rank == 0)  # the node's saver
    if latest is None:
        return
    state, _ = latest
    job.model.module.load_state_dict(state["model"])
    job.optimizer.load_state_dict(state["optimizer"])
    job.scheduler.load_state_dict(state["scheduler"])
    job.sampler.load_state_dict(state["sampler"])
    job.step = int(state["step"])
    if job.rank == 0:
        s = state["sampler"]
        print(
            f"attempt {job.attempt}: resumed from epoch {s['epoch']}, step {job.step} "
            f"({s['consumed']} samples of the epoch done)",
            flush=True,
        )


def hold(job: Job) -> None:
    """After each --hold-at-step step every rank waits until --hold-dir has its file
    step-N, so that a test puts a fault after an event it waits for (a store member
    restarted), not after a time. The wait is marked quiet: it is no hang."""
    if job.step not in job.args.hold_at_step or job.args.hold_dir is None:
        return
    import elastic_core  # only asked for in tests: the script runs on torch alone

    gate = job.args.hold_dir / f"step-{job.step}"
    deadline = time.monotonic() + HOLD_SECONDS
    with elastic_core.quiet():
        while not gate.exists() and time.monotonic() < deadline:
            time.sleep(0.02)


def inject_failure(job: Job) -> None:
    """On the first attempt, the last rank crashes or hangs at the step asked for."""
    if job.attempt != 0 or job.rank != job.world - 1:
        return
    if job.step == job.args.crash_at_step:
        print(f"rank {job.rank}: simulating a crash at step {job.step}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    if job.step == job.args.hang_at_step:
        print(f"rank {job.rank}: simulating a hang at step {job.step}", flush=True)
        time.sleep(3600)


def train_epoch(job: Job, epoch: int, progress: tqdm[Any]) -> torch.Tensor:
    """One epoch (from where the sampler stands); returns the last loss."""
    loss = torch.tensor(0.0)
    job.sampler.set_epoch(epoch)  # keeps a resumed position within the same epoch
    for epoch_steps, (images, labels, ids) in enumerate(job.loader, start=1):
        hold(job)
        inject_failure(job)
        started = time.monotonic()
        device = next(job.model.parameters()).device
        x, y = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
        loss = F.cross_entropy(job.model(x), y)
        job.optimizer.zero_grad()
        loss.backward()
        job.optimizer.step()  # elasticrun beats here
        job.scheduler.step()
        job.step += 1
        time.sleep(max(0.0, job.args.step_time - (time.monotonic() - started)))
        # Every step goes to the memory tier (on disk every --checkpoint-every steps), before
        # it is reported done; the epoch's last step is saved by the caller, as the start of
        # the next epoch.
        if epoch_steps < len(job.loader):
            job.save(epoch_steps)
        job.trained(epoch, ids)
        progress.update(1)
        progress.set_postfix_str(f"epoch {epoch} loss {loss.item():.3f}", refresh=False)
    return loss


def progress_bar(job: Job) -> tqdm[Any]:
    """The bar starts at the resumed step, so its rate is this run's, not steps since step 0."""
    args = job.args
    first_epoch = job.sampler.epoch
    per_epoch = math.ceil(math.ceil(args.samples / job.world) / args.batch_size)
    left_now = math.ceil(len(job.sampler) / args.batch_size) if first_epoch < args.epochs else 0
    total = job.step + left_now + per_epoch * max(0, args.epochs - first_epoch - 1)
    return tqdm(
        total=total,
        initial=job.step,
        unit="step",
        disable=job.rank != 0,
        dynamic_ncols=True,
        mininterval=0.2 if sys.stdout.isatty() else 5.0,
        file=sys.stdout,
    )


def setup(args: argparse.Namespace) -> Job:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu")
    if args.backend == "nccl":  # checkpoints' and samplers' CPU tensors still go over gloo
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("cpu:gloo,cuda:nccl")
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    data = SyntheticImages(args.samples, args.classes, args.image_size, args.seed)
    # Resumes mid-epoch on any number of workers, with every sample exactly once per epoch.
    sampler = ElasticDistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed)
    on_gpu = {"device_ids": [local_rank]} if device.type == "cuda" else {}
    net = SmallCNN(args.classes).to(device)
    model = DistributedDataParallel(net, **on_gpu, **bucket_per_parameter())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    workers = args.loader_workers
    job = Job(
        args,
        rank,
        local_rank,
        world,
        attempt=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        sampler=sampler,
        # The sampler runs here, the loader's workers only load: the order is the sampler's.
        loader=DataLoader(
            data,
            batch_size=args.batch_size,
            sampler=sampler,
            num_workers=workers,
            persistent_workers=workers > 0,
            pin_memory=device.type == "cuda",
        ),
        model=model,
        optimizer=optimizer,
        scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=50, gamma=0.8),
        # Every step to the node's memory (a restarted worker resumes at the step where the
        # failure struck), every --checkpoint-every steps to disk.
        checkpoints=CheckpointManager(
            args.checkpoint_dir,
            keep_last=3,
            memory=True,
            persist_every=args.checkpoint_every,
            replicas=1 if args.replicas else 0,
        ),
    )
    if args.record_samples is not None:
        args.record_samples.mkdir(parents=True, exist_ok=True)
        path = args.record_samples / f"attempt{job.attempt}-rank{rank}.txt"
        job.record = open(path, "a")  # noqa: SIM115 - the process's lifetime
    return job


def main() -> None:
    args = parse_args()
    job = setup(args)
    resume(job)
    progress = progress_bar(job)
    loss = torch.tensor(0.0)
    for epoch in range(job.sampler.epoch, args.epochs):
        loss = train_epoch(job, epoch, progress)
        job.sampler.set_epoch(epoch + 1)  # the epoch is done: a checkpoint now starts the next
        job.save(0)
    progress.close()
    job.checkpoints.close()  # waits for the last copy
    job.kept(job.in_flight)
    dist.barrier()
    if job.rank == 0:
        if args.final_weights is not None:
            torch.save(job.model.module.state_dict(), args.final_weights)
        print(
            f"done: {job.step} steps, {args.epochs} epochs, final loss {loss.item():.3f}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
