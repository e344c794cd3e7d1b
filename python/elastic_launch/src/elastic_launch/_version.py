"""The package's version (the same for the three packages and the C++ library: cpp/VERSION)."""

__version__ = "0.1.0"
