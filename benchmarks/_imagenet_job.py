"""A job shaped like torchelastic 0.1's imagenet example (examples/imagenet/main.py at
v0.1.0rc1), with its imports mapped: a ResNet built in the script (BasicBlocks, 0.1's
"training in one hour" initialisation), a dataset of images, ``CoordinatorP2P`` called as the
example calls it, a State whose ``sync`` broadcasts the state of the rank that is furthest and
rebuilds DDP, the optimizer and a DataLoader with worker processes over
``ElasticDistributedSampler``. torchvision cannot be installed beside torch 2.13.0 here: the
ResNet is written out, and the images are made from their index (as torchvision's FakeData).

``--mode loop`` runs it on the classic train loop (elasticrun); ``--mode ddp`` is the same
model, data and optimizer as a plain DDP script that saves a checkpoint every step and resumes
from it, for torchrun's group restart. The process of rank 1 SIGKILLs itself at step
``--kill-at`` (first generation only), after writing the time and the step to OUT/killed.
Every step appends
"monotonic_ns step world rank pid" to OUT/<pid>.steps; rank 0 writes its parameters' SHA-256 to
OUT/weights at the end. OUT/<pid>.marks has "monotonic_ns what": its first line, train().

    elasticrun --standalone --nproc-per-node 2 benchmarks/_imagenet_job.py OUT --mode loop
"""

# ruff: noqa: E402 - the first line's time is taken before the imports, which it measures

from __future__ import annotations

import time

FIRST_LINE_NS = time.monotonic_ns()

import argparse
import copy
import hashlib
import io
import os
import signal
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from elastic_launch import train_loop as torchelastic
from elastic_launch.train_loop import distributed as edist
from elastic_launch.train_loop.coordinator import CoordinatorP2P
from elastic_sampler import ElasticDistributedSampler
from torch import nn
from torch.nn.parameter import Parameter

ARGS = argparse.Namespace()


# ---- the model: a ResNet of BasicBlocks (torchvision's layout, narrower for a CPU) -----------


class BasicBlock(nn.Module):
    def __init__(self, inplanes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """ResNet-18's layout (2 BasicBlocks per stage) at `width` channels in the first stage."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 3, 1, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True)
        )
        layers, inplanes = [], width
        for stage in range(4):
            planes = width * 2**stage
            for block in range(2):
                layers.append(BasicBlock(inplanes, planes, 2 if stage and not block else 1))
                inplanes = planes
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(x, 1), 1))


def build_model(width: int, classes: int) -> nn.Module:
    """The model, with 0.1's tricks: each block's last BatchNorm starts at zero gamma, the
    linear layer from N(0, 0.01)."""
    torch.manual_seed(0)
    model = ResNet(width, classes)
    for m in model.modules():
        if isinstance(m, BasicBlock):
            m.bn2.weight = Parameter(torch.zeros(m.bn2.num_features))
        if isinstance(m, nn.Linear):
            m.weight.data.normal_(0, 0.01)
    model.train()
    return model


class Images(torch.utils.data.Dataset):
    """Images and labels made from their index (torchvision's FakeData, without torchvision).
    With `folder`, the dataset is indexed first as torchvision's ImageFolder does (a directory
    per class, its files sorted): the example's cost at its top, which grows with the data."""

    def __init__(self, size: int, image: int, classes: int, folder: Path | None = None) -> None:
        self.size, self.image, self.classes = size, image, classes
        if folder is not None:
            self.samples = image_folder(folder)
            self.size = min(size, len(self.samples))

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        g = torch.Generator().manual_seed(index)
        x = torch.randn(3, self.image, self.image, generator=g)
        if torch.rand(1, generator=g).item() < 0.5:  # RandomHorizontalFlip
            x = x.flip(2)
        return x, int(torch.randint(self.classes, (1,), generator=g))


def image_folder(root: Path) -> list[tuple[str, int]]:
    """(path, class index) of every file under `root`'s class directories, as ImageFolder
    lists them (classes sorted, then files sorted within each)."""
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    samples = []
    for index, name in enumerate(classes):
        for path in sorted(e.path for e in os.scandir(root / name) if e.is_file()):
            if path.lower().endswith((".jpg", ".jpeg", ".png")):
                samples.append((path, index))
    return samples


# ---- the classic loop: the example's State ---------------------------------------------------


class ImagenetState(torchelastic.State):
    """0.1's ImagenetState: the model and the data position; DDP, the optimizer and the
    loader are made again on every sync (they belong to a group)."""

    def __init__(self, model: nn.Module, dataset: Images, epochs: int) -> None:
        self.model, self.dataset, self.num_epochs = model, dataset, epochs
        self.epoch = self.iteration = self.data_start_index = 0
        self.optimizer: torch.optim.Optimizer = make_optimizer(model)
        self.dist_model: Any = None
        self.data_iter: Any = None
        self.data_loader: Any = None

    def job_state(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "position": (self.epoch, self.iteration, self.data_start_index),
        }

    def set_job_state(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.epoch, self.iteration, self.data_start_index = state["position"]

    def capture_snapshot(self) -> dict[str, Any]:
        return copy.deepcopy(self.job_state())

    def apply_snapshot(self, snapshot: dict[str, Any]) -> None:
        self.set_job_state(copy.deepcopy(snapshot))

    def sync(self, world_size: int, rank: int) -> None:
        mark("sync")
        max_rank, _ = edist.all_gather_return_max_long(self.data_start_index)
        buffer = io.BytesIO()
        torch.save(self.job_state(), buffer)
        data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.long)
        dist.broadcast(size, src=max_rank)
        if rank != max_rank:
            data = torch.zeros(int(size), dtype=torch.uint8)
        dist.broadcast(data, src=max_rank)
        if rank != max_rank:
            self.set_job_state(torch.load(io.BytesIO(data.numpy().tobytes())))
        self.dist_model = torch.nn.parallel.DistributedDataParallel(
            self.model, broadcast_buffers=False
        )
        self.data_loader = loader(self.dataset, self.data_start_index, self.epoch)
        self.data_iter = iter(self.data_loader)
        mark("synced")


def make_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), ARGS.lr, momentum=0.9, weight_decay=1e-4)


def loader(dataset: Images, start_index: int, epoch: int) -> torch.utils.data.DataLoader:
    sampler = ElasticDistributedSampler(
        dataset,
        num_replicas=dist.get_world_size(),
        rank=dist.get_rank(),
        start_index=start_index,
        seed=0,
    )
    sampler.set_epoch(epoch)
    return torch.utils.data.DataLoader(
        dataset, batch_size=ARGS.batch, sampler=sampler, num_workers=ARGS.loader_workers
    )


def train_step(state: ImagenetState) -> tuple[ImagenetState, torchelastic.SimpleWorkerStats]:
    start = time.time()
    world = dist.get_world_size()
    batch = next(state.data_iter, None)
    if batch is None:
        if state.epoch + 1 >= state.num_epochs:
            raise StopIteration
        state.epoch, state.data_start_index = state.epoch + 1, 0
        state.data_loader = loader(state.dataset, 0, state.epoch)
        state.data_iter = iter(state.data_loader)
        batch = next(state.data_iter)
    step(state.dist_model, state.optimizer, batch, state.iteration + 1, world)
    state.data_start_index += world * ARGS.batch
    state.iteration += 1
    return state, torchelastic.SimpleWorkerStats(1 / max(time.time() - start, 1e-9))


# ---- shared by both modes -----------------------------------------------------------------------


def step(model: Any, optimizer: Any, batch: Any, number: int, world: int) -> None:
    """One step; rank 1's first process dies before step --kill-at (with --armed, before the
    first step from there once OUT/arm exists: the driver creates it when a hot spare waits)."""
    if number >= ARGS.kill_at >= 0 and os.environ.get("RANK") == "1" and armed():
        (ARGS.out / "killed").write_text(f"{time.monotonic_ns()} {number}")
        os.kill(os.getpid(), signal.SIGKILL)
    started = time.monotonic()
    images, labels = batch
    loss = nn.functional.cross_entropy(model(images), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    time.sleep(max(0.0, ARGS.step_time - (time.monotonic() - started)))
    line = f"{time.monotonic_ns()} {number} {world} {dist.get_rank()} {os.getpid()}\n"
    with open(ARGS.out / f"{os.getpid()}.steps", "a") as f:
        f.write(line)


def armed() -> bool:
    """The first process of its rank, and (with --armed) OUT/arm made."""
    return first_generation() and (not ARGS.armed or (ARGS.out / "arm").exists())


def first_generation() -> bool:
    """The first process of its rank (elasticrun's replacements count; torchrun's restarts)."""
    env = os.environ
    return env.get("ELASTICRUN_REPLACEMENT", env.get("TORCHELASTIC_RESTART_COUNT", "0")) == "0"


def mark(what: str, ns: int | None = None) -> None:
    with open(ARGS.out / f"{os.getpid()}.marks", "a") as f:
        f.write(f"{time.monotonic_ns() if ns is None else ns} {what}\n")


def weights_digest(model: nn.Module) -> str:
    """The parameters' SHA-256 (not the BatchNorm statistics: with ``broadcast_buffers=False``,
    as 0.1's example, each rank keeps its own, and a re-formed group may renumber the ranks)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        h.update(name.encode())
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


# ---- the plain DDP form, for torchrun ---------------------------------------------------


def ddp(model: nn.Module, dataset: Images) -> None:
    """The same job as a DDP script: a checkpoint every step (rank 0), resumed on a restart."""
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = make_optimizer(model)
    checkpoint = ARGS.out / "checkpoint.pt"
    epoch, number, start = 0, 0, 0
    if checkpoint.exists():
        saved = torch.load(checkpoint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        epoch, number, start = saved["position"]
    wrapped = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
    while epoch < ARGS.epochs:
        for batch in loader(dataset, start, epoch):
            number += 1
            step(wrapped, optimizer, batch, number, world)
            start += world * ARGS.batch
            if rank == 0:
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "position": (epoch, number, start),
                }
                torch.save(state, checkpoint.with_suffix(".tmp"))
                os.replace(checkpoint.with_suffix(".tmp"), checkpoint)
        epoch, start = epoch + 1, 0
    if rank == 0:
        (ARGS.out / "weights").write_text(weights_digest(model))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--mode", choices=("loop", "ddp"), default="loop")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--samples", type=int, default=1600)
    p.add_argument("--image", type=int, default=32)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--classes", type=int, default=100)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--loader-workers", type=int, default=2)
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--kill-at", type=int, default=-1)
    p.add_argument("--armed", action="store_true", help="kill only once OUT/arm exists")
    p.add_argument("--image-folder", type=Path, help="index this tree first, as ImageFolder")
    p.parse_args(namespace=ARGS)
    mark("first_line", FIRST_LINE_NS)
    dataset = Images(ARGS.samples, ARGS.image, ARGS.classes, ARGS.image_folder)
    model = build_model(ARGS.width, ARGS.classes)
    if ARGS.mode == "ddp":
        ddp(model, dataset)
        return
    coordinator = CoordinatorP2P(
        c10d_backend="gloo",
        init_method="etcd://localhost:2379/imagenet?min_workers=2&max_workers=2",
        max_num_trainers=2,
        process_group_timeout=60000,
    )
    state = ImagenetState(model, dataset, ARGS.epochs)
    mark("train")
    final = torchelastic.train(coordinator, train_step, state)
    if coordinator.rank == 0:  # a spare the job never needed has none
        (ARGS.out / "weights").write_text(weights_digest(final.model))


if __name__ == "__main__":
    main()
