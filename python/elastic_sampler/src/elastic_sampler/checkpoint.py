"""Checkpoints that are never lost: atomic writes with a checksum, the newest one that verifies,
background saving, and agreement across ranks on node-local storage.

On disk, step N is ``<prefix>-<N:012d>.pt`` (written by ``torch.save``) and
``<prefix>-<N:012d>.pt.meta.json`` (its size and CRC-32). Each is written to a temporary file,
fsynced and renamed, then the directory is fsynced; a checkpoint counts only once both are in
place and agree, so a crash at any moment leaves the previous one intact. Older checkpoints
beyond ``keep_last`` are removed only after that.
"""

from __future__ import annotations

import contextlib
import copy
import ctypes
import errno
import io
import json
import logging
import os
import re
import socket
import threading
import warnings
import zlib
from pathlib import Path
from typing import IO, Any

import torch

from elastic_sampler.api import CheckpointError, CheckpointMismatchError

logger = logging.getLogger(__name__)

_FORMAT = 1
_BLOCK = 1 << 22
_HOST = socket.gethostname().replace("/", "_")


class _ChecksumWriter(io.RawIOBase):
    """A write-only stream that computes the CRC-32 and size of what passes through."""

    def __init__(self, f: IO[bytes]) -> None:
        self.f = f
        self.crc = 0
        self.size = 0
        self.error: OSError | None = None  # what the file system said, if a write failed

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _why(e: OSError) -> str:
    if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return f"{e.strerror} (the disk or quota is full)"
    return e.strerror or str(e)


def _atomic_write(path: Path, write: Any) -> tuple[int, int]:
    """Write `path` through a temporary file: write(f) fills it; fsync; rename. Returns the
    (size, crc32) of what was written. Leaves nothing behind on failure."""
    # The host in the name: on shared storage, only this host can tell whether pid lives.
    tmp = path.with_name(f".{path.name}.tmp-{_HOST}-{os.getpid()}-{threading.get_ident()}")
    w: _ChecksumWriter | None = None
    try:
        with open(tmp, "wb") as raw:
            w = _ChecksumWriter(raw)
            write(w)
            raw.flush()
            os.fsync(raw.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if w is not None and w.error is not None and w.error is not e:
            raise w.error from e
        raise
    assert w is not None
    return w.size, w.crc


def _file_crc(path: Path) -> tuple[int, int]:
    crc, size = 0, 0
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            crc = zlib.crc32(block, crc)
            size += len(block)
    return size, crc


def write_verified(path: str | os.PathLike[str], state: Any) -> Path:
    """``torch.save(state)`` to `path` atomically, with its checksum beside it."""
    target = Path(path)
    meta = target.with_name(target.name + ".meta.json")
    try:
        size, crc = _atomic_write(target, lambda f: torch.save(state, f))
        record = {"format": _FORMAT, "size": size, "crc32": crc}
        _atomic_write(meta, lambda f: f.write(json.dumps(record).encode()))
        _fsync_dir(target.parent)
    except OSError as e:
        raise CheckpointError(f"cannot write checkpoint '{target}': {_why(e)}") from e
    return target


def verify(path: str | os.PathLike[str]) -> str | None:
    """None if the checkpoint at `path` is complete and intact, else why not."""
    target = Path(path)
    meta = target.with_name(target.name + ".meta.json")
    try:
        record = json.loads(meta.read_text())
    except FileNotFoundError:
        return "its checksum file is missing (the save did not finish)"
    except (OSError, ValueError) as e:
        return f"its checksum file is unreadable ({e})"
    try:
        size, crc = _file_crc(target)
    except OSError as e:
        return f"it cannot be read ({e.strerror or e})"
    if size != record.get("size"):
        return f"it is torn ({size} bytes, {record.get('size')} were written)"
    if crc != record.get("crc32"):
        return "its contents are corrupt (checksum mismatch)"
    return None


def _check_fits(state: Any, model: torch.nn.Module, where: str) -> None:
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


def read_verified(
    path: str | os.PathLike[str], map_location: Any = "cpu", model: torch.nn.Module | None = None
) -> Any:
    """Load a checkpoint written by `write_verified`, after checking it is intact (and, given
    `model`, that it fits it)."""
    problem = verify(path)
    if problem is not None:
        raise CheckpointError(f"checkpoint '{path}' cannot be used: {problem}")
    state = torch.load(path, map_location=map_location, weights_only=False)
    if model is not None:
        _check_fits(state, model, f"checkpoint '{path}'")
    return state


def _reusable(buffer: Any, tensor: torch.Tensor) -> bool:
    return (
        type(buffer) is torch.Tensor
        and type(tensor) is torch.Tensor  # not a subclass (a DTensor's shape is global)
        and buffer.device.type == "cpu"
        and buffer.shape == tensor.shape
        and buffer.dtype == tensor.dtype
        and buffer.layout == tensor.layout == torch.strided
        and not tensor.is_quantized
    )


def snapshot(state: Any, reuse: Any = None) -> Any:
    """A copy of `state` that training can no longer change: tensors are copied to the CPU,
    containers rebuilt, anything else deep-copied.

    `reuse` is an earlier snapshot nobody uses any more (it is taken apart): its tensors that
    match in place, shape and dtype are copied into rather than allocated anew (fresh memory
    costs a page fault per 4 KiB, which makes a copy about 3x slower); the others are let go
    before their replacement is allocated."""
    if isinstance(state, torch.Tensor):
        source = state.detach()
        if _reusable(reuse, source):
            return reuse.copy_(source)
        del reuse  # free the mismatched buffer first: peak memory stays one copy
        return source.to("cpu", copy=True)
    if isinstance(state, dict):
        old = reuse if isinstance(reuse, dict) else {}
        del reuse
        items = [(k, snapshot(v, old.pop(k, None))) for k, v in state.items()]
        old.clear()
        try:
            return type(state)(items)  # dict, OrderedDict (state_dict's type)
        except TypeError:
            return dict(items)
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        old_items: list[Any] = (
            reuse if isinstance(reuse, list) else list(reuse) if isinstance(reuse, tuple) else []
        )
        del reuse
        copied = []
        for i, v in enumerate(state):
            r = None
            if i < len(old_items):
                r, old_items[i] = old_items[i], None
            copied.append(snapshot(v, r))
        old_items.clear()
        return copied if isinstance(state, list) else tuple(copied)
    return copy.deepcopy(state)


class CheckpointManager:
    """The checkpoints of one job in one directory: save, keep the last K, load the newest
    that verifies.

    With `reuse_buffers` (the default), a background save copies the state into the buffers
    of the previous background save where shapes match, which blocks training about a third
    as long; those buffers (one copy of the state, which every background save needs anyway)
    stay allocated until `close()`. ``reuse_buffers=False`` frees them after each write."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        keep_last: int = 3,
        prefix: str = "checkpoint",
        reuse_buffers: bool = True,
    ) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: keep at least 1 checkpoint")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
            raise ValueError(f"prefix={prefix!r}: use letters, digits, '.', '_' and '-'")
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.prefix = prefix
        self._pattern = re.compile(rf"{re.escape(prefix)}-(\d{{12}})\.pt")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            probe = self.directory / f".write-test-{os.getpid()}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            raise CheckpointError(
                f"cannot write checkpoints to '{self.directory}': {_why(e)}; choose a writable "
                "directory"
            ) from e
        self.reuse_buffers = reuse_buffers
        self._staging: Any = None  # the last background copy, once written: the next one's buffers
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self._remove_stale_temporaries()

    def _remove_stale_temporaries(self) -> None:
        """Temporary files of this host's writers that died mid-save (a killed worker)."""
        for p in self.directory.glob(f".{self.prefix}-*.tmp-*"):
            parts = p.name.rsplit(".tmp-", 1)[1].rsplit("-", 2)
            if len(parts) != 3 or parts[0] != _HOST:
                continue  # another host's (on shared storage): it may still be writing
            pid = parts[1]
            if pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
                with contextlib.suppress(OSError):
                    p.unlink()

    # ---- saving --------------------------------------------------------------------------

    def path(self, step: int) -> Path:
        return self.directory / f"{self.prefix}-{step:012d}.pt"

    def save(self, state: Any, step: int, background: bool = False) -> Path:
        """Write `state` as checkpoint `step`. With `background`, the state is copied first
        (so training may change it right away) and written by a worker thread; at most one
        write is in flight, and its error surfaces on the next call.

        Saving a step that exists already replaces it; a crash during that replacement
        leaves the step unverifiable (the others stay intact), so with ``keep_last=1`` give
        each save a new step."""
        if step < 0:
            raise ValueError(f"step={step} is negative")
        self.wait()  # one write at a time; raises a background error
        if not background:
            return self._write(state, step)
        copied = snapshot(state, self._take_staging())  # no reference kept here: see snapshot
        self._staging = copied if self.reuse_buffers else None
        self._thread = threading.Thread(
            target=self._write_in_background,
            args=(copied, step),
            name="elastic-checkpoint",
            daemon=True,
        )
        self._thread.start()
        return self.path(step)

    def _take_staging(self) -> Any:
        staging, self._staging = self._staging, None
        return staging

    def _write_in_background(self, state: Any, step: int) -> None:
        try:
            self._write(state, step)
        except BaseException as e:
            with self._lock:
                self._error = e

    def _write(self, state: Any, step: int) -> Path:
        target = self.path(step)
        try:
            write_verified(target, state)
        except CheckpointError as e:
            previous = self.latest_step()  # only now: it reads every byte to verify
            keep = (
                f"checkpoint step {previous} is intact"
                if previous is not None
                else "there is no earlier checkpoint"
            )
            raise CheckpointError(f"{e} ({keep})") from e.__cause__
        self._prune(step)
        return target

    def _prune(self, written: int) -> None:
        # Only up to the step just written: a newer one (of a timeline we resumed before)
        # never pushes out the checkpoint we just made.
        older = [s for s in self.steps() if s <= written]
        for step in older[: -self.keep_last]:
            for p in (
                self.path(step),
                self.path(step).with_name(self.path(step).name + ".meta.json"),
            ):
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for a background write; raise its error, if it failed."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"the background checkpoint write did not finish in {timeout} s")
            self._thread = None
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def close(self) -> None:
        """Finish any background write (raising its error) and free the copy's buffers."""
        self._staging = None
        self.wait()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- loading -------------------------------------------------------------------------

    def steps(self) -> list[int]:
        """Steps with a checkpoint file here (not verified), oldest first."""
        out = []
        try:
            names = list(self.directory.iterdir())
        except FileNotFoundError:
            return []
        for p in names:
            m = self._pattern.fullmatch(p.name)
            if m:
                out.append(int(m.group(1)))
        return sorted(out)

    def latest_step(self, verified: bool = True) -> int | None:
        """The newest step whose checkpoint verifies (or merely exists)."""
        for step in reversed(self.steps()):
            if not verified or verify(self.path(step)) is None:
                return step
        return None

    def load_latest(
        self, map_location: Any = "cpu", model: torch.nn.Module | None = None
    ) -> tuple[Any, int] | None:
        """(state, step) of the newest checkpoint that verifies, skipping torn or corrupt ones
        with a warning; None if there is none. Given `model`, a checkpoint of another model is
        an error."""
        self.wait()
        for step in reversed(self.steps()):
            path = self.path(step)
            problem = verify(path)
            if problem is not None:
                warnings.warn(f"skipping checkpoint '{path}': {problem}", stacklevel=2)
                continue
            return read_verified(path, map_location, model), step
        return None


def save_checkpoint(path: str | os.PathLike[str], state: Any) -> Path:
    """Save one checkpoint file atomically, with its checksum."""
    return write_verified(path, state)


def load_checkpoint(
    path: str | os.PathLike[str], map_location: Any = "cpu", model: torch.nn.Module | None = None
) -> Any:
    """Load one checkpoint file, verified (and checked against `model`, when given)."""
    return read_verified(path, map_location, model)


def broadcast_latest(
    manager: CheckpointManager, group: Any = None, map_location: Any = "cpu"
) -> tuple[Any, int] | None:
    """For node-local storage: the ranks agree on the newest step any of them holds intact,
    the lowest rank holding it sends it to all (gloo or any backend with broadcast), and the
    others keep a copy in their own directory. Returns (state, step), or None if no rank has
    a checkpoint. Every rank of `group` must call it."""
    import torch.distributed as dist

    manager.wait()  # a background write of this rank's must be complete (or fail here)
    local = manager.latest_step()
    best = torch.tensor([-1 if local is None else local], dtype=torch.int64)
    dist.all_reduce(best, op=dist.ReduceOp.MAX, group=group)
    step = int(best.item())
    if step < 0:
        return None
    me = dist.get_rank()
    holder = torch.tensor([me if local == step else 1 << 62], dtype=torch.int64)
    dist.all_reduce(holder, op=dist.ReduceOp.MIN, group=group)
    src = int(holder.item())
    path = manager.path(step)
    data, problem = b"", ""
    if me == src:
        try:
            data = path.read_bytes()
        except OSError as e:
            problem = _why(e)
    # -1: the holder could not read it; every rank raises rather than waiting forever.
    size = torch.tensor([-1 if problem else len(data)], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    if int(size.item()) < 0:
        raise CheckpointError(
            f"rank {src} holds checkpoint step {step} but could not read it"
            + (f": {problem}" if problem else f" (rank {src}'s error says why)")
        )
    buffer = torch.empty(int(size.item()), dtype=torch.uint8)
    if me == src:
        buffer.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dist.broadcast(buffer, src=src, group=group)
    raw = data if me == src else ctypes.string_at(buffer.data_ptr(), buffer.numel())
    if local != step:  # keep our own copy: this node may need it after the next failure
        try:
            size_written, crc = _atomic_write(path, lambda f: f.write(raw))
            meta = {"format": _FORMAT, "size": size_written, "crc32": crc}
            meta_path = path.with_name(path.name + ".meta.json")
            _atomic_write(meta_path, lambda f: f.write(json.dumps(meta).encode()))
            _fsync_dir(path.parent)
        except OSError as e:
            logger.warning("could not keep a copy of checkpoint %s: %s", path, _why(e))
    state = torch.load(io.BytesIO(raw), map_location=map_location, weights_only=False)
    return state, step
