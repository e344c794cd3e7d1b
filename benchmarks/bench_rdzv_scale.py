"""Rendezvous at scale: N simulated agents, real RendezvousHandler
objects made as the launcher makes them, in a few processes (benchmarks/_rdzv_sim.py; no
workers), against etcd v3, etcd v2 and the embedded service.

    python benchmarks/bench_rdzv_scale.py [--n 32,128,512] [--backend etcd,etcd-v2,embedded]
        [--procs 8] [--cap 120] [--no-loss] [--breakdown] [--channels shared,own]

Per backend and N, with `--nnodes N-1:N` (the round closes once N have joined; after a loss it
closes at once, the lost member being known gone) and the default lease (heartbeat_timeout 5 s):

- N-1 agents join (started over N/40 s, in turn in each process: see `ramp_seconds`) and wait;
  then the last one starts. (a) its join (next_rendezvous called) to
  the round final (the leader's commit of the final state), (b) to the last agent holding its
  result;
- (c) requests per agent in that round: etcd's own counters (gRPC calls started, keep-alives
  and health checks left out, as bench_rendezvous does; v2: its store's reads, writes and
  watches), and for every backend the client's side (every gRPC call / HTTP request the
  handlers sent, keep-alives apart);
- (d) the store's peak established connections, open fds and RSS (etcd; embedded: the hosting
  agent's process, which serves), sampled every 0.25 s;
- a node loss: one agent alone in its process is SIGKILLed; its lease expires, the survivors'
  watches see its join key go, they call next_rendezvous(MEMBERSHIP); from the first survivor
  to notice (the expiry, within the watch's delivery) to the new round final and to the last
  survivor holding its result.

Two shapes of simulator (`--channels`): "shared", the agents of a process share one gRPC
channel (one connection); "own", each agent has its own channel and connection, as deployed.
For etcd, a second table gives etcd's own side of each round in two windows, the joins (first
join to the last one's start) and the last join to every result: its requests, the bytes it
received and sent, and its CPU (from /proc), per agent, with the CPU that keep-alives alone
cost it (measured for 5 s after the round, every agent waiting) taken off.

Every wait is capped (`--cap`, per round); a round that does not complete is reported with what
was seen (results, lease losses, the longest keep-alive gap). Every process started is ended
by its pid.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_rendezvous import Etcd

from common import Row, free_port

HERE = Path(__file__).resolve().parent
SIM = HERE / "_rdzv_sim.py"
BACKENDS = ("etcd", "etcd-v2", "embedded")
CONF = "last_call_timeout=600,join_timeout=600"


def ramp_seconds(n: int) -> float:
    """The first N-1 agents start over this long, in turn in each process (as nodes arrive
    over some seconds), not all in one instant: on 2 cores, N Python agents starting at once
    starve their own lease renewals (each start costs tens of ms of CPU), which no
    deployment of one agent per machine sees. The figures run from the last join, after."""
    return n / 40.0  # the default lease: heartbeat_timeout 5 s


# ---- the store's side ---------------------------------------------------------------------------


def _metrics(endpoint: str) -> dict[str, float]:
    """etcd's counters that matter here, by name (gRPC ones by method)."""
    text = urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r"^(grpc_server_(?:started|msg_received)_total)\{([^}]*)\} (\S+)", line)
        if m:
            method = re.search(r'grpc_method="([^"]+)"', m.group(2))
            if method:
                key = f"{m.group(1)}.{method.group(1)}"
                out[key] = out.get(key, 0.0) + float(m.group(3))
            continue
        m = re.match(
            r"^(etcd_debugging_store_(?:reads|writes|watch_requests)_total|"
            r"etcd_network_client_grpc_(?:sent|received)_bytes_total|"
            r"etcd_debugging_mvcc_watcher_total|etcd_debugging_mvcc_watch_stream_total|"
            r"etcd_debugging_store_watchers|process_cpu_seconds_total)(\{[^}]*\})? (\S+)",
            line,
        )
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def _etcd_requests(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What etcd served between two scrapes: gRPC calls by method, v2 store requests, bytes."""
    keys = set(before) | set(after)
    diff = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in keys}
    gauges = ("watcher_total", "watch_stream_total", "store_watchers")
    return {k: v for k, v in diff.items() if v and not any(g in k for g in gauges)}


def _served(diff: dict[str, float]) -> float:
    """Requests, as bench_rendezvous counts them (keep-alives and health checks left out)."""
    total = 0.0
    for k, v in diff.items():
        if (
            k.startswith("grpc_server_started_total.") and not re.search(r"KeepAlive|Health", k)
        ) or (k.startswith("etcd_debugging_store_") and k.endswith("_total")):
            total += v
    return total


def _rss_fds(pid: int) -> tuple[float, int]:
    rss = 0.0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
    try:
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        fds = 0
    return rss, fds


def _connections(port: int) -> int:
    """Established TCP connections whose local port is `port` (the server's ends)."""
    n = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            next(f)
            for line in f:
                parts = line.split()
                if parts[3] == "01" and int(parts[1].rsplit(":", 1)[1], 16) == port:
                    n += 1
    return n


def _cpu(pid: int) -> float:
    """User + system CPU seconds of a process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler:
    """Peaks of the server process' RSS, fds and connections, every 0.25 s; etcd's watcher
    gauges every second."""

    def __init__(self, pid: int, port: int, metrics: str | None) -> None:
        self.pid, self.port, self.metrics = pid, port, metrics
        self.peaks: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _peak(self, name: str, value: float) -> None:
        self.peaks[name] = max(self.peaks.get(name, 0.0), value)

    def reset(self) -> dict[str, float]:
        peaks, self.peaks = self.peaks, {}
        return peaks

    def _run(self) -> None:
        tick = 0
        while not self._stop.wait(0.25):
            rss, fds = _rss_fds(self.pid)
            self._peak("rss_mb", rss)
            self._peak("fds", fds)
            self._peak("conns", _connections(self.port))
            tick += 1
            if self.metrics and tick % 4 == 0:
                with contextlib.suppress(OSError, ValueError):
                    m = _metrics(self.metrics)
                    for k in (
                        "etcd_debugging_mvcc_watcher_total",
                        "etcd_debugging_mvcc_watch_stream_total",
                        "etcd_debugging_store_watchers",
                    ):
                        if k in m:
                            self._peak(k, m[k])

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


# ---- the simulated agents ------------------------------------------------------------------------


@dataclass
class Sim:
    """One process of simulated agents, and what it reported."""

    proc: subprocess.Popen[str]
    first: int
    count: int
    role: str  # "bulk", "last", "victim", "host"
    events: queue.Queue[dict[str, Any]] = field(default_factory=queue.Queue)

    def send(self, cmd: str) -> None:
        with contextlib.suppress(BrokenPipeError, OSError, ValueError):
            assert self.proc.stdin is not None
            self.proc.stdin.write(cmd + "\n")
            self.proc.stdin.flush()


@dataclass(frozen=True)
class Scale:
    """One measurement: `backend` with `n` agents simulated by `procs` processes (their logs in
    `log_dir`), the rendezvous settings `conf`; `channels` "shared" (one gRPC channel per
    simulator process) or "own" (one per agent, as deployed)."""

    backend: str
    n: int
    procs: int
    log_dir: Path
    conf: str = ""
    channels: str = "shared"


class Run:
    """One backend at one N: its store, its processes, and the events they report."""

    def __init__(self, scale: Scale) -> None:
        backend, n, procs, log_dir = scale.backend, scale.n, scale.procs, scale.log_dir
        conf, channels = scale.conf or CONF, scale.channels
        self.backend, self.n, self.conf, self.channels = backend, n, conf, channels
        self.etcd: Etcd | None = None
        self.sims: list[Sim] = []
        self.done: dict[int, list[dict[str, Any]]] = {}  # handler -> its results
        self.joined: dict[int, float] = {}  # handler -> its first join
        self.commits: list[dict[str, Any]] = []
        self.changed: list[dict[str, Any]] = []
        self.errors: list[dict[str, Any]] = []
        self.lost: list[float] = []
        self.snaps: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self.log_dir = log_dir
        if backend == "embedded":
            self.port = free_port()
            self.endpoint = f"127.0.0.1:{self.port}"
        else:
            self.etcd = Etcd()
            self.port, self.endpoint = self.etcd.port, self.etcd.endpoint
        self.run_id = f"scale-{os.urandom(4).hex()}"
        self.layout: list[tuple[str, int]] = []  # (role, count)
        rest = n - 2  # the last one and the victim have a process each
        if backend == "embedded":
            self.layout.append(("host", 1))
            rest -= 1
        self.layout.append(("victim", 1))
        per, extra = divmod(rest, procs)
        self.layout += [("bulk", per + (1 if i < extra else 0)) for i in range(procs)]
        self.layout = [x for x in self.layout if x[1] > 0]
        self.layout.append(("last", 1))

    def _read(self, sim: Sim) -> None:
        assert sim.proc.stdout is not None
        for line in sim.proc.stdout:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            kind = ev.get("ev")
            with self._lock:
                if kind == "done":
                    self.done.setdefault(ev["h"], []).append(ev)
                elif kind == "joined":
                    self.joined.setdefault(ev["h"], ev["t"])
                elif kind == "commit":
                    self.commits.append(ev)
                elif kind == "changed":
                    self.changed.append(ev)
                elif kind == "error":
                    self.errors.append(ev)
                elif kind == "lease_lost":
                    self.lost.append(ev["t"])
                elif kind == "snap":
                    self.snaps.append(ev)
            sim.events.put(ev)

    def start(self) -> None:
        first = 0
        for role, count in self.layout:
            cmd = [
                sys.executable,
                str(SIM),
                "--backend",
                self.backend,
                "--endpoint",
                self.endpoint,
                "--run-id",
                self.run_id,
                "--min",
                str(self.n - 1),
                "--max",
                str(self.n),
                "--count",
                str(count),
                "--first",
                str(first),
                "--conf",
                self.conf,
                "--ramp",
                f"{ramp_seconds(self.n) if role == 'bulk' else 0.0:g}",
            ]
            if role == "host":
                cmd.append("--host")
            name = f"{self.backend}-{self.channels}-{self.n}-{role}-{first}.log"
            log = open(self.log_dir / name, "w")  # noqa: SIM115
            shared = "1" if self.channels == "shared" else "0"
            proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "RDZV_SIM_SHARED_CHANNEL": shared},
            )
            log.close()
            sim = Sim(proc, first, count, role)
            self.sims.append(sim)
            threading.Thread(target=self._read, args=(sim,), daemon=True).start()
            if role == "host":  # the service first
                self._ready(sim, 60)
            first += count
        for sim in self.sims:
            if sim.role != "host":
                self._ready(sim, 60)

    def _ready(self, sim: Sim, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ev = sim.events.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                raise RuntimeError(f"a simulator ({sim.role}) did not start") from None
            if ev.get("ev") == "ready":
                return

    def server_pid(self) -> int:
        if self.etcd is not None:
            return self.etcd.proc.pid
        return next(s.proc.pid for s in self.sims if s.role == "host")

    def wait(self, test: Any, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if test():
                    return True
            time.sleep(0.05)
        with self._lock:
            return bool(test())

    def snap(self, timeout: float = 60) -> list[dict[str, Any]]:
        """Every live process' counters since the last snap."""
        with self._lock:
            start = len(self.snaps)
        live = [s for s in self.sims if s.proc.poll() is None]
        for s in live:
            s.send("snap")
        self.wait(lambda: len(self.snaps) - start >= len(live), timeout)
        with self._lock:
            return self.snaps[start:]

    def close(self) -> None:
        for s in self.sims:
            s.send("quit")
        for s in self.sims:
            try:
                s.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(s.proc.pid, signal.SIGKILL)
                s.proc.wait(timeout=10)
        if self.etcd is not None:
            self.etcd.close()


def _merge(snaps: list[dict[str, Any]]) -> dict[str, Any]:
    counts: dict[str, float] = {}
    peaks: dict[str, float] = {}
    cpu = 0.0
    for s in snaps:
        for k, v in s["counts"].items():
            counts[k] = counts.get(k, 0.0) + v
        for k, v in s["peaks"].items():
            peaks[k] = max(peaks.get(k, 0.0), v)
        cpu += s["cpu"]
    return {"counts": counts, "peaks": peaks, "cpu": cpu}


def _client_requests(counts: dict[str, float]) -> float:
    """Requests the handlers sent, keep-alives (and their failures) left out."""
    total = 0.0
    for k, v in counts.items():
        if (k.startswith("rpc.") and k.count(".") == 1 and "KeepAlive" not in k) or (
            k.startswith("v2.") and k.count(".") == 1 and k != "v2.refresh"
        ):
            total += v
    return total


class Window:
    """etcd's side of one stretch of a run: its counters and its own CPU (from /proc)."""

    def __init__(self, run: Run, metrics: str | None) -> None:
        self.run, self.metrics = run, metrics
        self._begin()

    def _begin(self) -> None:
        self.t = time.monotonic()
        self.cpu = _cpu(self.run.server_pid())
        self.m = _metrics(self.metrics) if self.metrics else {}

    def take(self) -> dict[str, Any]:
        """What etcd did since the window began (or the last take), and begin anew."""
        t, cpu, m = self.t, self.cpu, self.m
        self._begin()
        diff = _etcd_requests(m, self.m) if self.metrics else {}
        return {"secs": self.t - t, "cpu": self.cpu - cpu, "etcd": diff}


IDLE_WINDOW = 5.0  # seconds of keep-alives alone, after the round, to price them


def measure(scale: Scale, cap: float, loss: bool) -> dict:
    """One backend at one N: the figures of the module's docstring, as a dict (`cap`: how long
    a round may take; `loss`: then lose a node and measure the next round)."""
    result: dict[str, Any] = {"backend": scale.backend, "n": scale.n, "channels": scale.channels}
    run = Run(scale)
    sampler: Sampler | None = None
    try:
        run.start()
        metrics = run.endpoint if run.etcd is not None else None
        sampler = Sampler(run.server_pid(), run.port, metrics)
        m0 = _metrics(metrics) if metrics else {}
        run.snap()  # what starting cost (imports, no requests yet): reset
        cpu0 = _cpu(run.server_pid())
        window = Window(run, metrics)
        _form_round(run, result, cap, window)
        result["store_cpu_round"] = _cpu(run.server_pid()) - cpu0
        if metrics:
            result["etcd_round"] = _etcd_requests(m0, _metrics(metrics))
            if result["round_ok"]:  # every agent waits: keep-alives alone
                window.take()
                time.sleep(IDLE_WINDOW)
                result["window_idle"] = window.take()
        result["store_round"] = sampler.reset()
        if loss and result["round_ok"]:
            result.update(_node_loss(run, scale.n, cap, metrics, sampler))
    finally:
        if sampler is not None:
            sampler.stop()
        run.close()
    return result


def _form_round(run: Run, result: dict[str, Any], cap: float, window: Window) -> None:
    """Every agent but the last joins; then the last one, and the round completes (or not
    within `cap`): its figures into `result`."""
    n = run.n
    last = next(s for s in run.sims if s.role == "last")
    for s in run.sims:
        if s is not last:
            s.send("go")
    t_start = time.monotonic()
    joined_all = run.wait(lambda: len(run.joined) >= n - 1, cap)
    result["joins_s"] = time.monotonic() - t_start
    if not joined_all:
        result["error"] = f"only {len(run.joined)} of {n - 1} joined in {cap:.0f} s"
    time.sleep(0.5)  # the others wait, as in bench_rendezvous
    result["window_joins"] = window.take()
    last.send("go")
    ok = run.wait(lambda: len(run.done) >= n or len(run.errors) > 0, cap if joined_all else 1.0)
    result["window_final"] = window.take()
    result.update(_round_outcome(run, n, t_start, ok))
    result["client_round"] = _merge(run.snap())


def _round_outcome(run: Run, n: int, t_start: float, ok: bool) -> dict[str, Any]:
    """Whether the round completed, and when: from the last join to the round's final state,
    and to the last agent's result."""
    result: dict[str, Any] = {}
    with run._lock:
        firsts = {h: evs[0] for h, evs in run.done.items()}
        finals = [c for c in run.commits if c["status"] == "final"]
        result["round_ok"] = ok and not run.errors and len(firsts) >= n
        result["round_done"] = len(firsts)
        result["round_errors"] = [e["error"] for e in run.errors[:3]]
        result["lease_lost_round"] = len(run.lost)
        if run.lost:  # when the first lease was lost, from the first join
            result["first_lease_lost_s"] = min(run.lost) - t_start
        # The round's commits (frozen, final, reopened), from the first join: where a round
        # that did not complete stopped.
        result["commits"] = [
            (c["status"], c["round"], c["nodes"], round(c["t"] - t_start, 2))
            for c in run.commits[:20]
        ]
    calls = [e["t_call"] for e in firsts.values() if e["reason"] == "start"]
    last_join = max(calls) if calls else None
    if result["round_ok"] and last_join is not None:
        rounds = {e["round"] for e in firsts.values()}
        final = [c["t"] for c in finals if c["round"] in rounds]
        result["join_to_final"] = min(final) - last_join if final else None
        result["join_to_last_result"] = max(e["t"] for e in firsts.values()) - last_join
        result["rounds_taken"] = max(rounds)
        result["world"] = sorted({e["world"] for e in firsts.values()})
    return result


def _node_loss(run: Run, n: int, cap: float, metrics: str | None, sampler: Sampler) -> dict:
    out: dict[str, Any] = {}
    victim = next(s for s in run.sims if s.role == "victim")
    m0 = _metrics(metrics) if metrics else {}
    cpu0 = _cpu(run.server_pid())
    with run._lock:
        seen_rounds = {evs[-1]["round"] for evs in run.done.values()}
        r1 = max(seen_rounds)
    errors_before = len(run.errors)
    t_kill = time.monotonic()
    os.kill(victim.proc.pid, signal.SIGKILL)  # its lease is no longer renewed
    victim.proc.wait(timeout=10)
    survivors = {h for h in run.done if h != victim.first}

    def again() -> bool:
        return all(any(e["round"] > r1 for e in run.done.get(h, [])) for h in survivors)

    ok = run.wait(lambda: again() or bool(run.errors), cap + 10)
    with run._lock:
        changed = [c["t"] for c in run.changed if c["round"] == r1]
        after = [e for evs in run.done.values() for e in evs if e["round"] > r1]
        finals = [c for c in run.commits if c["status"] == "final" and c["round"] > r1]
        out["loss_lease_lost"] = len([t for t in run.lost if t > t_kill])
    out["loss_ok"] = ok and again()
    out["loss_survivors_done"] = len({e["h"] for e in after})
    out["loss_errors"] = [e["error"] for e in run.errors[errors_before : errors_before + 3]]
    if changed:
        first_seen = min(changed)
        out["kill_to_detect"] = first_seen - t_kill
        if out["loss_ok"]:
            last_round = max(e["round"] for e in after)
            final = [c["t"] for c in finals if c["round"] == last_round]
            out["detect_to_final"] = min(final) - first_seen if final else None
            out["detect_to_last_result"] = max(e["t"] for e in after) - first_seen
            out["loss_rounds"] = sorted({e["round"] for e in after})
            out["loss_world"] = sorted({e["world"] for e in after if e["round"] == last_round})
    out["client_loss"] = _merge(run.snap())
    out["store_cpu_loss"] = _cpu(run.server_pid()) - cpu0
    if metrics:
        out["etcd_loss"] = _etcd_requests(m0, _metrics(metrics))
    out["store_loss"] = sampler.reset()
    return out


# ---- reporting -----------------------------------------------------------------------------------


def _s(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x * 1000:.0f} ms" if x < 1 else f"{x:.2f} s"


def _per(x: float, n: int) -> str:
    return f"{x / n:.1f}"


def _embedded_served(counts: dict[str, float]) -> float:
    """The requests the embedded service served, its keep-alives left out (its own counts)."""
    return sum(
        v
        for k, v in counts.items()
        if k.startswith("server.") and "KeepAlive" not in k and k.count(".") == 1
    )


def table(results: list[dict]) -> str:
    lines = [
        "| backend | N | round | (a) last join -> final | (b) last join -> last result "
        "| (c) requests/agent: store / client | store sent KiB/agent | (d) peak conns / fds / "
        "RSS MB | lease losses | loss: kill -> seen | seen -> final | seen -> last result "
        "| loss requests/agent |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        n = r["n"]
        status = "ok" if r.get("round_ok") else f"did not complete ({r.get('round_done', 0)}/{n})"
        if r.get("error"):
            status += f"; {r['error']}"
        etcd = r.get("etcd_round")
        client = r.get("client_round", {}).get("counts", {})
        # v2: a TTL refresh is a write too; the client's count of them is taken off.
        store_req = (
            _per(_served(etcd) - client.get("v2.refresh", 0), n) if etcd is not None else "n/a"
        )
        if etcd and etcd.get("etcd_network_client_grpc_sent_bytes_total"):
            sent = f"{etcd['etcd_network_client_grpc_sent_bytes_total'] / 1024 / n:.1f}"
        elif r["backend"] == "embedded":  # what the clients received
            got = sum(v for k, v in client.items() if k.endswith("reply_bytes"))
            sent = f"{got / 1024 / n:.1f}"
        else:
            sent = "n/a"
        if r["backend"] == "embedded":
            store_req = f"{_embedded_served(client) / n:.1f}"
        st = r.get("store_round", {})
        peaks = f"{st.get('conns', 0):.0f} / {st.get('fds', 0):.0f} / {st.get('rss_mb', 0):.0f}"
        lost = r.get("lease_lost_round", 0) + r.get("loss_lease_lost", 0)
        loss_req = "-"
        if "client_loss" in r:
            lc = r["client_loss"]["counts"]
            if r.get("etcd_loss") is not None:
                served = _served(r["etcd_loss"]) - lc.get("v2.refresh", 0)
                loss_req = f"{served / (n - 1):.1f}"
            elif r["backend"] == "embedded":
                loss_req = f"{_embedded_served(lc) / (n - 1):.1f}"
            loss_req += f" / {_client_requests(lc) / (n - 1):.1f}"
            if not r.get("loss_ok"):
                loss_req += f" (did not complete: {r.get('loss_survivors_done', 0)}/{n - 1})"
        lines.append(
            f"| {r['backend']}{', own channels' if r.get('channels') == 'own' else ''} | "
            f"{n} | {status} | {_s(r.get('join_to_final'))} | "
            f"{_s(r.get('join_to_last_result'))} | {store_req} / "
            f"{_client_requests(client) / n:.1f} | {sent} | {peaks} | {lost} | "
            f"{_s(r.get('kill_to_detect'))} | {_s(r.get('detect_to_final'))} | "
            f"{_s(r.get('detect_to_last_result'))} | {loss_req} |"
        )
    return "\n".join(lines)


def _keepalives_apart(r: dict, name: str) -> float:
    """etcd's CPU in a window less what the same time of keep-alives alone cost it."""
    w, idle = r[name], r.get("window_idle")
    rate = idle["cpu"] / idle["secs"] if idle and idle["secs"] > 0 else 0.0
    return max(w["cpu"] - rate * w["secs"], 0.0)


def etcd_per_agent(r: dict) -> dict[str, float]:
    """What etcd served per agent from the first join to the last result: requests
    (keep-alives apart) and KiB received and sent."""
    joins, final = r["window_joins"]["etcd"], r["window_final"]["etcd"]
    both = {k: joins.get(k, 0.0) + final.get(k, 0.0) for k in set(joins) | set(final)}
    n = r["n"]
    return {
        "requests": _served(both) / n,
        "kib_in": both.get("etcd_network_client_grpc_received_bytes_total", 0.0) / 1024 / n,
        "kib_out": both.get("etcd_network_client_grpc_sent_bytes_total", 0.0) / 1024 / n,
    }


def etcd_side(results: list[dict]) -> str:
    """What etcd itself did for each round (keep-alives apart): requests, bytes and CPU per
    agent, and its CPU in the last join's window; per agent figures flat in N mean O(N)."""
    lines = [
        "| channels | N | round | (a) last join -> final | etcd requests/agent | etcd KiB "
        "in / out per agent | etcd CPU per agent: joins + final | etcd CPU, last join -> "
        "results | etcd CPU of keep-alives alone |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        if r["backend"] != "etcd" or "window_final" not in r:
            continue
        n = r["n"]
        status = "ok" if r.get("round_ok") else f"did not complete ({r.get('round_done', 0)}/{n})"
        seen = etcd_per_agent(r)
        idle = r.get("window_idle")
        if idle:
            cpu = _keepalives_apart(r, "window_joins") + _keepalives_apart(r, "window_final")
            per = f"{cpu / n * 1e6:.0f} µs"
            keepalive = f"{idle['cpu'] / idle['secs'] * 1000:.0f} ms/s"
        else:
            cpu = r["window_joins"]["cpu"] + r["window_final"]["cpu"]
            per, keepalive = f"{cpu / n * 1e6:.0f} µs (keep-alives in)", "-"
        lines.append(
            f"| {r['channels']} | {n} | {status} | {_s(r.get('join_to_final'))} | "
            f"{seen['requests']:.1f} | {seen['kib_in']:.1f} / {seen['kib_out']:.1f} | {per} | "
            f"{_s(r['window_final']['cpu'])} | {keepalive} |"
        )
    return "\n".join(lines)


def breakdown(r: dict, phase: str = "round") -> str:
    """Per agent, by kind: what the rendezvous asked for, the RPCs that made, the answers."""
    n = r["n"] if phase == "round" else r["n"] - 1
    merged = r.get(f"client_{phase}")
    if not merged:
        return ""
    counts = merged["counts"]
    lines = [f"{r['backend']} N={n} ({phase}): per agent"]
    for k in sorted(counts):
        lines.append(f"  {k:48s} {counts[k] / n:12.2f}")
    for k, v in sorted(merged["peaks"].items()):
        lines.append(f"  peak {k:43s} {v:12.2f}")
    lines.append(f"  client CPU ms per agent {1000 * merged['cpu'] / n:27.1f}")
    lines.append(f"  store CPU s in the phase {r.get(f'store_cpu_{phase}', 0):26.2f}")
    etcd = r.get(f"etcd_{phase}")
    if etcd:
        for k in sorted(etcd):
            lines.append(f"  etcd {k:60s} {etcd[k] / n:12.2f}")
    return "\n".join(lines)


def run(cpp_build: Path | None = None) -> list[Row]:
    """The benchmarks/run.py section: N = 32 and 128 (BENCH_RDZV_SCALE_SIZES), each backend."""
    sizes = [int(x) for x in os.environ.get("BENCH_RDZV_SCALE_SIZES", "32,128").split(",")]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-scale-") as logs:
        results = [
            measure(Scale(b, n, 8, Path(logs)), 120.0, True) for n in sizes for b in BACKENDS
        ]
    for r in results:
        name, n = r["backend"], r["n"]
        note = "" if r.get("round_ok") else "did not complete"
        rows.append(
            Row(
                "rdzv_scale",
                f"{n} agents: last join to last agent's result, {name}",
                r.get("join_to_last_result") or float("nan"),
                None,
                "",
                "s",
                note,
            )
        )
        if r.get("loss_ok"):
            rows.append(
                Row(
                    "rdzv_scale",
                    f"{n} agents, one lost: its lease's expiry to the survivors' results, {name}",
                    r.get("detect_to_last_result") or float("nan"),
                    None,
                    "",
                    "s",
                )
            )
    return rows


# ---- the leader's cost per member ------------------------------------------------------------

_WRITER = """
import sys, threading
from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
endpoint, prefix, n, width = sys.argv[1], sys.argv[2], int(sys.argv[3]), 16
def write(first):
    store = EtcdV3Store(endpoint, StoreAccess("writer", retry_for=10))
    for i in range(first, n, width):
        store.put(f"{prefix}{i:06d}", b"1")
    store.close()
threads = [threading.Thread(target=write, args=(k,)) for k in range(width)]
for t in threads: t.start()
for t in threads: t.join(timeout=300)
"""


def leader_cost(n: int, cap: float = 120.0) -> dict[str, Any]:
    """What a member's confirmation costs the round's leader, apart from the simulator: N
    single-key writes (another process, 16 at a time, each its own revision, as N members'
    confirmations are) arrive on one watch of this process, as on the leader's, and are
    counted off as the leader does. The CPU this process spends (gRPC, decoding, the inbox,
    the bookkeeping) per event, and the events per second etcd delivered (bounded here by the
    writer's rate on the same 2 cores)."""
    from elastic_launch.rendezvous.etcd.v3 import EtcdV3Store
    from elastic_launch.rendezvous.store.api import Inbox, StoreAccess

    etcd = Etcd()
    writer: subprocess.Popen[bytes] | None = None
    store = EtcdV3Store(etcd.endpoint, StoreAccess("leader", retry_for=10))
    try:
        prefix = "/bench/m/v1/confirm/"
        _, revision = store.range(prefix)
        inbox = Inbox()
        store.watch(prefix, revision, inbox)
        unconfirmed = {f"{i:06d}" for i in range(n)}
        confirmed: set[str] = set()
        cpu0 = time.process_time()
        writer = subprocess.Popen(
            [sys.executable, "-c", _WRITER, etcd.endpoint, prefix, str(n)],
            stdout=subprocess.DEVNULL,
        )
        first = last = 0.0
        deadline = time.monotonic() + cap
        while unconfirmed and time.monotonic() < deadline:
            batch = inbox.next(1.0)
            for change in batch or []:
                node = change.key[len(prefix) :]
                confirmed.add(node)
                unconfirmed.discard(node)
                first, last = first or time.monotonic(), time.monotonic()
        cpu = time.process_time() - cpu0
        return {
            "n": n,
            "received": len(confirmed),
            "cpu_per_event_us": cpu / max(len(confirmed), 1) * 1e6,
            "events_per_s": len(confirmed) / (last - first) if last > first else float("nan"),
        }
    finally:
        if writer is not None:
            writer.kill()
            writer.wait()
        store.close()
        etcd.close()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", default="32,128", help="agent counts, comma-separated")
    parser.add_argument("--backend", default=",".join(BACKENDS), help="etcd, etcd-v2, embedded")
    parser.add_argument("--procs", type=int, default=8, help="processes for the bulk of agents")
    parser.add_argument("--cap", type=float, default=120.0, help="seconds a round may take")
    parser.add_argument("--no-loss", action="store_true", help="skip the node loss")
    parser.add_argument("--breakdown", action="store_true", help="per-agent counts by kind")
    parser.add_argument("--conf", default="", help="more --rdzv-conf keys (heartbeat_timeout=30)")
    parser.add_argument("--json", type=Path, help="write the raw results there")
    parser.add_argument("--logs", type=Path, help="keep the simulators' logs there")
    parser.add_argument(
        "--channels",
        default="shared",
        help="shared (one gRPC channel per simulator process), own (one per agent, as "
        "deployed), or both: shared,own",
    )
    parser.add_argument(
        "--leader-events",
        type=int,
        metavar="N",
        help="only measure what N members' confirmations cost the leader (etcd v3), and stop",
    )
    return parser


#: Streams an agent of the embedded service holds open: its lease's keep-alive, the watch of its
#: round, and (one endpoint) the watch of the successor key.
STREAMS_PER_AGENT = 3


def _check_shared_embedded(
    parser: argparse.ArgumentParser, backends: list[str], shapes: list[str], n: int, procs: int
) -> None:
    """The embedded service gives one connection a share of streams: agents sharing a channel
    (and so a connection) past it would be refused, which no deployment does (one agent, one
    connection). Say so before anything starts."""
    from elastic_launch.rendezvous.embedded.bounds import STREAMS_PER_CLIENT

    per_process = -(-n // procs)
    streams = STREAMS_PER_AGENT * per_process
    if "embedded" in backends and "shared" in shapes and streams > STREAMS_PER_CLIENT:
        parser.error(
            f"--channels shared with --backend embedded at --n {n}: {per_process} agents would "
            f"share one connection, and the embedded service opens {STREAMS_PER_CLIENT} streams "
            f"for one connection ({STREAMS_PER_AGENT} an agent); use --channels own (as "
            "deployed) or more --procs"
        )


def main() -> int:
    parser = _parser()
    args = parser.parse_args()
    if args.leader_events:
        r = leader_cost(args.leader_events)
        print(
            f"{r['received']} of {r['n']} confirmations: {r['cpu_per_event_us']:.0f} µs of the "
            f"leader's CPU each, delivered at {r['events_per_s']:.0f}/s"
        )
        return 0 if r["received"] == r["n"] else 1
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    for b in backends:
        if b not in BACKENDS:
            parser.error(f"--backend {b!r}: choose from {', '.join(BACKENDS)}")
    sizes = [int(x) for x in args.n.split(",")]
    if min(sizes) < 4:
        parser.error("--n: 4 agents at least")
    shapes = [c.strip() for c in args.channels.split(",") if c.strip()]
    for c in shapes:
        if c not in ("shared", "own"):
            parser.error(f"--channels {c!r}: choose from shared, own")
    _check_shared_embedded(parser, backends, shapes, max(sizes), args.procs)
    results = []
    with contextlib.ExitStack() as stack:
        logs = args.logs or Path(stack.enter_context(tempfile.TemporaryDirectory()))
        logs.mkdir(parents=True, exist_ok=True)
        for n in sizes:
            for b, shape in ((b, c) for b in backends for c in shapes):
                conf = f"{CONF},{args.conf}" if args.conf else CONF
                r = measure(Scale(b, n, args.procs, logs, conf, shape), args.cap, not args.no_loss)
                results.append(r)
                print(table([r]).splitlines()[-1], flush=True)
                if args.breakdown:
                    print(breakdown(r, "round"), flush=True)
                    if "client_loss" in r:
                        print(breakdown(r, "loss"), flush=True)
                if args.json:
                    args.json.write_text(json.dumps(results, indent=1))
    print()
    print(table(results))
    if any(r["backend"] == "etcd" for r in results):
        print()
        print(etcd_side(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
