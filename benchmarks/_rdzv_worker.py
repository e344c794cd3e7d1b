"""Worker of bench_rendezvous. Writes <out>/<pid>.json with {time, rank, world} (CLOCK_MONOTONIC
ns) when it starts (--mode start, then exits) or after its first all_reduce (--mode train, then
trains until stopped or --seconds pass)."""

from __future__ import annotations

import json
import os
import sys
import time


def stamp(out: str, **extra: object) -> None:
    path = os.path.join(out, f"{os.getpid()}.json")
    data = {
        "time": time.monotonic_ns(),
        "rank": int(os.environ["RANK"]),
        "world": int(os.environ["WORLD_SIZE"]),
        **extra,
    }
    with open(path + ".tmp", "w") as f:
        json.dump(data, f)
    os.replace(path + ".tmp", path)


mode, out = sys.argv[1], sys.argv[2]
if mode == "start":
    stamp(out)
    raise SystemExit(0)

from datetime import timedelta  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

dist.init_process_group("gloo", timeout=timedelta(seconds=20))
t = torch.ones(1)
dist.all_reduce(t)
stamp(out)
deadline = time.monotonic() + float(sys.argv[3])
while time.monotonic() < deadline:
    dist.all_reduce(t)
    time.sleep(0.05)
dist.destroy_process_group()
