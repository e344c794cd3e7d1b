"""Files a worker can replace (its error, loop and stack files, its logs, a function's result,
the run directory's directories, the memory tier's), opened as the launcher must open them:
without following a link, without blocking (a FIFO with no writer, a socket), checked to be a
regular file once open, and read up to a limit. Whatever a worker put at such a path, the
launcher gets bytes or an OSError that says what was there, and keeps answering signals; where
the launcher makes a directory or a log, what a worker left in the way is moved aside; where
it removes one, a link is removed, never followed."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFLNK: "a symbolic link",
}


class NotARegularFile(OSError):  # noqa: N818 - an OSError, as the callers catch
    """What a worker left at a path the launcher reads or writes is not a regular file."""


def kind(mode: int) -> str:
    """What a file of `mode` is, in words."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: str, flags: int, mode: int = 0o644) -> int:
    """A descriptor of the regular file at `path` (`flags` as os.open's, with no link followed
    and no blocking); raises OSError, :class:`NotARegularFile` for anything else there."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotARegularFile(e.errno, "a symbolic link, which is not followed", path) from e
        if e.errno in (errno.ENXIO, errno.EISDIR):
            try:
                found = kind(os.lstat(path).st_mode)
            except OSError:
                found = "nothing"
            raise NotARegularFile(e.errno, f"{found}, not a regular file", path) from e
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotARegularFile(errno.EINVAL, f"{kind(st.st_mode)}, not a regular file", path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read(path: str, limit: int, offset: int = 0) -> bytes:
    """At most `limit` bytes of the regular file at `path`, from `offset`; raises OSError
    (:class:`NotARegularFile` for anything but a regular file)."""
    fd = open_regular(path, os.O_RDONLY)
    try:
        chunks, left = [], limit
        while left > 0:
            chunk = os.pread(fd, min(left, 1 << 20), offset + limit - left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def size(path: str) -> int:
    """The size of the regular file at `path` (the link itself is not followed); 0 for
    anything else or nothing."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def append(path: str, data: bytes) -> None:
    """Append `data` to the regular file at `path` (created if missing); raises OSError
    (:class:`NotARegularFile` for anything but a regular file)."""
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def replace(path: str, data: bytes) -> None:
    """Write `data` to `path` whole, where a worker can write too: through a file of a random
    name made beside it (never one a worker could have put a link or a FIFO at), renamed over
    whatever is at `path` (a link is replaced, not followed); raises OSError (a directory
    there, for one)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".elasticrun-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _move_aside(path: str) -> str:
    """Rename what is at `path` (not followed, if a link) to a name of its own beside it, and
    say what it was."""
    found = kind(os.lstat(path).st_mode)
    aside = f"{path}.moved-{os.urandom(4).hex()}"
    os.rename(path, aside)
    return f"{found} at {path} (moved to {aside})"


def make_dir(path: str, top: str) -> list[str]:
    """Make the directory `path`, `top` (`path` or a directory above it, the launcher's own)
    and each one between that is missing, mode 0700. Whatever else a worker left at one of
    them (a file, a FIFO, a socket, a link, even to a directory) is moved aside, never
    followed. Returns what was moved aside, in words; raises OSError if a directory still
    cannot be made."""
    rel = os.path.relpath(path, top)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep):
        raise ValueError(f"{path} is not under {top}")
    moved = _make_one(top)
    current = top
    for part in [] if rel == os.curdir else rel.split(os.sep):
        current = os.path.join(current, part)
        moved.extend(_make_one(current))
    return moved


def _make_one(path: str) -> list[str]:
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            return []
        moved = [_move_aside(path)]
    except FileNotFoundError:
        moved = []
    os.mkdir(path, 0o700)
    return moved


def open_log(path: str) -> tuple[int, list[str]]:
    """A descriptor appending to the regular file at `path`, made if missing, blocking as a
    log's writer should. Whatever else a worker left there is moved aside first (returned, in
    words); raises OSError if the file still cannot be opened."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT
    moved = []
    try:
        fd = open_regular(path, flags)
    except NotARegularFile:
        moved.append(_move_aside(path))
        fd = open_regular(path, flags | os.O_EXCL)
    os.set_blocking(fd, True)
    return fd, moved


def remove_tree(path: str) -> None:
    """Remove the directory `path` and what is in it, or whatever a worker put in its place
    (a link is removed, never followed); nothing there is no error."""
    try:
        st = os.lstat(path)
    except OSError:
        return
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)
