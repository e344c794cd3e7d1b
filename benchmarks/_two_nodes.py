"""A job of 2 nodes x 2 workers on this machine (examples/train_ddp.py, each node a launcher of
its own), under elasticrun or torchrun, meeting one fault: a worker SIGKILLed, or a whole node
(its launcher and workers) SIGKILLed and a replacement node started, as a cluster would.

Measured from the job's own records (each rank writes the steps it trains): the steps lost,
the time from the kill to the first step trained after it, and the final weights.

A step is *completed* once every rank has recorded it (a rank records a step after its
optimizer step, and after saving it when the rank saves). The steps lost are the completed
steps the job trains again: the newest completed step at the kill, less the step the job
resumed from (the step before the first one trained after the kill).

Used by benchmarks/bench_steps_lost.py and tests/integration/test_steps_lost.py.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "train_ddp.py"
LAUNCHERS = {
    "elasticrun": [sys.executable, "-m", "elastic_launch"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
}
#: 100 steps (2 epochs of 50 on 4 workers), a disk checkpoint every 50, each step at least
#: 40 ms: a fault lands mid-run.
STEPS = 100
JOB = [
    "--samples",
    "3200",
    "--image-size",
    "16",
    "--classes",
    "10",
    "--epochs",
    "2",
    "--batch-size",
    "16",
    "--checkpoint-every",
    "50",
    "--step-time",
    "0.04",
]


@dataclass
class Outcome:
    """What one run did."""

    returncodes: list[int]
    completed_at_kill: int | None  # the newest step every rank had recorded
    resumed: int | None  # the step the job went on from
    recovery_s: float | None  # the kill to the first step trained after it
    weights: Path
    log: str

    @property
    def lost(self) -> int | None:
        if self.completed_at_kill is None or self.resumed is None:
            return None
        return max(0, self.completed_at_kill - self.resumed)


def free_port() -> int:
    """A free port below the ephemeral range (where the kernel could hand it to an outgoing
    connection before the rendezvous binds it)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _alive(pid: int) -> bool:
    """True if `pid` runs (a zombie counts as gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo.extend(children.get(p, []))
    return found


class TwoNodes:
    """One run's files and nodes."""

    def __init__(self, root: Path, name: str, launcher: str, job: tuple[str, ...] = ()) -> None:
        """`job`: arguments added to the example's (JOB)."""
        self.root = root / name
        self.job = job
        self.root.mkdir(parents=True, exist_ok=True)
        self.launcher = launcher
        self.samples = self.root / "samples"
        self.weights = self.root / "final.pt"
        self.port = free_port()
        self.run_id = f"{name}-{os.getpid()}-{self.port}"
        self.nodes: list[subprocess.Popen[bytes]] = []
        self._deadline = 0.0
        self.logs: list[Path] = []

    def _command(self) -> list[str]:
        extra = ["--monitor-interval", "0.05"] if self.launcher == "elasticrun" else []
        return [
            *LAUNCHERS[self.launcher],
            "--nnodes",
            "2",
            "--nproc-per-node",
            "2",
            "--rdzv-backend",
            "c10d",
            "--rdzv-endpoint",
            f"127.0.0.1:{self.port}",
            "--rdzv-id",
            self.run_id,
            "--max-restarts",
            "3",
            *extra,
            str(EXAMPLE),
            *JOB,
            *self.job,
            "--checkpoint-dir",
            str(self.root / "checkpoints"),
            "--record-samples",
            str(self.samples),
            "--final-weights",
            str(self.weights),
        ]

    def start_node(self) -> subprocess.Popen[bytes]:
        env = dict(os.environ)
        # One thread per worker in every run: torch's kernels would sum in another order
        # (and the weights differ in their last bits) with more.
        env["OMP_NUM_THREADS"] = "1"
        if self.launcher == "torchrun":
            # torchrun's reliable mode: with the rendezvous's store shared, its restarted
            # groups often hang in gloo's connectFullMesh (docs/benchmarks.md).
            env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        log = self.root / f"node{len(self.nodes)}.log"
        with open(log, "wb") as sink:
            node = subprocess.Popen(
                self._command(),
                env=env,
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                cwd=self.root,
            )
        self.nodes.append(node)
        self.logs.append(log)
        return node

    # ---- the records --------------------------------------------------------------------

    def _lines(self) -> dict[Path, list[str]]:
        found = {}
        for f in self.samples.glob("attempt*-rank*.txt"):
            with contextlib.suppress(OSError):
                found[f] = f.read_text().splitlines()
        return found

    def completed(self) -> int | None:
        """The newest step every rank has recorded, in the first attempt."""
        newest = {}
        for f, lines in self._lines().items():
            if not f.name.startswith("attempt0-"):
                continue
            steps = [int(line.split(" ")[1]) for line in lines if line.count(" ") == 2]
            if steps:
                newest[f.name] = max(steps)
        return min(newest.values()) if len(newest) == 4 else None

    def line_counts(self) -> dict[Path, int]:
        return {f: len(lines) for f, lines in self._lines().items()}

    def first_step_after(self, before: dict[Path, int]) -> int | None:
        """The first step trained by a worker started after the kill: the first line past
        `before` (the line counts once the workers of the kill's time were all gone) in any
        record, if any yet. (A membership change restarts workers under the same attempt
        number: their records grow, they are not new files.)"""
        firsts = []
        for f, lines in self._lines().items():
            new = lines[before.get(f, 0) :]
            if new and new[0].count(" ") == 2:
                firsts.append(int(new[0].split(" ")[1]))
        return min(firsts) if firsts else None

    # ---- a run --------------------------------------------------------------------------

    def run(self, fault: str | None, kill_at: int = 0, timeout: float = 240) -> Outcome:
        """The job, with `fault` ("worker", "node" or None) at step `kill_at`."""
        self._deadline = time.monotonic() + timeout
        try:
            host = self.start_node()
            self._until(lambda: _listening(self.port), "the first node hosting", host)
            other = self.start_node()
            completed = recovery = resumed = None
            if fault is not None:
                self._until(
                    lambda: (self.completed() or 0) >= kill_at, f"step {kill_at}", host, other
                )
                workers = list(self.workers().values())
                killed_at = time.monotonic()
                self._kill(fault, other)
                completed = self.completed()
                # The survivors fail on their dead peers; every line after is a new worker's.
                self._until(lambda: not any(_alive(p) for p in workers), "the old workers gone")
                before = self.line_counts()
                self._until(lambda: self.first_step_after(before) is not None, "a step after")
                recovery = time.monotonic() - killed_at
                resumed = (self.first_step_after(before) or 0) - 1
            codes = [
                node.wait(timeout=max(1.0, self._deadline - time.monotonic()))
                for node in self.nodes
                if not (node is other and fault == "node")
            ]
            return Outcome(codes, completed, resumed, recovery, self.weights, self._log())
        finally:
            self.stop()

    def _until(self, done: Callable[[], bool], what: str, *alive: subprocess.Popen[bytes]) -> None:
        while not done():
            if any(p.poll() is not None for p in alive):
                raise RuntimeError(f"the job ended before {what}: {self._log()}")
            if time.monotonic() > self._deadline:
                raise RuntimeError(f"no {what} in time: {self._log()}")
            time.sleep(0.002)

    def workers(self) -> dict[int, int]:
        """{rank: pid} of this run's workers (their command line names its records)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if os.fsencode(self.samples) not in cmdline:
                continue
            for var in environ:
                if var.startswith(b"RANK="):
                    found[int(var[5:])] = int(entry.name)
        return found

    def _kill(self, fault: str, other: subprocess.Popen[bytes]) -> None:
        if fault == "worker":
            victim = self.workers().get(3)
            if victim is None:
                raise RuntimeError(f"no worker of rank 3 to kill: {self.workers()}")
            os.kill(victim, signal.SIGKILL)
        elif fault == "node":
            for pid in _descendants(other.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            other.wait(timeout=30)
            self.start_node()  # the replacement
        else:
            raise ValueError(f"fault={fault!r}: give 'worker' or 'node'")

    def _log(self) -> str:
        return "\n".join(
            f"--- {p.name}:\n{p.read_text(errors='replace')[-3000:]}" for p in self.logs
        )

    def stop(self) -> None:
        """Every node still running, and all below it, killed (by process id)."""
        for node in self.nodes:
            if node.poll() is None:
                for pid in _descendants(node.pid):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    node.wait(timeout=30)
