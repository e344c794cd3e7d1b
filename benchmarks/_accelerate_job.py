"""A Hugging Face Accelerate job as users write one, for bench_frameworks.py: an
``Accelerator`` (CPU, the process group from the launcher's environment), an MLP with AdamW, a
``DataLoader`` with a worker process, ``save_state`` after every step and ``load_state`` to
resume. On the first attempt rank 1 SIGKILLs itself at step KILL_AT (OUT/killed holds the
time); every step appends "monotonic_ns step rank attempt" to OUT/<pid>.steps.

    elasticrun --standalone --nproc-per-node 2 --max-restarts 2 benchmarks/_accelerate_job.py OUT
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

KILL_AT = 30
STEPS = 60
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    loader = DataLoader(data, batch_size=32, num_workers=1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state, saved = out / "state", out / "step"
    start = 0
    if saved.exists():
        accelerator.load_state(str(state))
        start = int(saved.read_text()) + 1
    for step, (x, y) in enumerate(loader):
        if step < start:
            continue
        if step >= STEPS:
            break
        loss = torch.nn.functional.mse_loss(model(x), y)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.save_state(str(state))
        if accelerator.is_main_process:
            saved.write_text(str(step))
        accelerator.wait_for_everyone()
        with open(out / f"{os.getpid()}.steps", "a") as f:
            f.write(f"{time.monotonic_ns()} {step} {accelerator.process_index} {ATTEMPT}\n")
        if ATTEMPT == 0 and accelerator.process_index == 1 and step == KILL_AT:
            (out / "killed").write_text(str(time.monotonic_ns()))
            os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
