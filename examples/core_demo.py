"""A small training loop supervised by the C consumer (cpp/examples/consumer), for `make run`.

It beats on every step through `elastic_core.beat()`. To show what the supervisor does, the first
attempt kills itself mid-run (a crash), the second stops beating (a hang); the third resumes from
the last checkpoint and finishes. Run it under the consumer:

    build/consumer/elastic-consumer --hang-timeout 1500 --max-restarts 3 -- \\
        .venv/bin/python examples/core_demo.py
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
import time
from pathlib import Path

import elastic_core
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument(
        "--checkpoint",
        type=Path,
        default=Path(tempfile.gettempdir()) / f"elastic-core-demo-{os.getppid()}.pt",
    )
    args = parser.parse_args()
    attempt = int(os.environ.get("ELASTIC_RESTART_COUNT", "0"))

    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    true_w = torch.arange(8, dtype=torch.float32).unsqueeze(1) / 8
    start = 0
    if args.checkpoint.exists():
        state = torch.load(args.checkpoint)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"attempt {attempt}: resumed from step {start}", flush=True)

    for step in range(start, args.steps):
        x = torch.randn(64, 8)
        loss = torch.nn.functional.mse_loss(model(x), x @ true_w)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        elastic_core.beat(step + 1)
        if (step + 1) % 5 == 0:
            torch.save(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "step": step + 1,
                },
                args.checkpoint,
            )
            print(f"attempt {attempt}: step {step + 1:3d} loss {loss.item():.4f}", flush=True)
        if attempt == 0 and step + 1 == 22:
            print("attempt 0: simulating a crash (SIGKILL)", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == 1 and step + 1 == 41:
            print("attempt 1: simulating a hang (no more beats)", flush=True)
            time.sleep(600)
        time.sleep(0.05)
    args.checkpoint.unlink(missing_ok=True)
    print(f"attempt {attempt}: finished {args.steps} steps, final loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
