"""examples/train_ddp.py, the README's main job, under elasticrun with a crash and a hang."""

from __future__ import annotations

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
    result = run(
        [
            "--standalone",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "2",
            "--hang-timeout",
            "3",
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
    # The last disk checkpoint is step 8; the memory tier holds step 10, where the fault
    # struck: no completed step is lost.
    assert "attempt 1: resumed from epoch 1, step 10" in result.stdout
    assert "done: 16 steps, 2 epochs" in result.stdout
    # The progress bar (tqdm) of the resumed run starts at step 10 with its own clock at zero,
    # so its rate counts the resumed run's steps over the resumed run's time.
    resumed = result.stdout.split("attempt 1: resumed from", 1)[1]
    assert "10/16 [00:00<" in resumed, resumed[:2000]
