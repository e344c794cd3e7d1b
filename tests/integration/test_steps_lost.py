"""No completed step is lost: a DDP job of 2 nodes x 2 workers (examples/train_ddp.py, a disk
checkpoint every 50 steps) has a worker SIGKILLed, or a whole node SIGKILLed and replaced, at a
random step; it resumes from the memory tier at the newest completed step, and ends with the
very weights of a fault-free run. With --replicas every rank saves its own copy, kept on the
other node too (as a sharded state would be), and resumes it with restore_latest. The benchmark beside torchrun is
benchmarks/bench_steps_lost.py; the job's driver is shared with it."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from _job_run import STEPS, JobRun

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    got = JobRun(tmp_path_factory.mktemp("steps-lost"), "reference", "elasticrun").run(None)
    assert got.returncodes == [0, 0], got.log
    return got.weights


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("fault", "job"),
    [
        pytest.param("worker", (), id="worker"),
        pytest.param("node", (), id="node"),
        pytest.param("node", ("--replicas",), id="node-replicas"),
    ],
)
def test_a_fault_at_a_random_step_loses_no_completed_step(tmp_path, reference, fault, job):
    kill_at = random.Random(fault + "".join(job)).randint(10, STEPS - 15)  # a fixed draw
    got = JobRun(tmp_path, fault, "elasticrun", job).run(fault, kill_at)
    print(
        f"{fault}: killed at {kill_at}, completed {got.completed_at_kill}, resumed "
        f"{got.resumed}, back in {got.recovery_s:.2f} s"
    )
    assert all(code == 0 for code in got.returncodes), got.log
    assert got.completed_at_kill is not None and got.completed_at_kill >= kill_at
    assert got.lost == 0, f"resumed at {got.resumed}, {got.completed_at_kill} was completed"
    expected, final = torch.load(reference), torch.load(got.weights)
    assert expected.keys() == final.keys()
    for name, tensor in expected.items():
        assert torch.equal(tensor, final[name]), f"{name} differs from the fault-free run"
