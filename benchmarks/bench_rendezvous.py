"""Rendezvous benchmarks: elasticrun beside torchrun's c10d and etcd-v2 backends on the
same etcd, in one run:

- N agents (N = 2, 8, 32, trivial workers) completing a round: the last agent is started once
  the others wait, and the time runs from its start to every worker running; elasticrun's own
  events also give the time from the last join to the round being final;
- requests the store served per round as N grows (etcd's own counters, lease keep-alives left
  out);
- a node's death (its agent and workers SIGKILLed) to the survivors' restarted workers' first
  collective (N = 3, --nnodes 2:3).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import Row, free_port

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_rdzv_worker.py"
ELASTICRUN = [sys.executable, "-m", "elastic_launch"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
FAST = "heartbeat_timeout=5,last_call_timeout=3,join_timeout=300"


class Etcd:
    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="bench-etcd-"))
        self.port, peer = free_port(), free_port()
        self.endpoint = f"127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                "etcd",
                "--data-dir",
                str(self.dir / "data"),
                "--enable-v2",
                "--listen-client-urls",
                f"http://{self.endpoint}",
                "--advertise-client-urls",
                f"http://{self.endpoint}",
                "--listen-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-advertise-peer-urls",
                f"http://127.0.0.1:{peer}",
                "--initial-cluster",
                f"default=http://127.0.0.1:{peer}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for _ in range(200):
            with contextlib.suppress(OSError):
                urllib.request.urlopen(f"http://{self.endpoint}/health", timeout=1)
                return
            time.sleep(0.05)
        raise RuntimeError("etcd did not start")

    def requests(self) -> int:
        """Requests served so far: gRPC calls (v3) and store reads/writes/watches (v2), lease
        keep-alives and health checks left out."""
        text = urllib.request.urlopen(f"http://{self.endpoint}/metrics", timeout=5).read().decode()
        total = 0
        for line in text.splitlines():
            m = re.match(r"^grpc_server_started_total\{([^}]*)\} (\S+)", line)
            if m and "KeepAlive" not in m.group(1) and "Health" not in m.group(1):
                total += int(float(m.group(2)))
            m = re.match(
                r"^etcd_debugging_store_(reads|writes|watch_requests)_total(\{[^}]*\})? (\S+)", line
            )
            if m:
                total += int(float(m.group(3)))
        return total

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


def _spawn(cmd: list[str]) -> subprocess.Popen[bytes]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LOGLEVEL": "ERROR"}
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def _end(procs: list[subprocess.Popen[bytes]], out: Path) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    subprocess.run(["pkill", "-9", "-f", str(out)], check=False)


def _stamps(out: Path) -> list[dict]:
    stamps = []
    for p in out.glob("*.json"):
        with contextlib.suppress(ValueError, OSError):
            stamps.append(json.loads(p.read_text()))
    return stamps


def _rdzv_flags(launcher: str, backend: str, n: str, endpoint: str, run_id: str) -> list[str]:
    flags = [
        "--nnodes",
        n,
        "--nproc-per-node",
        "1",
        "--rdzv-backend",
        backend,
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        run_id,
        "--max-restarts",
        "3",
    ]
    if launcher == "elasticrun":
        flags += ["--rdzv-conf", FAST, "--monitor-interval", "0.05"]
    return flags


def round_time(
    launcher: str, backend: str, n: int, endpoint: str, etcd: Etcd
) -> tuple[float | None, int, tuple[float, float] | None]:
    """(seconds from the last agent's start to every worker running, store requests per
    agent, elasticrun's own seconds from the last join to the median and to the last agent
    seeing the round final)."""
    out = Path(tempfile.mkdtemp(prefix="bench-round-"))
    events = out / "events"
    events.mkdir()
    run_id = f"bench-{os.urandom(4).hex()}"
    cmd = TORCHRUN if launcher == "torchrun" else ELASTICRUN
    procs = []
    before = etcd.requests()

    def agent(i: int) -> subprocess.Popen[bytes]:
        extra = ["--events-file", str(events / f"{i}.jsonl")] if launcher == "elasticrun" else []
        return _spawn(
            [
                *cmd,
                *_rdzv_flags(launcher, backend, str(n), endpoint, run_id),
                *extra,
                str(WORKER),
                "start",
                str(out),
            ]
        )

    try:
        for i in range(n - 1):
            procs.append(agent(i))
            time.sleep(0.05 if launcher == "elasticrun" else 0.2)
        time.sleep(3.0 + 0.1 * n + (2.0 if launcher == "torchrun" else 0.0))  # all waiting
        t0 = time.monotonic_ns()
        procs.append(agent(n - 1))
        deadline = time.monotonic() + 300
        while len(_stamps(out)) < n and time.monotonic() < deadline:
            time.sleep(0.01)
        stamps = _stamps(out)
        if len(stamps) < n:
            return None, 0, None
        elapsed = (max(s["time"] for s in stamps) - t0) / 1e9
        for p in procs:
            p.wait(timeout=120)
        requests = etcd.requests() - before
        internal = None
        if launcher == "elasticrun":
            joined = []
            for f in events.glob("*.jsonl"):
                for line in f.read_text().splitlines():
                    e = json.loads(line)
                    if e["event"] == "rendezvous_done":
                        joined.append(e)
            if joined:
                last_join = max(e["joined_at"] for e in joined)
                formed = sorted(e["formed_at"] - last_join for e in joined)
                internal = (formed[len(formed) // 2], formed[-1])
        return elapsed, requests // n if backend != "c10d" else 0, internal
    finally:
        _end(procs, out)
        shutil.rmtree(out, ignore_errors=True)


def death_recovery(launcher: str, backend: str, endpoint: str) -> float | None:
    """Seconds from killing one of three nodes to the survivors' first collective after."""
    out = Path(tempfile.mkdtemp(prefix="bench-death-"))
    run_id = f"bench-{os.urandom(4).hex()}"
    cmd = TORCHRUN if launcher == "torchrun" else ELASTICRUN
    procs = []
    for _ in range(3):  # the first hosts the store (c10d, embedded): it is not the victim
        procs.append(
            _spawn(
                [
                    *cmd,
                    *_rdzv_flags(launcher, backend, "2:3", endpoint, run_id),
                    str(WORKER),
                    "train",
                    str(out),
                    "120",
                ]
            )
        )
        time.sleep(0.5)
    try:
        deadline = time.monotonic() + 120
        while len([s for s in _stamps(out) if s["world"] == 3]) < 3:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.05)
        victim = procs[2]
        node_pids = [victim.pid, *_children(victim.pid)]
        t0 = time.monotonic_ns()
        for pid in node_pids:  # the whole node goes: agent and workers
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            after = [s for s in _stamps(out) if s["time"] > t0 and s["world"] == 2]
            if len({s["rank"] for s in after}) == 2:
                return (max(s["time"] for s in after) - t0) / 1e9
            time.sleep(0.02)
        return None
    finally:
        _end(procs, out)
        shutil.rmtree(out, ignore_errors=True)


def _children(pid: int) -> list[int]:
    """Every descendant of `pid` (workers live in their own sessions)."""
    ps = ["ps", "-e", "-o", "pid=,ppid="]
    out = subprocess.run(ps, capture_output=True, text=True, check=True).stdout
    parents: dict[int, list[int]] = {}
    for line in out.splitlines():
        child, parent = map(int, line.split())
        parents.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for c in parents.get(todo.pop(), []):
            found.append(c)
            todo.append(c)
    return found


def run(cpp_build: Path) -> list[Row]:
    etcd = Etcd()
    rows: list[Row] = []
    try:
        sizes = [int(x) for x in os.environ.get("BENCH_RDZV_SIZES", "2,8,32").split(",")]
        for n in sizes:
            rows += _round_rows(n, etcd)
        rows += _death_rows(etcd)
    finally:
        etcd.close()
    return rows


def _round_rows(n: int, etcd: Etcd) -> list[Row]:
    """N agents on each backend: the last start to all workers running, and (etcd) the
    requests per agent, beside torchrun's c10d and etcd-v2."""
    rows: list[Row] = []
    embedded = f"127.0.0.1:{free_port()}"
    torch_c10d = f"127.0.0.1:{free_port()}"
    theirs, _, _ = round_time("torchrun", "c10d", n, torch_c10d, etcd)
    theirs_v2, their_req, _ = round_time("torchrun", "etcd-v2", n, etcd.endpoint, etcd)
    for backend, endpoint in (
        ("c10d", embedded),
        ("etcd", etcd.endpoint),
        ("etcd-v2", etcd.endpoint),
    ):
        ours, req, internal = round_time("elasticrun", backend, n, endpoint, etcd)
        v2 = backend == "etcd-v2"
        base, base_name = (theirs_v2, "torchrun etcd-v2") if v2 else (theirs, "torchrun c10d")
        name = "embedded" if backend == "c10d" else backend
        note = (
            f"last join to final: median agent {internal[0] * 1000:.0f} ms, "
            f"last {internal[1] * 1000:.0f} ms"
            if internal
            else ""
        )
        rows.append(
            Row(
                "rdzv",
                f"{n} agents: last start to all workers running, {name}",
                ours if ours is not None else float("nan"),
                base,
                base_name,
                "s",
                note,
            )
        )
        if backend != "c10d":
            rows.append(
                Row(
                    "rdzv",
                    f"{n} agents: etcd requests per agent, {name}",
                    float(req),
                    float(their_req) if v2 else None,
                    "torchrun etcd-v2",
                    "requests",
                )
            )
    return rows


def _death_rows(etcd: Etcd) -> list[Row]:
    rows: list[Row] = []
    for backend, endpoint in (("c10d", None), ("etcd", etcd.endpoint)):
        ours = death_recovery("elasticrun", backend, endpoint or f"127.0.0.1:{free_port()}")
        theirs = death_recovery("torchrun", "c10d", f"127.0.0.1:{free_port()}")
        name = "embedded" if backend == "c10d" else backend
        rows.append(
            Row(
                "death",
                f"node killed to survivors' first collective, {name}",
                ours if ours is not None else float("nan"),
                theirs,
                "torchrun c10d",
                "s",
                "" if theirs is not None else "torchrun: not recovered in 90 s",
            )
        )
    return rows
