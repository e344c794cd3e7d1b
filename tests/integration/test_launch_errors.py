"""Bad input gives a clear error, exit status 2, and starts nothing."""

from __future__ import annotations

import pytest
from launcher_util import run, worker_args


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nproc-per-node", "0"], "--nproc-per-node '0': need at least 1 worker per node"),
        (["--nproc-per-node", "many"], "--nproc-per-node 'many' is not valid"),
        (["--nproc-per-node", "gpu"], "--nproc-per-node 'gpu': no GPU found"),
        (["--nnodes", "3:1"], "--nnodes '3:1': need 1 <= MIN <= MAX <= 1000000 (got MIN=3, MAX=1)"),
        (["--nnodes", "two"], "--nnodes 'two' is not a node count"),
        (
            ["--rdzv-backend", "zookeeper", "--rdzv-endpoint", "h:1"],
            "--rdzv-backend 'zookeeper' is not a rendezvous backend: choose one of",
        ),
        (
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:port"],
            "--rdzv-endpoint 'localhost:port': port 'port' is not a number",
        ),
        (
            ["--rdzv-backend", "c10d", "--rdzv-endpoint", "::1:29400"],
            "write an IPv6 address in brackets",
        ),
        (
            ["--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout"],
            "'join_timeout' is not key=value",
        ),
        (
            ["--rdzv-backend", "c10d", "--rdzv-conf", "bogus=1"],
            "'bogus' is not an option of the c10d rendezvous",
        ),
        (
            ["--rdzv-backend", "c10d", "--rdzv-conf", "join_timeout=-3"],
            "join_timeout='-3' is not valid",
        ),
        (["--redirects", "0:4"], "--redirects '0:4' is not valid"),
        (["--tee", "x"], "--tee 'x' is not valid"),
        (["--local-ranks-filter", "0,a"], "--local-ranks-filter '0,a' is not valid"),
        (["--signals-to-handle", "SIGTERM,SIGNOPE"], "'SIGNOPE' is not a signal name"),
        (["--signals-to-handle", "SIGKILL"], "SIGKILL cannot be handled"),
        (["--hang-timeout", "-1"], "--hang-timeout '-1' is not valid"),
        (["--monitor-interval", "0"], "--monitor-interval '0' is not valid"),
        (["--max-restarts", "-1"], "--max-restarts '-1' is not valid"),
        (["--preload", "torch,not a module"], "'not a module' is not a module name"),
        (
            ["--logs-specs", "custom"],
            "Could not find entrypoint under 'torchrun.logs_specs[custom]'",
        ),
        (["--numa-binding", "node"], "--numa-binding node is not supported"),
        (["--event-log-handler", "kafka"], "--event-log-handler 'kafka' is not supported"),
        (["--module", "--no-python"], "Don't use both the '--no-python' flag and the '--module'"),
        (["--health-port", "99999"], "--health-port '99999' is not a port number"),
        (["--nnodes", "2", "--rdzv-backend", "c10d"], "needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "1:2", "--rdzv-backend", "static"], "the static rendezvous has a fixed size"),
        (
            [
                "--nnodes",
                "2",
                "--rdzv-backend",
                "static",
                "--node-rank",
                "2",
                "--master-port",
                "29555",
            ],
            "--node-rank 2 is out of range for --nnodes 2",
        ),
    ],
)
def test_bad_flags(out, flags, message, monkeypatch):
    monkeypatch.setenv("ELASTIC_NVML_LIBRARY", "/nonexistent/libnvidia-ml.so.1")
    result = run(
        [*flags, *worker_args(out)],
        out,
        env={"ELASTIC_NVML_LIBRARY": "/nonexistent/libnvidia-ml.so.1"},
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr, result.stderr
    assert not list(out.glob("*.pid")), "nothing may start after a usage error"


def test_missing_script(out, tmp_path):
    missing = tmp_path / "nope.py"
    result = run(["--nproc-per-node", "2", str(missing)], out)
    assert result.returncode == 2
    assert f"training script '{missing}' does not exist" in result.stderr


def test_missing_module_and_program(out):
    result = run(["-m", "no_such_module_here"], out)
    assert result.returncode == 2
    assert "module 'no_such_module_here' cannot be found" in result.stderr
    result = run(["--no-python", "/nonexistent/trainer"], out)
    assert result.returncode == 2
    assert "program '/nonexistent/trainer' is not an executable file" in result.stderr


def test_no_script_is_an_argparse_error(out):
    result = run(["--nproc-per-node", "2"], out)
    assert result.returncode == 2
    assert "training_script" in result.stderr


def test_bad_pet_environment(out):
    result = run(worker_args(out), out, env={"PET_STANDALONE": "maybe"})
    assert result.returncode == 2
    assert "PET_STANDALONE='maybe' is not a boolean" in result.stderr
    result = run(worker_args(out), out, env={"PET_NNODES": "0"})
    assert result.returncode == 2
    assert "PET_NNODES '0'" in result.stderr, "the variable is named, not the flag"


def test_log_dir_that_is_a_file(out, tmp_path):
    f = tmp_path / "file"
    f.write_text("")
    result = run(["--log-dir", str(f), *worker_args(out)], out)
    assert result.returncode == 2
    assert f"--log-dir '{f}' is a file" in result.stderr
