"""The memory tier's payload (elastic_sampler._payload): large tensors copied apart from a small
skeleton, read back exactly, checked, and safe to read."""

from __future__ import annotations

import io
import os
from collections import OrderedDict

import pytest
import torch
from elastic_sampler import _payload
from elastic_sampler.api import CheckpointError, UnsafeCheckpointError

#: Whose state the payloads of these tests are: rank 0 of 1, step 1, a run's digest.
ID = _payload.Identity(0, 1, 1, b"r" * 32)


def written(state) -> bytearray:
    plan = _payload.plan(state, ID)
    out = bytearray(plan.size)
    crc = plan.write(memoryview(out))
    assert crc == _payload.checksum(memoryview(out)), "the checksum is of the bytes written"
    return out


def mixed_state() -> dict:
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 100, generator=g)
    return {
        "model": OrderedDict(
            w=big,
            half=torch.randn(40_000, generator=g).to(torch.bfloat16),
            mask=torch.rand(70_000, generator=g) > 0.5,
            ids=torch.arange(20_000, dtype=torch.int64),
            bias=torch.ones(3),  # small: stays in the skeleton
        ),
        "strided": big.t(),  # large and not contiguous
        "nested": [1, "two", (3.0, torch.zeros(20_000))],
        "empty": torch.empty(0, 7),
        "step": 12,
    }


def test_a_state_reads_back_exactly_and_keeps_its_containers():
    state = mixed_state()
    plan = _payload.plan(state, ID)
    assert len(plan.tensors) == 8, "every tensor is copied, none serialized"
    got = _payload.decode(written(state), "test")
    assert type(got["model"]) is OrderedDict and list(got["model"]) == list(state["model"])
    for k, v in state["model"].items():
        assert got["model"][k].dtype == v.dtype and torch.equal(got["model"][k], v)
    assert torch.equal(got["strided"], state["strided"])
    assert got["nested"][:2] == [1, "two"] and isinstance(got["nested"][2], tuple)
    assert torch.equal(got["nested"][2][1], torch.zeros(20_000))
    assert got["empty"].shape == (0, 7) and got["step"] == 12


def test_offsets_are_aligned_and_tensors_do_not_overlap():
    plan = _payload.plan(mixed_state(), ID)
    ends = 0
    for t, at in zip(plan.tensors, plan.offsets):
        assert at % _payload.ALIGN == 0 and at >= max(ends, len(plan.head))
        ends = at + t.numel() * t.element_size()
    assert plan.size == ends


def test_the_bytes_of_a_torch_file_decode_too():
    buffer = io.BytesIO()
    torch.save({"w": torch.arange(5)}, buffer)
    assert torch.equal(_payload.decode(buffer.getvalue(), "test")["w"], torch.arange(5))


def test_a_payload_cut_short_is_an_error():
    data = written(mixed_state())
    with pytest.raises(CheckpointError, match="cut short"):
        _payload.decode(data[: len(data) - 100], "the copy")


def test_a_state_the_skeleton_cannot_hold_is_saved_whole_by_torch():
    import numpy as np

    state = {"w": torch.zeros(100_000), "meta": torch.empty(5, device="meta"), "a": np.arange(3)}
    plan = _payload.plan(state, ID)
    assert plan.tensors == [] and plan.head[:8] == _payload.WHOLE, "torch.save's bytes"
    assert _payload.identity_of(plan.head) == ID, "with whose they are"
    got = _payload.decode(written(state), "test")
    assert torch.equal(got["w"], state["w"]) and got["meta"].device.type == "meta"
    assert list(got["a"]) == [0, 1, 2]


def test_an_object_in_the_state_is_refused_by_default():
    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    data = written({"x": Evil(), "w": torch.zeros(100_000)})
    with pytest.raises(UnsafeCheckpointError, match="weights_only=True refuses"):
        _payload.decode(data, "the copy")


def test_a_skeleton_naming_anything_else_is_refused():
    """A payload's skeleton is read by an unpickler that builds its few types and no other: a
    crafted one that names a function is refused, not called."""
    import pickle

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    body = pickle.dumps({"state": Evil(), "at": []}, protocol=4)
    data = ID.head(_payload.MAGIC, len(body)) + body
    with pytest.raises(UnsafeCheckpointError, match=r"names posix\.system, which a skeleton"):
        _payload.decode(data, "the copy")


@pytest.mark.timeout(60)
def test_a_skeleton_of_shared_references_is_refused_before_it_is_walked():
    """Pickle's memo lets a few hundred bytes hold one list twice at each of 40 levels: walked,
    that is 2^40 visits (this test's time limit ends it). plan() writes every container once,
    so a container met twice is refused at once; states with repeated values still load."""
    import pickle

    shared: list = [1]
    for _ in range(40):
        shared = [shared, shared]
    body = pickle.dumps({"state": {"model": shared}, "at": []}, protocol=4)
    assert len(body) < 4096
    data = ID.head(_payload.MAGIC, len(body)) + body
    with pytest.raises(CheckpointError, match="holds one container in two places"):
        _payload.decode(data, "the copy")
    same = [0.5, (1, 2)]
    state = {"a": same, "b": same, "t": (), "u": (), "x": torch.ones(3), "y": torch.zeros(5000)}
    back = _payload.decode(written(state), "ok")
    assert back["a"] == back["b"] == same and back["t"] == back["u"] == ()


def test_a_skeleton_whose_table_lies_is_an_error():
    import pickle

    for entry in [(0, "no_such_dtype", (3,), "cpu"), (0, "float32", (-1,), "cpu"), "x"]:
        body = pickle.dumps({"state": [_payload.TensorRef(0)], "at": [entry]}, protocol=4)
        data = ID.head(_payload.MAGIC, len(body)) + body + bytes(64)
        with pytest.raises(CheckpointError, match="the copy"):
            _payload.decode(data, "the copy")


def test_the_checksum_is_of_the_pieces_checksums_whatever_the_tensors_boundaries():
    """Tensors start and end anywhere on the CHUNK grid (whole pieces are copied three at a
    time, partial ones continued): the checksum is the CRC-32C of every piece's CRC-32C."""
    import struct

    from elastic_core import crc32c

    g = torch.Generator().manual_seed(1)
    state = {
        "a": torch.randn(_payload.CHUNK // 4 + 1000, generator=g),
        "b": torch.randint(0, 100, (3 * _payload.CHUNK + 77,), dtype=torch.uint8, generator=g),
        "c": torch.randn(5 * _payload.CHUNK // 4, generator=g).t(),
    }
    data = written(state)
    pieces = [
        crc32c(memoryview(data)[i : i + _payload.CHUNK])
        for i in range(0, len(data), _payload.CHUNK)
    ]
    expected = crc32c(struct.pack(f"<{len(pieces)}I", *pieces))
    plan = _payload.plan(state, ID)
    assert plan.write(memoryview(bytearray(len(data)))) == expected
    got = _payload.decode(data, "test")
    assert all(torch.equal(got[k], v) for k, v in state.items())


def test_a_copy_out_is_checked_as_it_is_copied():
    data = written({"w": torch.randn(3 * _payload.CHUNK // 4)})
    source = torch.frombuffer(data, dtype=torch.uint8)
    out = bytearray(len(data))
    assert _payload.copy_out(out, source.data_ptr(), len(data)) == _payload.checksum(
        memoryview(data)
    )
    assert out == data


def test_a_change_in_place_after_planning_is_seen():
    w = torch.zeros(100_000)
    plan = _payload.plan({"w": w}, ID)
    assert not plan.changed()
    w.add_(1)
    assert plan.changed()


def test_map_location_places_the_large_tensors():
    data = written({"w": torch.zeros(100_000)})
    assert _payload.decode(data, "t", map_location=torch.device("cpu"))["w"].device.type == "cpu"
    with pytest.raises(CheckpointError, match=r"map_location=.* is not supported"):
        _payload.decode(data, "t", map_location=lambda s, loc: s)


def test_the_plan_copies_what_training_may_change_before_the_copy_runs():
    """Only the large tensors are read later (the optimizer step waits for that); small
    tensors and plain values are taken when the plan is made."""
    state = {"big": torch.zeros(100_000), "small": torch.zeros(3), "seen": [1, 2]}
    plan = _payload.plan(state, ID)
    state["small"].add_(5)
    state["seen"].append(3)
    got = _payload.decode(written_plan(plan), "test")
    assert torch.equal(got["small"], torch.zeros(3)) and got["seen"] == [1, 2]


def written_plan(plan) -> bytearray:
    out = bytearray(plan.size)
    plan.write(memoryview(out))
    return out
