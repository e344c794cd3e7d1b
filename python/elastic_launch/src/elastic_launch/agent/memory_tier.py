"""The memory tier's home on this node: a private directory in shared memory where each local
rank keeps its newest checkpoint (elastic_sampler's ``CheckpointManager(memory=True)``). It
outlives the workers, so a replacement resumes from the last step saved rather than the last
one on disk, and it is removed with the launcher on every exit path (by the guardian should
the launcher be SIGKILLed), as the heartbeat table is.

The workers find it through two variables (literal names shared with elastic_sampler's
``_memory``): the directory, and the bytes one rank's slot may take."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from elastic_launch import untrusted
from elastic_launch.agent.shm import own_name

if TYPE_CHECKING:
    from elastic_launch.processes.guardian import Guardian

MEMORY_DIR_ENV = "ELASTICRUN_MEMORY_DIR"
MEMORY_LIMIT_ENV = "ELASTICRUN_MEMORY_LIMIT"


@contextlib.contextmanager
def memory_tier(guardian: Guardian, limit: int | None) -> Iterator[dict[str, str]]:
    """Make the node's directory (mode 0700), have the guardian remove it should the launcher
    die, and give the workers' environment; the directory goes when the launcher ends."""
    path = own_name("memory")
    os.mkdir(path, 0o700)
    try:
        guardian.remove_path(path)
        env = {MEMORY_DIR_ENV: path}
        if limit is not None:
            env[MEMORY_LIMIT_ENV] = str(limit)
        yield env
    finally:
        untrusted.remove_tree(path)  # or what a worker put in its place
