"""A Hugging Face ``transformers`` ``Trainer`` job as users write one, for bench_frameworks.py:
a small GPT-2 built from a config (no download), DDP on CPU over gloo, the Trainer's AdamW and
its DataLoader over token ids made from their index, a checkpoint every step, and
``train(resume_from_checkpoint=<the last one>)`` to resume. On the first attempt rank 1
SIGKILLs itself at step KILL_AT (OUT/killed holds the time); every step appends
"monotonic_ns step rank attempt" to OUT/<pid>.steps.

    elasticrun --standalone --nproc-per-node 2 --max-restarts 2 benchmarks/_trainer_job.py OUT
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

KILL_AT = 30
STEPS = 60
ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


class Tokens(torch.utils.data.Dataset):
    """Sequences of token ids, each made from its index."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 512, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Steps(TrainerCallback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_step_end(self, args: TrainingArguments, state: object, control: object, **kw: object):
        step = state.global_step  # type: ignore[attr-defined]
        rank = int(os.environ.get("RANK", "0"))
        with open(self.out / f"{os.getpid()}.steps", "a") as f:
            f.write(f"{time.monotonic_ns()} {step} {rank} {ATTEMPT}\n")
        if ATTEMPT == 0 and rank == 1 and step == KILL_AT:
            (self.out / "killed").write_text(str(time.monotonic_ns()))
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=32, n_embd=64, n_layer=2, n_head=2)
    checkpoints = out / "checkpoints"
    args = TrainingArguments(
        output_dir=str(checkpoints),
        per_device_train_batch_size=8,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=1,
        save_total_limit=2,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        dataloader_num_workers=1,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=GPT2LMHeadModel(config),
        args=args,
        train_dataset=Tokens(),
        callbacks=[Steps(out)],
    )
    last = get_last_checkpoint(str(checkpoints)) if checkpoints.exists() else None
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
