"""Child of bench_core: ns per elastic_core.beat() from Python, with the heartbeat attached."""

from __future__ import annotations

import json
import sys
import timeit

import elastic_core

calls = int(sys.argv[1]) if len(sys.argv) > 1 else 1_000_000
elastic_core.beat()  # attach (first call reads the environment)
assert elastic_core.heartbeat_slot() is not None, "run with the heartbeat environment set"
per_call = min(timeit.repeat("beat()", globals={"beat": elastic_core.beat}, number=calls, repeat=7))
per_step = min(
    timeit.repeat("beat(7)", globals={"beat": elastic_core.beat}, number=calls, repeat=7)
)
print(json.dumps({"beat_ns": per_call / calls * 1e9, "beat_step_ns": per_step / calls * 1e9}))
