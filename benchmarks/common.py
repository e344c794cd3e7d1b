"""Helpers shared by the benchmark sections: timing statistics, children, result rows."""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Row:
    """One line of the result table: our figure beside the baseline's, and their ratio."""

    section: str
    metric: str
    ours: float
    baseline: float | None
    baseline_name: str
    unit: str
    note: str = ""

    @property
    def ratio(self) -> float | None:
        """How many times better we are (baseline / ours, for costs and latencies)."""
        if self.baseline is None or self.ours == 0:
            return None
        return self.baseline / self.ours


def median(values: list[float]) -> float:
    return statistics.median(values)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    index = min(len(ordered) - 1, round(q * (len(ordered) - 1)))
    return ordered[index]


def step_records(out: Path) -> list[tuple[int, int, int, int, int]]:
    """(t_ns, step, world, rank, pid) of every step a loop worker recorded in OUT/*.steps."""
    rows = []
    for path in out.glob("*.steps"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 5:
                rows.append(tuple(int(x) for x in parts))
    return rows  # type: ignore[return-value]


def wait_until(pred: Callable[[], Any], timeout: float, interval: float = 0.002) -> Any:
    """`pred()`'s first true value within `timeout` s (polled every `interval` s), else None.
    A driver that only reads what the job records with its own timestamps polls slowly
    (say 0.1 s): on 2 cores a 2 ms poll takes CPU time from the job it measures."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pred()
        if found:
            return found
        time.sleep(interval)
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_json(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    """Run a benchmark program that prints one JSON object as its last line."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    result = subprocess.run(
        cmd, env=full_env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if result.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({result.returncode}): {result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def python_json(script: Path, *args: str, env: dict[str, str] | None = None) -> dict:
    return run_json([sys.executable, str(script), *args], env=env)


def start_job(cmd: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A launcher (or worker) in its own session, output discarded; `env` adds to ours."""
    full = dict(os.environ)
    full.update(env or {})
    return subprocess.Popen(
        cmd, env=full, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )


def end_job(proc: subprocess.Popen[bytes], pattern: str | Path) -> None:
    """Kill a job started with start_job: its session, then every process whose command line
    has `pattern` (its workers, by their --out argument or script)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    subprocess.run(["pkill", "-9", "-f", str(pattern)], check=False)


def format_table(rows: list[Row]) -> str:
    """A Markdown table: the same one goes to the terminal and into the README."""
    lines = [
        "| benchmark | elasticrun | baseline | baseline is | ratio |",
        "|---|---:|---:|---|---:|",
    ]
    for r in rows:
        base = "n/a" if r.baseline is None else f"{_fmt(r.baseline)} {r.unit}"
        ratio = "" if r.ratio is None else f"{r.ratio:,.1f}x"
        metric = r.metric + (f" ({r.note})" if r.note else "")
        lines.append(
            f"| {metric} | {_fmt(r.ours)} {r.unit} | {base} | {r.baseline_name} | {ratio} |"
        )
    return "\n".join(lines)


def _fmt(value: float) -> str:
    if value >= 100:
        return f"{value:,.0f}"
    if value >= 10:
        return f"{value:.1f}"
    return f"{value:.2f}"


def save(name: str, rows: list[Row]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps([asdict(r) | {"ratio": r.ratio} for r in rows], indent=2))
    return path


def loop_state(pid: int) -> str:
    """What train-loop worker `pid` says of the loop: running, waiting (for a round: a hot
    spare, or between rounds) or fatal (its loop file, found through its environment)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        with open(env[b"ELASTICRUN_LOOP_FILE"]) as f:
            return f.read().split(" ")[0]
    except (OSError, KeyError):
        return ""


def waiting_spare(events: Path, started_as: str = "hot_spare_started") -> int | None:
    """The pid of a hot spare (or of a worker the event `started_as` names, such as
    "worker_replaced") that waits in the workers' rendezvous (from the job's events file),
    once one does."""
    if not events.exists():
        return None
    for line in events.read_text().splitlines():
        e = json.loads(line)
        if e["event"] == started_as and loop_state(e["pid"]) == "waiting":
            return int(e["pid"])
    return None
