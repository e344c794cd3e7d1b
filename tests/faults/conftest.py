"""The fault suite drives real jobs with the integration tests' helpers (launcher_util) and its
own (jobs.py): the fault-free run's weights, network namespaces."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))

from jobs import FAST, ONE_THREAD, Job, Netns, finish_quietly
from launcher_util import finish, start, wait_for


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


@pytest.fixture(scope="session")
def shrunk_reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The final weights of a job that trains 8 steps on 2 ranks, then goes on alone from
    step 8: what a two-node job that loses a node there, and no step, ends with. Made from
    two fault-free parts: 2 ranks to step 8 (its checkpoint on disk), then 1 rank from it."""
    root = tmp_path_factory.mktemp("shrunk")
    job = Job(root, "shrunk", hold=(8,))
    first = job.args()
    first[first.index("--checkpoint-every") + 1] = "8"  # step 8 on disk (no other effect)
    part = start(["--standalone", "--nproc-per-node", "2", *FAST, *first], ONE_THREAD)
    try:
        at_8 = lambda: job.assert_checkpoint_intact(8) == 8  # noqa: E731
        assert wait_for(lambda: _holds(at_8) or part.poll() is not None, 120), "no step 8"
        assert part.poll() is None, finish(part)[2][-3000:]
    finally:
        finish_quietly(part)
    rest = ["--standalone", "--nproc-per-node", "1", *FAST, *Job(root, "shrunk").args()]
    code, _, err = finish(start(rest, ONE_THREAD), timeout=150)
    assert code == 0, err[-3000:]
    return job.weights


def _holds(check) -> bool:  # type: ignore[no-untyped-def]
    try:
        return bool(check())
    except (AssertionError, FileNotFoundError):
        return False


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
