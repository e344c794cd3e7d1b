"""One checkpoint file on disk: written atomically with its checksum beside it, read back only
if it verifies, from one open file so that a concurrent prune cannot pull it away mid-read.

Step N of a manager is ``<prefix>-<N:012d>.pt`` (written by ``torch.save``) and
``<prefix>-<N:012d>.pt.meta.json`` (its size and CRC-32). Each is written to a temporary file,
fsynced and renamed, then the directory is fsynced: a crash at any moment leaves either the
whole new file or none of it.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import pickle
import re
import socket
import threading
import zlib
from pathlib import Path
from typing import IO, Any

import torch

from elastic_sampler.api import CheckpointError, CheckpointMismatchError, UnsafeCheckpointError

FORMAT = 1
_BLOCK = 1 << 22
HOST = socket.gethostname().replace("/", "_")


class AbandonedError(Exception):
    """A background write given up at exit or on SIGTERM (its time bound passed)."""


class UnusableError(CheckpointError):
    """A checkpoint that is torn, corrupt, unreadable or without its checksum."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"checkpoint '{path}' cannot be used: {problem}")
        self.path = path
        self.problem = problem


class GoneError(Exception):
    """The checkpoint was removed (pruned by another process) while it was being read."""


class _ChecksumWriter(io.RawIOBase):
    """A write-only stream that computes the CRC-32 and size of what passes through, and stops
    at the next write once `abandon` is set."""

    def __init__(self, f: IO[bytes], abandon: threading.Event | None) -> None:
        self.f = f
        self.crc = 0
        self.size = 0
        self.abandon = abandon
        self.error: OSError | None = None  # what the file system said, if a write failed

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        if self.abandon is not None and self.abandon.is_set():
            raise AbandonedError("the write was abandoned")
        view = memoryview(b)
        try:
            self.f.write(view)
        except OSError as e:
            self.error = e  # torch.save turns it into a RuntimeError: keep the real cause
            raise
        self.crc = zlib.crc32(view, self.crc)
        self.size += view.nbytes
        return view.nbytes

    def tell(self) -> int:
        return self.size

    def flush(self) -> None:
        self.f.flush()


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def why(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"{e.strerror} (the disk or quota is full)"
    return e.strerror or str(e)


def meta_path(path: Path) -> Path:
    return path.with_name(path.name + ".meta.json")


def temporary(path: Path, pid: int | None = None, thread: int | None = None) -> Path:
    """The temporary file a writer fills before renaming it to `path`. The host is in the name:
    on shared storage, only this host can tell whether `pid` lives."""
    pid = os.getpid() if pid is None else pid
    thread = threading.get_ident() if thread is None else thread
    return path.with_name(f".{path.name}.tmp-{HOST}-{pid}-{thread}")


def remove_my_temporaries(path: Path) -> list[Path]:
    """Remove this process's temporary files for `path` and its checksum (a write given up)."""
    removed = []
    for target in (path, meta_path(path)):
        for p in target.parent.glob(f".{target.name}.tmp-{HOST}-{os.getpid()}-*"):
            with contextlib.suppress(OSError):
                p.unlink()
                removed.append(p)
    return removed


def remove_dead_temporaries(directory: Path, prefix: str) -> None:
    """Remove the temporary files (named by `temporary`) of this host's writers that died
    mid-save, a killed worker's, for files whose name starts with `prefix`."""
    for p in directory.glob(f".{prefix}*.tmp-*"):
        parts = p.name.rsplit(".tmp-", 1)[1].rsplit("-", 2)
        if len(parts) != 3 or parts[0] != HOST:
            continue  # another host's (on shared storage): it may still be writing
        pid = parts[1]
        if pid.isascii() and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            with contextlib.suppress(OSError):
                p.unlink()


def _write_temporary(
    path: Path, write: Any, abandon: threading.Event | None
) -> tuple[Path, int, int]:
    """Fill `path`'s temporary file with write(f) and fsync it. Returns (temporary, size,
    crc32). Leaves nothing behind on failure."""
    tmp = temporary(path)
    w: _ChecksumWriter | None = None
    try:
        with open(tmp, "wb") as raw:
            w = _ChecksumWriter(raw, abandon)
            write(w)
            raw.flush()
            os.fsync(raw.fileno())
        if abandon is not None and abandon.is_set():
            raise AbandonedError("the write was abandoned")
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if w is not None and w.error is not None and w.error is not e:
            raise w.error from e
        raise
    return tmp, w.size, w.crc


def atomic_write(path: Path, write: Any, abandon: threading.Event | None = None) -> tuple[int, int]:
    """Write `path` through a temporary file: write(f) fills it; fsync; rename. Returns the
    (size, crc32) of what was written. Leaves nothing behind on failure."""
    tmp, size, crc = _write_temporary(path, write, abandon)
    try:
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return size, crc


def write_verified(
    path: str | os.PathLike[str], state: Any, abandon: threading.Event | None = None
) -> Path:
    """``torch.save(state)`` to `path` atomically, with its checksum beside it. Raises GoneError if
    another process removed it before its checksum was in place. Replacing a copy that verifies
    keeps it verifiable until the new one is: a failure at any point (a full disk) leaves one of
    the two loadable."""
    target = Path(path)
    old = _intact_record(target)
    try:
        if old is not None:
            _replace_verified(target, state, old, abandon)
            return target
        size, crc = atomic_write(target, lambda f: torch.save(state, f), abandon)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint '{target}': {why(e)}") from e
    try:
        written = os.stat(target).st_ino
    except FileNotFoundError:  # pruned by another manager on the directory as soon as renamed
        raise GoneError(f"'{target}' was removed by another process as it was written") from None
    try:
        record_checksum(target, size, crc, abandon)
    except GoneError:
        raise
    except BaseException as e:
        # Without its checksum the new file can never be used: take it back, if still ours.
        with contextlib.suppress(OSError):
            if os.stat(target).st_ino == written:
                target.unlink()
        if isinstance(e, OSError):
            raise CheckpointError(f"cannot write checkpoint '{target}': {why(e)}") from e
        raise
    return target


def _intact_record(target: Path) -> dict[str, int] | None:
    """The checksum record of the copy at `target`, if that copy verifies."""
    try:
        with open(target, "rb") as f:
            size, crc = _verified(f, target)
    except (OSError, _UnusableError, GoneError):
        return None
    return {"size": size, "crc32": crc}


def _replace_verified(
    target: Path, state: Any, old: dict[str, int], abandon: threading.Event | None
) -> None:
    """Replace an intact copy: the new file is made durable under a temporary name, then the
    checksum file accepts both copies, then the new one takes the name, then the checksum file
    names it alone. Until the rename, a failure changes nothing."""
    tmp, size, crc = _write_temporary(target, lambda f: torch.save(state, f), abandon)
    try:
        _write_record(target, {"size": size, "crc32": crc, "also": [old]}, abandon)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(target.parent)
    with contextlib.suppress(OSError):  # the record above verifies the new copy already
        record_checksum(target, size, crc, abandon)


def _write_record(target: Path, record: dict[str, Any], abandon: threading.Event | None) -> None:
    atomic_write(
        meta_path(target),
        lambda f: f.write(json.dumps({"format": FORMAT, **record}).encode()),
        abandon,
    )


def record_checksum(
    target: Path, size: int, crc: int, abandon: threading.Event | None = None
) -> None:
    """Write the checksum of `target`. If another process removed `target` meanwhile, the
    checksum goes too: no checksum file outlives its checkpoint."""
    meta = meta_path(target)
    _write_record(target, {"size": size, "crc32": crc}, abandon)
    if not target.exists():  # pruned: (a step rewritten by another writer is its to record)
        with contextlib.suppress(OSError):
            meta.unlink()
        raise GoneError(f"'{target}' was removed by another process while it was written")
    fsync_dir(target.parent)


def _crc_of(f: IO[bytes]) -> tuple[int, int]:
    crc, size = 0, 0
    while block := f.read(_BLOCK):
        crc = zlib.crc32(block, crc)
        size += len(block)
    return size, crc


class _UnusableError(Exception):
    """Why a checkpoint cannot be used."""


def _problem(f: IO[bytes], target: Path) -> str | None:
    """Why the open checkpoint `f` cannot be used, or None. Raises GoneError if `target` was
    removed or replaced since `f` was opened (its checksum may belong to another file)."""
    try:
        _verified(f, target)
    except _UnusableError as e:
        return str(e)
    return None


def _verified(f: IO[bytes], target: Path) -> tuple[int, int]:
    """The (size, crc32) of the open checkpoint `f`, which its checksum record accepts; else
    _UnusableError saying why, or GoneError as for :func:`_problem`."""

    def gone() -> bool:
        try:
            return os.stat(target).st_ino != os.fstat(f.fileno()).st_ino
        except FileNotFoundError:
            return True

    try:
        accepted = _accepted(json.loads(meta_path(target).read_text()))
    except FileNotFoundError:
        if gone():
            raise GoneError(str(target)) from None
        raise _UnusableError("its checksum file is missing (the save did not finish)") from None
    except (OSError, ValueError) as e:
        raise _UnusableError(f"its checksum file is unreadable ({e})") from None
    try:
        size, crc = _crc_of(f)
    except OSError as e:
        raise _UnusableError(f"it cannot be read ({e.strerror or e})") from None
    if (size, crc) not in accepted:
        if gone():
            raise GoneError(str(target))
        if size not in [s for s, _ in accepted]:
            raise _UnusableError(f"it is torn ({size} bytes, {accepted[0][0]} were written)")
        raise _UnusableError("its contents are corrupt (checksum mismatch)")
    return size, crc


def _accepted(record: Any) -> list[tuple[int, int]]:
    """The (size, crc32) pairs a checksum record accepts: its own, then a replaced copy's
    while the replacement is under way. ValueError if it is not one of ours."""

    def pair(r: Any) -> tuple[int, int]:
        if not isinstance(r, dict):
            raise ValueError(f"a record must be an object, not {type(r).__name__}")
        values = []
        for name in ("size", "crc32"):
            v = r.get(name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, not {v!r}")
            values.append(v)
        return values[0], values[1]

    if not isinstance(record, dict):
        raise ValueError(f"a record must be an object, not {type(record).__name__}")
    also = record.get("also", [])
    if not isinstance(also, list):
        raise ValueError("'also' must be a list")
    return [pair(record)] + [pair(r) for r in also[:1]]


def verify(path: str | os.PathLike[str]) -> str | None:
    """None if the checkpoint at `path` is complete and intact, else why not."""
    target = Path(path)
    try:
        with open(target, "rb") as f:
            return _problem(f, target)
    except (FileNotFoundError, GoneError):
        return "it does not exist (removed meanwhile?)"
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"


def read_verified(
    path: str | os.PathLike[str],
    map_location: Any = "cpu",
    model: torch.nn.Module | None = None,
    weights_only: bool = True,
) -> Any:
    """Load a checkpoint written by `write_verified`, after checking it is intact (and, given
    `model`, that it fits it). Raises GoneError if another process removes it meanwhile."""
    target = Path(path)
    try:
        f = open(target, "rb")  # noqa: SIM115 - one open file for the check and the load
    except FileNotFoundError:
        raise GoneError(str(target)) from None
    except OSError as e:
        raise UnusableError(target, f"it cannot be read ({why(e)})") from e
    with f:
        problem = _problem(f, target)
        if problem is not None:
            raise UnusableError(target, problem)
        f.seek(0)
        state = load(f, f"checkpoint '{target}'", map_location, weights_only)
    if model is not None:
        check_fits(state, model, f"checkpoint '{target}'")
    return state


def _numpy_globals() -> list[Any]:
    """What numpy arrays, scalars and RNG states (``numpy.random.get_state()``) need to load
    with ``weights_only``: the array rebuilder and the plain dtypes, not object arrays."""
    try:
        import numpy
        import numpy.dtypes
        from numpy._core.multiarray import _reconstruct, scalar
    except ImportError:
        return []
    dtypes = [
        getattr(numpy.dtypes, n)
        for n in dir(numpy.dtypes)
        if n.endswith("DType") and n not in ("ObjectDType", "VoidDType")
    ]
    return [numpy.dtype, numpy.ndarray, _reconstruct, scalar, *dtypes]


def load(source: Any, where: str, map_location: Any, weights_only: bool) -> Any:
    """``torch.load`` that rebuilds only tensors, containers, plain values and numpy arrays
    unless `weights_only` is False; a refused object is an UnsafeCheckpointError saying how to
    opt out and why not to."""
    if not weights_only:
        return torch.load(source, map_location=map_location, weights_only=False)
    try:
        with torch.serialization.safe_globals(_numpy_globals()):
            return torch.load(source, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        refused = re.search(r"unsupported GLOBAL ([\w.]+)|but got <class '([\w.]+)'>", str(e))
        if refused is None and "Unsupported operand" in str(e):
            raise CheckpointError(f"{where} is not a torch checkpoint (unreadable data)") from e
        what = f" ({refused.group(1) or refused.group(2)})" if refused else ""
        raise UnsafeCheckpointError(
            f"{where} holds an object that loading with weights_only=True refuses to "
            f"rebuild{what}. If you wrote this file yourself, allow its class with "
            "torch.serialization.add_safe_globals([...]), or pass weights_only=False; never "
            "do either for a file from elsewhere: unpickling it runs any code it names"
        ) from e


def check_fits(state: Any, model: torch.nn.Module, where: str) -> None:
    weights = state.get("model", state) if isinstance(state, dict) else state
    if not isinstance(weights, dict):
        raise CheckpointMismatchError(f"{where} holds no model state dict to compare")
    mine = model.state_dict()
    missing = sorted(set(mine) - set(weights))
    unexpected = sorted(set(weights) - set(mine))
    shapes = [
        f"{k}: checkpoint {tuple(weights[k].shape)} vs model {tuple(mine[k].shape)}"
        for k in sorted(set(mine) & set(weights))
        if isinstance(weights[k], torch.Tensor) and weights[k].shape != mine[k].shape
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        if unexpected:
            parts.append(f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
        if shapes:
            parts.append(f"shapes differ: {'; '.join(shapes[:5])}")
        raise CheckpointMismatchError(
            f"{where} was saved from another model ({', '.join(parts)}); point the manager at "
            "this model's checkpoints"
        )
