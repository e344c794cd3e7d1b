"""Files written whole or not at all: a reader (a worker, the launcher, a later run) sees the
old content or the new, never a part of it. The one writer of elastic_launch's files
(elastic_sampler, which needs only torch, has its own for checkpoints and their checksums)."""

from __future__ import annotations

import contextlib
import os
import threading


def write_atomically(
    path: str | os.PathLike[str], data: bytes | str, durable: bool = False
) -> None:
    """Write `data` to `path` through a temporary file beside it, renamed over it. With
    `durable`, the file and then its directory are fsynced, so that a crash of the machine keeps
    the old content or the new. Raises OSError; leaves no temporary file behind."""
    path = os.fspath(path)
    tmp = f"{path}.{os.getpid()}-{threading.get_ident()}.tmp"  # one per writer: writers may race
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(os.path.dirname(path) or ".")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory `path` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
