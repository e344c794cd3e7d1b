"""The main job with elastic_sampler: killed mid-epoch, it still trains on every sample of each
epoch exactly once, and ends with the very weights of an uninterrupted run."""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pytest
import torch
from launcher_util import run

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_ddp.py"
SAMPLES, WORLD, BATCH, EPOCHS = 512, 2, 16, 2
SMALL = [
    "--samples",
    str(SAMPLES),
    "--image-size",
    "16",
    "--classes",
    "10",
    "--epochs",
    str(EPOCHS),
    "--batch-size",
    str(BATCH),
    "--checkpoint-every",
    "5",
]


def train(out: Path, tmp: Path, name: str, *extra: str):
    result = run(
        [
            "--standalone",
            "--nproc-per-node",
            str(WORLD),
            "--max-restarts",
            "2",
            str(EXAMPLE),
            *SMALL,
            "--checkpoint-dir",
            str(tmp / f"{name}-ckpt"),
            "--record-samples",
            str(tmp / f"{name}-samples"),
            "--final-weights",
            str(tmp / f"{name}.pt"),
            *extra,
        ],
        out,
        timeout=200,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def trained_samples(directory: Path) -> dict[int, Counter]:
    """Per epoch, the samples of the steps the final model went through: a step re-done after
    a restart counts once, with the last attempt's samples."""
    steps: dict[tuple[int, int, int], list[int]] = {}
    for f in sorted(
        directory.glob("attempt*-rank*.txt"), key=lambda p: int(p.name[7:].split("-")[0])
    ):
        rank = int(f.stem.split("rank")[1])
        for line in f.read_text().splitlines():
            if line.startswith("kept "):  # the step's copy sealed: no step of its own
                continue
            epoch, step, ids = line.split(" ")
            steps[(int(epoch), int(step), rank)] = [int(i) for i in ids.split(",")]
    per_epoch: dict[int, Counter] = defaultdict(Counter)
    for (epoch, _, _), ids in steps.items():
        per_epoch[epoch].update(ids)
    return per_epoch


@pytest.mark.timeout(420)
def test_killed_mid_epoch_every_sample_once_and_the_same_weights(out, tmp_path):
    train(out, tmp_path, "straight")
    crashed = train(out, tmp_path, "crashed", "--crash-at-step", "21")
    assert "restarting the workers (restart 1 of 2)" in crashed.stderr
    assert "resumed from epoch 1" in crashed.stdout, "the resume is mid-epoch"
    for epoch, counts in trained_samples(tmp_path / "crashed-samples").items():
        assert set(counts) == set(range(SAMPLES)), f"epoch {epoch}: a sample was skipped"
        assert max(counts.values()) == 1, f"epoch {epoch}: a sample was trained twice"
    straight = torch.load(tmp_path / "straight.pt")
    resumed = torch.load(tmp_path / "crashed.pt")
    for name, tensor in straight.items():
        assert torch.equal(tensor, resumed[name]), f"{name} differs from the uninterrupted run"
