"""The fault suite: a small deterministic DDP job (examples/train_ddp.py) meets a real fault
while it trains, and must end with the very weights of a fault-free run (or fail with a clear
error), with nothing left running and its last good checkpoint intact.

Faults are injected from outside, as they happen: signals to real processes, an etcd server
stopped, a full disk. Each waits for the job's own record of its progress (the steps it
trained), not for a time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from elastic_sampler import CheckpointManager
from launcher_util import ELASTICRUN, finish, free_port, listening, start, wait_for, wait_gone

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

    def __init__(self, root: Path, name: str) -> None:
        self.checkpoints = root / f"{name}-ckpt"
        self.samples = root / f"{name}-samples"
        self.weights = root / f"{name}.pt"

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
        ]

    def step(self) -> int:
        """The newest step any rank has trained."""
        newest = 0
        for f in self.samples.glob("attempt*-rank*.txt"):
            for line in f.read_text().splitlines():
                with contextlib.suppress(ValueError, IndexError):
                    newest = max(newest, int(line.split(" ")[1]))
        return newest

    def wait_step(self, step: int, *procs: subprocess.Popen[str], timeout: float = 90) -> None:
        def reached() -> bool:
            for p in procs:
                assert p.poll() is None, f"the job ended before step {step}: {p.returncode}"
            return self.step() >= step

        assert wait_for(reached, timeout), f"the job did not reach step {step} in {timeout} s"

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


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault-free run's final weights."""
    root = tmp_path_factory.mktemp("reference")
    job = Job(root, "clean")
    code, _, err = finish(
        start(["--standalone", "--nproc-per-node", "2", *FAST, *job.args()]), timeout=150
    )
    assert code == 0, err[-3000:]
    return job.weights


def _signal_one_worker(job: Job, sig: int, *flags: str) -> tuple[int, str, list[int]]:
    """Run the job on one node with 2 restarts; at step 12, send rank 1 `sig`. Returns the
    launcher's exit code and stderr, and the workers the fault met."""
    proc = start(["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", *flags])
    try:
        job.wait_step(12, proc)
        victims = job.workers()
        os.kill(victims[1], sig)
        code, _, err = finish(proc, timeout=150)
    finally:
        finish_quietly(proc)
    return code, err, list(victims.values())


@pytest.mark.timeout(200)
def test_a_worker_killed_mid_run(tmp_path, reference):
    job = Job(tmp_path, "sigkill")
    code, err, victims = _signal_one_worker(job, signal.SIGKILL, *FAST, *job.args())
    assert code == 0, err[-3000:]
    assert "restarting the workers (restart 1 of 2)" in err
    job.assert_recovered(reference, victims)


@pytest.mark.timeout(200)
def test_a_worker_stopped_mid_run_is_found_hung_and_replaced(tmp_path, reference):
    job = Job(tmp_path, "sigstop")
    flags = ["--hang-timeout", "3", *FAST]
    code, err, victims = _signal_one_worker(job, signal.SIGSTOP, *flags, *job.args())
    assert code == 0, err[-3000:]
    assert "hung" in err and "restart 1 of 2" in err, err[-3000:]
    job.assert_recovered(reference, victims)


def _two_node_args(job: Job, endpoint: str, run_id: str, *extra: str) -> list[str]:
    """One node of a two-node job of one worker per node on the embedded rendezvous."""
    return [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        "c10d",
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


@pytest.mark.timeout(240)
def test_an_agent_killed_on_one_of_two_nodes_and_started_again(tmp_path, reference):
    # Two "nodes" (agents) of one worker each; the embedded rendezvous is hosted by the
    # first. The second node's agent is SIGKILLed (its worker dies with it); as a cluster
    # would, a new agent is started in its place, and the job goes on from the checkpoint.
    job = Job(tmp_path, "agent")
    endpoint = f"127.0.0.1:{free_port()}"
    node = _two_node_args(job, endpoint, f"faults-{os.getpid()}")
    # One worker per node: elasticrun (as torchrun) leaves OMP_NUM_THREADS alone, and torch's
    # kernels would sum in another order than the reference's (2 workers: 1 thread each).
    one_thread = {"OMP_NUM_THREADS": "1"}
    host = start(node, one_thread)
    procs = [host]
    try:
        assert wait_for(lambda: listening(endpoint), 30), "the first agent did not host"
        other = start(node, one_thread)
        procs.append(other)
        job.wait_step(12, host, other)
        victims = job.workers()
        assert len(victims) == 2, f"not both workers running at the fault: {victims}"
        os.kill(other.pid, signal.SIGKILL)  # the agent only: its worker must die with it
        other.wait(timeout=30)
        assert wait_for(lambda: len(job.workers()) < 2, 30), "the dead agent's worker lives"
        again = start(node, one_thread)
        procs.append(again)
        results = [finish(p, timeout=180) for p in (host, again)]
    finally:
        for p in procs:
            finish_quietly(p)
    said = "\n".join(
        f"{name} exited {code}:\n{err[-3000:]}"
        for name, (code, _, err) in zip(("the host", "the new agent"), results)
    )
    assert all(code == 0 for code, _, _ in results), said
    job.assert_recovered(reference, list(victims.values()))


@pytest.mark.timeout(200)
def test_etcd_stopped_and_started_again_mid_run(tmp_path, reference, etcd):
    job = Job(tmp_path, "etcd")
    rdzv = ["--rdzv-backend", "etcd", "--rdzv-endpoint", etcd.endpoint, "--nnodes", "1"]
    proc = start([*rdzv, "--nproc-per-node", "2", "--max-restarts", "2", *FAST, *job.args()])
    try:
        job.wait_step(6, proc)
        etcd.stop()
        job.wait_step(12, proc)  # training goes on without the store
        etcd.start()
        code, _, err = finish(proc, timeout=150)
    finally:
        finish_quietly(proc)
    assert code == 0, err[-3000:]
    assert "restarting" not in err, "a store outage is no reason to restart the workers"
    job.assert_same_weights(reference)
    job.assert_checkpoint_intact(TOTAL_STEPS)


@pytest.mark.timeout(120)
def test_etcd_unreachable_at_start_is_a_clear_error(tmp_path):
    job = Job(tmp_path, "no-etcd")
    endpoint = f"127.0.0.1:{free_port()}"
    args = ["--rdzv-backend", "etcd", "--rdzv-endpoint", endpoint, "--nnodes", "1"]
    began = time.monotonic()
    code, _, err = finish(
        start([*args, "--rdzv-conf", "join_timeout=4", "--nproc-per-node", "2", *job.args()]),
        timeout=90,
    )
    assert code != 0
    assert f"etcd at {endpoint} is unreachable" in err, err[-3000:]
    assert time.monotonic() - began < 60, "bounded by join_timeout"
    assert not job.samples.exists(), "no worker started"
    assert job.workers() == {}


class Hosts:
    """Two network namespaces joined by a veth pair: two hosts on one machine (root only)."""

    def __init__(self) -> None:
        tag = f"{os.getpid() % 100000}"
        self.names = [f"elx{tag}a", f"elx{tag}b"]
        self.links = [f"elx{tag}va", f"elx{tag}vb"]
        self.addrs = ["10.231.0.1", "10.231.0.2"]

    def setup(self) -> str:
        """Create them; returns why they cannot be made here ("" when made)."""
        for name in self.names:
            if (problem := _ip("netns", "add", name)) is not None:
                return problem
        a, b = self.links
        steps = [("link", "add", a, "type", "veth", "peer", "name", b)]
        for name, link, addr in zip(self.names, self.links, self.addrs, strict=True):
            steps += [
                ("link", "set", link, "netns", name),
                ("-n", name, "addr", "add", f"{addr}/24", "dev", link),
                ("-n", name, "link", "set", link, "up"),
                ("-n", name, "link", "set", "lo", "up"),
            ]
        for step in steps:
            if (problem := _ip(*step)) is not None:
                return problem
        return ""

    def cut(self, up: bool = False) -> None:
        """Take the link down (both ends lose their carrier), or bring it up again."""
        for name, link in zip(self.names, self.links, strict=True):
            assert _ip("-n", name, "link", "set", link, "up" if up else "down") is None

    def launcher(self, host: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[host], *ELASTICRUN]

    def remove(self) -> None:
        for name in self.names:  # the veth pair goes with its namespaces
            _ip("netns", "delete", name)


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


@pytest.fixture
def two_hosts():
    hosts = Hosts()
    try:
        problem = hosts.setup()
        if problem:
            pytest.skip(f"cannot make two network namespaces here ({problem}): needs root")
        yield hosts
    finally:
        hosts.remove()


@pytest.mark.timeout(240)
def test_a_network_partition_between_two_nodes_that_heals(tmp_path, reference, two_hosts):
    # Two hosts (network namespaces) of one worker each; the first hosts the embedded
    # rendezvous. At step 12 the link between them goes down: the first host sees the
    # second's lease expire and stops its worker (stuck in a collective with its lost peer:
    # it is killed after --shutdown-timeout). The link comes back; the second host finds its
    # lease gone, stops its worker, rejoins, and the job goes on from the last checkpoint.
    job = Job(tmp_path, "partition")
    endpoint = f"{two_hosts.addrs[0]}:29400"
    token = os.urandom(16).hex()
    procs = []

    def node(host: int) -> subprocess.Popen[str]:
        args = _two_node_args(
            job,
            endpoint,
            f"partition-{os.getpid()}",
            "--rdzv-conf",
            f"is_host={'true' if host == 0 else 'false'}",
            "--local-addr",
            two_hosts.addrs[host],
            "--shutdown-timeout",
            "3",
        )
        # gloo binds the interface named here (the hostname resolves to 127.0.0.1 on both);
        # one thread per worker, as in the agent scenario above.
        env = {
            "GLOO_SOCKET_IFNAME": two_hosts.links[host],
            "OMP_NUM_THREADS": "1",
            "ELASTICRUN_RDZV_TOKEN": token,  # the service listens beyond loopback
        }
        proc = start(args, env, launcher=two_hosts.launcher(host))
        procs.append(proc)
        return proc

    try:
        first, second = node(0), node(1)
        job.wait_step(12, first, second)
        victims = job.workers()
        two_hosts.cut()
        # The first host's record of the fault: its worker is stopped (within the lease's
        # 5 s, the --shutdown-timeout's 3 s and a margin).
        pids = list(victims.values())
        assert wait_for(lambda: len(wait_gone(pids, 0)) < 2, 30), "the partition went unnoticed"
        two_hosts.cut(up=True)
        results = [finish(p, timeout=180) for p in (first, second)]
    finally:
        for p in procs:
            finish_quietly(p)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    assert "left the job" in results[0][2], results[0][2][-3000:]
    assert "the rendezvous lease expired; this node will rejoin" in results[1][2]
    job.assert_recovered(reference, list(victims.values()))


@pytest.fixture
def small_disk(tmpfs, reference: Path) -> Path:
    """A tmpfs that holds two of the job's checkpoints but not three (root only)."""
    sizes = [p.stat().st_size for p in reference.parent.glob("clean-ckpt/checkpoint-*")]
    one = max(s for s in sizes if s > 1000) + 4096  # a checkpoint, its checksum's page
    return tmpfs((one * 5 // 2 + 4095) // 4096 * 4096)


@pytest.mark.timeout(200)
def test_a_full_disk_while_checkpointing_fails_clearly_and_keeps_the_last_good_one(
    tmp_path, small_disk
):
    job = Job(tmp_path, "full")
    job.checkpoints = small_disk / "ckpt"
    code, _, err = finish(
        start(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", *FAST, *job.args()]),
        timeout=150,
    )
    assert code != 0
    assert "No space left on device (the disk or quota is full)" in err, err[-3000:]
    step = job.assert_checkpoint_intact(at_least=5)
    assert step < TOTAL_STEPS
    assert job.workers() == {}


def finish_quietly(proc: subprocess.Popen[str]) -> None:
    """End a launcher a test left running (after a failed assertion): its whole group."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)
