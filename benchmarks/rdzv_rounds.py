"""Many small rounds, for a figure steadier than one round: last join -> round final for N
agents, `trials` rounds per backend (embedded and etcd v3), with the medians over the rounds.

    python benchmarks/rdzv_rounds.py [N] [TRIALS]

To compare two versions, run it alternately with PYTHONPATH pointing at each tree's
python/elastic_launch/src (single rounds vary by tens of ms on a loaded machine).
"""

from __future__ import annotations

import statistics
import sys

import bench_rendezvous as b

from common import free_port


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    etcd = b.Etcd()
    try:
        for backend in ("c10d", "etcd"):
            median, last, requests = [], [], []
            for _ in range(trials):
                endpoint = f"127.0.0.1:{free_port()}" if backend == "c10d" else etcd.endpoint
                _, req, internal = b.round_time("elasticrun", backend, n, endpoint, etcd)
                if internal:
                    median.append(internal[0] * 1000)
                    last.append(internal[1] * 1000)
                requests.append(req)
            name = "embedded" if backend == "c10d" else backend
            print(
                f"{name}: last join to final, per round (median agent, ms): "
                f"{[round(x) for x in median]}; median {statistics.median(median):.0f} ms, "
                f"last agent {statistics.median(last):.0f} ms; requests per agent {requests}",
                flush=True,
            )
    finally:
        etcd.close()


if __name__ == "__main__":
    main()
