"""deploy/slurm/elasticrun.sbatch on a real two-node Slurm cluster: munged, slurmctld and two
slurmd (n1, n2) on this host (deploy/slurm/local_cluster.py). The job trains
examples/train_ddp.py over both nodes and completes. Then it trains again over etcd and one
node's agent is SIGKILLed mid-training: the other node goes on alone and completes."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import local_cluster
import pytest
from elastic_launch.net import listeners
from elastic_launch.rendezvous.embedded.peers import Peer
from elastic_launch.rendezvous.embedded.roles import seen
from elastic_launch.rendezvous.store.endpoints import StoreMember
from launcher_util import free_port, held, release, wait_for, wait_gone

ROOT = Path(__file__).resolve().parents[2]

SBATCH = ROOT / "deploy" / "slurm" / "elasticrun.sbatch"
EXAMPLE = ROOT / "examples" / "train_ddp.py"
TRAIN = ["--samples", "256", "--image-size", "16", "--classes", "10", "--batch-size", "16"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(
        local_cluster.missing() is not None,
        reason=f"no Slurm cluster here: {local_cluster.missing()} (make test installs it)",
    ),
]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local_cluster.LocalCluster]:
    c = local_cluster.LocalCluster(tmp_path_factory.mktemp("slurm"), nodes=2)
    c.start()
    daemons = c.pids()
    yield c
    c.stop()
    assert wait_gone(daemons) == [], "a Slurm daemon outlived the tests"


def job_env(**settings: str) -> dict[str, str]:
    """The submitter's environment: elasticrun on PATH (this virtualenv) and the settings.
    The first round waits for both nodes however late srun starts the second (it freezes as
    soon as both are in): a test's verdict must not depend on when a task starts."""
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    whole = {"ELASTICRUN_RDZV_CONF": "last_call_timeout=120"}
    return {"PATH": path, "ELASTICRUN_NPROC": "1", **whole, **settings}


def submit(cluster: local_cluster.LocalCluster, tmp: Path, env: dict[str, str], *args: str) -> int:
    return cluster.submit(
        [
            *("--nodes", "2", "--chdir", str(tmp), "--output", str(tmp / "job-%j.out")),
            *(str(SBATCH), str(EXAMPLE), *TRAIN, "--checkpoint-dir", str(tmp / "ckpt"), *args),
        ],
        env,
    )


def agents(job_id: int) -> dict[int, int]:
    """{SLURM_NODEID: pid} of the job's elasticrun agents."""
    return {
        node: pid
        for pid, node, argv in local_cluster.LocalCluster.processes(job_id)
        if len(argv) > 1 and argv[1].endswith("/elasticrun")
    }


def steps_trained(samples: Path) -> int:
    newest = 0
    for f in samples.glob("attempt*-rank*.txt"):
        for line in f.read_text().splitlines():
            parts = line.split(" ")
            if len(parts) == 3:
                newest = max(newest, int(parts[1]))
    return newest


def two_free_ports() -> int:
    """A port free with the next one (the script gives the second node port + 1)."""
    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two free ports in a row")


def test_a_two_node_job_completes(cluster, tmp_path):
    port = two_free_ports()
    env = job_env(ELASTICRUN_RDZV_PORT=str(port))
    job_id = submit(cluster, tmp_path, env, "--epochs", "1")
    fields = cluster.wait(job_id, timeout=180)
    out = (tmp_path / f"job-{job_id}.out").read_text()
    assert fields["JobState"] == "COMPLETED", out
    host = os.uname().nodename
    assert f"rendezvous embedded at {host}:{port},{host}:{port + 1}, nodes 1:2" in out
    assert "(node 0, n1) exited 0" in out and "(node 1, n2) exited 0" in out, out
    # Both nodes trained: 256 samples, 16 per step on each of 2 workers.
    assert "done: 8 steps, 1 epochs" in out, out


def kill_an_agent_mid_training(
    cluster: local_cluster.LocalCluster,
    tmp: Path,
    env: dict[str, str],
    pick: Callable[[dict[int, int]], int],
) -> tuple[int, int, dict[str, str], str]:
    """Submit a two-epoch training job; once it trains, SIGKILL the agent of the node that
    `pick` names, given the agents ({node: pid}) (its worker dies with it). The job's id,
    that node, the job's end (Slurm's fields) and its output. The workers hold after step 3
    until the agent is killed, so the kill always meets the job mid-training."""
    samples, gates = tmp / "samples", tmp / "gates"
    job_id = submit(
        cluster,
        tmp,
        env,
        *("--epochs", "2", "--step-time", "0.1", "--checkpoint-every", "2"),
        *("--record-samples", str(samples), *held(gates, 3)),
    )
    assert wait_for(lambda: steps_trained(samples) >= 3, 120), "the job did not start training"
    found = agents(job_id)
    assert sorted(found) == [0, 1], found
    node = pick(found)
    os.kill(found[node], signal.SIGKILL)
    release(gates, 3)
    fields = cluster.wait(job_id, timeout=180)
    return job_id, node, fields, (tmp / f"job-{job_id}.out").read_text()


def test_a_node_killed_mid_training_the_other_completes(cluster, tmp_path, etcd):
    env = job_env(ELASTICRUN_RDZV="etcd", ELASTICRUN_ETCD=etcd.endpoint)
    job_id, _, fields, out = kill_an_agent_mid_training(cluster, tmp_path, env, lambda _: 1)
    # n1's agent saw n2 leave (a membership change: no restart spent), re-formed alone,
    # resumed from the checkpoint and finished training.
    assert "(node 0, n1) exited 0" in out, out
    assert "(node 1, n2) exited 137" in out, out
    assert "0: elasticrun: WARNING: node(s) " in out and "left the job" in out, out
    assert "the job now has 1 node(s), 1 worker(s)" in out, out
    assert "resumed from epoch" in out and "2 epochs" in out, out
    # Slurm reports the killed node's task: the job as a whole ends FAILED.
    assert fields["JobState"] == "FAILED", fields
    assert agents(job_id) == {}


def hosting(port: int, token: str) -> int:
    """The port of the job's service that hosts, as the two services' Status says (at `port`
    and `port` + 1: the first agent up hosts, on the first endpoint its host can bind)."""

    async def look() -> list[int]:
        found = []
        for i in (0, 1):
            peer = Peer(StoreMember(socket.gethostname(), port + i), i, token, None)
            try:
                status = await peer.status()
            finally:
                await peer.close()
            if status is not None and seen(i, status).host:
                found.append(i)
        return found

    deadline = time.monotonic() + 30
    while len(found := asyncio.run(look())) != 1:
        assert time.monotonic() < deadline, f"not one host among the job's services: {found}"
        time.sleep(0.1)
    return port + found[0]


def listener(port: int, pids: dict[int, int]) -> int:
    """Which of `pids` ({node: pid}) listens on TCP `port` (both nodes are this host)."""
    inodes = {f"socket:[{inode}]" for _, inode in listeners(port)}
    for node, pid in pids.items():
        fds = Path(f"/proc/{pid}/fd")
        if any(os.readlink(fd) in inodes for fd in fds.iterdir()):
            return node
    raise AssertionError(f"none of the agents {pids} listens on port {port}")


def test_the_node_hosting_the_rendezvous_killed_the_other_completes(cluster, tmp_path):
    # The embedded rendezvous on the first two nodes: one hosts it, the other stands by. The
    # host's agent is SIGKILLed mid-training: the other's service takes over with the job's
    # state, and that node re-forms alone and finishes the training.
    port, token = two_free_ports(), os.urandom(16).hex()
    env = job_env(ELASTICRUN_RDZV_PORT=str(port), ELASTICRUN_RDZV_TOKEN=token)
    job_id, killed, _, out = kill_an_agent_mid_training(
        cluster, tmp_path, env, lambda found: listener(hosting(port, token), found)
    )
    other = 1 - killed
    assert f"(node {other}, n{other + 1}) exited 0" in out, out
    said = f"{other}: elasticrun: WARNING: this node's rendezvous service hosts the job now"
    assert said in out, out
    assert "the job now has 1 node(s), 1 worker(s)" in out, out
    assert "resumed from epoch" in out and "2 epochs" in out, out
    assert agents(job_id) == {}


def test_stopping_the_cluster_ends_its_running_jobs(tmp_path):
    c = local_cluster.LocalCluster(tmp_path / "cluster", nodes=2)
    c.start()
    try:
        job_id = c.submit(["--nodes", "2", "--chdir", str(tmp_path), "--wrap", "srun sleep 300"])
        assert wait_for(lambda: c.job(job_id)["JobState"] == "RUNNING", 30)
        assert wait_for(lambda: len(c.processes(job_id)) >= 2, 30), "no task started"
        tasks = [pid for pid, _, _ in c.processes(job_id)]
    finally:
        daemons = c.pids()
        c.stop()
    assert wait_gone(daemons + tasks) == [], "a daemon or a task outlived the cluster"
    assert c._strays() == []
