"""Heartbeat table and heartbeats from Python, including from other processes."""

from __future__ import annotations

import os
import struct
import time

import elastic_core as ec
import pytest


def test_create_attach_beat_read(shm_path):
    path = shm_path("hb")
    with ec.HeartbeatTable.create(path, 4) as table:
        assert table.capacity == 4
        assert table.owner
        assert table.read(1).state == ec.SlotState.EMPTY
        with ec.Heartbeat.attach(path, 1) as hb:
            assert table.read(1).state == ec.SlotState.ATTACHED
            before = ec.now_ns()
            hb.beat()
            hb.beat()
            info = table.read(1)
            assert info.state == ec.SlotState.BEATING
            assert info.step == 2
            assert info.pid == os.getpid()
            assert before <= info.last_beat_ns <= ec.now_ns()
            hb.beat(step=40)
            assert table.read(1).step == 40
            hb.set_timeout(1.5)
            assert table.read(1).timeout_ms == 1500
        assert table.read(1).state == ec.SlotState.DETACHED
        generation = table.generation
        table.reset()
        assert table.generation == generation + 1
        assert table.read(1).state == ec.SlotState.EMPTY
    assert not os.path.exists(path), "the creator removes the file"
    with pytest.raises(ValueError, match="closed"):
        table.read(0)


def test_other_process_beats(shm_path, procs):
    path = shm_path("hb")
    table = ec.HeartbeatTable.create(path, 2)
    child = procs.python(
        f"""
        import elastic_core, time
        hb = elastic_core.Heartbeat.attach({path!r}, 0)
        for step in range(1, 31):
            hb.beat(step)
        time.sleep(60)
        """
    )
    deadline = time.monotonic() + 30
    while table.read(0).step != 30 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert table.read(0).step == 30
    assert table.read(0).pid == child.pid


def test_missing_foreign_truncated_and_wrong_version_files(shm_path, tmp_path):
    missing = shm_path("missing")
    with pytest.raises(ec.BadFileError, match="does not exist") as info:
        ec.Heartbeat.attach(missing, 0)
    assert missing in str(info.value)
    assert info.value.status == "ELASTIC_ERR_BAD_FILE"

    foreign = tmp_path / "foreign"
    foreign.write_bytes(b"\x7fELF" + b"\0" * 4092)
    with pytest.raises(ec.BadFileError, match="not an elasticrun heartbeat table"):
        ec.Heartbeat.attach(str(foreign), 0)

    truncated = tmp_path / "truncated"
    truncated.write_bytes(b"abc")
    with pytest.raises(ec.BadFileError, match="truncated"):
        ec.Heartbeat.attach(str(truncated), 0)

    path = shm_path("future")
    with ec.HeartbeatTable.create(path, 2):
        with open(path, "r+b") as f:
            f.seek(8)
            f.write(struct.pack("<I", 7))
        with pytest.raises(ec.BadFileError, match="layout version 7"):
            ec.Heartbeat.attach(path, 0)


def test_bad_arguments(shm_path):
    with pytest.raises(ec.InvalidArgumentError, match="'relative' is not absolute"):
        ec.HeartbeatTable.create("relative", 1)
    with pytest.raises(ValueError, match="got 0"):
        ec.HeartbeatTable.create(shm_path(), 0)
    path = shm_path()
    with ec.HeartbeatTable.create(path, 2) as table:
        with pytest.raises(ec.InvalidArgumentError, match="slot 5 is out of range"):
            ec.Heartbeat.attach(path, 5)
        with pytest.raises(ec.StateError, match="exists"):
            ec.HeartbeatTable.create(path, 2)
        with pytest.raises(TypeError):
            table.read(-1)
        with ec.Heartbeat.attach(path, 0) as hb, pytest.raises(ValueError, match="timeout=-1"):
            hb.set_timeout(-1)
