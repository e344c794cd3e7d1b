"""elastic_sampler: a DistributedSampler that survives failures and resizes, and checkpoints
that are never lost.

- :class:`ElasticDistributedSampler`: torch's sampler plus ``start_index`` and a
  ``state_dict()`` that resumes on any number of replicas with every sample exactly once.
- :class:`CheckpointManager`: atomic, checksummed checkpoints, keep the last K, load the newest
  that verifies, optional background saving; :func:`broadcast_latest` for node-local
  storage, :func:`restore_latest` for states that differ per rank.

Needs only torch.
"""

from __future__ import annotations

from typing import Any

from elastic_sampler._files import verify
from elastic_sampler.api import (
    CheckpointDirectoryError,
    CheckpointError,
    CheckpointMismatchError,
    ElasticSamplerError,
    SamplerStateError,
    UnsafeCheckpointError,
)
from elastic_sampler.checkpoint import (
    CheckpointManager,
    broadcast_latest,
    load_checkpoint,
    restore_latest,
    save_checkpoint,
    snapshot,
)
from elastic_sampler.permutation import FeistelPermutation
from elastic_sampler.sampler import ElasticDistributedSampler


def __getattr__(name: str) -> Any:
    if name == "__version__":  # importlib.metadata alone costs ~40 ms
        from importlib.metadata import version

        return version("elasticrun-sampler")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "CheckpointDirectoryError",
    "CheckpointError",
    "CheckpointManager",
    "CheckpointMismatchError",
    "ElasticDistributedSampler",
    "ElasticSamplerError",
    "FeistelPermutation",
    "SamplerStateError",
    "UnsafeCheckpointError",
    "__version__",
    "broadcast_latest",
    "load_checkpoint",
    "restore_latest",
    "save_checkpoint",
    "snapshot",
    "verify",
]
