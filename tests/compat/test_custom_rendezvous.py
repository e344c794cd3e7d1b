"""A rendezvous handler in torch's shape (a subclass of torch's ``RendezvousHandler``: see
``plugin/fixed_store_rdzv.py``), run by elasticrun: through the agent API, registered by name
or given as the spec's handler (torch's own c10d handler too), and through
``elasticrun --rdzv-backend NAME`` from an entry point. Follows what torch's
local_elastic_agent_test.py asks of a handler: the agent joins rounds with it, ranks its
workers through the handler's store and shuts it down."""

from __future__ import annotations

import multiprocessing
import os
import sys
import uuid
from pathlib import Path

import pytest
from elastic_launch.launcher.agent_api import (
    LocalElasticAgent,
    RendezvousParameters,
    WorkerSpec,
    WorkerState,
    get_rendezvous_handler,
)
from elastic_launch.net import free_port
from elastic_launch.rendezvous import register

pytestmark = pytest.mark.slow  # real agents, workers and TCPStores

PLUGIN = Path(__file__).resolve().parent / "plugin"
WORKER = Path(__file__).resolve().parents[1] / "integration" / "scripts" / "worker.py"
SPAWN = multiprocessing.get_context("spawn")


def dist_sum() -> tuple[int, int]:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    t = torch.tensor(int(os.environ["RANK"]))
    dist.all_reduce(t)
    return int(os.environ["RANK"]), int(t.item())


def agent_with_registered_backend(endpoint: str, run_id: str, rank: int, lws: int, out) -> None:
    """One node: the backend registered by name, as a user's launcher script would."""
    sys.path.insert(0, str(PLUGIN))
    from fixed_store_rdzv import create

    register("fixed-store", create)
    params = RendezvousParameters("fixed-store", endpoint, run_id, 2, 2, rank=rank)
    spec = WorkerSpec("sum", lws, get_rendezvous_handler(params), entrypoint=dist_sum)
    try:
        result = LocalElasticAgent(spec, exit_barrier_timeout=30).run()
    finally:
        spec.rdzv_handler.shutdown()
    out.put((rank, result.state.value, result.return_values))


def test_a_torch_shaped_backend_registered_by_name_runs_a_two_node_job():
    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    out = SPAWN.Queue()
    procs = [
        SPAWN.Process(target=agent_with_registered_backend, args=(endpoint, run_id, r, n, out))
        for r, n in ((0, 2), (1, 1))
    ]
    for p in procs:
        p.start()
    try:
        got = sorted(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [(rank, state) for rank, state, _ in got] == [(0, "SUCCEEDED"), (1, "SUCCEEDED")]
    values = {k: v for _, _, vals in got for k, v in vals.items()}
    assert values == {0: (0, 3), 1: (1, 3), 2: (2, 3)}, "node 0's 2 workers, then node 1's"


def test_a_spec_may_hold_torchs_own_handler(monkeypatch):
    """torch's c10d handler (torch's registry, torch's parameters) as the spec's handler."""
    from torch.distributed.elastic.rendezvous import RendezvousParameters as TorchParameters
    from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler as torchs

    params = TorchParameters("c10d", f"localhost:{free_port()}", uuid.uuid4().hex[:8], 1, 1)
    spec = WorkerSpec("sum", 2, torchs(params), entrypoint=dist_sum)
    try:
        result = LocalElasticAgent(spec).run()
    finally:
        spec.rdzv_handler.shutdown()
    assert result.state == WorkerState.SUCCEEDED
    assert result.return_values == {0: (0, 1), 1: (1, 1)}


def test_elasticrun_runs_a_backend_from_an_entry_point(tmp_path):
    import subprocess

    endpoint, run_id = f"127.0.0.1:{free_port()}", uuid.uuid4().hex[:8]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(PLUGIN), *sys.path])}
    procs = []
    for rank in range(2):
        out = tmp_path / str(rank)
        out.mkdir()
        cmd = [sys.executable, "-m", "elastic_launch", "--nnodes", "2", "--rdzv-backend"]
        cmd += ["fixed-store", "--rdzv-endpoint", endpoint, "--rdzv-id", run_id]
        cmd += ["--rdzv-conf", f"rank={rank}", str(WORKER), "--out", str(out), "--dist"]
        procs.append(subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True))
    try:
        for p in procs:
            _, err = p.communicate(timeout=120)
            assert p.returncode == 0, err[-3000:]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)
    ranks = sorted(int(f.name.split(".")[0].split("-")[1]) for f in tmp_path.glob("*/*.dist.json"))
    assert ranks == [0, 1]
