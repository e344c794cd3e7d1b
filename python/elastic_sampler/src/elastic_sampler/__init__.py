"""elastic_sampler: a DistributedSampler that survives resizes, and checkpoint helpers."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("elasticrun-sampler")
except PackageNotFoundError:  # imported from a source tree
    __version__ = "0.0.0"

__all__ = ["__version__"]
