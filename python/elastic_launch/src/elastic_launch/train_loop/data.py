"""The classic package's data helpers (``torchelastic.utils.data``): :class:`CyclingIterator`,
and ``ElasticDistributedSampler`` (elastic_sampler's, which takes 0.1's ``start_index`` as a
keyword: ``ElasticDistributedSampler(dataset, start_index=n)``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any


class CyclingIterator:
    """The iterators ``generator_fn(epoch)`` for epochs `start_epoch` to ``n - 1``, one after
    the other: a dataset unrolled over `n` epochs."""

    def __init__(
        self, n: int, generator_fn: Callable[[int], Iterator[Any]], start_epoch: int = 0
    ) -> None:
        self._n = n
        self._epoch = start_epoch
        self._generator_fn = generator_fn
        self._iter = generator_fn(start_epoch)

    def __iter__(self) -> CyclingIterator:
        return self

    def __next__(self) -> Any:
        while True:
            try:
                return next(self._iter)
            except StopIteration:
                if self._epoch >= self._n - 1:
                    raise
                self._epoch += 1
                self._iter = self._generator_fn(self._epoch)


def __getattr__(name: str) -> Any:
    # elastic_sampler (and torch) only when the sampler is asked for.
    if name == "ElasticDistributedSampler":
        try:
            from elastic_sampler import ElasticDistributedSampler
        except ImportError as e:
            raise ImportError(
                "ElasticDistributedSampler is elastic_sampler's: pip install elasticrun-sampler"
            ) from e
        return ElasticDistributedSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["CyclingIterator", "ElasticDistributedSampler"]  # noqa: F822 - by __getattr__
