"""The train loop's checkpoints in torchelastic 0.1's API: the file layout 0.1 wrote (and
reads), checkpoints that appear only when committed, damaged ones skipped, a manager written
for 0.1 used by the loop."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from elastic_launch.train_loop.checkpoint import (
    DEFAULT_KEY,
    CheckpointManager,
    FileSystemCheckpointManager,
)


def write(manager: FileSystemCheckpointManager, payload: bytes, commit: bool = True):
    checkpoint = manager.create_checkpoint()
    with checkpoint.open_output_stream(DEFAULT_KEY) as f:
        f.write(payload)
    if commit:
        checkpoint.commit()
    return checkpoint


def read(checkpoint) -> bytes:
    with checkpoint.open_input_stream(DEFAULT_KEY) as f:
        return f.read()


def test_the_layout_is_0_1s_and_the_newest_comes_first(tmp_path):
    m = FileSystemCheckpointManager(tmp_path / "ck")
    assert m.list_checkpoints() == [] and m.get_latest_checkpoint() is None
    for payload in (b"zero", b"one", b"two"):
        write(m, payload)
    assert (tmp_path / "ck" / "1" / "default").read_bytes() == b"one"
    assert [c.sequence_id for c in m.list_checkpoints()] == [2, 1, 0]
    assert read(m.get_latest_checkpoint()) == b"two"
    assert read(m.get_checkpoint(0)) == b"zero"
    with pytest.raises(FileNotFoundError, match="checkpoint 7 not found"):
        m.get_checkpoint(7)


def test_folders_written_by_torchelastic_0_1_are_read(tmp_path):
    for n, payload in ((0, b"old"), (4, b"older layout, newest")):
        (tmp_path / str(n)).mkdir()
        (tmp_path / str(n) / "default").write_bytes(payload)
    (tmp_path / "notes").mkdir()  # not a checkpoint: no number
    m = FileSystemCheckpointManager(tmp_path)
    assert [c.sequence_id for c in m.list_checkpoints()] == [4, 0]
    assert read(m.get_latest_checkpoint()) == b"older layout, newest"
    assert write(m, b"next").sequence_id == 5


def test_a_checkpoint_appears_only_when_committed(tmp_path):
    m = FileSystemCheckpointManager(tmp_path)
    write(m, b"kept")
    unfinished = write(m, b"half", commit=False)  # as a save that crashed
    assert read(m.get_latest_checkpoint()) == b"kept"
    assert not (tmp_path / "1").exists() and (tmp_path / ".1.partial").is_dir()
    unfinished.discard()
    assert not (tmp_path / ".1.partial").exists()
    again = write(m, b"after the crash")
    assert again.sequence_id == 1 and read(m.get_latest_checkpoint()) == b"after the crash"
    again.commit()  # a second commit does nothing


def test_a_damaged_checkpoint_is_skipped_with_a_warning(tmp_path, caplog):
    m = FileSystemCheckpointManager(tmp_path)
    write(m, b"good")
    write(m, b"truncated by a full disk")
    with open(tmp_path / "1" / "default", "r+b") as f:
        f.truncate(3)
    assert read(m.get_latest_checkpoint()) == b"good"
    assert "checkpoint" in caplog.text and "damaged" in caplog.text


def test_keep_last_removes_the_oldest(tmp_path):
    m = FileSystemCheckpointManager(tmp_path, keep_last=2)
    for payload in (b"a", b"b", b"c"):
        write(m, payload)
    assert sorted(os.listdir(tmp_path)) == ["1", "2"]
    with pytest.raises(ValueError, match="keep_last=0"):
        FileSystemCheckpointManager(tmp_path, keep_last=0)


@pytest.mark.parametrize("key", ["", "../escape", ".hidden", "a/b"])
def test_a_key_is_a_plain_name(tmp_path, key):
    checkpoint = FileSystemCheckpointManager(tmp_path).create_checkpoint()
    with pytest.raises(ValueError, match="plain name"):
        checkpoint.open_output_stream(key)


def test_a_manager_written_for_0_1_is_a_checkpoint_manager():
    class InMemory(CheckpointManager):
        def create_checkpoint(self): ...
        def get_checkpoint(self, sequence_id): ...
        def get_latest_checkpoint(self): ...
        def list_checkpoints(self):
            return []

    assert InMemory().list_checkpoints() == []
    with pytest.raises(TypeError):
        type("Incomplete", (CheckpointManager,), {})()


def test_a_committed_checkpoint_is_not_written_again(tmp_path):
    checkpoint = write(FileSystemCheckpointManager(tmp_path), b"x")
    with pytest.raises(ValueError, match="is committed"):
        checkpoint.open_output_stream(DEFAULT_KEY)
    assert Path(checkpoint.checkpoint_dir).name == "0"
