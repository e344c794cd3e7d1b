"""The memory tier's cost, beside torch's own primitives, in one run:

- per step: a training step of about 100 ms on a 100 MB state (plain SGD), saving every
  step with CheckpointManager(memory=True), against the same steps with no snapshot, and with
  torch.save of the state into /dev/shm (torch's own way to keep a step in memory). Each round
  interleaves the modes in blocks; a mode's overhead is the median over its blocks of its time
  against the no-snapshot block next to it; the figure is the median of 5 rounds. Run with the
  step's compute on 1 thread (a GPU job: the host's cores are free) and on 2 (every core of
  this machine computing).
- replicas: the same step on two processes standing for two nodes (one rank each, both cores
  computing, gloo over loopback), saving every step with replicas=1 (each rank's copy also
  sent to the other), against no snapshot, the tier alone, and torch's own primitives for
  the same end: torch.save of the state into bytes, exchanged with the peer by
  torch.distributed send and recv. Rank 0's figures.
- one copy: the time to put a 1 GB state into the tier (plan, copy, checksum, seal), against a
  plain memcpy of 1 GB into memory already mapped, and torch.save of it into /dev/shm. Median
  of 5.

    python benchmarks/bench_memory_tier.py [--rounds 5] [--steps 20]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from common import Row, free_port, run_json

HERE = Path(__file__).resolve().parent
STATE_MB = 100
STEP_MS = 100
BLOCKS = 5  # interleaved blocks of each mode per round
GB = 1 << 30


def _env(directory: str) -> None:
    os.environ["ELASTICRUN_MEMORY_DIR"] = directory
    os.environ["TORCHELASTIC_RUN_ID"] = "bench"
    os.environ["LOCAL_RANK"] = "0"


class Workload:
    """A training step of about STEP_MS on STATE_MB of parameters (plain SGD: the state is the
    parameters). `compute`: the step's work is a cache-resident matmul loop, then the
    optimizer's update of the whole state (as on a GPU node, the host's memory bus is left to
    the copy); `mlp`: forward and backward of an MLP of that size, bound by memory bandwidth
    on a CPU, the copy's worst case."""

    def __init__(self, torch, kind: str) -> None:  # type: ignore[no-untyped-def]
        self.torch, self.kind = torch, kind
        width = 1024
        layers = max(1, STATE_MB * (1 << 20) // (4 * width * width))
        if kind == "mlp":
            blocks = [(torch.nn.Linear(width, width), torch.nn.ReLU()) for _ in range(layers)]
            self.model = torch.nn.Sequential(*[m for block in blocks for m in block])
        else:
            self.model = torch.nn.ParameterList(
                torch.nn.Parameter(torch.randn(width * width)) for _ in range(layers)
            )
            for p in self.model:
                p.grad = torch.randn_like(p) * 1e-3  # a fixed update: no backward here
            self.a, self.b = torch.randn(256, 256), torch.randn(256, 256)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=1e-6)
        self.size = 8  # the batch (mlp) or matmuls (compute) that make STEP_MS
        self.x = None
        while True:
            took = self.time(3)
            if took * 1000 >= STEP_MS * 0.95 or self.size >= 1 << 16:
                break
            self.size = max(self.size + 1, int(self.size * STEP_MS / (took * 1000)))

    def time(self, n: int) -> float:
        self.step()
        t = time.perf_counter()
        for _ in range(n):
            self.step()
        return (time.perf_counter() - t) / n

    def step(self) -> None:
        torch = self.torch
        if self.kind == "mlp":
            if self.x is None or self.x.shape[0] != self.size:
                self.x = torch.randn(self.size, 1024)
            self.optimizer.zero_grad(set_to_none=False)
            self.model(self.x).square().mean().backward()
        else:
            c = self.a
            for _ in range(self.size):
                c = torch.mm(c, self.b).tanh_()
        self.optimizer.step()

    def state(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}


def per_step(kind: str, threads: int, rounds: int, steps: int) -> dict:
    import torch
    from elastic_sampler import CheckpointManager

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    work = Workload(torch, kind)
    state_bytes = sum(p.numel() * p.element_size() for p in work.model.parameters())
    shm = tempfile.mkdtemp(prefix="bench-memory-", dir="/dev/shm")
    _env(shm)
    disk = tempfile.mkdtemp(prefix="bench-memory-ckpt-")
    manager = CheckpointManager(disk, memory=True, persist_every=10**9)
    blocking = CheckpointManager(disk, memory=True, persist_every=10**9, overlap=False)
    saved = Path(shm) / "torch-save.pt"
    counter = iter(range(1, 10**9))

    def none() -> None:
        pass

    def tier(m: CheckpointManager) -> None:
        m.save(work.state(), next(counter))

    def torch_save() -> None:
        torch.save(work.state(), saved)

    modes = {
        "none": none,
        "tier": lambda: tier(manager),
        "tier_blocking": lambda: tier(blocking),
        "torch_save_shm": torch_save,
    }
    measured = _interleaved(work, modes, [manager], rounds, steps)
    for m in (manager, blocking):
        m.close()
    out = {
        "kind": kind,
        "threads": threads,
        "state_mb": state_bytes / (1 << 20),
        "size": work.size,
        **measured,
    }
    for path in Path(shm).iterdir():
        path.unlink()
    os.rmdir(shm)
    shutil.rmtree(disk, ignore_errors=True)
    return out


def _interleaved(work: Workload, modes: dict, managers: list, rounds: int, steps: int) -> dict:
    """Each mode's step time, and its overhead against no snapshot.

    This VM's speed drifts by tens of percent over seconds: each round runs every mode in
    short blocks, interleaved, and a mode's overhead in a round is the median over its blocks
    of (block / the no-snapshot block of the same cycle) - 1; the figure is the median over
    rounds."""
    times: dict[str, list[float]] = {k: [] for k in modes}
    save_ms: dict[str, list[float]] = {k: [] for k in modes}
    paired: dict[str, list[float]] = {k: [] for k in modes}
    for snap in modes.values():  # warm: buffers and slots exist
        work.step()
        snap()
    for manager in managers:
        manager.wait()
    block = max(1, steps // BLOCKS)
    for r in range(rounds):
        spent = dict.fromkeys(modes, 0.0)
        blocked = dict.fromkeys(modes, 0.0)
        each: dict[str, list[float]] = {k: [] for k in modes}
        for b in range(BLOCKS):
            names = list(modes)
            order = names[(r + b) % len(names) :] + names[: (r + b) % len(names)]
            for name in order:
                snap = modes[name]
                # Steady state: one step (untimed) starts a copy that overlaps the first timed
                # step, and the copy after the last timed step is waited for untimed.
                work.step()
                snap()
                t = time.perf_counter()
                for _ in range(block):
                    work.step()
                    s = time.perf_counter()
                    snap()
                    blocked[name] += time.perf_counter() - s
                spent[name] += time.perf_counter() - t
                each[name].append(time.perf_counter() - t)
                for manager in managers:
                    manager.wait()
        for name in modes:
            times[name].append(spent[name] / (block * BLOCKS))
            # Each block against the no-snapshot block of the same cycle (seconds apart).
            paired[name].append(
                statistics.median(x / y for x, y in zip(each[name], each["none"])) - 1
            )
            save_ms[name].append(blocked[name] / (block * BLOCKS) * 1000)
    return {
        "step_ms": {k: statistics.median(v) * 1000 for k, v in times.items()},
        "in_save_ms": {k: statistics.median(v) for k, v in save_ms.items()},
        "rounds_ms": {k: [round(x * 1000, 1) for x in v] for k, v in times.items()},
        "overhead": {k: statistics.median(v) for k, v in paired.items()},
        "overhead_rounds": {k: [round(100 * x, 1) for x in v] for k, v in paired.items()},
    }


def replicas(rank: int, port: int, rounds: int, steps: int) -> dict:
    """Rank `rank` of two, each its own node: see the module's docstring."""
    import io

    import torch
    import torch.distributed as dist
    from elastic_sampler import CheckpointManager

    shm = tempfile.mkdtemp(prefix=f"bench-replica-{rank}-", dir="/dev/shm")
    _env(shm)
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", GROUP_RANK=str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    work = Workload(torch, "compute")
    size = torch.tensor([work.size])
    dist.broadcast(size, src=0)  # the same step on both: the exchange pairs them
    work.size = int(size.item())
    disk = tempfile.mkdtemp(prefix="bench-replica-ckpt-")
    local = CheckpointManager(disk, memory=True, persist_every=10**9, prefix="local")
    replicated = CheckpointManager(disk, memory=True, replicas=1, persist_every=10**9)
    counter = iter(range(1, 10**9))
    peer = 1 - rank

    def torch_exchange() -> None:
        buffer = io.BytesIO()
        torch.save(work.state(), buffer)
        out = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
        sizes = [torch.tensor([out.numel()]), torch.empty(1, dtype=torch.int64)]
        sent = dist.isend(sizes[0], dst=peer)
        dist.recv(sizes[1], src=peer)
        sent.wait()
        got = torch.empty(int(sizes[1].item()), dtype=torch.uint8)
        sent = dist.isend(out, dst=peer)
        dist.recv(got, src=peer)
        sent.wait()

    modes = {
        "none": lambda: None,
        "tier": lambda: local.save(work.state(), next(counter)),
        "tier_replicas": lambda: replicated.save(work.state(), next(counter)),
        "torch_exchange": torch_exchange,
    }
    measured = _interleaved(work, modes, [local, replicated], rounds, steps)
    for m in (local, replicated):
        m.close()
    dist.barrier()
    dist.destroy_process_group()
    shutil.rmtree(shm, ignore_errors=True)
    shutil.rmtree(disk, ignore_errors=True)
    state_bytes = sum(p.numel() * p.element_size() for p in work.model.parameters())
    return {"state_mb": state_bytes / (1 << 20), "size": work.size, **measured}


def _replicas_pair(rounds: int, steps: int) -> dict:
    """Rank 0's figures from a pair of `replicas` children."""
    import subprocess

    port = free_port()
    me = [sys.executable, str(Path(__file__).resolve()), "--child", "replicas"]
    args = ["--port", str(port), "--rounds", str(rounds), "--steps", str(steps)]
    procs = [
        subprocess.Popen([*me, "--rank", str(r), *args], stdout=subprocess.PIPE, text=True)
        for r in (0, 1)
    ]
    try:
        outs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise RuntimeError(f"the replicas benchmark failed: {outs}")
    return json.loads(outs[0].strip().splitlines()[-1])


def one_copy(rounds: int) -> dict:
    import torch
    from elastic_sampler import _payload
    from elastic_sampler._memory import MemorySlot

    torch.manual_seed(0)
    state = {"w": torch.randn(GB // 4)}
    shm = tempfile.mkdtemp(prefix="bench-memory-", dir="/dev/shm")
    slot = MemorySlot(Path(shm) / "slot", "bench")
    slot.put_plan(_payload.plan(state), 0)  # the slot made (mapped, faulted in)
    slot.put_plan(_payload.plan(state), 1)  # both buffers touched
    target = Path(shm) / "plain"
    fd = os.open(target, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, GB)
    plain = mmap.mmap(fd, GB)
    os.close(fd)
    dest = ctypes.addressof(ctypes.c_char.from_buffer(plain))
    libc = ctypes.CDLL(None)
    libc.memcpy.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    source = state["w"].data_ptr()
    libc.memcpy(dest, source, GB)  # faulted in
    saved = Path(shm) / "torch-save.pt"
    memcpy, tier, torch_save = [], [], []
    for r in range(rounds):
        t = time.perf_counter()
        libc.memcpy(dest, source, GB)
        memcpy.append(time.perf_counter() - t)
        t = time.perf_counter()
        slot.put_plan(_payload.plan(state), 2 + r)
        tier.append(time.perf_counter() - t)
        t = time.perf_counter()
        torch.save(state, saved)
        torch_save.append(time.perf_counter() - t)
        saved.unlink()
    slot.close()
    plain.close()
    for path in Path(shm).iterdir():
        path.unlink()
    os.rmdir(shm)
    return {
        "memcpy_s": statistics.median(memcpy),
        "tier_s": statistics.median(tier),
        "torch_save_s": statistics.median(torch_save),
    }


#: (step kind, compute threads) measured by `run`.
CASES = (("compute", 1), ("compute", 2), ("mlp", 1))


def run(cases: tuple[tuple[str, int], ...] = CASES, rounds: int = 5, steps: int = 20) -> list[Row]:
    rows = []
    me = [sys.executable, str(Path(__file__).resolve())]
    for kind, n in cases:
        args = ["--kind", kind, "--threads", str(n), "--rounds", str(rounds), "--steps", str(steps)]
        got = run_json([*me, "--child", "per-step", *args], timeout=1800)
        base = got["step_ms"]["none"]
        note = (
            f"{got['state_mb']:.0f} MB state, step {base:.0f} ms with no snapshot "
            f"({kind} step of size {got['size']}), {n} compute thread(s); median of {rounds}"
        )
        rows.append(
            Row(
                "memory_tier",
                f"memory snapshot every step, {kind} step, {n} thread(s): % of step time",
                100 * got["overhead"]["tier"],
                100 * got["overhead"]["torch_save_shm"],
                "torch.save to /dev/shm",
                "%",
                note + f" (rounds: {got['overhead_rounds']['tier']} %); save() blocks "
                f"{got['in_save_ms']['tier']:.2f} ms; without overlap "
                f"{100 * got['overhead']['tier_blocking']:.1f}%",
            )
        )
    got = _replicas_pair(rounds, steps)
    base = got["step_ms"]["none"]
    rows.append(
        Row(
            "memory_tier",
            "memory snapshot every step, replicated to a peer node: % of step time",
            100 * got["overhead"]["tier_replicas"],
            100 * got["overhead"]["torch_exchange"],
            "torch.save + send/recv to the peer",
            "%",
            f"2 processes as 2 nodes, gloo over loopback, both cores computing; "
            f"{got['state_mb']:.0f} MB state per rank, step {base:.0f} ms with no snapshot; "
            f"median of {rounds} (rounds: {got['overhead_rounds']['tier_replicas']} %); "
            f"the tier without replicas {100 * got['overhead']['tier']:.1f}%",
        )
    )
    copy = run_json([*me, "--child", "one-copy", "--rounds", str(rounds)], timeout=1800)
    rows.append(
        Row(
            "memory_tier",
            "1 GB state into the memory tier (plan, copy, checksum, seal)",
            copy["tier_s"],
            copy["memcpy_s"],
            "memcpy of 1 GB",
            "s",
            f"{copy['tier_s'] / copy['memcpy_s']:.2f}x memcpy; torch.save to /dev/shm "
            f"{copy['torch_save_s']:.2f} s; median of {rounds}",
        )
    )
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--child", choices=["per-step", "one-copy", "replicas"])
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--only-replicas", action="store_true", help="measure the replicas alone")
    p.add_argument("--kind", choices=["compute", "mlp"], default="compute")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    if args.child == "per-step":
        print(json.dumps(per_step(args.kind, args.threads, args.rounds, args.steps)))
        return 0
    if args.child == "replicas":
        print(json.dumps(replicas(args.rank, args.port, args.rounds, args.steps)))
        return 0
    if args.only_replicas:
        print(json.dumps(_replicas_pair(args.rounds, args.steps)))
        return 0
    if args.child == "one-copy":
        print(json.dumps(one_copy(args.rounds)))
        return 0
    for row in run(CASES, args.rounds, args.steps):
        ratio = f" ({row.ratio:.2f}x)" if row.ratio else ""
        print(
            f"{row.metric}: {row.ours:.3f} {row.unit} vs {row.baseline_name} "
            f"{row.baseline:.3f}{ratio} - {row.note}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
