"""Files a worker can replace (its error, loop and stack files, its logs, a function's result),
opened as the launcher must open them: without following a link, without blocking (a FIFO with
no writer, a socket), checked to be a regular file once open, and read up to a limit. Whatever
a worker put at such a path, the launcher gets bytes or an OSError that says what was there,
and keeps answering signals."""

from __future__ import annotations

import errno
import os
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
