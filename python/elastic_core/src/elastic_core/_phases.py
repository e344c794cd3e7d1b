"""Marking a phase that makes no optimizer steps, so that it is not taken for a hang."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from elastic_core._core import beat, current_step, hang_timeout, set_hang_timeout

# What "no limit" is stored as: the longest timeout a worker may set (7 days); the watchdog
# takes a longer one for a slot the worker's library did not write.
NO_LIMIT = 604800.0


@contextlib.contextmanager
def quiet(seconds: float | None = None) -> Iterator[None]:
    """Inside this block the worker is held hung only after `seconds` without a beat (None: it
    is never held hung). For a phase without optimizer steps that the launcher cannot see
    working (a wait on another node's evaluation, a checkpoint to a slow filesystem)::

        with elastic_core.quiet(900):
            evaluate(model)

    On exit the worker's previous timeout returns and the block's end counts as a beat (at the
    same step, so the phase does not look like one long step). Blocks nest. A no-op outside
    elasticrun."""
    limit = NO_LIMIT if seconds is None else float(seconds)
    if not 0 < limit <= NO_LIMIT:
        raise ValueError(
            f"quiet(seconds={seconds!r}): give seconds greater than 0, or None for no limit"
        )
    previous = hang_timeout()
    beat(current_step())  # the limit counts from the start of the phase
    set_hang_timeout(limit)
    try:
        yield
    finally:
        beat(current_step())
        set_hang_timeout(previous)
