"""elastic_launch: rendezvous, the elastic agent and the ``elasticrun`` launcher."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("elasticrun-launch")
except PackageNotFoundError:  # imported from a source tree
    __version__ = "0.0.0"

__all__ = ["__version__"]
