"""The rendezvous scale benchmark's simulator (benchmarks/bench_rdzv_scale.py) at a small N:
real handlers in two processes against a real etcd, in both of its shapes (one gRPC channel
per process, one per agent as deployed). It must form the round, and etcd must serve both
shapes alike: the shared channel changes the client's cost, not what the store sees. How many
compare-and-swaps lose and are retried depends on timing (more on a loaded machine), so each
shape's requests per agent must lie in the protocol's band, and what one request carries must
be the same in both."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import bench_rdzv_scale


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_both_simulator_shapes_form_the_round_and_etcd_serves_them_alike(tmp_path):
    n = 12
    seen = {}
    for shape in ("shared", "own"):
        scale = bench_rdzv_scale.Scale("etcd", n, 2, tmp_path, channels=shape)
        r = bench_rdzv_scale.measure(scale, 60.0, False)
        assert r["round_ok"], (shape, r.get("round_errors"), r.get("commits"))
        assert r["round_done"] == n and r["world"] == [n]
        seen[shape] = bench_rdzv_scale.etcd_per_agent(r)
    for shape in ("shared", "own"):
        # The protocol's 11-14 a round, and a few retries.
        assert 8 <= seen[shape]["requests"] <= 20, seen
    shared, own = seen["shared"], seen["own"]
    for what in ("kib_in", "kib_out"):
        per_request = shared[what] / shared["requests"], own[what] / own["requests"]
        assert per_request[0] == pytest.approx(per_request[1], rel=0.2), (what, seen)
