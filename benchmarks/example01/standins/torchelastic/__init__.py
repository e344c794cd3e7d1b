"""torchelastic 0.1's top-level names, as elastic_launch.train_loop provides them."""

from elastic_launch.train_loop import SimpleWorkerStats, State, train

__all__ = ["SimpleWorkerStats", "State", "train"]
