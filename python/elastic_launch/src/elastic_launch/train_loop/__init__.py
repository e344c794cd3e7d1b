"""The classic torchelastic train loop (``State``, ``train_step``, ``train``), on elasticrun.

A script written for torchelastic 0.1 runs after changing its imports::

    from elastic_launch.train_loop import State, train

    class MyState(State):
        def sync(self, world_size, rank): ...          # broadcast from the most tenured
        def capture_snapshot(self): ...                # taken after every step
        def apply_snapshot(self, snapshot): ...        # a failed step is rolled back to it

    def train_step(state):
        ...                                            # one step; StopIteration at the end
        return state

    final = train(coordinator, train_step, MyState(...))

Owns: the loop (``loop``), its interfaces (``api``), the coordinator that re-forms the workers'
process group (``coordinator``), and in 0.1's shapes its checkpoints (``checkpoint``), metrics
(``metrics``), collectives (``distributed``) and data helpers (``data``).
May import: ``rendezvous`` and the foundation; it runs in the workers, never in the agent.
"""

from __future__ import annotations

from typing import Any

from elastic_launch.train_loop import checkpoint, data, distributed, metrics
from elastic_launch.train_loop.api import (
    Coordinator,
    NonRetryableException,
    SimpleWorkerStats,
    State,
    StopException,
    UserMethodError,
    WorkerStats,
)
from elastic_launch.train_loop.checkpoint import (
    Checkpoint,
    CheckpointManager,
    CheckpointUtil,
    FileSystemCheckpoint,
    FileSystemCheckpointManager,
    get_checkpoint_manager,
    set_checkpoint_manager,
)
from elastic_launch.train_loop.coordinator import (
    CoordinatorP2P,
    ElasticCoordinator,
    from_environment,
    parse_init_method,
)
from elastic_launch.train_loop.data import CyclingIterator
from elastic_launch.train_loop.loop import MAX_FAILURES, is_group_failure, train


def __getattr__(name: str) -> Any:
    if name == "ElasticDistributedSampler":  # elastic_sampler's, imported when asked for
        return data.ElasticDistributedSampler
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MAX_FAILURES",
    "Checkpoint",
    "CheckpointManager",
    "CheckpointUtil",
    "Coordinator",
    "CoordinatorP2P",
    "CyclingIterator",
    "ElasticCoordinator",
    "ElasticDistributedSampler",
    "FileSystemCheckpoint",
    "FileSystemCheckpointManager",
    "NonRetryableException",
    "SimpleWorkerStats",
    "State",
    "StopException",
    "UserMethodError",
    "WorkerStats",
    "checkpoint",
    "data",
    "distributed",
    "from_environment",
    "get_checkpoint_manager",
    "is_group_failure",
    "metrics",
    "parse_init_method",
    "set_checkpoint_manager",
    "train",
]
