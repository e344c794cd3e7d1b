"""``CyclingIterator`` as torchelastic v0.1.0rc1's ``test/utils/data/cycling_iterator_test.py``
pins it (written here; no code is copied)."""

from __future__ import annotations

import pytest
from elastic_launch.train_loop.data import CyclingIterator


def counting(stride: int):
    """Epoch e yields stride*e, ..., stride*e + stride - 1."""
    return lambda epoch: iter(range(stride * epoch, stride * epoch + stride))


def test_cycling_iterator():
    """upstream: test_cycling_iterator"""
    it = CyclingIterator(n=90, generator_fn=counting(3))
    assert [next(it) for _ in range(3 * 90)] == list(range(3 * 90))
    with pytest.raises(StopIteration):
        next(it)


def test_cycling_iterator_start_epoch():
    """upstream: test_cycling_iterator_start_epoch"""
    it = CyclingIterator(2, counting(3), 1)
    assert list(it) == [3, 4, 5]


def test_an_empty_epoch_is_skipped():
    it = CyclingIterator(3, lambda e: iter([] if e == 1 else [e]))
    assert list(it) == [0, 2]


def test_the_sampler_is_there_too():
    from elastic_launch.train_loop.data import ElasticDistributedSampler
    from elastic_sampler import ElasticDistributedSampler as Ours

    assert ElasticDistributedSampler is Ours
    ranks = [list(ElasticDistributedSampler(range(10), 2, r, start_index=4)) for r in (0, 1)]
    assert [len(s) for s in ranks] == [3, 3], "(10 - 4) / 2 samples each"
    # 0.1 took start_index as a dataset index; here it counts the epoch's samples consumed:
    # the ranks go on with exactly those not consumed yet (docs/compat.md).
    epoch = list(ElasticDistributedSampler(range(10), 1, 0))
    assert sorted(i for s in ranks for i in s) == sorted(epoch[4:])
