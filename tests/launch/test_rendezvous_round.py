"""One elastic rendezvous round, in process: several handlers (one per thread, each with its own
store connection) against the embedded service and a real etcd."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from elastic_launch.rendezvous.api import RendezvousInfo, RendezvousParameters
from elastic_launch.rendezvous.elastic import ElasticRendezvous, Timeouts
from elastic_launch.rendezvous.etcd_v3 import EtcdV3Store

# MAX nodes freeze a round at once; a long last call keeps a slow thread from being left out.
TIMEOUTS = Timeouts(join=30.0, last_call=10.0, heartbeat=5.0, close=10.0, reconnect=5.0)


class CountingStore(EtcdV3Store):
    """Counts compare-and-swap writes, the state's only writes once it exists."""

    cas_calls = 0
    lock = threading.Lock()

    def cas(self, key: str, value: bytes, version: int) -> int:
        with CountingStore.lock:
            CountingStore.cas_calls += 1
        return super().cas(key, value, version)


@pytest.fixture(params=["embedded", "etcd"])
def endpoint(request):
    if request.param == "etcd":
        return request.getfixturevalue("etcd").endpoint, None
    return request.getfixturevalue("embedded")


def handlers(
    endpoint: tuple[str, str | None],
    n: int,
    run_id: str,
    stores: list[type[EtcdV3Store]] | None = None,
) -> list[ElasticRendezvous]:
    """`n` handlers of a job of 2..n nodes, each with its own connection (of `stores`)."""
    address, token = endpoint
    params = RendezvousParameters("etcd", address, run_id, 2, n, 1, local_addr="127.0.0.1")
    return [
        ElasticRendezvous(
            params, store(address, "test store", token=token, retry_for=5), TIMEOUTS, "127.0.0.1"
        )
        for store in stores or [CountingStore] * n
    ]


def form_round(members: list[ElasticRendezvous]) -> list[RendezvousInfo]:
    pool = ThreadPoolExecutor(len(members))
    try:
        return list(pool.map(lambda h: h.next_rendezvous(), members, timeout=60))
    finally:
        pool.shutdown(wait=False)  # a thread still waiting ends when the test shuts it down


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def watcher_threads() -> int:
    return sum(t.name == "elasticrun-rdzv" and t.is_alive() for t in threading.enumerate())


def test_a_round_of_max_nodes_writes_the_state_twice(endpoint, request):
    members = handlers(endpoint, 4, f"round-{request.node.callspec.id}-{time.monotonic_ns()}")
    try:
        CountingStore.cas_calls = 0
        infos = form_round(members)
        assert sorted(i.group_rank for i in infos) == [0, 1, 2, 3]
        assert {(i.round, i.group_world_size, i.master_port) for i in infos} == {
            (infos[0].round, 4, infos[0].master_port)
        }
        # Freeze and final, once each: the leader goes on from what it wrote instead of
        # writing again until its watch brings the change back.
        assert CountingStore.cas_calls == 2
    finally:
        for h in members:
            h.shutdown()


@pytest.mark.parametrize("settle", [0.0, 0.3], ids=["at-once", "later"])
def test_the_members_see_a_node_leave_after_the_round(endpoint, request, settle):
    run_id = f"leave-{request.node.callspec.id}-{time.monotonic_ns()}"
    members = handlers(endpoint, 3, run_id)
    try:
        form_round(members)
        if settle:
            time.sleep(settle)
            assert not any(h.membership_changed() for h in members)
        # Its lease is revoked: its join key goes at once, before or after the others'
        # watchers have taken their first look.
        members[0].shutdown()
        wait_for(
            lambda: all(h.membership_changed() for h in members[1:]),
            "the others never noticed the node leave",
        )
    finally:
        for h in members:
            h.shutdown()
    assert watcher_threads() == 0, "a watcher outlived its handler"


def test_a_new_round_right_after_one_formed_starts_clean(endpoint, request):
    members = handlers(endpoint, 2, f"again-{request.node.callspec.id}-{time.monotonic_ns()}")
    try:
        first = form_round(members)
        second = form_round(members)  # at once, while the first round's watchers start
        assert {i.round for i in second} == {first[0].round + 1}
        time.sleep(0.3)
        assert not any(h.membership_changed() for h in members), "a stale change was reported"
        assert watcher_threads() == len(members), "one watcher per handler, the old ones gone"
    finally:
        for h in members:
            h.shutdown()


class SlowConfirmStore(EtcdV3Store):
    def put(self, key: str, value: bytes, ephemeral: bool = False) -> int:
        if "/confirm/" in key:
            time.sleep(0.5)
        return super().put(key, value, ephemeral)


def test_a_member_that_leads_the_confirmations_but_not_the_join_sees_them(endpoint, request):
    """The join's leader loses its key and rejoins, so another member comes first in the
    frozen round and leads the confirmations with a watch on the state alone: it must still
    see every confirmation, not wait out the close timeout and start the round over."""
    address, token = endpoint
    run_id = f"confirm-{request.node.callspec.id}-{time.monotonic_ns()}"
    raw = EtcdV3Store(address, "test store", token=token, retry_for=5)
    # The other two confirm late, after the confirmations' leader has read them once.
    members = handlers(endpoint, 3, run_id, [SlowConfirmStore, EtcdV3Store, SlowConfirmStore])
    join_prefix = f"/elasticrun/{run_id}/v1/join/"

    def joined() -> list[tuple[int, str]]:
        return sorted((kv.created, kv.key) for kv in raw.range(join_prefix)[0])

    pool = ThreadPoolExecutor(3)
    try:
        first = pool.submit(members[0].next_rendezvous)
        wait_for(lambda: len(joined()) == 1, "the first node never joined")
        second = pool.submit(members[1].next_rendezvous)
        wait_for(lambda: len(joined()) == 2, "the second node never joined")
        leader_key = joined()[0][1]
        raw.delete(leader_key)  # as if its lease had expired: it joins again, now second
        wait_for(lambda: [k for _, k in joined()][-1:] == [leader_key], "it never rejoined")
        third = pool.submit(members[2].next_rendezvous)
        infos = [f.result(timeout=30) for f in (first, second, third)]
        assert [i.round for i in infos] == [1, 1, 1], "the round was started over"
        assert sorted(i.group_rank for i in infos) == [0, 1, 2]
    finally:
        for h in members:
            h.shutdown()
        raw.close()
        pool.shutdown(wait=False)


def test_a_node_that_finished_first_waits_for_the_job_to_close(endpoint, request):
    """The embedded host lingers until the others' last writes are through: a member that
    has written its done key but not yet closed the job still needs the service."""
    members = handlers(endpoint, 2, f"linger-{request.node.callspec.id}-{time.monotonic_ns()}")
    try:
        form_round(members)
        first, last = members
        assert not first.mark_done(), "the other member still runs"
        last.store.put(f"{last.prefix}/done/{last.node}", b"1")  # mid-way through mark_done
        assert not first.wait_for_others(1.0), "it left before the job was closed"
        assert last.mark_done(), "the last to finish closes the job"
        assert first.wait_for_others(10.0)
    finally:
        for h in members:
            h.shutdown()
