"""Running elasticrun (and torchrun) as real processes in tests, and checking what they leave."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from elastic_launch.net import free_port

__all__ = ["free_port"]  # the tests import it from here

HERE = Path(__file__).resolve().parent
WORKER = HERE / "scripts" / "worker.py"
ELASTICRUN = [sys.executable, "-m", "elastic_launch"]


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    out: Path

    def pids(self) -> dict[str, int]:
        return {p.stem: int(p.read_text()) for p in self.out.glob("*.pid") if p.read_text()}

    def env(self, tag: str) -> dict[str, str]:
        return json.loads((self.out / f"{tag}.env.json").read_text())


def alive(pid: int) -> bool:
    """True if `pid` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    """Wait until none of `pids` runs; returns those still running."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        left = [p for p in pids if alive(p)]
        if not left:
            return []
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def start(
    args: list[str],
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    launcher: list[str] | None = None,
    log: Path | None = None,
) -> subprocess.Popen[str]:
    """The launcher with `args`; its output in pipes (read them with finish()), or in the file
    `log` for a job the test does not finish by reading (a full pipe would stall it)."""
    full_env = dict(os.environ)
    full_env.pop("OMP_NUM_THREADS", None)
    full_env.update(env or {})
    sink = open(log, "w") if log is not None else None  # noqa: SIM115 - closed below
    try:
        return subprocess.Popen(
            [*(launcher or ELASTICRUN), *args],
            stdout=sink or subprocess.PIPE,
            stderr=subprocess.STDOUT if sink else subprocess.PIPE,
            text=True,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
        )
    finally:
        if sink is not None:
            sink.close()  # the launcher has its own copy


def run(
    args: list[str],
    out: Path,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    launcher: list[str] | None = None,
) -> Run:
    """Run a launcher to completion (bounded)."""
    code, stdout, stderr = finish(start(args, env, cwd, launcher), timeout)
    return Run(code, stdout, stderr, out)


def listening(endpoint: str) -> bool:
    """True if something accepts connections at host:port (a hosted rendezvous service)."""
    import socket

    host, port = endpoint.rsplit(":", 1)
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((host, int(port))) == 0


def held(gates: Path, *steps: int) -> tuple[str, ...]:
    """The examples' flags that hold every rank at each of `steps` until release(): a fault
    comes after what the test waited for, never after a number of steps the job might have
    run past on a slow machine."""
    gates.mkdir(exist_ok=True)
    return ("--hold-at-step", ",".join(map(str, steps)), "--hold-dir", str(gates))


def release(gates: Path, step: int) -> None:
    """The ranks held at `step` go on."""
    (gates / f"step-{step}").touch()


def health(port: int) -> dict:
    """The launcher's /healthz answer on `port` ({} while it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
            return json.loads(r.read())
    except OSError:
        return {}


def wait_for(pred, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def finish(proc: subprocess.Popen[str], timeout: float = 120) -> tuple[int, str, str]:
    """Wait (bounded) for a launcher started with start(); kill it if it overruns."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(
            f"launcher {proc.pid} did not finish in {timeout} s:\n{err[-3000:]}"
        ) from None
    return proc.returncode, out, err


def worker_args(out: Path, *extra: str) -> list[str]:
    return [str(WORKER), "--out", str(out), *extra]
