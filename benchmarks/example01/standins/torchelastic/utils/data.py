"""torchelastic.utils.data."""

from elastic_launch.train_loop.data import CyclingIterator
from elastic_sampler import ElasticDistributedSampler

__all__ = ["CyclingIterator", "ElasticDistributedSampler"]
