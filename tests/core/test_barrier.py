"""Local and TCP barriers from Python: many rounds, aborts naming the culprit, bad input."""

from __future__ import annotations

import threading

import elastic_core as ec
import pytest
from elastic_launch.net import free_port

PARTICIPANT = """
import sys, elastic_core
b = elastic_core.LocalBarrier.open({path!r}, {index})
try:
    for _ in range({rounds}):
        b.wait(timeout=60)
except elastic_core.BarrierAbortedError as e:
    print("ABORTED", e.culprit, e, flush=True)
    sys.exit(3)
print("DONE", flush=True)
"""


def test_four_processes_pass_a_thousand_rounds(procs, shm_path):
    path = shm_path("bar")
    with ec.LocalBarrier.create(path, 4) as owner:
        children = [
            procs.python(PARTICIPANT.format(path=path, index=i, rounds=1000)) for i in range(4)
        ]
        for child in children:
            out, err = child.communicate(timeout=90)
            assert child.returncode == 0, err
            assert out.decode().strip() == "DONE"
        assert owner.rounds == 1000


def test_killed_participant_aborts_the_barrier_naming_it(procs, shm_path):
    path = shm_path("abort")
    owner = ec.LocalBarrier.create(path, 3)
    with ec.Watchdog() as wd:
        wd.attach_barrier(owner)
        waiters = [procs.python(PARTICIPANT.format(path=path, index=i, rounds=1)) for i in (0, 1)]
        doomed = procs.python(
            f"import elastic_core, time; b = elastic_core.LocalBarrier.open({path!r}, 2); "
            "time.sleep(120)"
        )
        wd.watch(2, doomed.pid)
        doomed.kill()
        for waiter in waiters:
            out, err = waiter.communicate(timeout=30)
            assert waiter.returncode == 3, err
            line = out.decode()
            assert line.startswith("ABORTED 2 ")
            assert "worker 2" in line
            assert "SIGKILL" in line
    assert owner.aborted
    owner.reset()
    assert not owner.aborted
    owner.close()


def test_timeout_names_the_missing_participants(shm_path):
    path = shm_path("timeout")
    with ec.LocalBarrier.create(path, 2), ec.LocalBarrier.open(path, 0) as me:
        with pytest.raises(ec.WaitTimeoutError, match=r"participant\(s\) 1 did not arrive") as e:
            me.wait(timeout=0.1)
        assert isinstance(e.value, TimeoutError)
        assert e.value.culprit == 1


def test_bad_arguments(shm_path):
    path = shm_path("bad")
    with pytest.raises(ec.InvalidArgumentError, match="got 0"):
        ec.LocalBarrier.create(path, 0)
    with ec.LocalBarrier.create(path, 2) as owner:
        with pytest.raises(ec.InvalidArgumentError, match="participant 2 is out of range"):
            ec.LocalBarrier.open(path, 2)
        with pytest.raises(ec.StateError, match="not a participant"):
            owner.wait(timeout=0.1)
        with pytest.raises(ValueError, match="timeout=-2"):
            owner.wait(timeout=-2)
    with pytest.raises(ec.BadFileError, match="does not exist"):
        ec.LocalBarrier.open(path, 0)


def test_tcp_barrier_rounds_across_three_peers():
    peers = [f"127.0.0.1:{free_port()}", "127.0.0.1:2", "127.0.0.1:3"]
    errors: list[BaseException] = []

    def peer(rank: int) -> None:
        try:
            with ec.TcpBarrier(peers, rank, token="job", connect_timeout=20) as b:
                for _ in range(100):
                    b.wait(timeout=20)
                assert b.rounds == 100
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=peer, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors


def test_tcp_barrier_names_an_unreachable_peer():
    leader = f"127.0.0.1:{free_port()}"
    with pytest.raises(ec.PeerError, match=rf"peer 0 \({leader}\) is unreachable") as e:
        ec.TcpBarrier([leader, "127.0.0.1:1"], 1, connect_timeout=0.3)
    assert e.value.culprit == 0
    assert isinstance(e.value, ConnectionError)


def test_tcp_barrier_bad_peer_strings():
    with pytest.raises(ec.InvalidArgumentError, match="peer 1 'nohost' is not host:port"):
        ec.TcpBarrier(["127.0.0.1:1", "nohost"], 0, connect_timeout=0.1)
