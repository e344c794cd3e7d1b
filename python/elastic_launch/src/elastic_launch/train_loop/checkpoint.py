"""Checkpoints of the train loop, as in the classic package: set a manager before ``train``;
rank 0 loads the newest checkpoint once, before the first ``sync`` (which hands it to the
others), and saves one after a step whenever ``state.should_save_checkpoint(rank)`` says so
(every rank then meets at a barrier).

The files are elastic_sampler's: written atomically, verified on load, the last K kept; a
checkpoint that cannot be read is skipped with a warning, so a crash in the middle of a save
leaves the previous one in place. ``state.save``/``state.load`` write and read the bytes, as
the classic ``State`` defines them.
"""

from __future__ import annotations

import io
import logging
import os
from typing import Any, Protocol

from elastic_launch.train_loop.api import State, UserMethodError

logger = logging.getLogger(__name__)


class CheckpointManager(Protocol):
    """What the loop needs of a manager (elastic_sampler's CheckpointManager has it)."""

    def save(self, state: Any, step: int, background: bool = False) -> Any: ...

    def load_latest(self) -> tuple[Any, int] | None: ...

    def latest_step(self, verified: bool = True) -> int | None: ...


_manager: CheckpointManager | None = None


def set_checkpoint_manager(manager: CheckpointManager | None) -> None:
    """Checkpoint the train loop with `manager` (None: no checkpoints, the default)."""
    global _manager
    _manager = manager


def get_checkpoint_manager() -> CheckpointManager | None:
    return _manager


def FileSystemCheckpointManager(  # noqa: N802 - the classic package's class name
    checkpoint_dir: str | os.PathLike[str], keep_last: int = 3
) -> CheckpointManager:
    """The classic name: checkpoints in `checkpoint_dir` (created if missing), the last
    `keep_last` kept. Needs the elasticrun-sampler package."""
    try:
        from elastic_sampler import CheckpointManager as Files
    except ImportError as e:
        raise ImportError(
            "train-loop checkpoints are written by elastic_sampler: pip install elasticrun-sampler"
        ) from e
    return Files(checkpoint_dir, keep_last=keep_last, prefix="train-loop")


class CheckpointUtil:
    """The loop's side: load once (rank 0), save when the state asks, barrier."""

    def __init__(self, coordinator: Any) -> None:
        self.manager = _manager
        self.coordinator = coordinator
        self.loaded = False

    def barrier(self) -> None:
        self.coordinator.barrier()

    def load_checkpoint(self, state: State, rank: int) -> None:
        """Before the first sync: rank 0 restores the newest checkpoint (the others get it
        from sync), unless some worker of the group has trained already: a replacement that
        became rank 0 must not take the survivors back to the last checkpoint. (Every rank
        calls this: the question is one small collective per round, on the loop's group.)"""
        if self.manager is None:
            return
        if self._anyone_loaded() or rank != 0:
            return
        found = self.manager.load_latest()
        if found is None:
            logger.info("no checkpoint to load: starting from the initial state")
            return
        payload, step = found
        try:
            state.load(io.BytesIO(payload["state"]))
        except Exception as e:
            raise UserMethodError(
                f"state.load raised {type(e).__name__}: {e} (checkpoint {step})"
            ) from e
        logger.warning("rank 0 loaded checkpoint %d", step)

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
        if self.manager is None:
            return
        try:
            wanted = state.should_save_checkpoint(rank)
        except Exception as e:
            raise UserMethodError(
                f"state.should_save_checkpoint raised {type(e).__name__}: {e}"
            ) from e
        if not wanted:
            return
        if rank == 0:
            stream = io.BytesIO()
            try:
                state.save(stream)
            except Exception as e:
                raise UserMethodError(
                    f"state.save raised {type(e).__name__}: {e}; the last checkpoint is kept"
                ) from e
            latest = self.manager.latest_step(verified=False)
            step = 0 if latest is None else latest + 1
            self.manager.save({"state": stream.getvalue()}, step)
            logger.info("rank 0 saved checkpoint %d", step)
        self.barrier()
