"""What a client can make a rendezvous service hold: our embedded service beside torch's
TCPStore (torchrun's c10d store), each alone in a process, under the same load.

The load: 300 idle TCP connections held open, 10,000 small writes, and 100 MB of overwrites of
one key (100 x 1 MB); ours also gets a watcher that never reads, over all of it. Then, with the
idle connections still open, a fresh client reads a key 20 times. Reported: what the load made
the service hold (its peak RSS, VmHWM, less its RSS before the load) and the read's median
latency. The slow test (tests/integration/test_hostile_load.py) runs the same load on ours and
checks the bound.

    python benchmarks/hostile_load.py        # both, as a table
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

IDLE = 300
SMALL_WRITES = 10_000
BIG = 1 << 20
OVERWRITES = 100
#: The stated bound on what the load may make our service hold (peak RSS above its RSS before
#: the load): a history of 16 MiB, 8 MiB queued for the watcher that does not read, the 1 MB
#: value and gRPC's buffers, with room to spare.
HELD_BOUND_MB = 64

_SERVE = """
import sys, time
kind = sys.argv[1]
if kind == "embedded":
    from elastic_launch.rendezvous.embedded.server import EmbeddedServer
    server = EmbeddedServer("127.0.0.1", 0, token=None)
    port = server.port
else:
    from datetime import timedelta
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=60))
    port = store.port
print(port, flush=True)
time.sleep(600)
"""


def start(kind: str) -> tuple[subprocess.Popen[str], int]:
    """A process hosting only the service of `kind` ("embedded" or "tcpstore"), and its port."""
    proc = subprocess.Popen([sys.executable, "-c", _SERVE, kind], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line.strip():
        proc.kill()
        proc.wait(10)
        raise RuntimeError(f"the {kind} service did not start")
    return proc, int(line)


def memory(pid: int) -> dict[str, float]:
    """Peak and current RSS of `pid`, in MB."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmHWM", "VmRSS"):
                fields[name] = int(value.split()[0]) / 1024
    return {"peak_mb": fields["VmHWM"], "rss_mb": fields["VmRSS"]}


class _Embedded:
    def __init__(self, port: int) -> None:
        import grpc
        from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc

        self.pb = rpc_pb2
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        self.kv = rpc_pb2_grpc.KVStub(self.channel)
        self.watch_stub = rpc_pb2_grpc.WatchStub(self.channel)

    def put(self, key: str, value: bytes) -> None:
        self.kv.Put(self.pb.PutRequest(key=key.encode(), value=value), timeout=30)

    def get(self, key: str) -> None:
        self.kv.Range(self.pb.RangeRequest(key=key.encode()), timeout=30)

    def never_reading_watcher(self, stop: threading.Event) -> Any:
        create = self.pb.WatchCreateRequest(key=b"/", range_end=b"\0")

        def requests() -> Any:
            yield self.pb.WatchRequest(create_request=create)
            stop.wait(300)

        return self.watch_stub.Watch(requests(), timeout=300)  # its responses are never read

    def close(self) -> None:
        self.channel.close()


class _TcpStore:
    def __init__(self, port: int) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        self.store = dist.TCPStore("127.0.0.1", port, 1, False, timeout=timedelta(seconds=60))

    def put(self, key: str, value: bytes) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> None:
        self.store.get(key)

    def close(self) -> None:
        pass


def load(kind: str) -> dict[str, float]:
    """Run the load on a fresh service of `kind`; its figures."""
    proc, port = start(kind)
    before = memory(proc.pid)["rss_mb"]
    idle: list[socket.socket] = []
    stop = threading.Event()
    client: Any = None
    watcher: Any = None
    try:
        for _ in range(IDLE):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=10))
        client = _Embedded(port) if kind == "embedded" else _TcpStore(port)
        if kind == "embedded":
            watcher = client.never_reading_watcher(stop)
        for i in range(SMALL_WRITES):
            client.put(f"/small/{i % 100}", b"x" * 100)
        big = os.urandom(BIG)
        for _ in range(OVERWRITES):
            client.put("/big", big)
        time.sleep(0.5)
        fresh = _Embedded(port) if kind == "embedded" else _TcpStore(port)
        latencies = []
        for _ in range(20):
            t0 = time.perf_counter()
            fresh.get("/small/1")
            latencies.append(time.perf_counter() - t0)
        fresh.close()
        after = memory(proc.pid)
        return {
            **after,
            "baseline_mb": before,
            "held_mb": after["peak_mb"] - before,
            "read_ms": statistics.median(latencies) * 1000,
        }
    finally:
        stop.set()
        if watcher is not None:
            watcher.cancel()
        if client is not None:
            client.close()
        for s in idle:
            s.close()
        proc.kill()
        proc.wait(30)


def run(_cpp_build: Any = None) -> list[Any]:
    """The benchmark section: rows of ours beside TCPStore."""
    from common import Row

    ours, theirs = load("embedded"), load("tcpstore")
    note = f"{IDLE} idle connections, {SMALL_WRITES} writes, {OVERWRITES} x 1 MB overwrites"
    return [
        Row(
            "hostile",
            "memory a client made the service hold",
            ours["held_mb"],
            theirs["held_mb"],
            "TCPStore",
            "MB",
            note + " (ours: and a watcher that never reads)",
        ),
        Row(
            "hostile",
            "a read while it holds the load",
            ours["read_ms"],
            theirs["read_ms"],
            "TCPStore",
            "ms",
            "median of 20",
        ),
    ]


if __name__ == "__main__":
    for name in ("embedded", "tcpstore"):
        print(name, load(name))
