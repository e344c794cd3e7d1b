"""Functions launched by test_launch_api (importable by reference in spawned workers)."""

from __future__ import annotations

import os


def square_rank(offset: int) -> int:
    rank = int(os.environ["RANK"])
    return rank * rank + offset


def fail_on_rank_one() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("rank one says no")
