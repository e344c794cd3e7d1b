"""Fixtures of the multi-process tests: an output directory whose recorded workers are always
ended at teardown, whatever the test did."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from launcher_util import kill_all


@pytest.fixture
def out(tmp_path: Path) -> Iterator[Path]:
    d = tmp_path / "out"
    d.mkdir()
    yield d
    pids = [int(p.read_text()) for p in d.glob("*.pid") if p.read_text().strip()]
    kill_all(pids)
