"""examples/train_ddp.py, the README's main job, under elasticrun with a crash and a hang."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from launcher_util import run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
SMALL = [
    "--samples",
    "512",
    "--image-size",
    "32",
    "--classes",
    "10",
    "--epochs",
    "2",
    "--checkpoint-every",
    "4",
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("fault", ["--crash-at-step", "--hang-at-step"])
def test_training_recovers_and_finishes(out, tmp_path, fault):
    # The hang is found by --hang-timeout; the crash at once, with the default timeout, which
    # no stall of a loaded machine (a peer slow to start) reaches before the first checkpoint.
    hang = ["--hang-timeout", "10"] if fault == "--hang-at-step" else []
    result = run(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            *hang,
            str(EXAMPLE),
            *SMALL,
            "--checkpoint-dir",
            str(tmp_path / "ckpt"),
            fault,
            "10",
        ],
        out,
        timeout=200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "restarting the workers (restart 1 of 2)" in result.stderr
    assert (
        "printed as the launcher stopped it (SIGTERM) is its stop, not the cause" in result.stderr
    )
    # The one restart is the injected fault's, at step 10 (not a stall before it).
    assert "simulating a" in result.stdout and "at step 10" in result.stdout, result.stderr[-3000:]
    # The last disk checkpoint is step 8; the memory tier holds step 10, where the fault
    # struck, once the saving rank has called save() for it, else step 9 (its copy is sealed
    # before step 10's optimizer step ends): which one depends on how far rank 0 got before
    # it was stopped, and no completed step is lost either way.
    found = re.search(r"attempt 1: resumed from epoch 1, step (\d+)", result.stdout)
    assert found is not None, result.stdout[-2000:]
    step = int(found[1])
    assert step in (9, 10), result.stdout[-2000:]
    assert "done: 16 steps, 2 epochs" in result.stdout
    # The progress bar (tqdm) of the resumed run starts at that step with its own clock at
    # zero, so its rate counts the resumed run's steps over the resumed run's time.
    resumed = result.stdout.split("attempt 1: resumed from", 1)[1]
    assert f"{step}/16 [00:00<" in resumed, resumed[:2000]


def test_a_checkpoint_directory_that_cannot_be_written_is_one_line_before_training(tmp_path):
    """Under a regular file: each worker says so in one line as the manager is made, before a
    step, and the summary's root cause is that line, with no traceback."""
    (tmp_path / "file").write_text("")
    result = run(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            str(EXAMPLE),
            "--checkpoint-dir",
            str(tmp_path / "file" / "checkpoints"),
        ],
        tmp_path,
        timeout=120,
    )
    assert result.returncode == 1
    line = "CheckpointDirectoryError: cannot write checkpoints to"
    assert f"error      : {line}" in result.stderr, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "traceback  :" not in result.stderr
    assert "step" not in result.stdout.lower(), "no step was taken"
