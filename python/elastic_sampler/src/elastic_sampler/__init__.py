"""elastic_sampler: a DistributedSampler that survives resizes, and checkpoint helpers."""

from __future__ import annotations


def __getattr__(name: str) -> str:
    # Looked up on demand: importlib.metadata costs ~40 ms of start-up.
    if name == "__version__":
        from importlib.metadata import version

        return version("elasticrun-sampler")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["__version__"]
