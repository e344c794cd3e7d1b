"""Crash loops between tiers: a step restored from memory, after which the worker died before
saving a newer step, is counted; once twice, that step is not restored from memory again (the
disk is used), so a copy that kills its reader does not kill every replacement.

The count lives beside the rank's slot, in the node's shared memory, so that it outlives the
workers and ends with the job: one line, ``<step> <count>``.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

#: Restores of one step that may end in a death before the next save; the next one falls back.
LIMIT = 2


class RestoreLog:
    """The count of restores of one step from memory, at `path`."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def last(self) -> int | None:
        """The step the log counts restores of, if any."""
        try:
            parts = self.path.read_text(encoding="ascii").split()
        except (OSError, UnicodeDecodeError):
            return None
        return int(parts[0]) if len(parts) == 2 and parts[0].isdigit() else None

    def attempts(self, step: int) -> int:
        """How many times `step` was restored from memory with no newer step saved since."""
        try:
            text = self.path.read_text(encoding="ascii")
        except (OSError, UnicodeDecodeError):
            return 0
        parts = text.split()
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            return 0
        return int(parts[1]) if int(parts[0]) == step else 0

    def exhausted(self, step: int) -> bool:
        """Whether `step` was restored `LIMIT` times with no newer step saved since: it is not
        restored from memory again."""
        return self.attempts(step) >= LIMIT

    def banned(self) -> int | None:
        """The step not to restore from memory again, if any."""
        step = self.last()
        return step if step is not None and self.exhausted(step) else None

    def record(self, step: int) -> None:
        """One more restore of `step` from memory."""
        count = self.attempts(step) + 1
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}")
        with contextlib.suppress(OSError):  # a count not kept only loses the fallback
            tmp.write_text(f"{step} {count}\n", encoding="ascii")
            os.replace(tmp, self.path)

    def clear(self) -> None:
        """A newer step was saved: the restore worked."""
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()
