"""The failure summary the launcher prints when a job fails: root cause first."""

from __future__ import annotations

import datetime
import os
import signal

from elastic_launch.api import FailureKind, RunResult, WorkerFailure

_WIDTH = 78


def describe(f: WorkerFailure) -> str:
    """One line: what happened to the worker."""
    if f.kind == FailureKind.HUNG:
        return f"hung: {f.detail}"
    if f.kind == FailureKind.HEARTBEAT:
        return f"broke its heartbeat: {f.detail}"
    if f.kind == FailureKind.GPU:
        return f"GPU fault: {f.detail}"
    if f.kind == FailureKind.SPAWN:
        return f"could not start: {f.detail}"
    if f.kind == FailureKind.STOPPED:
        status = _status(f.signal, f.exit_code)
        return f"stopped by elasticrun after the root cause ({f.detail}; {status})"
    return ended(f.signal, f.exit_code, f.detail)


def ended(signum: int | None, exit_code: int | None, detail: str = "") -> str:
    """How a process ended: its signal or exit code (else `detail`)."""
    if signum is None and exit_code is None:
        return detail or "exited (status unknown)"
    return _status(signum, exit_code)


def _status(signum: int | None, exit_code: int | None) -> str:
    """How the process ended: its signal or exit code."""
    if signum is not None:
        try:
            name = signal.Signals(signum).name
        except ValueError:
            name = f"signal {signum}"
        return f"killed by {name} (signal {signum})"
    if exit_code is not None:
        return f"exit code {exit_code}"
    return "status unknown"


def who(rank: int) -> str:
    """A worker by its rank; a hot spare has none the launcher knows (a round that takes it
    gives it the train loop's)."""
    return f"rank {rank}" if rank >= 0 else "a hot spare"


def _indent(text: str, by: str = "    ") -> str:
    return "\n".join(by + line for line in text.rstrip().splitlines())


def _block(f: WorkerFailure, title: str) -> list[str]:
    when = datetime.datetime.fromtimestamp(f.wall_time).isoformat(sep=" ", timespec="seconds")
    rank = f.rank if f.rank >= 0 else "none (a hot spare)"
    lines = [
        title,
        f"  rank       : {rank} (local rank {f.local_rank}, pid {f.pid})",
        f"  host       : {f.host}",
        f"  attempt    : {f.attempt}",
        f"  time       : {when}",
        f"  failure    : {describe(f)}",
    ]
    if f.message:
        lines.append(f"  error      : {f.message}")
    # Paths only while they exist: a temporary log directory is gone once the launcher exits.
    logs = [p for p in (f.stdout_log, f.stderr_log) if p and os.path.exists(p)]
    if logs:
        lines.append(f"  logs       : {', '.join(logs)}")
    if f.error_file and os.path.exists(f.error_file):
        lines.append(f"  error file : {f.error_file}")
    if f.traceback:
        lines += ["  traceback  :", _indent(f.traceback)]
    if f.stack:
        lines += ["  stacks     :", _indent(f.stack)]
    return lines


def format_summary(name: str, result: RunResult) -> str:
    """The report of a failed job, in the spirit of torchrun's ChildFailedError table."""
    root = result.root_cause
    out = ["=" * _WIDTH, f"elasticrun: {name} {result.state.value.upper()}", "-" * _WIDTH]
    restarts = f"{result.restarts} restart(s)"
    where = f"; logs under {result.log_dir}" if result.log_dir else ""
    out.append(f"state {result.state.value} after {result.attempts} attempt(s), {restarts}{where}")
    if result.message:
        out.append(result.message)
    if root is not None:
        out += ["", *_block(root, "Root cause (first failure):")]
    others = [f for f in result.failures if f is not root]
    if others:
        out += ["", "Other workers:"]
        for f in sorted(others, key=lambda f: f.rank):
            out.append(f"  {who(f.rank)} (local rank {f.local_rank}): {describe(f)}")
    out.append("=" * _WIDTH)
    return "\n".join(out)
