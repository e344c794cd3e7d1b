"""A PyTorch Lightning job as users write one, for bench_lightning.py: a ``Trainer`` (DDP on
CPU over gloo, as many devices as the launcher's local workers), an MLP with AdamW, a
``DataLoader`` with a worker process, ``ModelCheckpoint`` saving the last step on every step,
``fit(ckpt_path=last)`` to resume. On the first attempt rank 1 SIGKILLs itself at step
KILL_AT (OUT/killed holds the time); every step appends "monotonic_ns step rank attempt" to
OUT/<pid>.steps.

    elasticrun --standalone --nproc-per-node 2 --max-restarts 2 benchmarks/_lightning_job.py OUT
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import lightning as L  # noqa: N812 - Lightning's convention
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

KILL_AT = 30
STEPS = 60
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Regressor(L.LightningModule):
    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
        )

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def on_train_batch_end(self, outputs: object, batch: object, i: int) -> None:
        step = self.global_step
        with open(self.out / f"{os.getpid()}.steps", "a") as f:
            f.write(f"{time.monotonic_ns()} {step} {self.global_rank} {ATTEMPT}\n")
        if ATTEMPT == 0 and self.global_rank == 1 and step == KILL_AT:
            (self.out / "killed").write_text(str(time.monotonic_ns()))
            os.kill(os.getpid(), signal.SIGKILL)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(4096, 32), torch.randn(4096, 1))
    checkpoints = out / "checkpoints"
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ["LOCAL_WORLD_SIZE"]),
        strategy="ddp",
        max_steps=STEPS,
        enable_progress_bar=False,
        logger=False,
        enable_model_summary=False,
        callbacks=[ModelCheckpoint(dirpath=checkpoints, save_last=True, every_n_train_steps=1)],
    )
    last = checkpoints / "last.ckpt"
    loader = DataLoader(data, batch_size=32, num_workers=1)
    trainer.fit(Regressor(out), loader, ckpt_path=str(last) if last.exists() else None)


if __name__ == "__main__":
    main()
