"""Child of bench_core: cost of torch's file-based timer, `with expires(after=...)`, per step.

The client writes two JSON requests per step into a FIFO that the server drains every
`max_interval`; in a tight loop the FIFO fills and the client fails with BlockingIOError. So the
cost is timed in batches that fit the FIFO, with pauses for the server between them, and the
tight-loop failure is reported separately.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

from torch.distributed.elastic import timer

batches = int(sys.argv[1]) if len(sys.argv) > 1 else 20
BATCH = 100
with tempfile.TemporaryDirectory() as tmp:
    fifo = os.path.join(tmp, "timer")
    server = timer.FileTimerServer(fifo, run_id="bench", max_interval=0.1, daemon=True)
    server.start()
    timer.configure(timer.FileTimerClient(fifo, signal=0))
    tight_loop_calls = None
    for i in range(100_000):
        try:
            with timer.expires(after=60):
                pass
        except BlockingIOError:
            tight_loop_calls = i
            break
    time.sleep(0.5)
    samples = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(BATCH):
            with timer.expires(after=60):
                pass
        samples.append((time.perf_counter_ns() - t0) / BATCH)
        time.sleep(0.15)
    server.stop()
median = sorted(samples)[len(samples) // 2]
print(json.dumps({"expires_ns": median, "tight_loop_fails_after": tight_loop_calls}))
