"""torchelastic.distributed's helpers."""

from elastic_launch.train_loop.distributed import *  # noqa: F403
