"""A two-node job on the IPv6 loopback: the static backend with --master-addr ::1 (the workers
meet at rank 0's store on [::1]) and the embedded service at [::1]:PORT."""

from __future__ import annotations

import socket

import pytest
from launcher_util import finish, start, wait_gone, worker_args


def free_v6_port() -> int:
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["static", "c10d"])
def test_a_two_node_job_on_ipv6(tmp_path, backend):
    port = free_v6_port()
    if backend == "static":
        nodes = [
            [
                "--rdzv-backend",
                "static",
                "--master-addr",
                "::1",
                "--master-port",
                str(port),
                "--node-rank",
                str(rank),
            ]
            for rank in (0, 1)
        ]
    else:
        rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"[::1]:{port}", "--rdzv-id", "v6"]
        nodes = [rdzv, rdzv]
    outs = [tmp_path / f"node{i}" for i in (0, 1)]
    procs = []
    for flags, out in zip(nodes, outs):
        out.mkdir()
        procs.append(start(["--nnodes", "2", *flags, *worker_args(out, "--dist")]))
    for proc in procs:
        code, _, err = finish(proc, 150)
        assert code == 0, err[-3000:]
    envs = [__import__("json").loads(p.read_text()) for out in outs for p in out.glob("*.env.json")]
    assert {e["MASTER_ADDR"] for e in envs} == {"::1"}
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1]
    pids = [int(p.read_text()) for out in outs for p in out.glob("*.pid")]
    assert wait_gone(pids) == []
