"""A job on this machine (examples/train_ddp.py, each node a launcher of its own; 2 nodes x 2
workers unless a `Shape` says otherwise), under elasticrun or torchrun, meeting one fault: a
worker SIGKILLed, a worker hung, or a whole node (its launcher and workers) SIGKILLed and a
replacement node started, as a cluster would.

Measured from the job's own records (each rank writes the steps it trains): the steps lost,
the time from the kill to the first step trained after it, and the final weights.

A step is *completed* once every rank has it: a rank that saves once it has said the step's
copy is sealed ("kept STEP", one step late: examples/train_ddp.py), the others once they have
trained it. The steps lost are the completed steps the job trains again: the newest completed
step at the kill, less the step the job resumed from (the step before the first one trained
after the kill).

Used by benchmarks/bench_steps_lost.py, benchmarks/bench_real_job.py and
tests/integration/test_steps_lost.py.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
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


@dataclass(frozen=True)
class Shape:
    """The job's nodes and workers, and the launcher's flags beyond the rendezvous's."""

    nnodes: int = 2
    nproc: int = 2
    flags: tuple[str, ...] = ("--max-restarts", "3")
    ours: tuple[str, ...] = ("--monitor-interval", "0.05")  # elasticrun's only
    #: GPUs, NCCL: each node gets `nproc` of `gpus` (CUDA_VISIBLE_DEVICES entries, in order)
    gpus: tuple[str, ...] = ()
    #: The embedded c10d rendezvous's endpoints (elasticrun's: torchrun's c10d takes one).
    endpoints: int = 1
    #: Another rendezvous: its backend and every member of its store (etcd's; torchrun is
    #: given the first, all its etcd backends take).
    backend: str = "c10d"
    store: tuple[str, ...] = ()
    #: --nnodes MIN:nnodes (elastic) when set; the job starts with `nnodes` nodes either way.
    min_nodes: int | None = None

    @property
    def world(self) -> int:
        return self.nnodes * self.nproc


@dataclass
class Outcome:
    """What one run did."""

    returncodes: list[int]
    completed_at_kill: int | None  # the newest step every rank had recorded
    resumed: int | None  # the step the job went on from
    recovery_s: float | None  # the kill to the first step trained after it
    gone_s: float | None  # the kill to the last worker of its time gone (the loss seen)
    weights: Path
    log: str
    restarts: int | None = None  # elasticrun's: restarts of the job's budget spent

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


#: torchrun's spare: steps the job trains after its agent connected, before the fault (its
#: rendezvous syncs once a second; at 20 steps a second this is about two syncs).
SPARE_SETTLE_STEPS = 40


def _connected_to(pid: int, port: int) -> bool:
    """Whether `pid` holds an established TCP connection to `port` (on any address)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(target[8:-1])
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
                f = line.split()
                if int(f[2].rsplit(":", 1)[1], 16) == port and f[3] == "01" and f[9] in inodes:
                    return True
    return False


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


NODE_FAULTS = ("node", "spare", "host", "host-spare", "host-alone")
FAULTS = ("worker", "hang", "member", *NODE_FAULTS)


def _trained(lines: list[str]) -> list[int]:
    """The steps of a record's "EPOCH STEP IDS" lines, in order."""
    return [int(line.split(" ")[1]) for line in lines if line.count(" ") == 2]


class JobRun:
    """One run's files and nodes."""

    def __init__(
        self,
        root: Path,
        name: str,
        launcher: str,
        job: tuple[str, ...] = (),
        shape: Shape = Shape(),
    ) -> None:
        """`job`: arguments added to the example's (JOB)."""
        self.root = root / name
        self.job = job
        self.shape = shape
        self.root.mkdir(parents=True, exist_ok=True)
        self.launcher = launcher
        self.samples = self.root / "samples"
        self.weights = self.root / "final.pt"
        self.ports = [free_port() for _ in range(shape.endpoints)]
        self.port = self.ports[0]  # where the first node hosts the embedded rendezvous
        self.run_id = f"{name}-{os.getpid()}-{self.port}"
        self.nodes: list[subprocess.Popen[bytes]] = []
        self._deadline = 0.0
        self.logs: list[Path] = []
        #: What the "member" fault does to the store (an etcd member SIGKILLed).
        self.store_fault: Callable[[], None] = lambda: None
        self.killed: subprocess.Popen[bytes] | None = None  # the node a fault SIGKILLed

    def _endpoint(self) -> str:
        """--rdzv-endpoint: every endpoint or member for elasticrun, the first for torchrun."""
        given = self.shape.store or tuple(f"127.0.0.1:{p}" for p in self.ports)
        return ",".join(given) if self.launcher == "elasticrun" else given[0]

    def _command(self) -> list[str]:
        extra = self.shape.ours if self.launcher == "elasticrun" else ()
        return [
            *LAUNCHERS[self.launcher],
            "--nnodes",
            str(self.shape.nnodes)
            if self.shape.min_nodes is None
            else f"{self.shape.min_nodes}:{self.shape.nnodes}",
            "--nproc-per-node",
            str(self.shape.nproc),
            "--rdzv-backend",
            self.shape.backend,
            "--rdzv-endpoint",
            self._endpoint(),
            "--rdzv-id",
            self.run_id,
            *self.shape.flags,
            *extra,
            str(EXAMPLE),
            *JOB,
            *(("--backend", "nccl") if self.shape.gpus else ()),
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
        if self.shape.gpus:  # a replacement node takes the GPUs of the node it replaces
            at = (len(self.nodes) % self.shape.nnodes) * self.shape.nproc
            env["CUDA_VISIBLE_DEVICES"] = ",".join(self.shape.gpus[at : at + self.shape.nproc])
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
        """The newest step every rank has completed, in the first attempt: for a rank that
        saves, the newest step whose copy it has said is sealed ("kept STEP"); for the
        others, the newest they trained."""
        newest = {}
        for f, lines in self._lines().items():
            if not f.name.startswith("attempt0-"):
                continue
            kept = [int(line.split(" ")[1]) for line in lines if line.startswith("kept ")]
            steps = kept or _trained(lines)
            if steps:
                newest[f.name] = max(steps)
        return min(newest.values()) if len(newest) == self.shape.world else None

    def newest(self, rank: int) -> int:
        """The newest step `rank` has trained in the first attempt (0: none yet)."""
        lines = self._lines().get(self.samples / f"attempt0-rank{rank}.txt", [])
        return max(_trained(lines), default=0)

    def line_counts(self) -> dict[Path, int]:
        return {f: len(lines) for f, lines in self._lines().items()}

    def first_step_after(self, before: dict[Path, int]) -> int | None:
        """The first step trained by a worker started after the kill: the first step past
        `before` (the line counts once the workers of the kill's time were all gone) in any
        record, if any yet. (A membership change restarts workers under the same attempt
        number: their records grow, they are not new files.)"""
        firsts = []
        for f, lines in self._lines().items():
            new = _trained(lines[before.get(f, 0) :])
            if new:
                firsts.append(new[0])
        return min(firsts) if firsts else None

    # ---- a run --------------------------------------------------------------------------

    def run(
        self, fault: str | None, kill_at: int = 0, timeout: float = 240, victim: int | None = None
    ) -> Outcome:
        """The job, with `fault` at step `kill_at`: "worker" (rank `victim`, the last unless
        given, SIGKILLed once every rank has recorded the step), "hang" (the last rank stops
        making progress after training the step: the example's --hang-at-step), "node" (the
        last node's launcher and workers SIGKILLed, a new node started), "spare" (the same,
        with a node started before the fault that waits as a spare, and none after), "host"
        and "host-spare" (the same for the first node, which hosts the embedded rendezvous),
        "member" (`store_fault` at the step, then a worker SIGKILLed 10 steps later: measured
        from that kill), or None."""
        self._deadline = time.monotonic() + timeout
        if fault == "hang":
            self.job = (*self.job, "--hang-at-step", str(kill_at))
        try:
            self._start_nodes(fault)
            completed = recovery = resumed = gone = None
            if fault is not None:
                faulted_at, workers = self._fault(fault, kill_at, victim)
                completed = self.completed()
                # The survivors fail on their dead peers; every line after is a new worker's.
                self._until(lambda: not any(_alive(p) for p in workers), "the old workers gone")
                gone = time.monotonic() - faulted_at
                before = self.line_counts()
                self._until(lambda: self.first_step_after(before) is not None, "a step after")
                recovery = time.monotonic() - faulted_at
                resumed = (self.first_step_after(before) or 0) - 1
            codes = [
                node.wait(timeout=max(1.0, self._deadline - time.monotonic()))
                for node in self.nodes
                if node is not self.killed
            ]
            outcome = Outcome(codes, completed, resumed, recovery, gone, self.weights, self._log())
            outcome.restarts = self.restarts_spent()
            return outcome
        finally:
            self.stop()

    def _start_nodes(self, fault: str | None) -> None:
        """The job's nodes, the first hosting the embedded rendezvous, and for a "spare" fault
        a spare node, ready, once the job trains."""
        host = self.start_node()
        if self.shape.nnodes > 1 and not self.shape.store:  # one node alone needs no service
            self._until(lambda: _listening(self.port), "the first node hosting", host)
        for _ in range(self.shape.nnodes - 1):
            self.start_node()
        if fault in (
            "spare",
            "host-spare",
        ):  # once the round runs: a node that joins it is no spare
            self._until(lambda: (self.completed() or 0) >= 1, "step 1", *self.nodes)
            spare = self.start_node()
            self._until(lambda: self._spare_ready(spare), "the spare node waiting", spare)
            if self.launcher == "torchrun":  # its agent syncs its rendezvous once a second
                at = (self.completed() or 0) + SPARE_SETTLE_STEPS
                self._until(lambda: (self.completed() or 0) >= at, f"step {at}", spare)

    def _fault(self, fault: str, at: int, victim: int | None) -> tuple[float, list[int]]:
        """Bring `fault` about at step `at`: when it struck, and the workers of that time."""
        running = tuple(self.nodes)
        if fault == "hang":
            last = self.shape.world - 1
            self._until(lambda: self.newest(last) >= at, f"rank {last} at step {at}", *running)
            return time.monotonic(), list(self.workers().values())
        self._until(lambda: (self.completed() or 0) >= at, f"step {at}", *running)
        if fault.startswith("host") and self._one_endpoint():
            # Its agents' successor holds a copy of the rendezvous before the host is lost.
            self._until(self._successor_ready, "a successor standing by", *running)
        if fault == "member":
            self.store_fault()
            at += 10
            self._until(lambda: (self.completed() or 0) >= at, f"step {at}", *running)
        workers = self.workers()
        killed_at = time.monotonic()
        if fault in ("worker", "member"):
            rank = self.shape.world - 1 if victim is None else victim
            if rank not in workers:
                raise RuntimeError(f"no worker of rank {rank} to kill: {workers}")
            os.kill(workers[rank], signal.SIGKILL)
        elif fault in NODE_FAULTS:
            # Never the spare; the host only when asked.
            self.killed = self.nodes[{"node": -1, "spare": -2}.get(fault, 0)]
            for pid in _descendants(self.killed.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.killed.wait(timeout=30)
            if fault in ("node", "host"):
                self.start_node()  # the replacement
        else:
            raise ValueError(f"fault={fault!r}: give one of {FAULTS}")
        return killed_at, list(workers.values())

    def _one_endpoint(self) -> bool:
        """elasticrun's embedded rendezvous on one endpoint (its agents choose a successor)."""
        embedded = self.shape.backend in ("c10d", "embedded") and not self.shape.store
        return self.launcher == "elasticrun" and embedded and self.shape.endpoints == 1

    def _successor_ready(self) -> bool:
        """The agents have chosen a successor, and its service holds a copy of the host's."""
        from elastic_launch.rendezvous.embedded.succession import standing_by

        return standing_by(f"127.0.0.1:{self.port}")

    def _spare_ready(self, node: subprocess.Popen[bytes]) -> bool:
        """elasticrun: `node` says it waits as a spare, and its zygote is warm (it has forked
        a warm spare). torchrun: its agent is connected to the rendezvous's store."""
        if self.launcher == "torchrun":
            return _connected_to(node.pid, self.port)
        if "waits as a spare" not in self.logs[self.nodes.index(node)].read_text(errors="replace"):
            return False
        for pid in _descendants(node.pid):
            with contextlib.suppress(OSError):
                if b"(warm spare)" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
        return False

    def _until(self, done: Callable[[], bool], what: str, *alive: subprocess.Popen[bytes]) -> None:
        while not done():
            if any(p.poll() is not None for p in alive):
                raise RuntimeError(f"the job ended before {what}: {self._log()}")
            if time.monotonic() > self._deadline:
                raise RuntimeError(f"no {what} in time: {self._log()}")
            time.sleep(0.002)

    def workers(self) -> dict[int, int]:
        """{rank: pid} of this run's workers (their command line names its records; a
        DataLoader's worker processes, forked from theirs, share it and are left out)."""
        found: dict[int, tuple[int, int]] = {}  # pid: (rank, parent)
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
                environ = (entry / "environ").read_bytes().split(b"\0")
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue
            if os.fsencode(self.samples) not in cmdline:
                continue
            for var in environ:
                if var.startswith(b"RANK="):
                    found[int(entry.name)] = (int(var[5:]), parent)
        return {rank: pid for pid, (rank, parent) in found.items() if parent not in found}

    def restarts_spent(self) -> int | None:
        """elasticrun's: the restarts of the job's budget its nodes say were spent (the node
        whose workers failed says "restart N of M"); None under torchrun."""
        if self.launcher != "elasticrun":
            return None
        said = "\n".join(p.read_text(errors="replace") for p in self.logs)
        return max((int(n) for n in re.findall(r"\(restart (\d+) of \d+\)", said)), default=0)

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
