"""A node whose agent is stopped keeps no rank that a newer round gave away: its workers stop
themselves before its lease can expire (:mod:`elastic_launch.processes.fence`), so no two
processes hold one rank at once."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest
from elastic_launch.net import free_port
from launcher_util import start, wait_for

SCRIPT = Path(__file__).with_name("scripts") / "rank_log.py"


def records(out: Path) -> dict[int, list[tuple[int, int]]]:
    """Per pid: its (rank, time) records."""
    found: dict[int, list[tuple[int, int]]] = defaultdict(list)
    for log in out.glob("*.log"):
        for line in log.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                found[int(parts[2])].append((int(parts[0]), int(parts[3])))
    return found


def state_of(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.slow  # two launchers, a lease's time
@pytest.mark.timeout(240)
def test_a_stopped_agent_keeps_no_rank_the_new_round_gave_away(tmp_path):
    # Row 3 of the re-probe: the stopped host's worker held rank 0 for 7.5 s while the new
    # round's rank 0 trained.
    out = tmp_path / "out"
    out.mkdir()
    endpoint = f"127.0.0.1:{free_port()},127.0.0.1:{free_port()}"
    common = [
        "--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "3",
        "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "fence",
        "--rdzv-conf", "heartbeat_timeout=3,last_call_timeout=1",
        "--monitor-interval", "0.1",
    ]  # fmt: skip
    env = {"ELASTICRUN_RDZV_TOKEN": "fence-token"}
    logs = [tmp_path / "node0.log", tmp_path / "node1.log"]
    nodes = [
        start([*common, "--node-rank", str(i), str(SCRIPT), str(out)], env=env, log=logs[i])
        for i in range(2)
    ]
    stopped = nodes[0]
    try:
        assert wait_for(lambda: len(records(out)) == 2, 120), "the first round never ran"
        first = dict(records(out))
        (old,) = [pid for pid, recs in first.items() if _node_of(pid) == stopped.pid]
        os.kill(stopped.pid, signal.SIGSTOP)  # the agent alone: its worker runs on
        assert wait_for(lambda: _new_steps(records(out), first) >= 10, 120), "no new round"
        assert state_of(old) == "T", "the fenced worker is stopped"
        _assert_no_rank_held_twice(records(out))
        os.kill(stopped.pid, signal.SIGCONT)
    finally:
        (out / "stop").touch()
        for node in nodes:
            with contextlib.suppress(OSError):
                os.kill(node.pid, signal.SIGCONT)
        for node in nodes:
            _end(node)
    assert "its agent has not renewed its place in the round" in logs[0].read_text()


def _new_steps(found: dict[int, list[tuple[int, int]]], first: dict[int, object]) -> int:
    """Records of workers the first round did not have."""
    return sum(len(recs) for pid, recs in found.items() if pid not in first)


def _assert_no_rank_held_twice(found: dict[int, list[tuple[int, int]]]) -> None:
    """No two pids recorded one rank over overlapping spans of time."""
    spans: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for pid, recs in found.items():
        for rank in {r for r, _ in recs}:
            times = [t for r, t in recs if r == rank]
            spans[rank].append((min(times), max(times), pid))
    for rank, held in spans.items():
        held.sort()
        for (_, end, pid), (begin, _, other) in zip(held, held[1:]):
            assert end < begin, (
                f"rank {rank} held by pid {pid} until {end} and by pid {other} from {begin}"
            )


def _node_of(pid: int) -> int:
    """The launcher a worker belongs to: its parent, or the zygote's parent."""
    with open(f"/proc/{pid}/stat") as f:
        parent = int(f.read().rsplit(")", 1)[1].split()[1])
    with open(f"/proc/{parent}/cmdline", "rb") as f:
        if b"zygote" in f.read():
            with open(f"/proc/{parent}/stat") as g:
                return int(g.read().rsplit(")", 1)[1].split()[1])
    return parent


def _end(node: subprocess.Popen[str]) -> None:
    try:
        node.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(node.pid, signal.SIGKILL)
        node.wait(timeout=10)
