"""Checkpoints of the train loop, in the classic package's API (``torchelastic.checkpoint``).

Set a manager before ``train``; rank 0 loads the newest checkpoint once, before the first
``sync`` (which hands it to the others), and saves one after a step whenever the coordinator's
``should_save_checkpoint()`` or ``state.should_save_checkpoint(rank)`` says so (every rank then
meets at a barrier). ``state.save``/``state.load`` write and read the checkpoint's
``default`` stream, as the classic loop did::

    from elastic_launch.train_loop import FileSystemCheckpointManager, set_checkpoint_manager
    set_checkpoint_manager(FileSystemCheckpointManager("/checkpoints/job1"))

:class:`FileSystemCheckpointManager` keeps 0.1's layout, ``<dir>/<N>/<key>`` (N counting up
from 0), and reads folders torchelastic 0.1 wrote. It writes safely where 0.1 did not: a
checkpoint is written under ``<dir>/.<N>.partial`` and appears as ``<dir>/<N>`` only when
committed (a crash in the middle of a save leaves the previous one the newest), with the
size of each file recorded; a checkpoint whose files no longer have their recorded sizes
(truncated by a full disk, a partial copy) is skipped by :meth:`get_latest_checkpoint`, with
a warning. Any :class:`CheckpointManager` subclass written for 0.1 works as well.
"""

from __future__ import annotations

import abc
import contextlib
import json
import logging
import os
import shutil
from typing import IO, Any

from elastic_launch.files import fsync_dir, write_atomically
from elastic_launch.train_loop.api import State, UserMethodError

logger = logging.getLogger(__name__)

#: The stream the loop saves the state to, as in 0.1.
DEFAULT_KEY = "default"
#: What a committed checkpoint records of its files (absent from 0.1's folders).
RECORD = ".elasticrun.json"


class Checkpoint(abc.ABC):
    """One checkpoint: named binary streams, visible once committed."""

    @abc.abstractmethod
    def open_output_stream(self, key: str) -> IO[bytes]:
        """A stream to write `key` (written again if opened twice)."""

    @abc.abstractmethod
    def open_input_stream(self, key: str) -> IO[bytes]: ...

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the checkpoint available (once; again is a no-op)."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Drop the checkpoint."""


class CheckpointManager(abc.ABC):
    """Creates checkpoints and finds them, newest first."""

    @abc.abstractmethod
    def create_checkpoint(self) -> Checkpoint: ...

    @abc.abstractmethod
    def get_checkpoint(self, sequence_id: int) -> Checkpoint:
        """Checkpoint `sequence_id`; raises if there is none."""

    @abc.abstractmethod
    def get_latest_checkpoint(self) -> Checkpoint | None: ...

    @abc.abstractmethod
    def list_checkpoints(self) -> list[Checkpoint]:
        """Every checkpoint, newest first."""


class FileSystemCheckpoint(Checkpoint):
    """Checkpoint `sequence_id` of a :class:`FileSystemCheckpointManager`."""

    def __init__(self, manager: FileSystemCheckpointManager, sequence_id: int) -> None:
        self.manager = manager
        self.sequence_id = sequence_id
        self.checkpoint_dir = os.path.join(manager.checkpoint_dir, str(sequence_id))
        self.partial_dir = os.path.join(manager.checkpoint_dir, f".{sequence_id}.partial")
        self.committed = os.path.isdir(self.checkpoint_dir)

    def _where(self) -> str:
        return self.checkpoint_dir if self.committed else self.partial_dir

    def open_output_stream(self, key: str) -> IO[bytes]:
        if self.committed:
            raise ValueError(f"checkpoint {self.sequence_id} is committed: it is not written again")
        return open(os.path.join(self.partial_dir, _file_name(key)), "wb")

    def open_input_stream(self, key: str) -> IO[bytes]:
        return open(os.path.join(self._where(), _file_name(key)), "rb")

    def commit(self) -> None:
        if self.committed:
            return
        sizes = {}
        for name in sorted(os.listdir(self.partial_dir)):
            path = os.path.join(self.partial_dir, name)
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
            sizes[name] = os.path.getsize(path)
        record = os.path.join(self.partial_dir, RECORD)
        write_atomically(record, json.dumps({"sizes": sizes}), durable=True)
        os.rename(self.partial_dir, self.checkpoint_dir)
        with contextlib.suppress(OSError):
            fsync_dir(self.manager.checkpoint_dir)
        self.committed = True
        self.manager.prune()

    def discard(self) -> None:
        shutil.rmtree(self._where(), ignore_errors=True)

    def intact(self) -> bool:
        """Whether every file has the size recorded at commit (0.1's folders: no record)."""
        try:
            with open(os.path.join(self.checkpoint_dir, RECORD)) as f:
                sizes = json.load(f)["sizes"]
        except FileNotFoundError:
            return True
        except (OSError, ValueError, KeyError, TypeError):
            return False
        for name, size in sizes.items():
            path = os.path.join(self.checkpoint_dir, name)
            if not os.path.isfile(path) or os.path.getsize(path) != size:
                return False
        return True

    def __repr__(self) -> str:
        return f"FileSystemCheckpoint({self._where()!r})"


class FileSystemCheckpointManager(CheckpointManager):
    """Checkpoints in `checkpoint_dir` (created if missing), in 0.1's layout; the newest
    `keep_last` kept (None: every one, as 0.1)."""

    def __init__(self, checkpoint_dir: str | os.PathLike[str], keep_last: int | None = None):
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"keep_last={keep_last}: keep at least 1 checkpoint, or None for all")
        self.checkpoint_dir = os.fspath(checkpoint_dir)
        self.keep_last = keep_last
        os.makedirs(self.checkpoint_dir, exist_ok=True)

    def _sequence_ids(self) -> list[int]:
        """The committed checkpoints' numbers, newest first."""
        ids = []
        for name in os.listdir(self.checkpoint_dir):
            if (
                name.isascii()
                and name.isdigit()
                and os.path.isdir(os.path.join(self.checkpoint_dir, name))
            ):
                ids.append(int(name))
        return sorted(ids, reverse=True)

    def create_checkpoint(self) -> FileSystemCheckpoint:
        ids = self._sequence_ids()
        checkpoint = FileSystemCheckpoint(self, ids[0] + 1 if ids else 0)
        shutil.rmtree(checkpoint.partial_dir, ignore_errors=True)  # a crashed save's
        os.makedirs(checkpoint.partial_dir)
        return checkpoint

    def get_checkpoint(self, sequence_id: int) -> FileSystemCheckpoint:
        checkpoint = FileSystemCheckpoint(self, int(sequence_id))
        if not checkpoint.committed:
            raise FileNotFoundError(
                f"checkpoint {sequence_id} not found: {checkpoint.checkpoint_dir} is not a folder"
            )
        return checkpoint

    def get_latest_checkpoint(self) -> FileSystemCheckpoint | None:
        for sequence_id in self._sequence_ids():
            checkpoint = FileSystemCheckpoint(self, sequence_id)
            if checkpoint.intact():
                return checkpoint
            logger.warning(
                "checkpoint %s is damaged (a file is not the size it was saved with): "
                "skipped, an older one is used",
                checkpoint.checkpoint_dir,
            )
        return None

    def list_checkpoints(self) -> list[Checkpoint]:
        return [FileSystemCheckpoint(self, i) for i in self._sequence_ids()]

    def prune(self) -> None:
        """Remove all but the newest `keep_last` checkpoints."""
        if self.keep_last is None:
            return
        for sequence_id in self._sequence_ids()[self.keep_last :]:
            shutil.rmtree(os.path.join(self.checkpoint_dir, str(sequence_id)), ignore_errors=True)


def _file_name(key: str) -> str:
    if not key or "/" in key or key.startswith(".") or "\0" in key:
        raise ValueError(f"checkpoint key {key!r}: give a plain name, as 'default' or 'model'")
    return key


_manager: CheckpointManager | None = None


def set_checkpoint_manager(manager: CheckpointManager | None) -> None:
    """Checkpoint the train loop with `manager` (None: no checkpoints, the default)."""
    global _manager
    _manager = manager


def get_checkpoint_manager() -> CheckpointManager | None:
    return _manager


class CheckpointUtil:
    """The loop's side: load once (rank 0), save when asked, barrier."""

    def __init__(self, coordinator: Any) -> None:
        self.manager = _manager
        self.coordinator = coordinator
        self.loaded = False

    def load_checkpoint(self, state: State, rank: int) -> None:
        """Before the first sync: rank 0 restores the newest checkpoint (the others get it
        from sync), unless some worker of the group has trained already: a replacement that
        became rank 0 must not take the survivors back to the last checkpoint. (Every rank
        calls this: the question is one small collective per round, on the loop's group.)"""
        if self.manager is None:
            return
        if self._anyone_loaded() or rank != 0:
            return
        checkpoint = self.manager.get_latest_checkpoint()
        if checkpoint is None:
            logger.info("no checkpoint to load: starting from the initial state")
            return
        try:
            with checkpoint.open_input_stream(DEFAULT_KEY) as stream:
                state.load(stream)
        except Exception as e:
            raise UserMethodError(
                f"state.load raised {type(e).__name__}: {e} (checkpoint {checkpoint!r})"
            ) from e
        logger.warning("rank 0 loaded checkpoint %r", checkpoint)

    def _anyone_loaded(self) -> bool:
        try:
            import torch
            import torch.distributed as dist
        except ImportError:
            return self.loaded
        if not (dist.is_available() and dist.is_initialized()):
            return self.loaded
        flag = torch.tensor([1 if self.loaded else 0])
        group = getattr(self.coordinator, "coordinator_process_group", None)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def set_checkpoint_loaded(self) -> None:
        self.loaded = True

    def save_checkpoint(self, state: State, rank: int) -> None:
        if self.manager is None or not self._wanted(state, rank):
            return
        if rank == 0:
            self._save(state)
        self.coordinator.barrier()

    def _wanted(self, state: State, rank: int) -> bool:
        """The coordinator (a platform's request) or the state asks for one; every rank must
        answer the same."""
        try:
            return bool(self.coordinator.should_save_checkpoint()) or bool(
                state.should_save_checkpoint(rank)
            )
        except Exception as e:
            raise UserMethodError(f"should_save_checkpoint raised {type(e).__name__}: {e}") from e

    def _save(self, state: State) -> None:
        assert self.manager is not None
        checkpoint = self.manager.create_checkpoint()
        try:
            with checkpoint.open_output_stream(DEFAULT_KEY) as stream:
                state.save(stream)
        except Exception as e:
            checkpoint.discard()
            raise UserMethodError(
                f"state.save raised {type(e).__name__}: {e}; the last checkpoint is kept"
            ) from e
        try:
            checkpoint.commit()
        except OSError as e:
            checkpoint.discard()
            raise OSError(f"checkpoint {checkpoint!r} could not be committed: {e}") from e
        logger.info("rank 0 saved checkpoint %r", checkpoint)
