"""A property: whatever a worker does to its own heartbeat file, the supervisor lives, and the
hang of another worker is still seen.

The watchdog reads through pread() (never a mapping a worker can cut under it), one table per
worker (the launcher's layout), and checks what it reads. Hypothesis draws sequences of what
a process of the same user can do to a file: cut it, grow it, write bytes anywhere, stamp any
value into any field of the slot, unlink it, put another file at its path."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import elastic_core as ec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

HEADER = 64  # the table's header, then the slot (heartbeat_layout.hpp)
FIELDS = {"pid": 0, "state": 4, "step": 8, "last_beat_ns": 16, "timeout_ms": 24}
HANG = 0.2

ops = st.one_of(
    st.tuples(st.just("truncate"), st.integers(0, 200)),
    st.tuples(st.just("grow"), st.integers(129, 1 << 20)),
    st.tuples(st.just("write"), st.integers(0, 200), st.binary(min_size=1, max_size=128)),
    st.tuples(st.just("stamp"), st.sampled_from(sorted(FIELDS)), st.integers(0, 2**64 - 1)),
    st.tuples(st.just("unlink")),
    st.tuples(st.just("replace"), st.binary(max_size=256)),
)


def apply(op: tuple, path: str) -> None:
    kind = op[0]
    if kind in ("truncate", "grow") and os.path.exists(path):
        os.truncate(path, op[1])
    elif kind == "write" and os.path.exists(path):
        with open(path, "r+b") as f:
            f.seek(op[1])
            f.write(op[2])
    elif kind == "stamp" and os.path.exists(path):
        size = 4 if op[1] in ("pid", "state") else 8
        with open(path, "r+b") as f:
            f.seek(HEADER + FIELDS[op[1]])
            f.write((op[2] % (1 << (8 * size))).to_bytes(size, "little"))
    elif kind == "unlink" and os.path.exists(path):
        os.unlink(path)
    elif kind == "replace":
        if os.path.exists(path):
            os.unlink(path)
        with open(path, "wb") as f:
            f.write(op[1])


@pytest.fixture(scope="module")
def sleepers() -> Iterator[list[int]]:
    """Two processes the watchdog watches as workers 0 and 1 (their files are what's tested)."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)
    ]
    yield [p.pid for p in procs]
    for p in procs:
        p.kill()
        p.wait(timeout=30)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(attack=st.lists(ops, min_size=1, max_size=5))
def test_whatever_a_worker_does_to_its_file_another_workers_hang_is_seen(
    attack, sleepers, shm_path
):
    mine, other = shm_path("attacker"), shm_path("hung")
    with (
        ec.HeartbeatTable.create(mine, 1) as a,
        ec.HeartbeatTable.create(other, 1) as b,
        ec.Watchdog() as wd,
    ):
        hb = ec.Heartbeat.attach(other, 0)
        hb.beat()  # the other worker beats once, then hangs
        wd.watch(0, sleepers[0], a, slot=0, hang_timeout=HANG)
        wd.watch(1, sleepers[1], b, slot=0, hang_timeout=HANG)
        for op in attack:
            apply(op, mine)
        hung_seen, deadline = False, time.monotonic() + 30
        while not hung_seen and time.monotonic() < deadline:
            event = wd.poll(timeout=1.0)
            if event is None:
                continue
            assert event.kind in (ec.EventKind.HUNG, ec.EventKind.BAD_HEARTBEAT), event.detail
            if event.worker == 0 and event.kind == ec.EventKind.BAD_HEARTBEAT:
                assert mine in event.detail and "cannot be trusted" in event.detail
            hung_seen = event.worker == 1 and event.kind == ec.EventKind.HUNG
        assert hung_seen, "the other worker's hang went unseen"
        hb.detach()
        a.reset()  # the next worker gets a good table at the same path
        assert a.read(0).state == ec.SlotState.EMPTY
        with ec.Heartbeat.attach(mine, 0) as fresh:
            fresh.beat(3)
            assert a.read(0).step == 3
