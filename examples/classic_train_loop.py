"""A classic torchelastic 0.1 training script (``State``, ``train_step``, ``train``) on
elasticrun. Its only change from torchelastic is the import lines.

    elasticrun --standalone --nproc-per-node 3 examples/classic_train_loop.py

or, without a launcher, on every node (etcd running at HOST:2379)::

    python examples/classic_train_loop.py --init-method 'etcd://HOST:2379/myjob?min_workers=3'

A linear model learns from a synthetic dataset made from a seed. Each step takes the next
``world_size x --batch`` samples of the epoch (rank r its r-th slice) and averages the gradient
over the ranks, so the result does not depend on who computed what. The state keeps the model,
the position in the data and the history of which samples each step took, so the end can
prove that every sample was used exactly once per epoch across failures and resizes.

Under elasticrun a worker that dies is replaced alone: the others roll back the step that
failed, re-form the group and go on, and the replacement receives the state from the most
advanced rank through ``sync``. ``--kill-at-step``/``--raise-at-step`` inject a failure (first
generation of the chosen rank only) to watch it; ``--out`` writes the final state.
"""

from __future__ import annotations

import argparse
import copy
import io
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

# torchelastic 0.1:
#   import torchelastic
#   from torchelastic.p2p.coordinator_p2p import CoordinatorP2P
from elastic_launch import train_loop as torchelastic
from elastic_launch.train_loop import CoordinatorP2P

FEATURES = 8
HOLD_SECONDS = 45  # under the launcher's 60 s hang floor: a hold is never a hang


def sample(index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample `index` of the dataset: the same on every rank, made from the index."""
    g = torch.Generator().manual_seed(1_000_003 + index)
    x = torch.randn(FEATURES, generator=g)
    y = x.sum(dim=0, keepdim=True) * 0.5 + 1.0
    return x, y


class LinearState(torchelastic.State):
    """The bootstrap state S0 is built alike on every worker; ``sync`` makes them one."""

    def __init__(
        self, samples: int, epochs: int, batch: int, lr: float, checkpoint_every: int = 0
    ) -> None:
        torch.manual_seed(0)
        self.checkpoint_every = checkpoint_every
        self.model = torch.nn.Linear(FEATURES, 1)
        self.samples, self.epochs, self.batch, self.lr = samples, epochs, batch, lr
        self.epoch = 0
        self.position = 0  # the next sample of the epoch
        self.steps = 0
        self.history: list[tuple[int, int, int]] = []  # (epoch, first sample, count) per step
        self.world_size, self.rank = 1, -1  # until the first sync

    def capture_snapshot(self) -> dict[str, object]:
        return {
            "model": copy.deepcopy(self.model.state_dict()),
            "epoch": self.epoch,
            "position": self.position,
            "steps": self.steps,
            "history": list(self.history),
        }

    def apply_snapshot(self, snapshot: dict[str, object]) -> None:
        self.model.load_state_dict(snapshot["model"])  # type: ignore[arg-type]
        self.epoch = snapshot["epoch"]  # type: ignore[assignment]
        self.position = snapshot["position"]  # type: ignore[assignment]
        self.steps = snapshot["steps"]  # type: ignore[assignment]
        self.history = list(snapshot["history"])  # type: ignore[call-overload]

    def should_save_checkpoint(self, rank: int) -> bool:
        return bool(self.checkpoint_every) and self.steps % self.checkpoint_every == 0

    def sync(self, world_size: int, rank: int) -> None:
        """The rank that has taken the most steps sends its state to all (a new worker has
        taken none)."""
        self.world_size, self.rank = world_size, rank
        steps = torch.tensor([self.steps, rank])
        everyone = [torch.zeros(2, dtype=torch.long) for _ in range(world_size)]
        dist.all_gather(everyone, steps)
        source = int(max(everyone, key=lambda t: (int(t[0]), -int(t[1])))[1])
        buffer = io.BytesIO()
        if rank == source:
            self.save(buffer)
        size = torch.tensor([buffer.getbuffer().nbytes])
        dist.broadcast(size, source)
        data = torch.zeros(int(size), dtype=torch.uint8)
        if rank == source:
            data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        dist.broadcast(data, source)
        if rank != source:
            self.load(io.BytesIO(data.numpy().tobytes()))


def train_step(state: LinearState) -> tuple[LinearState, torchelastic.SimpleWorkerStats]:
    if state.epoch >= state.epochs:
        raise StopIteration
    started = time.monotonic()
    args = ARGS
    if state.steps == args.hold_world_at_step and state.world_size < args.hold_until_world:
        dist.barrier()  # a step with a collective, as every step: the ranks stay in step
        time.sleep(0.05)
        return state, torchelastic.SimpleWorkerStats(None)
    hold(args, state)
    fault(args, state)
    count = min(state.world_size * state.batch, state.samples - state.position)
    mine = range(state.position, state.position + count)[state.rank :: state.world_size]
    state.model.zero_grad()
    if len(mine):
        xs, ys = zip(*(sample(i) for i in mine), strict=True)
        loss = torch.nn.functional.mse_loss(
            state.model(torch.stack(xs)), torch.stack(ys), reduction="sum"
        )
        loss.backward()
    else:  # more ranks than samples left in the epoch: take part with nothing
        for p in state.model.parameters():
            p.grad = torch.zeros_like(p)
    with torch.no_grad():
        for p in state.model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)
            p.sub_(state.lr * p.grad / count)
    state.history.append((state.epoch, state.position, count))
    state.position += count
    state.steps += 1
    if state.position >= state.samples:
        state.epoch, state.position = state.epoch + 1, 0
    if args.step_seconds:
        time.sleep(args.step_seconds)
    say(f"step {state.steps} rank {state.rank} world {state.world_size} pid {os.getpid()}")
    return state, torchelastic.SimpleWorkerStats(1.0 / max(time.monotonic() - started, 1e-9))


def say(line: str) -> None:
    """One line in one write: the workers share the terminal, and lines must not mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def hold(args: argparse.Namespace, state: LinearState) -> None:
    """Every rank waits before each step of --hold-at-step until the file step-N exists in
    --hold-dir, so that a test puts a fault after an event it waits for (a hot spare ready),
    not after a time. A wait ends at HOLD_SECONDS whatever happens."""
    if state.steps not in args.hold_at_step or not args.hold_dir:
        return
    gate = os.path.join(args.hold_dir, f"step-{state.steps}")
    deadline = time.monotonic() + HOLD_SECONDS
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.02)


def fault(args: argparse.Namespace, state: LinearState) -> None:
    """The failures to watch, on the first generation of the --fault-rank ranks only (the rank
    elasticrun gave the process, which a re-formed group may renumber)."""
    if os.environ.get("ELASTICRUN_REPLACEMENT", "0") != "0":
        return
    if int(os.environ.get("RANK", state.rank)) not in args.fault_rank:
        return
    if state.steps == args.kill_at_step:
        os.kill(os.getpid(), signal.SIGKILL)
    if state.steps == args.stop_at_step:
        os.kill(os.getpid(), signal.SIGSTOP)  # hung: only the watchdog can tell
    if state.steps == args.fatal_at_step:
        raise torchelastic.NonRetryableException(f"injected fatal error at step {state.steps}")
    if args.raise_every:
        raise RuntimeError(f"injected failure at step {state.steps}, every time")
    if state.steps == args.raise_at_step and not getattr(fault, "raised", False):
        fault.raised = True  # type: ignore[attr-defined]
        with torch.no_grad():  # a half-done step: the snapshot must undo it
            for p in state.model.parameters():
                p.add_(1.0)
        state.position += 1
        raise RuntimeError("injected failure in train_step")


def fault_options(parser: argparse.ArgumentParser) -> None:
    """The failures to inject, and the holds that order them after a test's events."""
    parser.add_argument(
        "--fault-rank",
        type=lambda v: {int(r) for r in v.split(",")},
        default={1},
        help="the rank (or comma-separated ranks) the injected faults hit",
    )
    parser.add_argument("--kill-at-step", type=int, default=-1)
    parser.add_argument("--raise-at-step", type=int, default=-1)
    parser.add_argument("--stop-at-step", type=int, default=-1)
    parser.add_argument(
        "--hold-until-world",
        type=int,
        default=0,
        help="train on only once this many workers form a group (a job that needs its whole "
        "cluster first, or waits for a node at --hold-world-at-step)",
    )
    parser.add_argument(
        "--hold-world-at-step",
        type=int,
        default=0,
        help="the step at which --hold-until-world holds (a job that waits for a node that joins "
        "mid-training)",
    )
    parser.add_argument(
        "--hold-at-step",
        type=lambda v: {int(s) for s in v.split(",")},
        default=set(),
        help=f"every rank waits before these steps (comma-separated) until --hold-dir has a "
        f"file step-N ({HOLD_SECONDS} s at most)",
    )
    parser.add_argument("--hold-dir", help="where --hold-at-step looks for its files")
    parser.add_argument("--fatal-at-step", type=int, default=-1)
    parser.add_argument("--raise-every", action="store_true", help="every step fails")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--init-method", default="etcd://localhost:2379/classic?min_workers=1")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--max-trainers", type=int, default=64)
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2, help="samples per rank and step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--step-seconds", type=float, default=0.0)
    fault_options(parser)
    parser.add_argument("--max-failures", type=int, default=torchelastic.MAX_FAILURES)
    parser.add_argument("--checkpoint-dir", help="checkpoint every --checkpoint-every steps")
    parser.add_argument("--checkpoint-every", type=int, default=8)
    parser.add_argument("--out", help="write the final state here (JSON)")
    global ARGS
    ARGS = parser.parse_args()
    coordinator = CoordinatorP2P(
        c10d_backend=ARGS.backend,
        init_method=ARGS.init_method,
        max_num_trainers=ARGS.max_trainers,
        process_group_timeout=60000,
    )
    if ARGS.checkpoint_dir:
        # torchelastic 0.1: from torchelastic.checkpoint import FileSystemCheckpointManager, ...
        torchelastic.set_checkpoint_manager(
            torchelastic.FileSystemCheckpointManager(ARGS.checkpoint_dir)
        )
    state = LinearState(ARGS.samples, ARGS.epochs, ARGS.batch, ARGS.lr, ARGS.checkpoint_every)
    final = torchelastic.train(coordinator, train_step, state, max_failures=ARGS.max_failures)
    assert isinstance(final, LinearState)
    say(f"done: {final.steps} steps, {final.epochs} epochs")
    if ARGS.out and final.rank == 0:  # a worker that came after the end never synced
        weights = [p.detach().flatten().tolist() for p in final.model.parameters()]
        with open(ARGS.out, "w") as f:
            json.dump({"steps": final.steps, "history": final.history, "weights": weights}, f)


ARGS = argparse.Namespace()

if __name__ == "__main__":
    sys.exit(main())
