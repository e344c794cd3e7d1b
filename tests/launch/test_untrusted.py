"""Files a worker can replace, as the launcher opens them (elastic_launch.untrusted): whatever is
at the path (a FIFO with or without a writer, a directory, a symbolic link, a socket, a huge
file), the launcher gets bytes or an OSError naming what was there, and never blocks."""

from __future__ import annotations

import os
import socket

import pytest
from elastic_launch import untrusted
from elastic_launch.agent.worker import Worker
from elastic_launch.errors import read_error_file

pytestmark = pytest.mark.timeout(30)  # a blocking open would hang: the limit fails it

KINDS = ("fifo", "fifo with a writer", "directory", "symlink", "socket", "huge")


@pytest.fixture
def place(tmp_path):
    """Make `kind` at a path; whatever it holds open is closed after the test."""
    held: list = []

    def make(kind: str) -> str:
        path = str(tmp_path / f"file-{kind.replace(' ', '-')}")
        if kind.startswith("fifo"):
            os.mkfifo(path)
            if kind == "fifo with a writer":
                reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                held.extend([reader, os.open(path, os.O_WRONLY)])
        elif kind == "directory":
            os.mkdir(path)
        elif kind == "symlink":
            target = tmp_path / "target"
            target.write_text("{}")
            os.symlink(target, path)
        elif kind == "socket":
            s = socket.socket(socket.AF_UNIX)
            s.bind(path)
            held.append(s)
        elif kind == "huge":
            with open(path, "wb") as f:
                f.truncate(1 << 40)  # a terabyte, sparse
        return path

    yield make
    for h in held:
        h.close() if isinstance(h, socket.socket) else os.close(h)


@pytest.mark.parametrize("kind", KINDS)
def test_a_read_gets_bytes_or_an_error_that_names_what_was_there(place, kind):
    path = place(kind)
    if kind == "huge":
        assert untrusted.read(path, 100) == b"\0" * 100, "no more than the limit"
        assert untrusted.read(path, 10, offset=(1 << 40) - 4) == b"\0" * 4
        return
    with pytest.raises(untrusted.NotARegularFile) as e:
        untrusted.read(path, 100)
    said = str(e.value)
    assert path in said and (
        "FIFO" in said or "directory" in said or "link" in said or "socket" in said
    ), said
    assert untrusted.size(path) == 0


@pytest.mark.parametrize("kind", KINDS)
def test_an_append_never_blocks_and_never_writes_through_a_link(place, kind, tmp_path):
    path = place(kind)
    if kind == "huge":
        untrusted.append(path, b"more")
        assert os.path.getsize(path) == (1 << 40) + 4
        return
    with pytest.raises(untrusted.NotARegularFile):
        untrusted.append(path, b"stack")
    if kind == "symlink":
        assert (tmp_path / "target").read_text() == "{}", "the link's target is untouched"


@pytest.mark.parametrize("kind", KINDS)
def test_the_launchers_readers_take_what_a_worker_left_as_nothing_said(place, kind):
    """The error file's reader and the loop file's: nothing was said."""
    path = place(kind)
    assert read_error_file(path) is None
    worker = Worker.__new__(Worker)
    worker.loop_file = path
    assert worker.train_loop().value == "" and worker.loop_budget() == 0


def test_a_regular_file_reads_whole_and_appends(tmp_path):
    path = str(tmp_path / "log")
    untrusted.append(path, b"one\n")
    untrusted.append(path, b"two\n")
    assert untrusted.read(path, 1 << 20) == b"one\ntwo\n" and untrusted.size(path) == 8
    assert untrusted.read(path, 3, offset=4) == b"two"
