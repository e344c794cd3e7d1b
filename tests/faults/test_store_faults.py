"""The store loses a member while a real job trains: a 3-member etcd cluster (as etcd is
deployed), two launchers of one worker each, and every member named in --rdzv-endpoint. A
member is killed, stopped, cut off or restarted, then a worker crashes, so that the job needs a
new round through the members that are left: it must complete with the weights of a fault-free
run, and spend one restart on the crash and none on the store.

Each waits for the job's own record of its progress, never for a time."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from elastic_launch.rendezvous.embedded.succession import standing_by
from jobs import ONE_THREAD, Job, Netns, finish_quietly, node_args
from launcher_util import finish, free_port, listening, start, wait_for, wait_gone


class TwoNodes:
    """A two-node job (one worker each) on the etcd at `endpoint`; node b may list the members
    in another order (`endpoint_b`: each node names the members as it likes)."""

    def __init__(
        self,
        job: Job,
        backend: str,
        endpoint: str,
        *extra: str,
        endpoint_b: str = "",
        extra_b: tuple[str, ...] = (),
    ) -> None:
        run_id = f"store-{os.getpid()}-{os.urandom(2).hex()}"
        self.job = job
        self.args = [
            node_args(job, endpoint, run_id, *extra, backend=backend),
            node_args(job, endpoint_b or endpoint, run_id, *extra, *extra_b, backend=backend),
        ]
        self.procs: list[subprocess.Popen[str]] = []
        self.spares: list[subprocess.Popen[str]] = []

    def start(self, *nodes: int) -> None:
        """Start nodes `nodes` (every node when none is named)."""
        for i in nodes or (0, 1):
            self.procs.append(start(self.args[i], ONE_THREAD))

    def start_spare(self, log: Path) -> subprocess.Popen[str]:
        """A third node with node b's command, its output in `log`; once it says it waits
        as a spare."""
        spare = start(self.args[1], ONE_THREAD, log=log)
        self.spares.append(spare)
        said = lambda: "waits as a spare" in log.read_text(errors="replace")  # noqa: E731
        assert wait_for(lambda: said() or spare.poll() is not None, 90), "no spare waited"
        assert spare.poll() is None, log.read_text()[-3000:]
        return spare

    def crash_a_worker(self) -> None:
        """SIGKILL the worker of rank 1 (as a worker's fault would end it)."""
        workers = self.job.workers()
        assert 1 in workers, f"no worker of rank 1 runs: {workers}"
        os.kill(workers[1], signal.SIGKILL)

    def finish(self) -> list[tuple[int, str, str]]:
        """Every node's (exit code, stdout, stderr); each must have succeeded."""
        results = [finish(p, timeout=180) for p in self.procs]
        said = "\n".join(
            f"node {i} exited {code}:\n{err[-3000:]}" for i, (code, _, err) in enumerate(results)
        )
        assert all(code == 0 for code, _, _ in results), said
        return results

    def end(self) -> None:
        for p in self.procs + self.spares:
            finish_quietly(p)


@pytest.fixture
def two_nodes(tmp_path: Path) -> Iterator[Callable[..., TwoNodes]]:
    made: list[TwoNodes] = []

    def make(
        backend: str,
        endpoint: str,
        *extra: str,
        endpoint_b: str = "",
        hold: tuple[int, ...] = (),
        extra_b: tuple[str, ...] = (),
    ) -> TwoNodes:
        job = Job(tmp_path, "store", hold)
        made.append(
            TwoNodes(job, backend, endpoint, *extra, endpoint_b=endpoint_b, extra_b=extra_b)
        )
        return made[-1]

    yield make
    for nodes in made:
        nodes.end()


def spent(results: list[tuple[int, str, str]], restarts: int) -> None:
    """The job restarted `restarts` times, no more: the store's fault cost none. (The node
    whose worker failed spends the restart and says so; the others restart for it.)"""
    logs = "\n".join(err for _, _, err in results)
    if restarts:
        assert f"restart {restarts} of 3" in logs, logs[-4000:]
    assert f"restart {restarts + 1} of 3" not in logs, logs[-4000:]


def moved(results: list[tuple[int, str, str]]) -> None:
    """Some node left a failed member for the next."""
    assert any("failed" in err and "going on with" in err for _, _, err in results), [
        err[-2000:] for _, _, err in results
    ]


#: The steps a_store_fault_then_a_crash holds the ranks after: the store's fault, the crash.
FAULT_HOLDS = (8, 16)


def a_store_fault_then_a_crash(nodes: TwoNodes, fault: Callable[[], None], reference: Path):
    """The job trains; `fault` hits the store at step 8; a worker crashes at step 16 (a new
    round through what is left of the store); the job completes as a fault-free run did.
    (`nodes` hold after FAULT_HOLDS, so each fault meets the job where it should.)"""
    nodes.start()
    nodes.job.wait_step(8, *nodes.procs)
    fault()
    nodes.job.release(8)
    nodes.job.wait_step(16, *nodes.procs)  # training goes on without the member
    victims = list(nodes.job.workers().values())
    nodes.crash_a_worker()
    nodes.job.release(16)
    results = nodes.finish()
    spent(results, 1)
    nodes.job.assert_recovered(reference, victims)
    return results


@pytest.mark.timeout(240)
def test_the_member_named_first_killed(two_nodes, etcd_cluster, reference):
    # The v2 API's store meets the same fault alone: test_store.py's
    # test_a_store_goes_on_when_the_member_it_uses_is_killed.
    nodes = two_nodes("etcd", etcd_cluster.endpoint, hold=FAULT_HOLDS)
    results = a_store_fault_then_a_crash(nodes, etcd_cluster.members[0].kill, reference)
    moved(results)


@pytest.mark.timeout(240)
def test_the_leader_killed(two_nodes, etcd_cluster, reference):
    etcd_cluster.lead(1)  # not the member the nodes use: they see only the election
    nodes = two_nodes("etcd", etcd_cluster.endpoint, hold=FAULT_HOLDS)
    a_store_fault_then_a_crash(nodes, etcd_cluster.members[1].kill, reference)


@pytest.mark.timeout(240)
def test_a_member_stopped(two_nodes, etcd_cluster, reference):
    # SIGSTOP: the member keeps its connections open and answers nothing (a hung VM).
    stopped = etcd_cluster.members[0]
    nodes = two_nodes("etcd", etcd_cluster.endpoint, hold=FAULT_HOLDS)
    try:
        assert stopped.proc is not None
        results = a_store_fault_then_a_crash(
            nodes, lambda: stopped.proc.send_signal(signal.SIGSTOP), reference
        )
    finally:
        if stopped.proc is not None:
            stopped.proc.send_signal(signal.SIGCONT)
    moved(results)


@pytest.fixture
def cut_off(etcd_clusters) -> Iterator[tuple[Any, Netns]]:
    """A 3-member cluster whose first member runs in a network namespace of its own, joined
    to this one by a veth pair: (the cluster, the namespace)."""
    net = Netns("e", names=1)
    cluster = None
    try:
        problem = net.setup()
        if problem:
            pytest.skip(f"cannot make a network namespace here ({problem}): needs root")
        inside, outside = net.addrs[0], net.addrs[1]
        here = {"peer_host": outside}  # the others' peers: reachable from the namespace
        where = {
            0: {"host": inside, "peer_host": inside, "prefix": net.prefix(0)},
            1: here,
            2: here,
        }
        cluster = etcd_clusters(3, where)
        yield cluster, net
    finally:
        if cluster is not None:
            cluster.members[0].kill()  # cut off, it would wait for its peers to stop
        net.remove()


@pytest.mark.timeout(240)
def test_a_member_cut_off_by_the_network(two_nodes, cut_off, reference):
    cluster, net = cut_off
    nodes = two_nodes("etcd", cluster.endpoint, hold=FAULT_HOLDS)
    results = a_store_fault_then_a_crash(nodes, net.cut, reference)
    moved(results)


@pytest.mark.timeout(300)
def test_a_rolling_restart_of_every_member_with_a_crash_after_each(
    two_nodes, etcd_cluster, reference
):
    # As etcd is upgraded: one member at a time is stopped and started again; a worker
    # crashes after each, so that every new round goes through a cluster missing a member
    # a moment before.
    holds = (6, 12, 18)  # each attempt's ranks wait there for the member's restart
    nodes = two_nodes("etcd", etcd_cluster.endpoint, hold=holds)
    nodes.start()
    victims: set[int] = set()
    for attempt, (member, step) in enumerate(zip(etcd_cluster.members, holds, strict=True)):
        nodes.job.wait_step(step, *nodes.procs, attempt=attempt)
        member.restart()
        victims |= set(nodes.job.workers().values())
        nodes.crash_a_worker()
        nodes.job.release(step)
    results = nodes.finish()
    spent(results, 3)
    nodes.job.assert_recovered(reference, list(victims))


@pytest.mark.timeout(240)
def test_a_watched_history_compacted_under_a_waiting_node(two_nodes, etcd_cluster, reference):
    # Node a waits for node b, watching the job from the revision after its last read, on
    # member 0. The cluster moves on (writes elsewhere) and compacts its history up to now:
    # a's watch, in sync on member 0, hears nothing of it. Member 0 is killed: a's watch
    # goes on from its revision on member 1, finds that history compacted (etcd's "required
    # revision has been compacted"), reads the round again and watches from that read. Node
    # b then joins, and the job forms and completes.
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
    from elastic_launch.rendezvous.store.api import StoreAccess

    nodes = two_nodes("etcd", etcd_cluster.endpoint)
    nodes.start(0)
    other = EtcdV3Store(etcd_cluster.members[1].endpoint, StoreAccess("etcd", retry_for=10))

    def joined() -> bool:
        return any("/join/" in kv.key for kv in other.range("/elasticrun/")[0])

    try:
        assert wait_for(joined, 60), "node a did not join"
        # ... and waits, watching on member 0 from before what follows (not a read after it)
        assert wait_for(lambda: etcd_cluster.members[0].watchers() > 0, 60), "a never waited"
        for i in range(5):
            other.put(f"/elsewhere/{i}", b"x")
        etcd_cluster.compact(via=1)
        etcd_cluster.members[0].kill()
    finally:
        other.close()
    nodes.start(1)
    results = nodes.finish()
    assert "compacted" in results[0][2] and "reading the round again" in results[0][2]
    spent(results, 0)
    nodes.job.assert_same_weights(reference)


def fill(endpoint: str) -> None:
    """Write to the etcd at `endpoint` until it raises its NOSPACE alarm."""
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
    from elastic_launch.rendezvous.store.api import StoreAccess, StoreError

    filler = EtcdV3Store(endpoint, StoreAccess("etcd", retry_for=10))
    try:
        for i in range(1000):
            try:
                filler.put(f"/filler/{i}", b"x" * 100_000)
            except StoreError as e:
                full = e
                break
        else:
            raise AssertionError("etcd never said NOSPACE")
        assert "NOSPACE" in str(full), full
    finally:
        filler.close()


@pytest.mark.timeout(240)
def test_a_full_etcd_is_a_clear_error_naming_its_alarm(two_nodes, etcd_small):
    # The job trains; etcd's database reaches its quota (its NOSPACE alarm: every write is
    # refused); a worker crashes and the job needs a new round, which it cannot write.
    nodes = two_nodes("etcd", etcd_small.endpoint, hold=(8,))
    nodes.start()
    nodes.job.wait_step(8, *nodes.procs)
    fill(etcd_small.endpoint)
    nodes.crash_a_worker()
    nodes.job.release(8)
    results = [finish(p, timeout=180) for p in nodes.procs]
    assert all(code != 0 for code, _, _ in results)
    said = "\n".join(err for _, _, err in results)
    assert "raised its NOSPACE alarm" in said and "etcdctl alarm disarm" in said, said[-3000:]
    assert "Traceback (most recent call last)" not in said.split("[rank")[-1]
    nodes.job.assert_checkpoint_intact(at_least=5)
    assert nodes.job.workers() == {}


@pytest.mark.timeout(240)
def test_the_node_hosting_the_embedded_rendezvous_killed_and_started_again(two_nodes, reference):
    # Two nodes, each serving one of the two endpoints: node a hosts, node b stands by. Node
    # a's launcher is SIGKILLed (its worker dies with it) and started again with the same
    # command: node b's service has taken over with the job's state, node a's new service
    # follows it, and the job goes on from its checkpoint to the fault-free weights.
    first, second = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    nodes = two_nodes("c10d", f"{first},{second}", hold=(8,))
    nodes.start(0)
    assert wait_for(lambda: listening(first), 30), "node a did not serve the first endpoint"
    nodes.start(1)
    nodes.job.wait_step(8, *nodes.procs)
    victims = list(nodes.job.workers().values())
    host = nodes.procs.pop(0)
    host.kill()
    nodes.job.release(8)
    host.communicate(timeout=30)
    nodes.start(0)  # the same command, on the same host
    results = nodes.finish()
    assert "hosts the job now" in results[0][2], results[0][2][-3000:]
    nodes.job.assert_recovered(reference, victims)


# ---- one endpoint, as torchrun users write it --------------------------------------------------


def host_killed(
    nodes: TwoNodes, endpoint: str, spare: Path | None = None, successor: bool = True
) -> list[int]:
    """Once the job trains (held at step 8), a spare waits (its log `spare`, if given) and
    the agents' successor holds a copy of the rendezvous (unless `successor` is False: none
    may stand by), SIGKILL the node that hosts it (its launcher, and its worker with it):
    the workers of that time."""
    nodes.start(0)
    assert wait_for(lambda: listening(endpoint), 30), "node a did not serve the endpoint"
    nodes.start(1)
    nodes.job.wait_step(8, *nodes.procs)
    if spare is not None:
        nodes.start_spare(spare)
    if successor:
        assert wait_for(lambda: standing_by(endpoint), 60), "no successor stood by"
    victims = list(nodes.job.workers().values())
    host = nodes.procs.pop(0)
    host.kill()
    host.communicate(timeout=30)
    return victims


@pytest.mark.timeout(240)
def test_one_endpoint_the_host_killed_and_started_again_at_its_address(two_nodes, reference):
    # (a) Two nodes given one endpoint: node a hosts, node b is chosen as the successor and
    # keeps a copy. Node a's launcher is SIGKILLed and started again with the same command:
    # b's copy hosts, a's new service at the endpoint is told and follows it, a's agent finds
    # the job through it, and the job goes on from its memory to the fault-free weights,
    # without spending a restart.
    endpoint = f"127.0.0.1:{free_port()}"
    said = the_host_started_again(two_nodes("c10d", endpoint, hold=(8,)), endpoint, reference)
    assert "hosts the job now" in said, said[-3000:]


def the_host_started_again(
    nodes: TwoNodes, endpoint: str, reference: Path, successor: bool = True
) -> str:
    """The host's node SIGKILLed (see host_killed) and started again with the same command:
    the job completes as a fault-free run did, spending no restart. What the nodes said."""
    victims = host_killed(nodes, endpoint, successor=successor)
    nodes.job.release(8)
    nodes.start(0)  # the same command, at the same address
    results = nodes.finish()
    spent(results, 0)
    nodes.job.assert_recovered(reference, victims)
    return "\n".join(err for _, _, err in results)


@pytest.mark.timeout(240)
def test_one_endpoint_the_host_killed_and_a_spare_node_takes_its_place(
    two_nodes, reference, tmp_path
):
    # (c) The same two nodes and a third waiting as a spare: the host's node is lost and none
    # is started; b's copy hosts, the spare (which learned the successor) is admitted, and the
    # job goes on with two nodes to the fault-free weights, without spending a restart.
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = two_nodes("c10d", endpoint, hold=(8,))
    victims = host_killed(nodes, endpoint, spare=tmp_path / "spare.log")
    nodes.job.release(8)
    results = nodes.finish()
    spare = (tmp_path / "spare.log").read_text
    assert finish(nodes.spares[0], timeout=180)[0] == 0, spare()[-3000:]
    spent(results, 0)
    assert "restart 1 of 3" not in spare()
    nodes.job.assert_recovered(reference, victims)


@pytest.mark.timeout(240)
def test_one_endpoint_the_host_killed_and_an_elastic_job_goes_on_without_it(
    two_nodes, shrunk_reference, reference
):
    # (b) --nnodes 1:2, and nothing started in the host's place: b's copy hosts, b goes on
    # alone from the step both had at the loss (its memory), without spending a restart, to
    # the weights of a fault-free job of that shape.
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = two_nodes("c10d", endpoint, "--nnodes", "1:2", hold=(8,))
    victims = host_killed(nodes, endpoint)
    nodes.job.release(8)
    results = nodes.finish()
    spent(results, 0)
    nodes.job.assert_same_weights(shrunk_reference)
    with pytest.raises(AssertionError, match="differs"):  # it did go on alone
        nodes.job.assert_same_weights(reference)
    assert wait_gone(victims) == [] and nodes.job.workers() == {}


@pytest.mark.timeout(240)
def test_one_endpoint_the_host_started_again_with_no_copy_is_filled_by_the_survivor(
    two_nodes, reference
):
    # (a) with no successor (node b may not serve: is_host=false): the host's node is
    # SIGKILLed and started again; its new service is empty, and node b, finding it so, puts
    # back what it knows (its lease, the round and its members, the restart count); the
    # replacement joins that job, not a new one, and it goes on to the fault-free weights.
    endpoint = f"127.0.0.1:{free_port()}"
    nodes = two_nodes("c10d", endpoint, hold=(8,), extra_b=("--rdzv-conf", "is_host=false"))
    said = the_host_started_again(nodes, endpoint, reference, successor=False)
    assert "putting back what this node knows" in said, said[-3000:]


@pytest.mark.timeout(240)
def test_an_etcd_started_again_empty_is_filled_by_the_nodes(two_nodes, etcd, reference):
    # etcd, one member, loses its data while the job trains and comes back with the same
    # flags (its cluster id is its configuration's: only its revision says it is empty). The
    # nodes find it so and put back what they know (their leases, the round, the restart
    # count); a worker then crashes, and the new round goes through the filled store.
    nodes = two_nodes("etcd", etcd.endpoint, hold=FAULT_HOLDS)
    results = a_store_fault_then_a_crash(nodes, etcd.restart_empty, reference)
    said = "\n".join(err for _, _, err in results)
    assert "putting back what this node knows" in said, said[-3000:]
    assert "left the job" not in said, "a node whose keys came back a moment later is no loss"
