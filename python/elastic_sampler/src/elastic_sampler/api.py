"""The interface of a checkpoint tier, and the errors of elastic_sampler."""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class CheckpointTier(Protocol):
    """Where checkpoints live: the disk, the node's memory, a peer node's memory. A tier knows
    where bytes are; `CheckpointManager`, which composes the tiers, knows which step goes
    where and which one to load (as torch.distributed.checkpoint's storage layer and its
    planner)."""

    def save(self, state: Any, step: int) -> Any:
        """Keep `state` as step `step`."""

    def steps(self) -> list[int]:
        """The steps held, oldest first."""

    def load(self, step: int, map_location: Any = "cpu", weights_only: bool = True) -> Any:
        """Step `step`, checked; an error (a CheckpointError) if it is not held intact."""


class ElasticSamplerError(Exception):
    """Base of elastic_sampler's errors."""


class SamplerStateError(ElasticSamplerError, ValueError):
    """A sampler state that does not fit this sampler (another dataset, seed or order)."""


class CheckpointError(ElasticSamplerError, OSError):
    """A checkpoint could not be written or read; the message says which file and why."""


class CheckpointDirectoryError(CheckpointError):
    """The checkpoint directory cannot be made or written (read-only, under a file, no
    permission): a setting to fix, which the message names and says how. Raised when the
    manager is made, before training; a launcher shows its message without a traceback."""

    show_traceback = False


class CheckpointMismatchError(ElasticSamplerError, ValueError):
    """A checkpoint that does not fit the model it is loaded into."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holding objects that loading with ``weights_only=True`` refuses to rebuild
    (unpickling them could run any code the file names)."""
