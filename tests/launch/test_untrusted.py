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


def _plant(place, kind: str, tmp_path, at) -> None:
    """Put `kind` at path `at` (a symbolic link to a directory, or any of KINDS)."""
    if kind == "symlink to a directory":
        target = tmp_path / "elsewhere"
        target.mkdir()
        (target / "keep").write_text("mine")
        os.symlink(target, at)
    else:
        os.rename(place(kind), at)


PLANTED = (*KINDS, "symlink to a directory")


@pytest.mark.parametrize("kind", PLANTED)
@pytest.mark.parametrize("where", ["top", "middle", "last"])
def test_a_directory_is_made_whatever_a_worker_left_in_its_way(place, tmp_path, kind, where):
    top = tmp_path / "run"
    top.mkdir()
    path = top / "attempt_1" / "0"
    at = {"top": top, "middle": top / "attempt_1", "last": path}[where]
    if where != "top":
        at.parent.mkdir(parents=True, exist_ok=True)
    else:
        top.rmdir()
    _plant(place, kind, tmp_path, at)
    moved = untrusted.make_dir(str(path), str(top))
    assert os.path.isdir(path) and not os.path.islink(path) and not os.path.islink(at)
    if kind == "directory":
        assert moved == [], "a directory is a directory: kept"
        return
    assert len(moved) == 1 and str(at) in moved[0], moved
    aside = [p for p in os.listdir(at.parent) if p.startswith(at.name + ".moved-")]
    assert len(aside) == 1, "what was there is kept, beside"
    if kind == "symlink to a directory":
        assert os.listdir(tmp_path / "elsewhere") == ["keep"], "the link was never followed"


@pytest.mark.parametrize("kind", PLANTED)
def test_a_log_is_opened_whatever_a_worker_left_at_its_path(place, tmp_path, kind):
    path = tmp_path / "stderr.log"
    _plant(place, kind, tmp_path, path)
    fd, moved = untrusted.open_log(str(path))
    try:
        assert os.get_blocking(fd), "a worker writes its log as a blocking file"
        os.write(fd, b"line\n")
    finally:
        os.close(fd)
    if kind == "huge":
        assert moved == [] and os.path.getsize(path) == (1 << 40) + 5
        return
    assert len(moved) == 1 and str(path) in moved[0], moved
    assert not os.path.islink(path) and path.read_bytes() == b"line\n"
    if kind == "symlink":
        assert (tmp_path / "target").read_text() == "{}", "the link's target is untouched"
    if kind == "symlink to a directory":
        assert os.listdir(tmp_path / "elsewhere") == ["keep"]


@pytest.mark.parametrize("kind", PLANTED)
def test_a_tree_is_removed_whatever_a_worker_put_in_its_place(place, tmp_path, kind):
    path = tmp_path / "memory"
    _plant(place, kind, tmp_path, path)
    untrusted.remove_tree(str(path))
    assert not os.path.lexists(path)
    if kind == "symlink to a directory":
        assert os.listdir(tmp_path / "elsewhere") == ["keep"], "the link was never followed"
    untrusted.remove_tree(str(path))  # nothing there: no error
