"""The launcher's start-up and tear-down: each start-up step made to fail in turn, and a run that
ends normally; after each, no process, no heartbeat file, no lock file and no temporary
directory of the run remains."""

from __future__ import annotations

import glob
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from elastic_launch.api import AgentState, ConfigError, FailureKind, LaunchConfig
from elastic_launch.launcher.runner import run
from elastic_launch.net import free_port
from elastic_launch.processes import zygote as zygote_module
from elastic_launch.processes.entrypoint import Entrypoint, Kind
from elastic_launch.rendezvous import RendezvousConnectionError
from proc_util import children


def traces() -> set[str]:
    tmp = tempfile.gettempdir()
    return {
        *glob.glob(f"/dev/shm/elasticrun-{os.getpid()}-*"),
        *glob.glob(os.path.join(tmp, f"elasticrun_{os.getpid()}_*")),
        *glob.glob(os.path.join(tmp, "elasticrun-rdzv-*")),
    }


@pytest.fixture
def clean() -> Iterator[None]:
    """The test must leave no child process and no file of the run."""
    before_children, before_traces = set(children(os.getpid())), traces()
    yield
    import time

    deadline = time.monotonic() + 5
    while set(children(os.getpid())) - before_children and time.monotonic() < deadline:
        time.sleep(0.02)  # the guardian exits a moment after `done`
    assert set(children(os.getpid())) - before_children == set(), (
        "a process of the run is still there"
    )
    assert traces() - before_traces == set(), "files of the run are still there"


@pytest.fixture
def script(tmp_path: Path) -> Entrypoint:
    path = tmp_path / "ok.py"
    path.write_text("import os\nassert os.environ['WORLD_SIZE'] == '2'\n")
    return Entrypoint(Kind.SCRIPT, str(path))


def config(**kw) -> LaunchConfig:
    kw.setdefault("nproc_per_node", 2)
    kw.setdefault("monitor_interval", 0.02)
    kw.setdefault("shutdown_timeout", 2.0)
    return LaunchConfig(**kw)


def busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def test_a_run_that_succeeds_leaves_nothing(clean, script):
    result = run(config(preload=["json"]), script)
    assert result.state == AgentState.SUCCEEDED


@pytest.mark.parametrize("flag", ["health_port", "metrics_port"])
def test_a_busy_port_is_a_clear_error_and_everything_is_released(clean, script, flag):
    with busy_port() as s:
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"--{flag.replace('_', '-')} 127.0.0.1:{port}"):
            run(config(preload=["json"], **{flag: str(port)}), script)


def test_an_unusable_log_dir_is_named(clean, script):
    with pytest.raises(ConfigError, match="--log-dir '/proc/elasticrun-test' cannot be used"):
        run(config(log_dir="/proc/elasticrun-test"), script)


def test_an_unwritable_events_file_is_named(clean, script, tmp_path):
    missing = tmp_path / "no" / "events.jsonl"
    with pytest.raises(ConfigError, match=f"--events-file '{missing}' cannot be opened"):
        run(config(events_file=str(missing)), script)


def test_a_rendezvous_error_releases_everything(clean, script):
    endpoint = f"127.0.0.1:{free_port()}"  # nothing serves there
    with pytest.raises(RendezvousConnectionError, match="unreachable"):
        run(
            config(
                preload=["json"],
                min_nodes=1,
                max_nodes=2,
                rdzv_backend="etcd",
                rdzv_endpoint=endpoint,
                rdzv_configs={"join_timeout": "1"},
            ),
            script,
        )


def test_a_zygote_that_cannot_start_falls_back(clean, script, monkeypatch, caplog):
    def cannot_start(self, modules, spares=0, cgroup_path=None, kept=None):
        raise OSError(8, "Exec format error")

    monkeypatch.setattr(zygote_module.Zygote, "__init__", cannot_start)
    result = run(config(preload=["json"]), script)
    assert result.state == AgentState.SUCCEEDED
    assert "the --preload zygote cannot start" in caplog.text


def test_a_worker_that_cannot_be_spawned_fails_the_job(clean, script, monkeypatch):
    monkeypatch.setenv("PYTHON_EXEC", "/nonexistent/python3")
    result = run(config(max_restarts=1), script)
    assert result.state == AgentState.FAILED and result.restarts == 1
    root = result.root_cause
    assert root is not None and root.kind == FailureKind.SPAWN
    assert "/nonexistent/python3" in root.detail


def test_a_missing_script_is_reported_before_anything_starts(clean, tmp_path):
    with pytest.raises(ConfigError, match=r"training script .* does not exist"):
        run(config(), Entrypoint(Kind.SCRIPT, str(tmp_path / "nope.py")))


@pytest.mark.parametrize("start_method", ["spawn", "forkserver"])
def test_a_function_that_cannot_reach_a_new_interpreter_fails_at_once(clean, start_method):
    import threading

    def local_function():  # not importable by reference
        return 1

    lock = threading.Lock()
    for target, args, why in (
        (local_function, (), "Can't"),
        (print, (lock,), "cannot pickle '_thread.lock' object"),
    ):
        with pytest.raises(ConfigError) as e:
            run(
                config(start_method=start_method, max_restarts=3),
                Entrypoint.for_launch(target, args),
            )
        assert "cannot be sent to a new interpreter" in str(e.value) and why in str(e.value)


def test_under_fork_a_local_function_is_fine(clean):
    def local_function():
        return 7

    result = run(config(start_method="fork"), Entrypoint.for_launch(local_function, ()))
    assert result.state == AgentState.SUCCEEDED and result.return_values == {0: 7, 1: 7}


def test_the_temporary_log_dir_stays_only_when_it_holds_asked_for_logs(tmp_path, script):
    before = traces()
    result = run(config(redirects=__import__("elastic_launch").Std.ALL), script)
    kept = traces() - before
    try:
        assert result.log_dir is not None and len(kept) == 1
        assert Path(result.log_dir, "attempt_0", "0", "stdout.log").exists()
    finally:
        import shutil

        for path in kept:
            shutil.rmtree(path, ignore_errors=True)


def test_an_exception_in_the_agent_releases_everything(clean, script, monkeypatch):
    from elastic_launch.agent.agent import ElasticAgent

    def explode(self):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ElasticAgent, "run", explode)
    with pytest.raises(RuntimeError, match="a bug"):
        run(config(preload=["json"]), script)
    assert sys.exc_info() == (None, None, None)
