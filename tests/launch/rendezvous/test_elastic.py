"""The elastic rendezvous in process: several handlers (one per thread, each with its own store
connection) against the embedded service and a real etcd."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
from elastic_launch.api import Cancelled
from elastic_launch.cancel import CancelToken, Notice
from elastic_launch.rendezvous.api import (
    CloseReason,
    RendezvousClosedError,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousVersionError,
    RestartReason,
    RunIdInUseError,
)
from elastic_launch.rendezvous.conf import RendezvousConf
from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
from elastic_launch.rendezvous.round.elastic import ElasticRendezvous
from elastic_launch.rendezvous.store.api import StoreAccess

# MAX nodes freeze a round at once; a long last call keeps a slow thread from being left out.
CONF = RendezvousConf.defaults(
    join_timeout=30.0,
    last_call_timeout=10.0,
    heartbeat_timeout=5.0,
    close_timeout=10.0,
    reconnect_timeout=5.0,
)


class CountingStore(EtcdV3Store):
    """Counts compare-and-swap writes of an existing state, its only writes once it exists."""

    cas_calls = 0
    lock = threading.Lock()

    def cas(self, key: str, value: bytes, version: int, ttl: float | None = None) -> int:
        if version:
            with CountingStore.lock:
                CountingStore.cas_calls += 1
        return super().cas(key, value, version, ttl)

    def cas_with(self, key: str, value: bytes, version: int, puts: Mapping[str, bytes]) -> int:
        if version:
            with CountingStore.lock:
                CountingStore.cas_calls += 1
        return super().cas_with(key, value, version, puts)


SLOW = pytest.mark.slow  # a real etcd server


@pytest.fixture(
    params=["embedded", pytest.param("etcd", marks=SLOW), pytest.param("etcd-cluster", marks=SLOW)]
)
def endpoint(request):
    if request.param == "etcd-cluster":  # every test takes run ids of its own
        return request.getfixturevalue("etcd_cluster_shared").endpoint, None
    if request.param == "etcd":
        return request.getfixturevalue("etcd").endpoint, None
    return request.getfixturevalue("embedded")


def handlers(
    endpoint: tuple[str, str | None],
    n: int,
    run_id: str,
    stores: list[type[EtcdV3Store]] | None = None,
    min_nodes: int = 2,
    conf: RendezvousConf = CONF,
    max_restarts: int = 0,
    max_nodes: int | None = None,
) -> list[ElasticRendezvous]:
    """`n` handlers of a job of `min_nodes`..`max_nodes` (n) nodes, each with its own
    connection."""
    address, token = endpoint
    params = RendezvousParameters(
        "etcd",
        address,
        run_id,
        min_nodes,
        max_nodes or n,
        1,
        local_addr="127.0.0.1",
        max_restarts=max_restarts,
    )
    return [
        ElasticRendezvous(
            params,
            store(address, StoreAccess("test store", token=token, retry_for=5)),
            conf,
            "127.0.0.1",
        )
        for store in stores or [CountingStore] * n
    ]


def form_round(
    members: list[ElasticRendezvous], reason: RestartReason = RestartReason.START
) -> list[RendezvousInfo]:
    pool = ThreadPoolExecutor(len(members))
    try:
        return list(pool.map(lambda h: h.next_rendezvous(reason), members, timeout=60))
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


def test_each_member_reads_only_its_own_shard_of_the_membership(endpoint, request, monkeypatch):
    from elastic_launch.rendezvous.round import state as rnd

    monkeypatch.setattr(rnd, "SHARD_NODES", 1)  # a shard per node: 4 shards
    members = handlers(endpoint, 4, f"shard-{request.node.callspec.id}-{time.monotonic_ns()}")
    try:
        infos = form_round(members)
        assert sorted(i.group_rank for i in infos) == [0, 1, 2, 3]
        assert {(i.group_world_size, i.world_size, i.master_port) for i in infos} == {
            (4, 4, infos[0].master_port)
        }
        assert sorted(i.rank_offset for i in infos) == [0, 1, 2, 3]
        leader = [h for h in members if h._round is not None and h._round.leader == h.node]
        assert len(leader) == 1 and len(leader[0]._round.nodes) == 4, "the leader has all"
        others = [h for h in members if h is not leader[0]]
        names = [h.node for h in members]

        def shard(node: str) -> set[str]:
            return {n for n in names if rnd.shard_of(n, 4) == rnd.shard_of(node, 4)}

        assert all(set(h._round.nodes) == shard(h.node) for h in others), "the others theirs"
        # What needs every member reads every shard: a node that finishes last closes the job.
        assert [h.mark_done() for h in others] == [False, False, False]
        assert leader[0].mark_done() is True
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


class ReadCountingStore(EtcdV3Store):
    """Counts the keys each store's reads returned (ranges and gets)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.keys_read = 0

    def range(self, prefix: str):
        kvs, revision = super().range(prefix)
        self.keys_read += len(kvs)
        return kvs, revision

    def get(self, key: str):
        kv = super().get(key)
        self.keys_read += kv is not None
        return kv

    def put_get(self, key: str, value: bytes, get_key: str, ephemeral: bool = False):
        kv = super().put_get(key, value, get_key, ephemeral)
        self.keys_read += kv is not None
        return kv


def test_a_node_that_does_not_lead_reads_the_same_whatever_the_number_of_nodes(endpoint, request):
    """The state key stays small, the membership is read once, and only the leader reads the
    whole round: a node that does not lead costs the store the same at 2 nodes as at 8."""
    reads = {}
    for n in (2, 8):
        run_id = f"reads-{n}-{request.node.callspec.id}-{time.monotonic_ns()}"
        members = handlers(endpoint, n, run_id, [ReadCountingStore] * n)
        try:
            form_round(members)
            time.sleep(0.3)  # the followers take their first look
            leader = [h for h in members if h._round is not None and h._round.leader == h.node]
            assert len(leader) == 1
            others = [h.store.keys_read for h in members if h is not leader[0]]
            reads[n] = (max(others), leader[0].store.keys_read)
            assert all(
                len(kv.value) < 300 for kv in members[0].store.range(members[0].job.keys.state)[0]
            )
        finally:
            for h in members:
                h.shutdown()
    # The same few keys (state, leader key, members; a second look when a phase raced
    # another), where reading the round would be 2-3 keys per member.
    assert reads[8][0] <= 10 and reads[8][0] <= reads[2][0] + 2, reads
    assert reads[8][1] > reads[2][1], reads  # the leader reads every member's keys


class LateFreezeStore(CountingStore):
    """Freezes round 1 only once three nodes have joined it."""

    def cas_with(self, key: str, value: bytes, version: int, puts: Mapping[str, bytes]) -> int:
        joins = key[: -len("state")] + "m/v1/join/"
        wait_for(lambda: len(self.range(joins)[0]) == 3, "the third node never joined")
        return super().cas_with(key, value, version, puts)


def whole_first_round(n: int) -> list[type[EtcdV3Store]]:
    """Stores for `n` handlers whose first round freezes only once all `n` have joined it: a
    short last call then cannot leave out a thread that started late on a busy machine.
    Later rounds are not held."""

    class WholeFirstRound(CountingStore):
        held = True

        def cas_with(self, key: str, value: bytes, version: int, puts: Mapping[str, bytes]) -> int:
            if WholeFirstRound.held:
                joins = key[: -len("state")] + "m/v1/join/"
                wait_for(lambda: len(self.range(joins)[0]) == n, "a node never joined round 1")
                WholeFirstRound.held = False
            return super().cas_with(key, value, version, puts)

    return [WholeFirstRound] * n


def test_a_node_left_out_of_a_full_round_takes_its_confirmation_back(endpoint, request):
    """A member confirms with the read of its shard of the membership (one request); a node
    that joined but was left out (more joined than the maximum) finds itself absent there
    and deletes the confirmation it wrote, then waits as a spare."""
    run_id = f"full-{request.node.callspec.id}-{time.monotonic_ns()}"
    members = handlers(endpoint, 3, run_id, [LateFreezeStore] * 3, max_nodes=2)
    token = CancelToken()
    pool = ThreadPoolExecutor(3)
    try:
        futures = [pool.submit(h.next_rendezvous, cancel=token) for h in members]
        wait_for(lambda: sum(f.done() for f in futures) == 2, "the round never formed")
        infos = [f.result() for f in futures if f.done()]
        assert sorted(i.group_rank for i in infos) == [0, 1]
        left_out = next(h for h, f in zip(members, futures) if not f.done())
        wait_for(lambda: left_out._phase == "spare", "the node left out never waited as a spare")
        confirms = members[0].store.range(f"{members[0].job.keys.m}v1/confirm/")[0]
        assert sorted(kv.key.rsplit("/", 1)[1] for kv in confirms) == sorted(
            h.node for h in members if h is not left_out
        )
        token.cancel(15)
        with pytest.raises(Cancelled):
            next(f for f in futures if not f.done() or f.exception()).result(timeout=5)
    finally:
        token.cancel(15)
        for h in members:
            h.shutdown()
        pool.shutdown(wait=False)


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

    def put_get(self, key: str, value: bytes, get_key: str, ephemeral: bool = False):
        if "/confirm/" in key:
            time.sleep(0.5)
        return super().put_get(key, value, get_key, ephemeral)


def test_a_member_that_leads_the_confirmations_but_not_the_join_sees_them(endpoint, request):
    """The join's leader loses its key and rejoins, so another member comes first in the
    frozen round and leads the confirmations with a watch on the state alone: it must still
    see every confirmation, not wait out the close timeout and start the round over."""
    address, token = endpoint
    run_id = f"confirm-{request.node.callspec.id}-{time.monotonic_ns()}"
    raw = EtcdV3Store(address, StoreAccess("test store", token=token, retry_for=5))
    # The other two confirm late, after the confirmations' leader has read them once.
    members = handlers(endpoint, 3, run_id, [SlowConfirmStore, EtcdV3Store, SlowConfirmStore])
    join_prefix = f"/elasticrun/{run_id}/m/v1/join/"

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


def test_a_job_has_ended_here_once_closed_or_once_this_node_finished(endpoint, request):
    """What decides whether a hosting node keeps serving the others' last requests."""
    members = handlers(endpoint, 2, f"ended-{request.node.callspec.id}-{time.monotonic_ns()}")
    try:
        form_round(members)
        first, last = members
        assert not first.ended_here(), "the job runs on: a node that fails alone needs no wait"
        assert not first.mark_done(), "the other member still runs"
        assert first.ended_here() and not last.ended_here()
        assert last.mark_done(), "the last to finish closes the job"
        assert first.ended_here() and last.ended_here()
    finally:
        for h in members:
            h.shutdown()


def test_a_finished_jobs_run_id_is_refused_and_its_keys_expire(endpoint, request):
    """A new job under the run id of one that finished is told so (it never 'succeeds' without
    running); the finished job leaves only its state, which expires."""
    run_id = f"reuse-{request.node.callspec.id}-{time.monotonic_ns()}"
    members = handlers(endpoint, 2, run_id)
    try:
        form_round(members)
        assert not members[0].mark_done()
        assert members[1].mark_done(), "the last to finish closes the job"
        assert members[1].closed().reason == CloseReason.SUCCEEDED
        kvs, _ = members[0].store.range(members[0].job.keys.everything)
        assert [kv.key for kv in kvs] == [members[0].job.keys.state], "only the state is left"
    finally:
        for h in members:
            h.shutdown()
    (late,) = handlers(endpoint, 1, run_id, min_nodes=1)
    try:
        with pytest.raises(RunIdInUseError, match=f"the run id '{run_id}' names a job") as info:
            late.next_rendezvous()
        assert "new --rdzv-id" in str(info.value) and "succeeded" in str(info.value)
        ttl = late.store.client.call(
            "lease.LeaseTimeToLive",
            __import__(
                "elastic_launch.rendezvous.etcdpb.rpc_pb2", fromlist=["x"]
            ).LeaseTimeToLiveRequest(ID=_state_lease(late)),
        ).TTL
        assert 0 < ttl <= 600, "the closed state has a lease of its own: it expires"
    finally:
        late.shutdown()


def _state_lease(h: ElasticRendezvous) -> int:
    from elastic_launch.rendezvous.etcdpb import rpc_pb2

    reply = h.store.client.call("kv.Range", rpc_pb2.RangeRequest(key=h.job.keys.state.encode()))
    return int(reply.kvs[0].lease)


class SlowLookStore(EtcdV3Store):
    """Once armed, its next look at the whole job comes late: the round it joined is frozen
    by then."""

    armed = False

    def range(self, prefix: str):
        if self.armed and prefix.rstrip("/").count("/") == 2:  # /elasticrun/RUN_ID/
            self.armed = False
            time.sleep(0.5)
        return super().range(prefix)


def test_a_node_cut_off_longer_than_its_lease_is_in_the_next_round_at_once(endpoint, request):
    # A network partition: the member's lease expires on the server (revoked here, as expiry
    # does) while its workers run. Once the link is back its next write finds the lease gone
    # and replaces it. The next round forms at once: the loss is not taken for one at the
    # confirmation (waiting out close_timeout) nor reported as a change right after.
    run_id = f"cutoff-{request.node.callspec.id}-{time.monotonic_ns()}"
    members = handlers(endpoint, 2, run_id, stores=[CountingStore, SlowLookStore])
    leader, cut = members
    pool = ThreadPoolExecutor(1)
    try:
        first = form_round(members)
        from elastic_launch.rendezvous.etcdpb import rpc_pb2

        lease = cut.store.lease.id
        cut.store.client.call("lease.LeaseRevoke", rpc_pb2.LeaseRevokeRequest(ID=lease))
        wait_for(leader.membership_changed, "the leader never saw it go")
        wait_for(cut.membership_changed, "it never saw its key go")
        waiting = pool.submit(leader.next_rendezvous, RestartReason.MEMBERSHIP)
        wait_for(lambda: leader.counters().phase == "joining", "the leader never joined")
        cut.store.armed = True  # it joins, then finds the round frozen: it confirms
        t0 = time.monotonic()
        mine = cut.next_rendezvous(RestartReason.MEMBERSHIP)
        theirs = waiting.result(timeout=30)
        assert mine.round == theirs.round == first[0].round + 1, "one round, not abandoned"
        assert time.monotonic() - t0 < CONF.close_timeout, "it waited out the confirmation"
        time.sleep(0.3)
        assert [h.membership_changed() for h in members] == [False, False], "a stale loss"
    finally:
        for h in members:
            h.shutdown()
        pool.shutdown(wait=False)


def test_a_node_of_another_version_is_refused_naming_both(endpoint, request):
    run_id = f"versions-{request.node.callspec.id}-{time.monotonic_ns()}"
    first, other = handlers(endpoint, 2, run_id)
    other.release = "9.9.9"
    token = CancelToken()
    pool = ThreadPoolExecutor(1)
    try:
        waiting = pool.submit(first.next_rendezvous, cancel=token)
        wait_for(lambda: first.store.get(first.job.keys.state) is not None, "no state")
        with pytest.raises(RendezvousVersionError) as info:
            other.next_rendezvous()
        assert "9.9.9" in str(info.value) and first.release in str(info.value)
        token.cancel()  # the first one is still waiting for a second node
        with pytest.raises(Cancelled):
            waiting.result(timeout=5)
    finally:
        for h in (first, other):
            h.shutdown()
        pool.shutdown(wait=False)


def test_a_cancelled_wait_ends_at_once_and_the_node_leaves_the_round(endpoint, request):
    run_id = f"cancel-{request.node.callspec.id}-{time.monotonic_ns()}"
    (alone,) = handlers(endpoint, 2, run_id, stores=[CountingStore])  # waits for a second
    token = CancelToken()
    pool = ThreadPoolExecutor(1)
    try:
        waiting = pool.submit(alone.next_rendezvous, cancel=token)
        join_prefix = f"{alone.job.keys.m}v1/join/"
        wait_for(lambda: alone.store.range(join_prefix)[0], "it never joined")
        t0 = time.monotonic()
        token.cancel(15)
        with pytest.raises(Cancelled) as info:
            waiting.result(timeout=5)
        assert time.monotonic() - t0 < 1.0 and info.value.signum == 15
        alone.shutdown()
        (observer,) = handlers(endpoint, 1, run_id)
        try:
            assert observer.store.range(join_prefix)[0] == [], "its join key went with it"
        finally:
            observer.shutdown()
    finally:
        alone.shutdown()
        pool.shutdown(wait=False)


def test_a_member_whose_agent_died_is_lost_not_failed(endpoint, request):
    """Its presence port refuses: the survivor knows at once, long before its lease expires,
    and removes its join key so every other member knows too."""
    run_id = f"lost-{request.node.callspec.id}-{time.monotonic_ns()}"
    conf = replace(CONF, last_call_timeout=0.5)
    members = handlers(endpoint, 3, run_id, whole_first_round(3), min_nodes=2, conf=conf)
    try:
        form_round(members)
        dead = members[2]
        dead._presence.close()  # as if SIGKILLed: its port refuses, its lease still runs
        assert members[0].lost_members() == [dead.node]
        wait_for(members[1].membership_changed, "the other never saw it leave")
        assert members[1].lost_members() == [dead.node]
        dead._stop_follower()
        infos = form_round(members[:2])
        assert [i.group_world_size for i in infos] == [2, 2]
        assert [i.restart_count for i in infos] == [0, 0], "a lost node spends no restart"
    finally:
        for h in members:
            h.shutdown()


def test_failures_spend_the_job_wide_budget_then_close_it(endpoint, request):
    run_id = f"budget-{request.node.callspec.id}-{time.monotonic_ns()}"
    members = handlers(endpoint, 2, run_id, max_restarts=1)
    try:
        form_round(members)
        pool = ThreadPoolExecutor(2)
        failed = pool.submit(
            members[0].next_rendezvous, RestartReason.FAILURE, failure="rank 0 exit code 1"
        )
        wait_for(members[1].membership_changed, "the other never heard")
        other = pool.submit(members[1].next_rendezvous, RestartReason.MEMBERSHIP)
        infos = [failed.result(timeout=60), other.result(timeout=60)]
        assert [i.restart_count for i in infos] == [1, 1]
        with pytest.raises(RendezvousClosedError) as info:
            members[0].next_rendezvous(RestartReason.FAILURE, failure="rank 0 exit code 1")
        assert info.value.closed.reason == CloseReason.FAILED
        assert "restarts exhausted (1); rank 0 exit code 1" in info.value.closed.detail
        wait_for(members[1].membership_changed, "the other never heard")
        with pytest.raises(RendezvousClosedError):
            members[1].next_rendezvous(RestartReason.MEMBERSHIP)
        pool.shutdown(wait=False)
    finally:
        for h in members:
            h.shutdown()


def test_a_replacement_on_one_node_and_a_group_restart_spend_one_job_wide_count(endpoint, request):
    """A train-loop worker replaced on node 0 spends the restart the group restart of node 1
    would have: the job has max_restarts=1, so that group restart closes it. Every node reads
    the same count."""
    run_id = f"one-count-{request.node.callspec.id}-{time.monotonic_ns()}"
    members = handlers(endpoint, 2, run_id, max_restarts=1)
    try:
        form_round(members)
        spent = members[0].spend_restart(1)
        assert spent is not None and (spent.spent, spent.limit) == (1, 1)
        assert members[1].spend_restart(1) is None, "none left, whoever asks"
        assert not members[1].membership_changed(), "spending restarts no round"
        with pytest.raises(RendezvousClosedError) as info:
            members[1].next_rendezvous(RestartReason.FAILURE, failure="rank 1 exit code 1")
        assert "restarts exhausted (1); rank 1 exit code 1" in info.value.closed.detail
    finally:
        for h in members:
            h.shutdown()


def test_the_node_that_created_the_job_is_told_it_failed_not_that_its_id_is_taken(
    endpoint, request
):
    """The node that wrote the job's first state and then spent its budget sees its own job
    closed, not the run id of an ended job."""
    run_id = f"creator-{request.node.callspec.id}-{time.monotonic_ns()}"
    (only,) = handlers(endpoint, 1, run_id, min_nodes=1, max_restarts=0)
    try:
        only.next_rendezvous()
        with pytest.raises(RendezvousClosedError) as info:
            only.next_rendezvous(RestartReason.FAILURE, failure="rank 0 exit code 1")
        assert not isinstance(info.value, RunIdInUseError)
        assert info.value.closed.reason == CloseReason.FAILED
    finally:
        only.shutdown()


def test_a_spare_abandons_a_round_whose_members_are_all_gone(endpoint, request):
    """A job whose nodes all died leaves a final round behind: a new node does not wait for it
    forever."""
    run_id = f"dead-{request.node.callspec.id}-{time.monotonic_ns()}"
    members = handlers(endpoint, 2, run_id)
    form_round(members)
    for h in members:
        h._stop_follower()
        h.shutdown()  # their leases are revoked: as if they had died long ago
    (new,) = handlers(endpoint, 1, run_id, min_nodes=1, conf=replace(CONF, last_call_timeout=0.1))
    try:
        info = new.next_rendezvous()
        assert info.round == 2 and info.group_world_size == 1
    finally:
        new.shutdown()


def _silence(port: int) -> list[socket.socket]:
    """Make `port` drop connections (a full accept queue): the host 'does not answer'."""
    full = socket.socket()
    full.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    full.bind(("127.0.0.1", port))
    full.listen(0)
    held = [full]
    for _ in range(8):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(("127.0.0.1", port))
        held.append(c)
    return held


@pytest.mark.slow  # it waits out a lease, twice
def test_a_member_that_does_not_answer_is_lost_only_if_its_lease_expires(endpoint, request):
    """A firewall that drops the probe must not make a real failure a free restart: a silent
    member counts as lost only when its lease runs out."""
    run_id = f"silent-{request.node.callspec.id}-{time.monotonic_ns()}"
    conf = replace(CONF, heartbeat_timeout=2.0)
    members = handlers(endpoint, 2, run_id, conf=conf)
    held: list[socket.socket] = []
    try:
        form_round(members)
        alive, quiet = members
        port = quiet._presence.port
        quiet._presence.close()
        held = _silence(port)
        assert alive.lost_members() == [], "its lease is renewed: it is there"
        quiet.store.lease._stop.set()  # its keeper stops: the lease runs out
        assert alive.lost_members() == [quiet.node]
    finally:
        for s in held:
            s.close()
        for h in members:
            h.shutdown()


def test_a_long_join_says_what_it_waits_for_where_and_until_when(
    endpoint, request, caplog, monkeypatch
):
    monkeypatch.setattr(Notice, "AFTER", 0.2)
    run_id = f"alone-{request.node.callspec.id}-{time.monotonic_ns()}"
    alone, absent = handlers(endpoint, 2, run_id)
    cancel = CancelToken()
    threading.Timer(1.0, cancel.cancel).start()
    try:
        with caplog.at_level("WARNING"), pytest.raises(Cancelled):
            alone.next_rendezvous(cancel=cancel)
    finally:
        alone.shutdown()
        absent.shutdown()
    lines = [r.getMessage() for r in caplog.records if "waiting for nodes" in r.getMessage()]
    assert lines, [r.getMessage() for r in caplog.records]
    assert f"run '{run_id}'" in lines[0] and "1 node(s) joined, at least 2 needed" in lines[0]
    assert "--nnodes 2:2" in lines[0] and "giving up at" in lines[0]


def test_an_unreachable_store_says_so_while_it_retries(caplog, monkeypatch):
    monkeypatch.setattr(Notice, "AFTER", 0.2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    store = EtcdV3Store(f"127.0.0.1:{port}", StoreAccess("etcd at 127.0.0.1", retry_for=1.5))
    try:
        with caplog.at_level("WARNING"), pytest.raises(Exception, match="is unreachable"):
            store.range("/x")
    finally:
        store.close()
    (first, *_) = [r.getMessage() for r in caplog.records if "to answer" in r.getMessage()]
    assert "waiting for etcd at 127.0.0.1 to answer (UNAVAILABLE" in first
    assert "retrying until" in first and "--rdzv-endpoint" in first


def test_survivors_skip_the_last_call_when_the_rest_is_provably_gone(endpoint, request):
    """After a failure, a member that died (its presence port refuses, its lease still runs)
    is not waited for: the survivors' round freezes at once instead of after the last call."""
    run_id = f"gone-{request.node.callspec.id}-{time.monotonic_ns()}"
    conf = replace(CONF, last_call_timeout=20.0)
    members = handlers(endpoint, 3, run_id, min_nodes=2, conf=conf, max_restarts=5)
    try:
        form_round(members)
        dead = members[2]
        dead._presence.close()  # SIGKILLed: its port refuses at once
        dead._stop_follower()
        t0 = time.monotonic()
        infos = form_round(members[:2], RestartReason.FAILURE)
        assert [i.group_world_size for i in infos] == [2, 2]
        assert time.monotonic() - t0 < conf.last_call_timeout, "it waited out the last call"
    finally:
        for h in members:
            h.shutdown()


class RequestCountingStore(EtcdV3Store):
    """Counts ranges and gets by the prefix or key they read."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.ranges: list[str] = []
        self.gets: list[str] = []

    def range(self, prefix: str):
        self.ranges.append(prefix)
        return super().range(prefix)

    def get(self, key: str):
        self.gets.append(key)
        return super().get(key)


def test_survivors_coming_back_one_by_one_cost_the_leader_few_reads(endpoint, request):
    """A reopened round's leader looks at who of the previous round is still awaited each time
    a survivor comes back: its reads of the previous round's N join keys must not be one per
    survivor (N reads of N keys), only when those awaited have halved, then singly."""
    from elastic_launch.rendezvous.round.state import Member, RoundState, Status
    from elastic_launch.rendezvous.round.view import JoinView

    run_id = f"awaited-{request.node.callspec.id}-{time.monotonic_ns()}"
    (leader,) = handlers(endpoint, 1, run_id, [RequestCountingStore])
    alive = socket.create_server(("127.0.0.1", 0))  # the survivors' presence port: it answers
    try:
        nodes = [f"n{i:03d}" for i in range(200)]
        survivors = nodes[:150]  # the other 50 died: their join keys expired
        for node in survivors:
            member = Member("127.0.0.1", 1, 1, presence=alive.getsockname()[1])
            leader.store.put(f"{leader.job.keys.m}v1/join/{node}", member.to_json())
        state = RoundState(
            2, Status.JOINABLE, ran=1, prev_ranks={n: i for i, n in enumerate(nodes)}
        )
        leader.store.ranges.clear()
        joined: dict[str, int] = {}
        answers = []
        for node in survivors:
            joined[node] = len(joined)
            answers.append(
                leader.waits._rest_gone(state, JoinView(state, 0, "n000", joined=joined))
            )
        assert answers == [False] * 149 + [True], "not all back, or back and not seen"
        join_reads = [p for p in leader.store.ranges if p.endswith("/v1/join/")]
        assert len(join_reads) <= 8, f"{len(join_reads)} reads of the previous round's keys"
        assert len(leader.store.gets) <= 12, leader.store.gets
    finally:
        alive.close()
        leader.shutdown()


def test_a_member_that_is_alive_is_waited_for_until_the_last_call(endpoint, request):
    run_id = f"alive-{request.node.callspec.id}-{time.monotonic_ns()}"
    conf = replace(CONF, last_call_timeout=1.0)
    stores = whole_first_round(3)
    members = handlers(endpoint, 3, run_id, stores, min_nodes=2, conf=conf, max_restarts=5)
    try:
        form_round(members)
        members[2]._stop_follower()  # alive (its port answers) but slow to come back
        t0 = time.monotonic()
        infos = form_round(members[:2], RestartReason.FAILURE)
        assert [i.group_world_size for i in infos] == [2, 2]
        assert time.monotonic() - t0 >= conf.last_call_timeout
    finally:
        for h in members:
            h.shutdown()


def test_a_note_of_the_round_reaches_every_member_through_its_watch(endpoint, request):
    members = handlers(endpoint, 3, f"note-{request.node.callspec.id}-{time.monotonic_ns()}")
    try:
        form_round(members)
        assert [h.note("reform_at") for h in members] == [None, None, None]
        members[1].post_note("reform_at", "12")
        for h in members:
            wait_for(lambda h=h: h.note("reform_at") == "12", "a member never saw the note")
        assert not any(h.membership_changed() for h in members), "a note is not a change"
    finally:
        for h in members:
            h.shutdown()


def test_a_waiting_node_changes_the_membership_but_does_not_break_the_round(endpoint, request):
    """The train loop's NCCL abort acts on a broken round only, never on a node that waits."""
    run_id = f"broken-{request.node.callspec.id}-{time.monotonic_ns()}"
    members = handlers(endpoint, 3, run_id, min_nodes=2, conf=replace(CONF, last_call_timeout=0.3))
    try:
        form_round(members[:2])
        spare = ThreadPoolExecutor(1).submit(members[2].next_rendezvous)
        wait_for(members[0].membership_changed, "the spare was never seen")
        assert not members[0].round_broken()
        members[1]._presence.close()
        members[1].shutdown()  # leaves: its keys go
        wait_for(members[0].round_broken, "the member's leaving never broke the round")
        members[0]._stop_follower()
        spare.cancel()
    finally:
        for h in members:
            h.shutdown()
