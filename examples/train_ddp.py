"""A small, real DDP training job for elasticrun: synthetic ImageNet-like images, a small CNN,
gloo on CPU, checkpoints that let a restarted group resume where the last one stopped.

    elasticrun --standalone --nproc-per-node 2 --max-restarts 3 examples/train_ddp.py

It is an ordinary torchrun script: it reads RANK/WORLD_SIZE from the environment and calls
``init_process_group()``; elasticrun adds hang detection (a beat on every optimizer step) and
restarts without any change here. ``--crash-at-step`` and ``--hang-at-step`` inject a failure on
the first attempt, to watch the recovery.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F  # noqa: N812 - torch's convention
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class SyntheticImages(Dataset[tuple[torch.Tensor, int]]):
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

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        label = int(self.labels[index])
        noise = torch.randn(self.patterns.shape[1:], generator=g)
        return self.patterns[label] + noise, label


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


def save_checkpoint(path: Path, state: dict[str, object]) -> None:
    """Atomic: a crash mid-save leaves the previous checkpoint intact."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def training_state(
    model: DistributedDataParallel, optimizer: torch.optim.Optimizer, epoch: int, step: int
) -> dict[str, object]:
    return {
        "model": model.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "epoch": epoch,
        "step": step,
    }


class Progress:
    """A one-line progress bar for rank 0 (no dependency)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.start = total, enabled and total > 0, time.monotonic()

    def update(self, done: int, text: str) -> None:
        if not self.enabled:
            return
        width = 30
        filled = width * done // self.total
        rate = done / max(time.monotonic() - self.start, 1e-9)
        bar = "#" * filled + "-" * (width - filled)
        end = "\n" if done == self.total or not sys.stdout.isatty() else "\r"
        if sys.stdout.isatty() or done % 20 == 0 or done == self.total:
            print(f"[{bar}] {done}/{self.total} steps {rate:5.1f}/s {text}", end=end, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=8192)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=32, help="per worker")
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint-dir", type=Path, default=Path("checkpoints"))
    p.add_argument("--checkpoint-every", type=int, default=20, help="steps")
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
    args = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    torch.manual_seed(args.seed)

    data = SyntheticImages(args.samples, args.classes, args.image_size, args.seed)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, seed=args.seed)
    loader = DataLoader(data, batch_size=args.batch_size, sampler=sampler)
    model = DistributedDataParallel(SmallCNN(args.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    args.checkpoint_dir.mkdir(parents=True, exist_ok=True)
    ckpt = args.checkpoint_dir / "latest.pt"
    epoch, step = 0, 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu")
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        epoch, step = int(state["epoch"]), int(state["step"])
        if rank == 0:
            print(f"attempt {attempt}: resumed from epoch {epoch}, step {step}", flush=True)

    steps_per_epoch = len(loader)
    progress = Progress(args.epochs * steps_per_epoch, rank == 0)
    loss = torch.tensor(0.0)
    while epoch < args.epochs:
        sampler.set_epoch(epoch)
        skip = step - epoch * steps_per_epoch  # batches this epoch already trained
        for i, (images, labels) in enumerate(loader):
            if i < skip:
                continue
            if attempt == 0 and rank == world - 1:
                if step == args.crash_at_step:
                    print(f"rank {rank}: simulating a crash at step {step}", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                if step == args.hang_at_step:
                    print(f"rank {rank}: simulating a hang at step {step}", flush=True)
                    time.sleep(3600)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()  # elasticrun beats here
            step += 1
            progress.update(step, f"epoch {epoch} loss {loss.item():.3f}")
            if step % args.checkpoint_every == 0 and rank == 0:
                save_checkpoint(
                    ckpt,
                    {
                        "model": model.module.state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "epoch": epoch,
                        "step": step,
                    },
                )
        epoch += 1
        if rank == 0:
            save_checkpoint(
                ckpt,
                {
                    "model": model.module.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                    "step": step,
                },
            )
    dist.barrier()
    if rank == 0:
        print(f"done: {step} steps, {args.epochs} epochs, final loss {loss.item():.3f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
