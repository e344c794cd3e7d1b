"""The tiers a `CheckpointManager`'s arguments make: the disk always, the node's memory with
``memory=True`` (under elasticrun), a peer node's memory with ``replicas=1``. Each is checked
here, before anything is made, so that a bad value leaves nothing behind.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from elastic_sampler import _memory, _replica
from elastic_sampler._disk import DiskTier
from elastic_sampler._memory_tier import MemoryTier
from elastic_sampler._replica import ReplicaTier


class TierOptions(TypedDict, total=False):
    """The keyword settings of the tiers (`CheckpointManager` documents each)."""

    finish_timeout: float
    memory: bool
    persist_every: int
    overlap: bool
    replicas: int


@dataclass(frozen=True)
class Settings:
    """Checked `TierOptions`, with their defaults."""

    finish_timeout: float = 300.0
    memory: bool = False
    persist_every: int = 1
    overlap: bool = True
    replicas: int = 0

    @staticmethod
    def of(keep_last: Any, prefix: Any, options: dict[str, Any]) -> Settings:
        """The settings of `options`, or the error that names the bad value."""
        unknown = sorted(set(options) - set(TierOptions.__annotations__))
        if unknown:
            raise TypeError(
                f"CheckpointManager() got an unexpected keyword argument {unknown[0]!r}"
            )
        s = Settings(**options)
        if isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1:
            raise ValueError(f"keep_last={keep_last!r}: keep at least 1 checkpoint")
        every = s.persist_every
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"persist_every={every!r}: give a number of steps >= 1")
        if not isinstance(prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+", prefix):
            raise ValueError(f"prefix={prefix!r}: use letters, digits, '.', '_' and '-'")
        if type(s.replicas) is not int or s.replicas not in (0, 1):
            raise ValueError(f"replicas={s.replicas!r}: give 0, or 1 (a copy on the next node)")
        if s.replicas and not s.memory:
            raise ValueError("replicas=1 replicates the memory tier: pass memory=True as well")
        if not s.finish_timeout >= 0:  # also NaN
            raise ValueError(f"finish_timeout={s.finish_timeout!r}: give seconds >= 0")
        return s


@dataclass(frozen=True)
class Tiers:
    disk: DiskTier
    memory: MemoryTier | None
    replica: ReplicaTier | None


def compose(directory: Path, prefix: str, keep_last: int, reuse: bool, s: Settings) -> Tiers:
    """The tiers for checkpoints `prefix` in `directory` (`reuse`: reuse_buffers)."""
    rank, world = _replica.rank_and_world() if s.replicas else (_memory.SHARED, 0)
    # With replicas, files by rank (after a node's loss a rank may run on another node) and
    # world (a shard of one world is never another's).
    files = f"{prefix}-rank{rank}of{world}" if s.replicas else prefix
    disk = DiskTier(
        directory, files, keep_last, reuse_buffers=reuse, finish_timeout=float(s.finish_timeout)
    )
    # Slots are named by local rank, not rank: a replacement finds its predecessor's.
    slot = _memory.slot_for(directory, prefix, owner=rank, world=world) if s.memory else None
    memory = MemoryTier(slot, s.overlap, float(s.finish_timeout)) if slot is not None else None
    replica = None
    if memory is not None and s.replicas:
        peer = _memory.slot_for(directory, prefix, "replica")
        assert peer is not None  # the same variables made the memory tier's slot
        replica = ReplicaTier(memory, peer, disk, (rank, world), prefix)
    return Tiers(disk, memory, replica)
