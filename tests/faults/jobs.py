"""The fault suites' job and tools: a small deterministic DDP job (examples/train_ddp.py) whose
progress and weights the tests read, launchers for one or two nodes, network namespaces that
make separate hosts on one machine."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from pathlib import Path

import torch
from elastic_sampler import CheckpointManager
from launcher_util import ELASTICRUN, held, release, wait_for, wait_gone

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
# 2 epochs of 16 steps of 16 samples per rank on 2 ranks; a checkpoint every 5 steps; each
# step takes 0.1 s, so a fault lands mid-run.
JOB = [
    "--samples",
    "512",
    "--image-size",
    "16",
    "--classes",
    "10",
    "--epochs",
    "2",
    "--batch-size",
    "16",
    "--checkpoint-every",
    "5",
    "--step-time",
    "0.1",
]
TOTAL_STEPS = 32
FAST = ["--monitor-interval", "0.05"]


class Job:
    """One training job's files: checkpoints, the samples of each step, the final weights."""

    def __init__(self, root: Path, name: str, hold: tuple[int, ...] = ()) -> None:
        """`hold`: the steps after which every rank waits until the test release()s it."""
        self.checkpoints = root / f"{name}-ckpt"
        self.samples = root / f"{name}-samples"
        self.weights = root / f"{name}.pt"
        self.gates = root / f"{name}-gates"
        self.hold = hold

    def args(self) -> list[str]:
        return [
            str(EXAMPLE),
            *JOB,
            "--checkpoint-dir",
            str(self.checkpoints),
            "--record-samples",
            str(self.samples),
            "--final-weights",
            str(self.weights),
            *self.holds(),
        ]

    def holds(self) -> list[str]:
        """The script's flags for `hold`: a fault comes after what the test waited for, never
        after a number of steps the job might have run past on a slow machine."""
        return list(held(self.gates, *self.hold)) if self.hold else []

    def release(self, step: int) -> None:
        """The ranks held after `step` go on."""
        release(self.gates, step)

    def step(self, attempt: int | None = None) -> int:
        """The newest step any rank has trained (in `attempt` only, when given)."""
        newest = 0
        pattern = "attempt*-rank*.txt" if attempt is None else f"attempt{attempt}-rank*.txt"
        for f in self.samples.glob(pattern):
            for line in f.read_text().splitlines():
                with contextlib.suppress(ValueError, IndexError):
                    newest = max(newest, int(line.split(" ")[1]))
        return newest

    def wait_step(
        self,
        step: int,
        *procs: subprocess.Popen[str],
        timeout: float = 90,
        attempt: int | None = None,
    ) -> None:
        """Wait until a rank trained `step` (in `attempt`, when given)."""

        def reached() -> bool:
            for p in procs:
                assert p.poll() is None, f"the job ended before step {step}: {p.returncode}"
            return self.step(attempt) >= step

        where = "" if attempt is None else f" in attempt {attempt}"
        assert wait_for(reached, timeout), (
            f"the job did not reach step {step}{where} in {timeout} s"
        )

    def workers(self) -> dict[int, int]:
        """{rank: pid} of this job's running workers (their command line names its files)."""
        found = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
                environ = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if str(self.samples) not in cmdline or "worker_main" not in cmdline:
                continue
            for var in environ:
                if var.startswith(b"RANK="):
                    found[int(var[5:])] = int(entry.name)
        return found

    def assert_same_weights(self, reference: Path) -> None:
        expected, got = torch.load(reference), torch.load(self.weights)
        assert expected.keys() == got.keys()
        for name, tensor in expected.items():
            assert torch.equal(tensor, got[name]), f"{name} differs from the fault-free run"

    def assert_recovered(self, reference: Path, met: list[int]) -> None:
        """The job ended as the fault-free run did, with its last checkpoint intact and none
        of the workers the fault `met` (nor any other of its workers) still running."""
        self.assert_same_weights(reference)
        self.assert_checkpoint_intact(TOTAL_STEPS)
        assert wait_gone(met) == [], "a worker outlived its job"
        assert self.workers() == {}

    def assert_checkpoint_intact(self, at_least: int = 5) -> int:
        assert not [p for p in self.checkpoints.iterdir() if ".tmp-" in p.name], "half-written"
        latest = CheckpointManager(self.checkpoints).load_latest()
        assert latest is not None, "no checkpoint survived"
        assert latest[1] >= at_least
        return latest[1]


#: One worker per node: elasticrun (as torchrun) leaves OMP_NUM_THREADS alone, and torch's
#: kernels would sum in another order than the reference's (2 workers: 1 thread each).
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def node_args(
    job: Job, endpoint: str, run_id: str, *extra: str, backend: str = "c10d"
) -> list[str]:
    """One node of a two-node job of one worker per node (embedded rendezvous by default)."""
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--max-restarts",
        "3",
        *extra,
        *FAST,
        *job.args(),
    ]


def finish_quietly(proc: subprocess.Popen[str]) -> None:
    """End a launcher a test left running (after a failed assertion): its whole group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


class Netns:
    """Network namespaces joined by a veth pair to each other, or one namespace joined to this
    one: separate hosts on one machine (root only). `addrs[i]` is the address in `names[i]`
    ("" for this namespace)."""

    def __init__(self, tag: str, names: int = 2) -> None:
        tag = f"{tag}{os.getpid() % 100000}"
        self.names = [f"el{tag}a", f"el{tag}b"][:names] + [""] * (2 - names)
        self.links = [f"el{tag}va", f"el{tag}vb"]
        net = 200 + os.getpid() % 50
        self.addrs = [f"10.{net}.0.1", f"10.{net}.0.2"]

    def setup(self) -> str:
        """Create them; returns why they cannot be made here ("" when made)."""
        for name in filter(None, self.names):
            if (problem := _ip("netns", "add", name)) is not None:
                return problem
        a, b = self.links
        steps = [("link", "add", a, "type", "veth", "peer", "name", b)]
        for name, link, addr in zip(self.names, self.links, self.addrs, strict=True):
            where = ("-n", name) if name else ()
            if name:
                steps += [("link", "set", link, "netns", name), (*where, "link", "set", "lo", "up")]
            steps += [
                (*where, "addr", "add", f"{addr}/24", "dev", link),
                (*where, "link", "set", link, "up"),
            ]
        for step in steps:
            if (problem := _ip(*step)) is not None:
                return problem
        return ""

    def cut(self, up: bool = False) -> None:
        """Take the link down (both ends lose their carrier), or bring it up again."""
        for name, link in zip(self.names, self.links, strict=True):
            where = ("-n", name) if name else ()
            assert _ip(*where, "link", "set", link, "up" if up else "down") is None

    def prefix(self, host: int) -> list[str]:
        """The command prefix that runs a program in host `host`'s namespace."""
        return ["ip", "netns", "exec", self.names[host]] if self.names[host] else []

    def launcher(self, host: int) -> list[str]:
        return [*self.prefix(host), *ELASTICRUN]

    def remove(self) -> None:
        for name in filter(None, self.names):  # the veth pair goes with its namespaces
            _ip("netns", "delete", name)
        _ip("link", "delete", self.links[0])  # when one end is here


def _ip(*args: str) -> str | None:
    """Run `ip ARGS`: None when it succeeds, else what it said."""
    try:
        done = subprocess.run(
            ["ip", *args], check=False, capture_output=True, text=True, timeout=30
        )
    except FileNotFoundError:
        return "`ip` (iproute2) is not installed"
    if done.returncode != 0:
        return f"`ip {' '.join(args)}` failed: {done.stderr.strip()}"
    return None
