"""A store whose reads do not show its writes (a stale member answering reads from an old copy)
keeps no node busy and none past its join timeout: every loop that asks again after a lost
write is paced (:mod:`elastic_launch.rendezvous.round.pace`)."""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import pytest
from elastic_launch.cancel import Deadline
from elastic_launch.rendezvous.api import (
    RendezvousParameters,
    RendezvousTimeoutError,
    RestartReason,
)
from elastic_launch.rendezvous.conf import RendezvousConf
from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
from elastic_launch.rendezvous.round import pace
from elastic_launch.rendezvous.round.elastic import ElasticRendezvous
from elastic_launch.rendezvous.store.api import KeyValue, StoreAccess


class _Waits:
    """A cancel token that records the pauses asked of it (none is slept)."""

    def __init__(self) -> None:
        self.pauses: list[float] = []

    def wait(self, seconds: float) -> bool:
        self.pauses.append(seconds)
        return False


def test_the_first_tries_go_at_once_then_at_most_rate_a_second_until_the_deadline():
    waits = _Waits()
    p = pace.Pace(lambda: "gave up", Deadline(60), waits)  # type: ignore[arg-type]
    for _ in range(pace.AT_ONCE):
        p.again()
    assert waits.pauses == [], "contention settles in a few: those go at once"
    for _ in range(20):
        p.again()
    assert len(waits.pauses) == 20
    assert all(1.0 / pace.RATE <= s <= 1.5 / pace.RATE for s in waits.pauses)
    late = pace.Pace(lambda: "gave up: why", Deadline(0), waits)  # type: ignore[arg-type]
    with pytest.raises(RendezvousTimeoutError, match="gave up: why"):
        late.again()


class StaleReads(EtcdV3Store):
    """Reads the job's state from an old copy (before the job began: no state), while writes
    reach the store that holds it; counts the writes it tries."""

    writes = 0
    lock = threading.Lock()

    def get(self, key: str) -> KeyValue | None:
        return None if key.endswith("/state") else super().get(key)

    def cas(self, key: str, value: bytes, version: int, ttl: float | None = None) -> int:
        with StaleReads.lock:
            StaleReads.writes += 1
        return super().cas(key, value, version, ttl)


def test_a_store_whose_reads_miss_its_writes_keeps_no_node_busy_past_its_join_timeout(embedded):
    address, token = embedded
    join_timeout = 2.0
    params = RendezvousParameters("etcd", address, "stale", 1, 1, 1, local_addr="127.0.0.1")
    conf = replace(RendezvousConf.defaults(), join_timeout=join_timeout)
    first = ElasticRendezvous(
        params, EtcdV3Store(address, StoreAccess("the store", token=token)), conf, "127.0.0.1"
    )
    stale = ElasticRendezvous(
        params, StaleReads(address, StoreAccess("a stale member", token=token)), conf, "127.0.0.1"
    )
    try:
        first.next_rendezvous(RestartReason.START)  # the state exists: creating it fails
        started = time.monotonic()
        with pytest.raises(RendezvousTimeoutError, match="every write lost to a newer state"):
            stale.next_rendezvous(RestartReason.START)
        took = time.monotonic() - started
        # Bounded by the rate, whatever the machine's speed: the first few at once, then at
        # most RATE a second for as long as it took (it spun hundreds a second before).
        assert StaleReads.writes <= pace.AT_ONCE + 2 + took * pace.RATE
        assert StaleReads.writes >= pace.AT_ONCE, "it did try"
    finally:
        stale.shutdown()
        first.shutdown()


def test_confirming_a_round_whose_writes_lose_to_a_stale_read_is_paced_and_bounded():
    # Found by review: the leader's loop that moves a frozen round on went round at once
    # (287,687 writes in 2 s) with no deadline when each write lost to the same old state.
    from types import SimpleNamespace

    from elastic_launch.rendezvous.round import state as rnd
    from elastic_launch.rendezvous.round.view import confirm_view
    from elastic_launch.rendezvous.round.waits import RoundWaits

    member = rnd.Member("127.0.0.1", 1, 1)
    frozen = rnd.freeze(rnd.initial(""), {"a": 1, "b": 2}, {"a": member, "b": member}, 2, 2)
    assert frozen is not None
    writes = []

    class StaleJob:
        store = SimpleNamespace(name="a stale store")

        def advance(self, state, version):  # the write loses; the read gives the old round
            writes.append(time.monotonic())
            return frozen, version

    waits = RoundWaits.__new__(RoundWaits)
    waits.job = StaleJob()
    waits.conf = replace(RendezvousConf.defaults(), join_timeout=1.0)
    waits.params = RendezvousParameters("etcd", "x:1", "stale", 2, 2, 1)
    view = confirm_view(frozen, "a", {"a", "b"}, {"a", "b"})  # the leader, all confirmed
    started = time.monotonic()
    with pytest.raises(RendezvousTimeoutError, match="every write lost to a newer state"):
        waits._until_final(frozen, 5, view, None, None)
    took = time.monotonic() - started
    assert len(writes) <= pace.AT_ONCE + 2 + took * pace.RATE
