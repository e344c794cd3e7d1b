"""Checkpoints against hostile files and full disks: a crafted pickle is refused on every load
path unless the caller opts out; everything this project writes loads under the safe default;
a checksum file of the wrong shape is a skipped checkpoint, not a crash; a save that fails at any
point (a full disk) never costs the newest checkpoint that verified before it."""

from __future__ import annotations

import errno
import io
import json
import os
import random
import warnings
from pathlib import Path

import numpy
import pytest
import torch
from elastic_sampler import (
    CheckpointError,
    CheckpointManager,
    ElasticDistributedSampler,
    UnsafeCheckpointError,
    _files,
    load_checkpoint,
    save_checkpoint,
)


class Payload:
    """Unpickling this runs a shell command that leaves a marker file: proof of execution."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def crafted(tmp_path: Path) -> tuple[dict, Path]:
    marker = tmp_path / "code-ran"
    return {"model": {"w": torch.zeros(3)}, "step": 7, "x": Payload(marker)}, marker


def refused(excinfo: pytest.ExceptionInfo, marker: Path) -> None:
    message = str(excinfo.value)
    assert "weights_only=False" in message and "never" in message, message
    assert "posix.system" in message or "system" in message, message
    assert not marker.exists(), "the crafted checkpoint ran code"


def test_load_latest_refuses_a_crafted_checkpoint_even_with_a_matching_checksum(tmp_path):
    state, marker = crafted(tmp_path)
    m = CheckpointManager(tmp_path / "ckpt")
    m.save({"step": 1}, 1)
    m.save(state, 2)  # its checksum matches: a checksum authenticates nothing
    with pytest.raises(UnsafeCheckpointError) as e:
        m.load_latest()
    refused(e, marker)
    # Not skipped for an older step: falling back silently would hide the attack.
    assert "checkpoint-000000000002.pt" in str(e.value)


@pytest.mark.parametrize("shape", ["verified file", "plain file", "stream"])
def test_load_checkpoint_refuses_a_crafted_checkpoint(tmp_path, shape):
    state, marker = crafted(tmp_path)
    path = tmp_path / "one.pt"
    if shape == "verified file":
        save_checkpoint(path, state)
        source: object = path
    elif shape == "plain file":
        torch.save(state, path)
        source = path
    else:
        buffer = io.BytesIO()
        torch.save(state, buffer)
        buffer.seek(0)
        source = buffer
    with pytest.raises(UnsafeCheckpointError) as e:
        load_checkpoint(source)  # type: ignore[arg-type]
    refused(e, marker)


def test_opting_out_loads_it_and_shows_why_not_to(tmp_path):
    # The other side of the tests above: the same file does run code when asked to.
    state, marker = crafted(tmp_path)
    m = CheckpointManager(tmp_path / "ckpt")
    m.save(state, 2)
    loaded, step = m.load_latest(weights_only=False)
    assert step == 2 and loaded["step"] == 7
    assert marker.exists()


def test_the_train_loop_state_refuses_a_crafted_snapshot(tmp_path):
    from elastic_launch.train_loop import State

    class Snap(State):
        def __init__(self) -> None:
            self.value = None

        def capture_snapshot(self):
            return self.value

        def apply_snapshot(self, snapshot):
            self.value = snapshot

    state, marker = crafted(tmp_path)
    writer = Snap()
    writer.value = state
    stream = io.BytesIO()
    writer.save(stream)
    stream.seek(0)
    with pytest.raises(UnsafeCheckpointError) as e:
        Snap().load(stream)
    refused(e, marker)


def test_everything_this_project_writes_loads_under_the_safe_default(tmp_path):
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    sampler = ElasticDistributedSampler(list(range(50)), num_replicas=2, rank=0, shuffle=True)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "sampler": sampler.state_dict(steps=3, batch_size=4),
        "step": 12,
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": numpy.random.get_state(),
            "numpy_generator": numpy.random.default_rng(3).bit_generator.state,
        },
        "meta": {"note": "run 1", "loss": 0.5, "ok": True, "none": None, "shape": (2, 3)},
        "array": numpy.arange(6.0).reshape(2, 3),
    }
    m = CheckpointManager(tmp_path / "ckpt")
    m.save(state, 12)
    loaded, step = m.load_latest()
    assert step == 12
    random.setstate(loaded["rng"]["python"])
    numpy.random.set_state(loaded["rng"]["numpy"])
    torch.set_rng_state(loaded["rng"]["torch"])
    ElasticDistributedSampler(
        list(range(50)), num_replicas=3, rank=1, shuffle=True
    ).load_state_dict(loaded["sampler"])
    assert numpy.array_equal(loaded["array"], state["array"])
    assert loaded["meta"] == state["meta"]


def test_the_train_loop_snapshot_of_the_examples_loads_safely():
    from elastic_launch.train_loop import State

    class Typical(State):
        def __init__(self) -> None:
            self.model = torch.nn.Linear(2, 2)
            self.epoch, self.seen = 0, [1, 2]

        def capture_snapshot(self):
            return {"model": self.model.state_dict(), "epoch": self.epoch, "seen": self.seen}

        def apply_snapshot(self, snapshot):
            self.model.load_state_dict(snapshot["model"])
            self.epoch, self.seen = snapshot["epoch"], snapshot["seen"]

    a, b = Typical(), Typical()
    a.epoch, a.seen = 4, [5]
    stream = io.BytesIO()
    a.save(stream)
    stream.seek(0)
    b.load(stream)
    assert (b.epoch, b.seen) == (4, [5])
    assert torch.equal(b.model.weight, a.model.weight)


@pytest.mark.parametrize(
    "record",
    [
        "[1, 2]",
        '"x"',
        '{"size": "9"}',
        '{"size": -1, "crc32": 0}',
        '{"size": 1, "crc32": 1, "also": 3}',
        '{"size": true, "crc32": 1}',
        "null",
    ],
)
def test_a_checksum_file_of_the_wrong_shape_is_a_skipped_checkpoint(tmp_path, record):
    m = CheckpointManager(tmp_path)
    m.save({"step": 1}, 1)
    m.save({"step": 2}, 2)
    Path(str(m.path(2)) + ".meta.json").write_text(record)
    with pytest.warns(UserWarning, match="checksum file is unreadable"):
        state, step = m.load_latest()
    assert (state["step"], step) == (1, 1)


def test_a_resave_whose_checksum_write_fails_keeps_the_old_copy(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, keep_last=1)
    m.save({"w": torch.zeros(100)}, 5)
    real = _files.atomic_write

    def full_for_checksums(path, write, abandon=None):
        if path.name.endswith(".meta.json"):
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, write, abandon)

    monkeypatch.setattr(_files, "atomic_write", full_for_checksums)
    with pytest.raises(CheckpointError, match="disk or quota is full"):
        m.save({"w": torch.ones(100)}, 5)
    monkeypatch.undo()
    state, step = m.load_latest()
    assert step == 5 and torch.equal(state["w"], torch.zeros(100)), "the only copy survived"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_a_crash_between_the_steps_of_a_resave_leaves_one_copy_loadable(tmp_path, monkeypatch):
    m = CheckpointManager(tmp_path, keep_last=1)
    m.save({"w": torch.zeros(100)}, 5)
    real = os.replace

    def crash(src, dst):  # stands in for SIGKILL once the record accepting both is in place
        if not str(dst).endswith(".meta.json"):
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(_files.os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        m.save({"w": torch.ones(100)}, 5)
    monkeypatch.undo()
    record = json.loads(Path(str(m.path(5)) + ".meta.json").read_text())
    assert len(record["also"]) == 1, "the crash came between the two records"
    state, _ = CheckpointManager(tmp_path).load_latest()
    assert torch.equal(state["w"], torch.zeros(100))


def test_a_checkpoint_pruned_by_another_manager_as_soon_as_it_is_renamed_is_a_warning(
    tmp_path, monkeypatch
):
    """Two managers on one directory: the other one prunes the file between its rename and
    the checksum (the race tests/sampler/test_checkpoint.py's two real writers meet). The save
    warns and goes on, and leaves no checksum without its file."""
    m = CheckpointManager(tmp_path, keep_last=1)
    real = _files.atomic_write

    def pruned_at_once(path, write, abandon=None):
        written = real(path, write, abandon)
        if path.suffix == ".pt":
            path.unlink()  # the other manager's prune
        return written

    monkeypatch.setattr(_files, "atomic_write", pruned_at_once)
    with pytest.warns(UserWarning, match="removed by another process"):
        m.save({"w": torch.zeros(10)}, 1)
    assert list(tmp_path.iterdir()) == []


# ---- a real full disk ----------------------------------------------------------------------


@pytest.fixture
def tiny_disk(tmpfs) -> Path:
    """A 1 MiB tmpfs (root only): small enough to fill with one call."""
    return tmpfs(1 << 20)


def _leave_free(directory: Path, pages: int) -> None:
    filler = directory / "filler"
    filler.unlink(missing_ok=True)
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize
    with open(filler, "wb") as f:
        if free - pages * 4096 > 0:
            os.posix_fallocate(f.fileno(), 0, free - pages * 4096)


@pytest.mark.slow  # mounts a tmpfs
@pytest.mark.parametrize("resave", [False, True], ids=["new step", "existing step"])
def test_a_full_disk_at_any_point_of_a_save_keeps_the_newest_good_checkpoint(tiny_disk, resave):
    # Free space is swept page by page so that the disk fills up at every point of the save:
    # the data file, the checksum record that accepts both copies, the rename, the final record.
    directory = tiny_disk / "ckpt"
    m = CheckpointManager(directory, keep_last=1)
    weights = torch.zeros(40_000)  # 160 KB: about 40 pages
    failures = 0
    for pages in range(0, 2 * 40 + 8, 2):
        for p in directory.glob("checkpoint-*"):
            p.unlink()
        m.save({"w": weights, "step": 1}, 1)
        _leave_free(tiny_disk, pages)
        problem = ""
        try:
            m.save({"w": weights + 1, "step": 2}, 1 if resave else 2)
        except CheckpointError as e:
            failures += 1
            problem = str(e)
        assert not problem or "disk or quota is full" in problem, problem
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # nothing torn is left to skip
            state, _ = m.load_latest()
        assert state["step"] in (1, 2), pages
        assert torch.equal(state["w"], weights + state["step"] - 1)
        assert [p.name for p in directory.iterdir() if p.name.startswith(".")] == []
        (tiny_disk / "filler").unlink()
    assert 0 < failures < 44, "the sweep covered failures and successes"


@pytest.mark.slow  # two real processes and gloo
def test_broadcast_latest_refuses_a_crafted_checkpoint(tmp_path):
    from ranks_util import run_ranks

    script = f"""
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {str(Path(__file__).parent)!r})
from test_checkpoint_safety import crafted
from pathlib import Path
from elastic_sampler import CheckpointManager, broadcast_latest
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank,
                        world_size=2)
m = CheckpointManager(Path(sys.argv[3]) / ("rank" + str(rank)))
if rank == 0:
    m.save(crafted(Path(sys.argv[3]))[0], 10)
try:
    broadcast_latest(m)
    print("LOADED", rank, flush=True)
except Exception as e:
    print("ERROR", rank, type(e).__name__, e, flush=True)
dist.destroy_process_group()
"""
    outs = run_ranks(script, 2, str(tmp_path))
    for rank, out in enumerate(outs):
        assert f"ERROR {rank} UnsafeCheckpointError" in out, outs
        assert "sent by rank 0" in out, outs
    assert not (tmp_path / "code-ran").exists()
