"""What torch's launcher tests set up before each test, for the modules that follow them."""

from __future__ import annotations

import os

import pytest


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """As upstream's setUp: no PET_ variable, a sentinel the workers must inherit, torch's
    default log lines, one OpenMP thread per worker (several workers share two cores)."""
    for name in list(os.environ):
        if name.startswith("PET_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("TEST_SENTINEL_PARENT", "FOOBAR")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", raising=False)
