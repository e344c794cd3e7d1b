"""A rendezvous handler in torch's shape, run by elasticrun's agent: the rounds' ranks, role
ranks and master address learnt through the handler's store (a dict here: the real one, a
torch TCPStore, is in tests/compat), the restart budget, closing, the exit barrier."""

from __future__ import annotations

import datetime
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest
from elastic_launch import cancel as cancel_module
from elastic_launch.api import Cancelled
from elastic_launch.cancel import CancelToken, SignalRelay
from elastic_launch.rendezvous.api import (
    CloseReason,
    RendezvousClosedError,
    RendezvousParameters,
    RestartReason,
)
from elastic_launch.rendezvous.registry import adapt
from elastic_launch.rendezvous.torch_shaped import TorchShapedRendezvous


class Store:
    """A torch Store's methods the adapter uses, shared by the nodes of one test."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.cond = threading.Condition()

    def set(self, key: str, value: str | bytes) -> None:
        with self.cond:
            self.data[key] = value.encode() if isinstance(value, str) else value
            self.cond.notify_all()

    def get(self, key: str) -> bytes:
        with self.cond:
            assert self.cond.wait_for(lambda: key in self.data, 10), f"{key} never set"
            return self.data[key]

    def add(self, key: str, n: int) -> int:
        with self.cond:
            value = int(self.data.get(key, b"0")) + n
            self.data[key] = str(value).encode()
            self.cond.notify_all()
            return value

    def check(self, keys: list[str]) -> bool:
        with self.cond:
            return all(k in self.data for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        with self.cond:
            if not self.cond.wait_for(
                lambda: all(k in self.data for k in keys), timeout.total_seconds()
            ):
                raise RuntimeError("Socket Timeout")


@dataclass
class BootstrapInfo:
    master_addr: str
    master_port: int


@dataclass
class Info:
    store: Any
    rank: int
    world_size: int
    bootstrap_store_info: Any = None


class TorchShaped:
    """A handler written against torch's RendezvousHandler: one fixed round per call."""

    def __init__(self, store: Store, rank: int, nodes: int, old_tuple: bool = False) -> None:
        self.store, self.rank, self.nodes, self.old_tuple = store, rank, nodes, old_tuple
        self.closed = False
        self.waiting = 0
        self.shut = 0

    def get_backend(self) -> str:
        return "mine"

    def get_run_id(self) -> str:
        return "job"

    def next_rendezvous(self) -> Any:
        if self.old_tuple:
            return (self.store, self.rank, self.nodes)
        return Info(self.store, self.rank, self.nodes, BootstrapInfo("node0.example", 29500))

    def is_closed(self) -> bool:
        return self.closed

    def set_closed(self) -> None:
        self.closed = True

    def num_nodes_waiting(self) -> int:
        return self.waiting

    def shutdown(self) -> bool:
        self.shut += 1
        return True


def params(lws: int, role: str = "", max_restarts: int = 0) -> RendezvousParameters:
    return RendezvousParameters("mine", "", "job", 1, 4, lws, max_restarts=max_restarts, role=role)


def form(handlers: list[TorchShapedRendezvous]) -> list[Any]:
    out: list[Any] = [None] * len(handlers)

    def one(i: int) -> None:
        out[i] = handlers[i].next_rendezvous()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(handlers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out


def test_ranks_and_role_ranks_count_in_group_rank_order():
    store = Store()
    layout = [(3, "trainer"), (1, "ps"), (2, "trainer")]  # by group rank
    nodes = [
        adapt(params(lws, role), TorchShaped(store, rank, 3))
        for rank, (lws, role) in enumerate(layout)
    ]
    infos = form(nodes)
    assert [i.world_size for i in infos] == [6, 6, 6]
    assert [i.rank_offset for i in infos] == [0, 3, 4]
    assert [i.role_rank_offset for i in infos] == [0, 0, 3]
    assert [i.role_world_size for i in infos] == [5, 1, 5]
    assert [(i.group_rank, i.group_world_size) for i in infos] == [(0, 3), (1, 3), (2, 3)]
    # The workers' MASTER_ADDR is torch's bootstrap address; the port node 0's free one (the
    # bootstrap port is the agents' store, which the workers do not share).
    assert {(i.master_addr, i.master_port) for i in infos} == {
        ("node0.example", infos[0].master_port)
    }
    assert infos[0].master_port != 29500


def test_torchs_older_tuple_answer_is_read_too():
    store = Store()
    nodes = [adapt(params(2), TorchShaped(store, r, 2, old_tuple=True)) for r in range(2)]
    infos = form(nodes)
    assert [i.rank_offset for i in infos] == [0, 2]
    assert infos[0].master_addr == infos[1].master_addr == "127.0.0.1"


def test_restarts_are_counted_on_the_node_and_closing_reaches_the_handler():
    handler = TorchShaped(Store(), 0, 1)
    node = adapt(params(1, max_restarts=1), handler)
    assert node.next_rendezvous().restart_count == 0
    assert node.next_rendezvous(RestartReason.FAILURE, failure="rank 0 exit code 1").round == 2
    with pytest.raises(RendezvousClosedError, match="restarts exhausted"):
        node.next_rendezvous(RestartReason.FAILURE, failure="rank 0 exit code 1")
    assert handler.closed, "a failed job is closed for the handler's other nodes too"


def test_a_handler_closed_elsewhere_because_the_job_failed_ends_the_job_here():
    store = Store()
    here, there = nodes = [adapt(params(1), TorchShaped(store, r, 2)) for r in range(2)]
    form(nodes)
    assert not here.membership_changed()
    here.handler.waiting = 1
    assert here.membership_changed(), "a node waiting to join: a new round"
    here.handler.waiting = 0
    there.set_closed(CloseReason.FAILED, "rank 1 exit code 1")
    here.handler.closed = True  # the handlers share their state, as etcd's do
    assert here.membership_changed()
    with pytest.raises(RendezvousClosedError):
        here.next_rendezvous(RestartReason.MEMBERSHIP)


def test_a_handler_closed_by_a_node_that_finished_leaves_the_workers_running():
    """upstream: local_elastic_agent_test.py's test_workers_drift_fail_{etcd,etcd_v2}: torch's
    etcd handler closes the rendezvous when the first node's agent shuts down after its
    workers succeeded; the other node's workers go on to their end, as under torch's agent."""
    store = Store()
    here, there = nodes = [adapt(params(1), TorchShaped(store, r, 2)) for r in range(2)]
    form(nodes)
    there.set_closed(CloseReason.SUCCEEDED)
    there.shutdown()
    here.handler.closed = True
    assert not here.membership_changed()


def test_the_exit_barrier_waits_for_every_node_and_never_fails_the_job():
    store = Store()
    nodes = [adapt(params(1), TorchShaped(store, r, 2)) for r in range(2)]
    form(nodes)
    for n in nodes:
        n.exit_barrier_timeout = 5
    first = threading.Thread(target=nodes[0].mark_done)
    first.start()
    first.join(0.3)
    assert first.is_alive(), "the first to finish waits for the other"
    assert nodes[1].mark_done()
    first.join(5)
    assert not first.is_alive()
    # A round whose other node never finishes: the barrier times out, the job is done here.
    store = Store()
    lone, _ = nodes = [adapt(params(1), TorchShaped(store, r, 2)) for r in range(2)]
    form(nodes)
    lone.exit_barrier_timeout = 0.2
    assert lone.mark_done(), "a barrier that times out does not fail the job"
    assert lone.closed().reason == CloseReason.SUCCEEDED


def test_shutdown_reaches_the_handler():
    handler = TorchShaped(Store(), 0, 1)
    adapt(params(1), handler).shutdown()
    assert handler.shut == 1


class Waiting(TorchShaped):
    """A handler that waits for nodes that never come, sleeping as torch's does (no token
    reaches it); `entered` is set once it waits."""

    def __init__(self) -> None:
        super().__init__(Store(), 0, 2)
        self.entered = threading.Event()

    def next_rendezvous(self) -> Any:
        self.entered.set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            time.sleep(0.05)
        raise AssertionError("the signal did not end the wait")


def test_a_signal_ends_a_wait_in_a_handler_that_takes_no_token():
    """A signal must end the agent whatever handler it waits in: the handler is abandoned
    with Cancelled, and the token says which signal it was."""
    token = CancelToken()
    handler = Waiting()
    rdzv = TorchShapedRendezvous(params(1), handler)

    def signal_once_it_waits() -> None:
        if handler.entered.wait(30):
            os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=signal_once_it_waits, daemon=True).start()
    with SignalRelay(token, [signal.SIGUSR1]), pytest.raises(Cancelled):
        rdzv.next_rendezvous(cancel=token)
    assert token.wait(10) and token.signum == signal.SIGUSR1
    assert not cancel_module._foreign_calls, "outside the call, signals raise nothing"


def test_an_object_without_torchs_methods_is_refused_naming_what_it_lacks():
    from elastic_launch.rendezvous.api import RendezvousConfigError
    from elastic_launch.rendezvous.torch_shaped import is_torch_shaped

    class Half:
        def next_rendezvous(self) -> None: ...

        def is_closed(self) -> bool:
            return False

    params = RendezvousParameters("mine", "h:1", "r", 1, 1, 1)
    assert not is_torch_shaped(Half())
    with pytest.raises(RendezvousConfigError, match="lacks set_closed, num_nodes_waiting"):
        adapt(params, Half())
