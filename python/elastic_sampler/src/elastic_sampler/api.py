"""Errors of elastic_sampler."""

from __future__ import annotations


class ElasticSamplerError(Exception):
    """Base of elastic_sampler's errors."""


class SamplerStateError(ElasticSamplerError, ValueError):
    """A sampler state that does not fit this sampler (another dataset, seed or order)."""


class CheckpointError(ElasticSamplerError, OSError):
    """A checkpoint could not be written or read; the message says which file and why."""


class CheckpointMismatchError(ElasticSamplerError, ValueError):
    """A checkpoint that does not fit the model it is loaded into."""


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint holding objects that loading with ``weights_only=True`` refuses to rebuild
    (unpickling them could run any code the file names)."""
