"""Child of bench_hang: what the launcher's beat hook adds to one optimizer step.

Times `opt.step()` on a small model without the hook, then with the hook elasticrun installs
(`worker_main.install_hooks`, the heartbeat attached), alternating rounds, best of each.
"""

from __future__ import annotations

import json
import sys
import time

import elastic_core
import torch
from elastic_launch.processes import worker_main

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 20_000
model = torch.nn.Linear(16, 16)
opt = torch.optim.SGD(model.parameters(), lr=0.0)
model(torch.randn(4, 16)).sum().backward()
elastic_core.beat()  # attach
assert elastic_core.heartbeat_slot() is not None, "run with the heartbeat environment set"


def per_step() -> float:
    t0 = time.perf_counter_ns()
    for _ in range(steps):
        opt.step()
    return (time.perf_counter_ns() - t0) / steps


plain = [per_step() for _ in range(5)]
before = elastic_core.current_step()
worker_main.install_hooks()
hooked = [per_step() for _ in range(5)]
assert elastic_core.current_step() > before, "the hook beat"
print(json.dumps({"plain_ns": min(plain), "hooked_ns": min(hooked)}))
