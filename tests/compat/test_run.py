"""torchrun's own behaviours on elasticrun: ``elastic_launch.cli.main(args)`` called in-process, as
torch 2.13's ``test/distributed/launcher/test_run.py`` calls ``torch.distributed.run.main``.
Each test names the upstream test it follows (written here; no code of torch's is copied); the
deliberate differences are in docs/compat.md."""

from __future__ import annotations

import contextlib
import io
import multiprocessing
import os
import sys
import uuid
from pathlib import Path

import pytest
from elastic_launch.cli import main
from elastic_launch.errors import ChildFailedError
from elastic_launch.launcher.parse import parse_nnodes
from elastic_launch.net import free_port

# Real launchers and workers, in the environment upstream's setUp makes.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("clean_env")]

BIN = Path(__file__).resolve().parent / "bin"
SCRIPT = str(BIN / "env_script.py")
BASH = str(BIN / "touch_rank.sh")
COMMON = ["--monitor-interval=1", "--start-method=spawn"]


def touched(d: Path) -> set[str]:
    return {p.name for p in d.iterdir()}


def ranks(n: int) -> set[str]:
    return {str(i) for i in range(n)}


def test_launch_user_script_python(tmp_path):
    """upstream: test_launch_user_script_python"""
    args = ["--nnodes=1", "--nproc-per-node=4", f"--rdzv-id={uuid.uuid4()}", *COMMON]
    assert main([*args, SCRIPT, f"--touch-file-dir={tmp_path}"]) is None
    assert touched(tmp_path) == ranks(4)


def test_launch_user_script_python_caffe2_bc(tmp_path):
    """upstream: test_launch_user_script_python_caffe2_bc (static: master address and port)"""
    args = ["--nnodes=1", "--nproc-per-node=4", "--master-addr=localhost"]
    args += [f"--master-port={free_port()}", "--node-rank=0", *COMMON]
    main([*args, SCRIPT, f"--touch-file-dir={tmp_path}"])
    assert touched(tmp_path) == ranks(4)


@pytest.mark.parametrize("flag", ["--standalone", "--run-path"])
def test_launch_standalone_and_run_path(tmp_path, flag):
    """upstream: test_launch_standalone, test_launch_run_path"""
    main(["--nproc-per-node=4", flag, *COMMON, SCRIPT, f"--touch-file-dir={tmp_path}"])
    assert touched(tmp_path) == ranks(4)


def test_launch_elastic_with_a_quoted_rdzv_conf(tmp_path):
    """upstream: test_launch_elastic (its --rdzv-conf keeps the shell's quotes)"""
    args = ["--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=c10d"]
    args += [f"--rdzv-endpoint=localhost:{free_port()}", f"--rdzv-id={uuid.uuid4()}"]
    args += ["--rdzv-conf='join_timeout=5,last_call_timeout=1,timeout=5'", *COMMON]
    main([*args, SCRIPT, f"--touch-file-dir={tmp_path}"])
    assert touched(tmp_path) == ranks(4)


def _second_agent(argv: list[str]) -> None:
    main(argv)


def test_launch_elastic_multiple_agents(tmp_path):
    """upstream: test_launch_elastic_multiple_agents (a second launcher in another process),
    with its 5 s join timeout: an agent that does not host waits for the embedded service as
    torch's agents wait for their store (60 s), and the join timeout counts from its first
    answer. The last call is torch's 30 s (ours is 3 s): the second agent, spawned afresh,
    once came after the first had formed the round alone and finished."""
    args = ["--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=c10d"]
    args += [f"--rdzv-endpoint=localhost:{free_port()}", f"--rdzv-id={uuid.uuid4()}"]
    args += ["--rdzv_conf=timeout=5,last_call_timeout=30", *COMMON, SCRIPT]
    args += [f"--touch-file-dir={tmp_path}"]
    other = multiprocessing.get_context("spawn").Process(target=_second_agent, args=(args,))
    other.start()
    try:
        main(args)
        other.join(60)
        assert other.exitcode == 0
    finally:
        if other.is_alive():
            other.kill()
            other.join(10)
    assert touched(tmp_path) == ranks(8)


def test_launch_user_script_bash(tmp_path):
    """upstream: test_launch_user_script_bash; --no-python with --module is a usage error"""
    args = ["--nnodes=1", "--nproc-per-node=4", "--no-python", *COMMON]
    with pytest.raises(ValueError, match="--no-python"):
        main([*args, "--module", BASH, str(tmp_path)])
    main([*args, BASH, str(tmp_path)])
    assert touched(tmp_path) == ranks(4)


def test_launch_user_script_default_nproc(tmp_path):
    """upstream: test_launch_user_script_default_nproc"""
    main(["--nnodes=1", "--no-python", *COMMON, BASH, str(tmp_path)])
    assert touched(tmp_path) == ranks(1)


def test_launch_with_env_vars(tmp_path, monkeypatch):
    """upstream: test_launch_with_env_vars (every flag from its PET_ variable)"""
    for name, value in {
        "PET_NNODES": "1",
        "PET_NPROC_PER_NODE": "4",
        "PET_RDZV_ID": str(uuid.uuid4()),
        "PET_MONITOR_INTERVAL": "1",
        "PET_START_METHOD": "spawn",
        "PET_NO_PYTHON": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PET_MODULE", "1")
    with pytest.raises(ValueError, match=r"PET_MODULE|--module"):
        main([BASH, str(tmp_path)])
    monkeypatch.setenv("PET_MODULE", "0")
    main([BASH, str(tmp_path)])
    assert touched(tmp_path) == ranks(4)


def test_nproc_launch_unknown_configurations(tmp_path):
    """upstream: test_nproc_launch_unknown_configurations"""
    with pytest.raises(ValueError, match="unknown"):
        main(["--nproc-per-node=unknown", "--no-python", BASH, str(tmp_path)])


def test_nproc_launch_auto_configurations(tmp_path):
    """upstream: test_nproc_launch_auto_configurations (no GPU here: one worker per CPU)"""
    main(["--nproc-per-node=auto", "--no-python", *COMMON, BASH, str(tmp_path)])
    assert touched(tmp_path) == ranks(len(os.sched_getaffinity(0)))


def test_nproc_launch_number_configurations(tmp_path):
    """upstream: test_nproc_launch_number_configurations"""
    main(["--nproc-per-node=4", "--no-python", *COMMON, BASH, str(tmp_path)])
    assert touched(tmp_path) == ranks(4)


@pytest.mark.parametrize("nproc", ["auto", "gpu"])
def test_nproc_gpu_launch_configurations(tmp_path, monkeypatch, fake_nvml, nvml_script, nproc):
    """upstream: test_nproc_gpu_launch_configurations: three GPUs (torch mocks its CUDA
    module; elasticrun counts through NVML, here the test's fake one)"""
    monkeypatch.setenv("ELASTIC_NVML_LIBRARY", str(fake_nvml))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    nvml_script.write_text("devices 3\n")
    out = tmp_path / "out"
    out.mkdir()
    main([f"--nproc-per-node={nproc}", "--no-python", *COMMON, BASH, str(out)])
    assert touched(out) == ranks(3)


def test_nproc_xpu_launch_configurations_is_refused(tmp_path):
    """upstream: test_nproc_xpu_launch_configurations. Deliberate difference: elasticrun has
    no XPU support, and says so (docs/compat.md)."""
    with pytest.raises(ValueError, match="XPUs are not supported"):
        main(["--nproc-per-node=xpu", "--no-python", BASH, str(tmp_path)])


class AgentBrokeError(Exception):
    pass


def test_launch_elastic_agent_raise_exception(tmp_path, monkeypatch):
    """upstream: test_launch_elastic_agent_raise_exception: the agent's exception reaches the
    caller unchanged"""

    def broken(self, *a, **kw):
        raise AgentBrokeError("from the agent")

    monkeypatch.setattr("elastic_launch.agent.agent.ElasticAgent.run", broken)
    args = ["--nnodes=1:2", "--nproc-per-node=4", "--rdzv-backend=c10d", "--max-restarts=0"]
    args += [f"--rdzv-endpoint=localhost:{free_port()}", "--rdzv_conf=timeout=5", *COMMON]
    with pytest.raises(AgentBrokeError, match="from the agent"):
        main([*args, SCRIPT, f"--touch-file-dir={tmp_path}"])


def test_is_not_torchelastic_launched(tmp_path, monkeypatch):
    """upstream: test_is_not_torchelastic_launched: the same script run without a launcher"""
    import runpy

    for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    out = tmp_path / "out"
    monkeypatch.setattr(sys, "argv", [str(BIN / "launched.py"), f"--out-file={out}"])
    runpy.run_path(sys.argv[0], run_name="__main__")
    assert out.read_text() == "False"


def test_launch_elastic_worker_raise_exception(tmp_path):
    """upstream: test_launch_elastic_worker_raise_exception: torch's ChildFailedError (and
    elasticrun's), by rank"""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError as Torchs

    args = ["--nnodes=1:1", "--nproc-per-node=4", "--max-restarts=0", "--rdzv-backend=c10d"]
    args += [f"--rdzv-endpoint=localhost:{free_port()}", *COMMON]
    with pytest.raises(Torchs) as info:
        main([*args, SCRIPT, "--fail"])
    assert isinstance(info.value, ChildFailedError)
    rank, first = info.value.get_first_failure()
    assert rank in range(4) and first.exitcode == 1
    assert "raising exception since --fail flag was set" in str(first.message)
    assert set(info.value.failures) <= set(range(4))


def test_min_max_nnodes_parse():
    """upstream: test_min_max_nnodes_parse"""
    assert parse_nnodes("1") == (1, 1)
    assert parse_nnodes("2:20") == (2, 20)
    with pytest.raises(RuntimeError, match="2:20:30"):
        parse_nnodes("2:20:30")


def test_is_torchelastic_launched(tmp_path):
    """upstream: test_is_torchelastic_launched, ..._with_logs_spec_defined"""
    for i, extra in enumerate(([], ["--logs-specs=default"])):
        out = tmp_path / f"out{i}"
        main(
            [
                "--run-path",
                "--nnodes=1",
                "--nproc-per-node=1",
                *extra,
                *COMMON,
                str(BIN / "launched.py"),
                f"--out-file={out}",
            ]
        )
        assert out.read_text() == "True"


def test_logs_logs_spec_entrypoint_must_be_defined():
    """upstream: test_logs_logs_spec_entrypoint_must_be_defined"""
    with pytest.raises(ValueError, match=r"torchrun.logs_specs\[DOESNOT_EXIST\]"):
        main(["--logs-specs=DOESNOT_EXIST", SCRIPT])


@pytest.mark.parametrize("scheme", ["tcp", "env"])
def test_init_method_with_torchelastic(scheme, tmp_path):
    """upstream: test_init_method_tcp_with_torchelastic, test_init_method_env_with_torchelastic:
    the four ranks join through the init method and sum their one-hot ranks"""
    port = free_port()
    method = f"tcp://localhost:{port}" if scheme == "tcp" else "env://"
    main(
        [
            "--run-path",
            "--nnodes=1",
            "--nproc-per-node=4",
            "--master-addr=localhost",
            f"--master-port={port}",
            *COMMON,
            str(BIN / "init_method.py"),
            f"--init-method={method}",
            f"--out={tmp_path}",
        ]
    )
    got = {p.name: p.read_text() for p in tmp_path.glob("rank*.txt")}
    assert got == {f"rank{r}.txt": repr([1.0] * 4) for r in range(4)}


def test_capture_logs_using_default_logs_specs(tmp_path, monkeypatch):
    """upstream: test_capture_logs_using_default_logs_specs (the caller's stdout is a
    StringIO; --redirect is argparse's prefix of --redirects)"""
    monkeypatch.setenv("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", "[rank${rank}]: ")
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):
        main(
            [
                "--nnodes=1",
                "--nproc-per-node=4",
                "--no-python",
                "--redirect=3",
                "--tee=3",
                *COMMON,
                BASH,
                str(tmp_path),
            ]
        )
    for i in range(4):
        assert f"[rank{i}]: creating " in captured.getvalue()


def test_success_returns_none_and_help_exits_0(capsys):
    """upstream: run.main returns None; --help ends with SystemExit(0), which @record turns
    into a return"""
    assert main(["--help"]) is None
    assert "--nproc-per-node" in capsys.readouterr().out


def test_an_unknown_flag_is_argparse_s_usage_error():
    """upstream: argparse's errors reach the caller as SystemExit(2)"""
    with pytest.raises(SystemExit) as e:
        main(["--no-such-flag", SCRIPT])
    assert e.value.code == 2


def test_the_console_script_still_exits_2_with_the_message(tmp_path):
    import subprocess

    proc = subprocess.run(
        [sys.executable, "-m", "elastic_launch", "--nnodes=2:20:30", SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "--nnodes '2:20:30'" in proc.stderr
