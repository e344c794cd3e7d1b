"""Child of bench_core: one participant of a barrier benchmark. Rank 0 prints ns per round.

    _barrier_worker.py KIND RANK WORLD ROUNDS ADDRESS
KIND: elastic (elastic_core.LocalBarrier, ADDRESS = the barrier file), gloo
(torch.distributed.barrier), store (torch's TCPStore add/wait barrier).
"""

from __future__ import annotations

import json
import sys
import time

kind, rank, world, rounds, address = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    int(sys.argv[4]),
    sys.argv[5],
)
WARMUP = 20

if kind == "elastic":
    import elastic_core

    barrier = elastic_core.LocalBarrier.open(address, rank)

    def round_(i: int) -> None:
        barrier.wait(timeout=60)
elif kind == "gloo":
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://{address}", rank=rank, world_size=world)

    def round_(i: int) -> None:
        dist.barrier()
elif kind == "store":
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.utils.store import barrier as store_barrier

    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(
        host, int(port), world, is_master=rank == 0, timeout=timedelta(seconds=60)
    )

    def round_(i: int) -> None:
        store_barrier(store, world, key_prefix=f"round{i}", barrier_timeout=60)
else:
    raise SystemExit(f"unknown barrier kind {kind!r}")

for i in range(WARMUP):
    round_(i)
t0 = time.perf_counter_ns()
for i in range(WARMUP, WARMUP + rounds):
    round_(i)
elapsed = time.perf_counter_ns() - t0
if rank == 0:
    print(json.dumps({"round_ns": elapsed / rounds}))
