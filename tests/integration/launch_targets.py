"""Functions launched by test_launch_api (importable by reference in spawned workers)."""

from __future__ import annotations

import os


def square_rank(offset: int) -> int:
    rank = int(os.environ["RANK"])
    return rank * rank + offset


def fail_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one says no")


class SlowToPickle:
    """Pickles slowly (in a background writer thread); unpickles as 7."""

    def __deepcopy__(self, memo: dict) -> SlowToPickle:
        return SlowToPickle()

    def __reduce__(self) -> tuple:
        import time

        time.sleep(1.5)
        return (int, (7,))


def save_in_background_and_return(directory: str) -> int:
    """Starts a background checkpoint save and returns without close()."""
    from elastic_sampler import CheckpointManager

    manager = CheckpointManager(f"{directory}/rank{os.environ['RANK']}")
    manager.save({"slow": SlowToPickle()}, 2, background=True)
    return 1
