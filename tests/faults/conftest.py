"""The fault suite drives real jobs with the integration tests' helpers (launcher_util) and its
own (jobs.py): the fault-free run's weights, network namespaces."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from jobs import FAST, Job, Netns
from launcher_util import finish, start


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fault-free run's final weights."""
    root = tmp_path_factory.mktemp("reference")
    job = Job(root, "clean")
    code, _, err = finish(
        start(["--standalone", "--nproc-per-node", "2", *FAST, *job.args()]), timeout=150
    )
    assert code == 0, err[-3000:]
    return job.weights


@pytest.fixture
def two_hosts() -> Iterator[Netns]:
    """Two hosts, each a network namespace, joined by a veth pair."""
    hosts = Netns("x")
    try:
        problem = hosts.setup()
        if problem:
            pytest.skip(f"cannot make two network namespaces here ({problem}): needs root")
        yield hosts
    finally:
        hosts.remove()
