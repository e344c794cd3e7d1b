"""A worker that saves a checkpoint in the background and exits without close()."""

import sys
import time

import torch
from elastic_sampler import CheckpointManager


class Slow:
    """Pickles slowly (in the writer thread), so the script ends while the write runs."""

    def __deepcopy__(self, memo):
        return Slow()

    def __reduce__(self):
        time.sleep(1.5)
        return (int, (7,))


manager = CheckpointManager(sys.argv[1])
manager.save({"w": torch.ones(3), "slow": Slow()}, 2, background=True)
sys.exit(0)
