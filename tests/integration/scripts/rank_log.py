"""A worker that records, every 20 ms, which rank it holds: ``RANK RESTARTS PID TIME_NS`` lines
in OUT/<pid>.log (time.monotonic_ns: one clock for every process of the host). It ends with 0
once OUT/stop exists."""

import os
import sys
import time
from pathlib import Path

out = Path(sys.argv[1])
log = open(out / f"{os.getpid()}.log", "a", buffering=1)  # noqa: SIM115 - held to the end
rank, restarts = os.environ["RANK"], os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
while not (out / "stop").exists():
    log.write(f"{rank} {restarts} {os.getpid()} {time.monotonic_ns()}\n")
    time.sleep(0.02)
