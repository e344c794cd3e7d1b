"""An agent of one's own, as torch documents writing one (subclass ``SimpleElasticAgent`` and
implement the worker life), on elasticrun's real embedded rendezvous with real worker
processes. Follows torch 2.13's ``agent/server/test/api_test.py`` (its ``TestAgent``), with
workers that run."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from elastic_launch.launcher.agent_api import (
    RendezvousParameters,
    RunResult,
    SimpleElasticAgent,
    WorkerGroup,
    WorkerSpec,
    WorkerState,
    get_rendezvous_handler,
)
from elastic_launch.net import free_port

pytestmark = pytest.mark.slow  # a real rendezvous service and processes

#: A worker that writes its rank and environment, and fails on the first attempt if told to.
WORKER = """
import os, sys
out = sys.argv[1]
rank = os.environ["RANK"]
with open(os.path.join(out, f"attempt{os.environ['ATTEMPT']}-rank{rank}"), "w") as f:
    f.write(" ".join(os.environ[k] for k in ("WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")))
sys.exit(3 if os.environ["ATTEMPT"] == "0" and rank == "1" else 0)
"""


class ProcessAgent(SimpleElasticAgent):
    """Runs each worker as a Python process with the ranks the rendezvous gave."""

    def __init__(self, spec: WorkerSpec, out: Path) -> None:
        super().__init__(spec, exit_barrier_timeout=5)
        self.out, self.procs, self.attempt = out, {}, -1

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        self.attempt += 1
        for w in worker_group.workers:
            env = {
                **os.environ,
                "RANK": str(w.global_rank),
                "WORLD_SIZE": str(w.world_size),
                "MASTER_ADDR": str(worker_group.master_addr),
                "MASTER_PORT": str(worker_group.master_port),
                "ATTEMPT": str(self.attempt),
            }
            cmd = [sys.executable, "-c", WORKER, str(self.out)]
            self.procs[w.local_rank] = subprocess.Popen(cmd, env=env)
        return {rank: p.pid for rank, p in self.procs.items()}

    def _stop_workers(self, worker_group: WorkerGroup, is_restart: bool = False) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
            p.wait(30)

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        codes = {rank: p.poll() for rank, p in self.procs.items()}
        if any(c not in (None, 0) for c in codes.values()):
            return RunResult(WorkerState.FAILED)
        if all(c == 0 for c in codes.values()):
            return RunResult(WorkerState.SUCCEEDED, {r: 0 for r in codes})
        return RunResult(WorkerState.HEALTHY)

    def _shutdown(
        self, death_sig: signal.Signals = signal.SIGTERM, is_restart: bool = False
    ) -> None:
        self._stop_workers(self._worker_group)


def test_an_agent_of_ones_own_restarts_its_failed_workers_and_succeeds(tmp_path):
    """upstream: api_test.py's test_run_failure and test_run_happy_path, with real workers"""
    params = RendezvousParameters("c10d", f"127.0.0.1:{free_port()}", uuid.uuid4().hex, 1, 1)
    handler = get_rendezvous_handler(params)
    spec = WorkerSpec(
        role="trainer",
        local_world_size=2,
        rdzv_handler=handler,
        entrypoint=sys.executable,
        max_restarts=1,
        monitor_interval=0.05,
    )
    agent = ProcessAgent(spec, tmp_path)
    try:
        result = agent.run()
    finally:
        handler.shutdown()
    assert result.state == WorkerState.SUCCEEDED and result.return_values == {0: 0, 1: 0}
    assert agent._remaining_restarts == 0
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == ["attempt0-rank0", "attempt0-rank1", "attempt1-rank0", "attempt1-rank1"]
    world, addr, port = (tmp_path / "attempt1-rank0").read_text().split()
    assert world == "2" and addr and int(port) > 0
    assert all(p.poll() is not None for p in agent.procs.values()), "no worker left running"
