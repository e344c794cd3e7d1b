"""What a sustained attack at the request limit makes the embedded rendezvous service hold.

The service runs alone in a process of its own (:func:`hostile_load.start`); this process
drives N connections, each sending requests at the limit back to back, and samples the
service's RSS while they run and once they have stopped:

- ``put``: each connection overwrites a key of its own with a value at the request limit;
- ``read``: each connection sends a Range and then a Txn whose key is at the request limit.

Reported, in MB: the idle service's RSS, its peak (VmHWM) less that, and its RSS less that a
moment after the load ended. The load lasts a number of rounds per connection (the test's
form: the same work on any machine) or a number of seconds (the security probe's form).

    python benchmarks/sustained_load.py put 64 --seconds 20
    python benchmarks/sustained_load.py read 8 32 64 --rounds 20
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostile_load

MB = 1 << 20
SETTLE = 3.0  # seconds the service is left idle before its RSS after the load is read


async def _connection(port: int, kind: str, n: int, until: Any) -> dict[str, int]:
    """One connection's part of the load: requests back to back until `until()` says stop.
    What happened to them, by status."""
    import grpc
    from elastic_launch.rendezvous.embedded import bounds
    from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc

    options = [
        ("grpc.use_local_subchannel_pool", 1),  # a connection of its own
        ("grpc.max_send_message_length", 4 * bounds.MAX_REQUEST),
    ]
    seen: dict[str, int] = {}
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        kv = rpc_pb2_grpc.KVStub(channel)
        # A request whose encoding is just under the limit.
        big = os.urandom(bounds.MAX_REQUEST - 1024)
        key = b"/sustained/%d" % n
        compare = rpc_pb2.Compare(key=big, target=rpc_pb2.Compare.VERSION, version=0)
        calls = (
            [lambda: kv.Put(rpc_pb2.PutRequest(key=key, value=big), timeout=120)]
            if kind == "put"
            else [
                lambda: kv.Range(rpc_pb2.RangeRequest(key=big), timeout=120),
                lambda: kv.Txn(rpc_pb2.TxnRequest(compare=[compare]), timeout=120),
            ]
        )
        rounds = 0
        while not until(rounds):
            for call in calls:
                try:
                    await call()
                    status = "OK"
                except grpc.aio.AioRpcError as e:
                    status = e.code().name
                seen[status] = seen.get(status, 0) + 1
            rounds += 1
    return seen


async def _drive(port: int, kind: str, connections: int, until: Any) -> dict[str, int]:
    parts = await asyncio.gather(*(_connection(port, kind, n, until) for n in range(connections)))
    seen: dict[str, int] = {}
    for part in parts:
        for status, count in part.items():
            seen[status] = seen.get(status, 0) + count
    return seen


def cpu_seconds(pid: int) -> float:
    """The CPU time `pid` has used (user and system)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def attack(
    pid: int,
    port: int,
    kind: str,
    connections: int,
    rounds: int | None = None,
    seconds: float | None = None,
) -> dict[str, Any]:
    """Run `kind` ("put" or "read") on the service (process `pid`, at `port`) from
    `connections` connections, for `rounds` requests (a Range and a Txn: two) on each, or for
    `seconds`. The service's RSS before, at its peak and after, and the answers' statuses."""
    before = hostile_load.memory(pid)["rss_mb"]
    end = time.monotonic() + (seconds or 0.0)

    def until(done: int) -> bool:
        return done >= rounds if rounds is not None else time.monotonic() >= end

    samples: list[float] = []
    stop = threading.Event()

    def sample() -> None:
        while not stop.wait(0.2):
            samples.append(hostile_load.memory(pid)["rss_mb"])

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started, cpu = time.monotonic(), cpu_seconds(pid)
    try:
        seen = asyncio.run(_drive(port, kind, connections, until))
    finally:
        stop.set()
        sampler.join()
    took, cpu = time.monotonic() - started, cpu_seconds(pid) - cpu
    time.sleep(SETTLE)
    now = hostile_load.memory(pid)
    return {
        "kind": kind,
        "connections": connections,
        "seconds": round(took, 1),
        "statuses": seen,
        "cpu_ms_per_request": round(1000 * cpu / max(sum(seen.values()), 1), 2),
        "idle_mb": before,
        "peak_mb": round(now["peak_mb"] - before, 1),
        "sampled_peak_mb": round(max(samples, default=before) - before, 1),
        "after_mb": round(now["rss_mb"] - before, 1),
    }


def measure(
    kind: str, connections: int, rounds: int | None = None, seconds: float | None = None
) -> dict[str, Any]:
    """:func:`attack` on a fresh service alone in its process."""
    proc, port = hostile_load.start("embedded")
    try:
        time.sleep(0.5)  # its start-up's allocations are done
        return attack(proc.pid, port, kind, connections, rounds, seconds)
    finally:
        proc.kill()
        proc.wait(30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("put", "read"))
    parser.add_argument("connections", type=int, nargs="+")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--rounds", type=int)
    group.add_argument("--seconds", type=float)
    args = parser.parse_args()
    seconds = args.seconds if args.rounds is None else None
    if args.rounds is None and seconds is None:
        seconds = 20.0
    for n in args.connections:
        print(measure(args.kind, n, args.rounds, seconds), flush=True)


if __name__ == "__main__":
    main()
