"""The memory tier's directory on a node: private, handed to the workers, removed on every
exit path (the guardian is told, for a launcher that is killed)."""

from __future__ import annotations

import os
import stat

import pytest
from elastic_launch.agent.memory_tier import MEMORY_DIR_ENV, MEMORY_LIMIT_ENV, memory_tier


class Guardian:
    def __init__(self) -> None:
        self.paths: list[str] = []

    def remove_path(self, path: str) -> None:
        self.paths.append(path)


def test_a_private_directory_the_guardian_knows_and_the_end_removes():
    guardian = Guardian()
    with memory_tier(guardian, None) as env:  # type: ignore[arg-type]
        path = env[MEMORY_DIR_ENV]
        assert MEMORY_LIMIT_ENV not in env
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o700
        assert guardian.paths == [path]
        open(os.path.join(path, "slot"), "wb").close()  # a worker's slot
    assert not os.path.exists(path)


def test_the_limit_reaches_the_workers_and_an_error_still_removes_it():
    seen: dict[str, str] = {}

    def launcher_fails() -> None:
        with memory_tier(Guardian(), 8 << 30) as env:  # type: ignore[arg-type]
            seen.update(env)
            raise RuntimeError("the launcher failed")

    with pytest.raises(RuntimeError):
        launcher_fails()
    assert seen[MEMORY_LIMIT_ENV] == str(8 << 30)
    assert not os.path.exists(seen[MEMORY_DIR_ENV])
