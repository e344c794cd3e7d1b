"""elastic_launch's one writer of whole files."""

from __future__ import annotations

import os

import pytest
from elastic_launch.files import fsync_dir, write_atomically


@pytest.mark.parametrize("durable", [False, True])
def test_a_file_is_replaced_whole_and_no_temporary_is_left(tmp_path, durable):
    path = tmp_path / "result.json"
    path.write_text("old")
    write_atomically(path, '{"new": 1}', durable=durable)
    assert path.read_text() == '{"new": 1}'
    write_atomically(path, b"\x00bytes", durable=durable)
    assert path.read_bytes() == b"\x00bytes"
    assert os.listdir(tmp_path) == ["result.json"]


def test_a_failed_write_keeps_the_old_content_and_leaves_nothing(tmp_path):
    path = tmp_path / "result.json"
    path.write_text("old")
    with pytest.raises(TypeError):
        write_atomically(path, 42)  # type: ignore[arg-type]
    target = tmp_path / "a-directory"
    target.mkdir()
    with pytest.raises(IsADirectoryError):
        write_atomically(target, "x")
    assert path.read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["a-directory", "result.json"]
    with pytest.raises(FileNotFoundError):
        write_atomically(tmp_path / "missing" / "f", "x")


def test_fsync_dir_needs_a_directory(tmp_path):
    fsync_dir(tmp_path)
    a_file = tmp_path / "f"
    a_file.write_text("x")
    with pytest.raises(NotADirectoryError):
        fsync_dir(a_file)
