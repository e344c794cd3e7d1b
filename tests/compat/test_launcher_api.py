"""torch's launcher API (``torch.distributed.launcher.api``) on elasticrun, as torch 2.13's
``test/distributed/launcher/api_test.py`` pins it: ``elastic_launch(config, entrypoint)(*args)``
and ``launch_agent`` with torch's ``LaunchConfig``. Each test names the upstream test it follows
(written here; no code of torch's is copied); deliberate differences are in docs/compat.md."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import sys
import uuid
from pathlib import Path

import pytest
from elastic_launch.api import RunResult
from elastic_launch.launcher.api import (
    ChildFailedError,
    LaunchConfig,
    SignalException,
    _get_entrypoint_name,
    elastic_launch,
    launch_agent,
)
from elastic_launch.net import free_port
from elastic_launch.rendezvous import register
from elastic_launch.rendezvous.local import LocalRendezvous

# Real launchers, workers and etcd, in the environment upstream's setUp makes.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_env")]

BIN = Path(__file__).resolve().parent / "bin"
SCRIPT = str(BIN / "env_script.py")


def config(endpoint: str, min_nodes: int, max_nodes: int, nproc: int, **kw) -> LaunchConfig:
    """Upstream's test configuration: spawn, no restarts, a fast monitor."""
    return LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=kw.pop("run_id", ""),
        rdzv_endpoint=endpoint,
        monitor_interval=0.1,
        start_method="spawn",
        max_restarts=0,
        **kw,
    )


@pytest.fixture
def out(tmp_path: Path) -> Path:
    """Where the workers touch their rank (tmp_path also holds the etcd's data)."""
    d = tmp_path / "out"
    d.mkdir()
    return d


def touched(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def ranks(n: int) -> set[str]:
    return {str(i) for i in range(n)}


def rank_plus_ten() -> int:
    return 10 + int(os.environ["RANK"])


def dist_sum() -> int:
    import torch
    import torch.distributed as dist

    dist.init_process_group(backend="gloo")
    t = torch.tensor(int(os.environ["RANK"]))
    dist.all_reduce(t)
    return int(t.item())


def test_launch_script_python(etcd_shared, out):
    """upstream: test_launch_script_python, test_launch_script_python_local_rank_transfer"""
    elastic_launch(config(etcd_shared.endpoint, 1, 1, 4), sys.executable)(
        "-u", SCRIPT, f"--touch-file-dir={out}"
    )
    assert touched(out) == ranks(4)


def test_launch_script_bash(etcd_shared, out):
    """upstream: test_launch_script_bash"""
    elastic_launch(config(etcd_shared.endpoint, 1, 1, 4), str(BIN / "touch_rank.sh"))(str(out))
    assert touched(out) == ranks(4)


def test_launch_function(etcd_shared):
    """upstream: test_launch_function: the return values by global rank"""
    res = elastic_launch(config(etcd_shared.endpoint, 1, 1, 4), rank_plus_ten)()
    assert sorted(res.values()) == [10, 11, 12, 13]
    assert sorted(res) == [0, 1, 2, 3]


def test_launch_dist_sum_with_static_rdzv():
    """upstream: test_launch_dist_sum_with_static_rdzv: rdzv_configs {"rank": 0}, an int"""
    cfg = config(
        f"127.0.0.1:{free_port()}", 1, 1, 4, rdzv_backend="static", rdzv_configs={"rank": 0}
    )
    assert sorted(elastic_launch(cfg, dist_sum)().values()) == [6, 6, 6, 6]


def test_launch_elastic(etcd_shared, out):
    """upstream: test_launch_elastic: 1 to 2 nodes, one comes"""
    elastic_launch(config(etcd_shared.endpoint, 1, 2, 4), sys.executable)(
        "-u", SCRIPT, f"--touch-file-dir={out}"
    )
    assert touched(out) == ranks(4)


@pytest.mark.parametrize("whose", ["ours", "torch's"])
def test_launch_elastic_worker_raise_exception(etcd_shared, whose):
    """upstream: test_launch_elastic_worker_raise_exception, with the ChildFailedError it
    imports: torch's own (only the launcher's import swapped) or ours"""
    from torch.distributed.elastic.multiprocessing import errors

    caught = ChildFailedError if whose == "ours" else errors.ChildFailedError
    with pytest.raises(caught) as info:
        elastic_launch(config(etcd_shared.endpoint, 1, 2, 4), sys.executable)(
            "-u", SCRIPT, "--fail"
        )
    _, first = info.value.get_first_failure()
    assert first.exitcode == 1
    assert "raising exception since --fail flag was set" in str(first.message)


def _launch_in_child(out: str, endpoint: str, run_id: str) -> None:
    os.environ["TEST_SENTINEL_PARENT"] = "FOOBAR"
    # torch's last call (30 s; ours is 3 s): the spawned agent, which imports everything
    # afresh, may come seconds after the other on a busy machine, and upstream's 8 workers
    # need it in the same round. Once both are there the round forms at once.
    cfg = config(endpoint, 1, 2, 4, run_id=run_id, rdzv_configs={"last_call_timeout": 30})
    elastic_launch(cfg, sys.executable)("-u", SCRIPT, f"--touch-file-dir={out}")


def test_launch_elastic_multiple_agents(etcd_shared, out):
    """upstream: test_launch_elastic_multiple_agents: two agents of one run id, 8 workers"""
    run_id = str(uuid.uuid4().int)
    other = multiprocessing.get_context("spawn").Process(
        target=_launch_in_child, args=(str(out), etcd_shared.endpoint, run_id)
    )
    other.start()
    try:
        _launch_in_child(str(out), etcd_shared.endpoint, run_id)
        other.join(120)
        assert other.exitcode == 0
    finally:
        if other.is_alive():
            other.kill()
            other.join(10)
    assert touched(out) == ranks(8)


def test_get_entrypoint_name():
    """upstream: test_get_entrypoint_name"""
    assert _get_entrypoint_name(rank_plus_ten, []) == "rank_plus_ten"
    assert _get_entrypoint_name(sys.executable, []) == ""
    assert _get_entrypoint_name(sys.executable, ["-u"]) == ""
    assert _get_entrypoint_name(sys.executable, ["-u", "test_script.py"]) == "test_script.py"
    assert _get_entrypoint_name(None, []) == ""


# ---- the rendezvous handler's shutdown, by how the agent ends --------------------------------


class Recording(LocalRendezvous):
    """A real one-node rendezvous that counts its shutdowns (and takes the "timeout" torch's
    LaunchConfig gives every backend)."""

    shutdowns = 0

    def __init__(self, params) -> None:
        super().__init__(dataclasses.replace(params, config={}))

    def shutdown(self, cancel=None) -> None:  # type: ignore[override]
        Recording.shutdowns += 1
        super().shutdown() if cancel is None else super().shutdown(cancel)


@pytest.fixture
def recording():
    register("recording", Recording)
    Recording.shutdowns = 0
    return config("", 1, 1, 1, rdzv_backend="recording")


def test_launch_shutdown(recording, out):
    """upstream: test_launch_shutdown: the handler is shut down once after success"""
    elastic_launch(recording, sys.executable)("-u", SCRIPT, f"--touch-file-dir={out}")
    assert Recording.shutdowns == 1


class AgentBrokeError(Exception):
    pass


def test_rdzv_handler_shutdown_on_agent_error(recording, monkeypatch):
    """upstream: test_rdzv_handler_shutdown_on_agent_error, ..._agent_raise_exception: the
    agent's own exception reaches the caller unchanged, after the handler's shutdown"""

    def broken(self, *a, **kw) -> RunResult:
        raise AgentBrokeError("any other exception")

    monkeypatch.setattr("elastic_launch.agent.agent.ElasticAgent.run", broken)
    with pytest.raises(AgentBrokeError, match="any other exception"):
        launch_agent(recording, rank_plus_ten, [])
    assert Recording.shutdowns == 1


def _stop_launcher(launcher: int, sig: int) -> None:
    os.kill(launcher, sig)
    import time

    time.sleep(60)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_launch_agent_stopped_by_a_signal_raises_signal_exception(recording, sig):
    """upstream: test_rdzv_handler_shutdown_on_agent_signal: SignalException with the signal.
    The handler's shutdown here leaves the job open (others may go on): see docs/compat.md."""
    with pytest.raises(SignalException) as info:
        launch_agent(recording, _stop_launcher, [os.getpid(), sig])
    assert info.value.sigval == sig
    assert Recording.shutdowns == 1
