"""What the tests of examples/classic_train_loop.py share: where it is, the line each step
prints, its data, and the check that every sample of an epoch was trained once."""

from __future__ import annotations

import re
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "classic_train_loop.py"
STEP = re.compile(r"^step (\d+) rank (\d+) world (\d+) pid (\d+)$", re.MULTILINE)
SAMPLES = 96  # the example's default --samples


def assert_every_sample_once(history: list, epochs: int, samples: int = SAMPLES) -> None:
    """The final state's history ((epoch, first sample, count) per step): in each epoch the
    steps' spans tile the samples exactly, none skipped or repeated."""
    for epoch in range(epochs):
        spans = sorted((first, n) for e, first, n in history if e == epoch)
        at = 0
        for first, n in spans:
            assert first == at, f"epoch {epoch}: samples {at}..{first} skipped or repeated"
            at += n
        assert at == samples, f"epoch {epoch} ended at sample {at}"
