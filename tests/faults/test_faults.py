"""The fault suite: a small deterministic DDP job (examples/train_ddp.py) meets a real fault
while it trains, and must end with the very weights of a fault-free run (or fail with a clear
error), with nothing left running and its last good checkpoint intact.

Faults are injected from outside, as they happen: signals to real processes, an etcd server
stopped, a full disk. Each waits for the job's own record of its progress (the steps it
trained), not for a time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from jobs import FAST, ONE_THREAD, TOTAL_STEPS, Job, finish_quietly, node_args
from launcher_util import finish, free_port, listening, start, wait_for, wait_gone


def _signal_one_worker(job: Job, sig: int, *flags: str) -> tuple[int, str, list[int]]:
    """Run the job on one node with 2 restarts; at step 12, send rank 1 `sig` (while the
    ranks hold there, when the job holds at 12). Returns the launcher's exit code and stderr,
    and the workers the fault met."""
    proc = start(["--standalone", "--nproc-per-node", "2", "--max-restarts", "2", *flags])
    try:
        job.wait_step(12, proc)
        victims = job.workers()
        os.kill(victims[1], sig)
        if 12 in job.hold:
            job.release(12)
        code, _, err = finish(proc, timeout=150)
    finally:
        finish_quietly(proc)
    return code, err, list(victims.values())


@pytest.mark.timeout(200)
def test_a_worker_killed_mid_run(tmp_path, reference):
    job = Job(tmp_path, "sigkill", hold=(12,))
    code, err, victims = _signal_one_worker(job, signal.SIGKILL, *FAST, *job.args())
    assert code == 0, err[-3000:]
    assert "restarting the workers (restart 1 of 2)" in err
    job.assert_recovered(reference, victims)


@pytest.mark.timeout(200)
def test_a_worker_stopped_mid_run_is_found_hung_and_replaced(tmp_path, reference):
    # No hold here: a worker stopped inside a hold, which is quiet(), would never be hung.
    job = Job(tmp_path, "sigstop")
    flags = ["--hang-timeout", "3", *FAST]
    code, err, victims = _signal_one_worker(job, signal.SIGSTOP, *flags, *job.args())
    assert code == 0, err[-3000:]
    assert "hung" in err and "restart 1 of 2" in err, err[-3000:]
    job.assert_recovered(reference, victims)


@pytest.mark.timeout(240)
def test_an_agent_killed_on_one_of_two_nodes_and_started_again(tmp_path, reference):
    # Two "nodes" (agents) of one worker each; the embedded rendezvous is hosted by the
    # first. The second node's agent is SIGKILLed (its worker dies with it); as a cluster
    # would, a new agent is started in its place, and the job goes on from the checkpoint.
    job = Job(tmp_path, "agent", hold=(12,))
    endpoint = f"127.0.0.1:{free_port()}"
    node = node_args(job, endpoint, f"faults-{os.getpid()}")
    host = start(node, ONE_THREAD)
    procs = [host]
    try:
        assert wait_for(lambda: listening(endpoint), 30), "the first agent did not host"
        other = start(node, ONE_THREAD)
        procs.append(other)
        job.wait_step(12, host, other)
        victims = job.workers()
        assert len(victims) == 2, f"not both workers running at the fault: {victims}"
        os.kill(other.pid, signal.SIGKILL)  # the agent only: its worker must die with it
        job.release(12)
        other.wait(timeout=30)
        assert wait_for(lambda: len(job.workers()) < 2, 30), "the dead agent's worker lives"
        again = start(node, ONE_THREAD)
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


@pytest.mark.timeout(240)
def test_a_network_partition_between_two_nodes_that_heals(tmp_path, reference, two_hosts):
    # Two hosts (network namespaces) of one worker each; the first hosts the embedded
    # rendezvous. At step 12 the link between them goes down: the first host sees the
    # second's lease expire and stops its worker (stuck in a collective with its lost peer:
    # it is killed after --shutdown-timeout). The link comes back; the second host finds its
    # lease gone, stops its worker, rejoins, and the job goes on from the last checkpoint.
    job = Job(tmp_path, "partition", hold=(12,))
    endpoint = f"{two_hosts.addrs[0]}:29400"
    token = os.urandom(16).hex()
    procs = []

    def node(host: int) -> subprocess.Popen[str]:
        args = node_args(
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
        job.release(12)  # into a collective with the lost peer
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
