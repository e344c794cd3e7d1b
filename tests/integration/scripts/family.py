"""A worker with a family: two data-loader worker processes and a `subprocess` child, all
recorded (with the worker's own pid, its parent and its heartbeat file) in --out, then it waits
to be killed."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> int:
        time.sleep(0.05)
        return os.getpid()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    rank = os.environ["RANK"]
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"])
    loader = iter(DataLoader(Slow(), batch_size=1, num_workers=2))
    loader_pids = {int(next(loader)[0]) for _ in range(6)}
    record = {
        "worker": os.getpid(),
        "parent": os.getppid(),
        "child": child.pid,
        "loaders": sorted(loader_pids),
        "heartbeat": os.environ.get("ELASTIC_HEARTBEAT_FILE"),
    }
    tmp = os.path.join(args.out, f".family-{rank}.json")
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, os.path.join(args.out, f"family-{rank}.json"))
    while True:
        torch.ones(1).add_(1)
        time.sleep(0.1)


if __name__ == "__main__":
    main()
