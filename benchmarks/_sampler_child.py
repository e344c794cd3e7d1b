"""Child of bench_sampler: build one rank's sampler and iterate it; prints seconds and the peak
memory it added over the interpreter with torch imported (from /proc/self/status)."""

from __future__ import annotations

import json
import sys
import time

import torch
from elastic_sampler import ElasticDistributedSampler


def rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


class Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


kind, n, replicas, limit = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
# The baseline: torch imported and its allocator warmed by a first operation (~7 MB that any
# torch program pays), the sampler module imported. What follows is the sampler's own.
_ = (torch.arange(1 << 14) * 3).tolist()
del _
base = rss_kb("VmRSS")
t0 = time.perf_counter()
if kind == "torch-sampler":
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(Sized(n), num_replicas=replicas, rank=0, seed=1)
else:
    sampler = ElasticDistributedSampler(Sized(n), replicas, 0, seed=1, permutation=kind)
count = 0
for _ in sampler:
    count += 1
    if count == limit:
        break
elapsed = time.perf_counter() - t0
print(json.dumps({"seconds": elapsed, "count": count, "peak_mb": (rss_kb("VmHWM") - base) / 1024}))
