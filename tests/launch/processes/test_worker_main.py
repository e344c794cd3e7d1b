"""Becoming a worker: the one path of every worker process, checked in fresh interpreters
(``python -m elastic_launch.processes.worker_main``) and in forks of this process."""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import types

import pytest
from elastic_launch.processes.spawn import FunctionFork, SpawnRequest
from elastic_launch.processes.worker_main import DEVNULL, PARENT_ENV, STACK_FILE_ENV


def worker(argv: list[str], env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        [sys.executable, "-m", "elastic_launch.processes.worker_main", *argv],
        env={**os.environ, **(env or {})},
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_script_runs_as_main_with_its_argv_and_path(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys\nprint(__name__, sys.argv, sys.path[0])\nraise SystemExit(3)\n")
    done = worker(["--", str(script), "a", "--b"])
    assert done.returncode == 3
    assert done.stdout.strip() == f"__main__ {[str(script), 'a', '--b']} {tmp_path}"


def test_exit_with_a_message_is_status_one_and_the_message(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("raise SystemExit('bad config')\n")
    done = worker(["--", str(script)])
    assert (done.returncode, done.stderr.strip()) == (1, "bad config")


def test_an_uncaught_exception_is_written_to_the_error_file_without_our_frames(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("def fail():\n    raise ValueError('bad batch')\nfail()\n")
    error_file = tmp_path / "error.json"
    done = worker(["--", str(script)], {"TORCHELASTIC_ERROR_FILE": str(error_file)})
    assert done.returncode == 1
    assert "ValueError: bad batch" in done.stderr and "worker_main" not in done.stderr
    data = json.loads(error_file.read_text())["message"]
    assert data["message"] == "ValueError: bad batch"
    assert "in fail" in data["extraInfo"]["py_callstack"]
    assert "worker_main" not in data["extraInfo"]["py_callstack"]


def test_a_module_runs_with_the_working_directory_on_its_path(tmp_path):
    (tmp_path / "mymod.py").write_text("import sys\nprint(__name__, sys.argv[1:])\n")
    done = subprocess.run(
        [sys.executable, "-m", "elastic_launch.processes.worker_main", "--module", "mymod", "x"],
        cwd=tmp_path,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "__main__ ['x']"


def test_a_function_runs_from_its_spec_and_its_value_is_kept(tmp_path):
    import pickle

    spec, result = tmp_path / "spec", tmp_path / "result"
    with open(spec, "wb") as f:
        call = pickle.dumps((divmod, (17, 5), str(result)))
        pickle.dump({"main": None, "call": call}, f)  # as SpawnRequest.write_spec writes it
    assert worker(["--function", str(spec)]).returncode == 0
    assert pickle.loads(result.read_bytes()) == (3, 2)


def test_the_optimizer_step_hook_is_installed_when_torch_optim_is_imported(tmp_path):
    optim = tmp_path / "torch" / "optim"
    optim.mkdir(parents=True)
    (tmp_path / "torch" / "__init__.py").write_text("")
    (optim / "__init__.py").write_text("")
    (optim / "optimizer.py").write_text(
        "HOOKS = []\ndef register_optimizer_step_post_hook(h):\n    HOOKS.append(h)\n"
    )
    script = tmp_path / "s.py"
    script.write_text(
        "import sys\nprint('before', 'torch.optim.optimizer' in sys.modules)\n"
        "from torch.optim import optimizer\nprint('hooks', len(optimizer.HOOKS))\n"
        "optimizer.HOOKS[0](None, (), {})\n"  # a beat without a heartbeat slot: a no-op
    )
    done = worker(["--", str(script)], {"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["before", "False", "hooks", "1"]


def test_a_stack_dump_on_the_stack_signal(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        # "up" from inside the function: a signal after it finds the function's frame (said
        # before the call, the dump could show the module's frame only)
        "import time\ndef waiting_here():\n    print('up', flush=True)\n    time.sleep(60)\n"
        "waiting_here()\n"
    )
    stack = tmp_path / "stack.txt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "elastic_launch.processes.worker_main", "--", str(script)],
        env={**os.environ, STACK_FILE_ENV: str(stack)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        proc.send_signal(signal.SIGUSR2)
        deadline = time.monotonic() + 10
        while "waiting_here" not in (stack.read_text() if stack.exists() else ""):
            assert time.monotonic() < deadline, "no stack was dumped"
            time.sleep(0.02)
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def test_ctrl_c_ends_a_worker_by_sigint(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("raise KeyboardInterrupt\n")
    assert worker(["--", str(script)]).returncode == -signal.SIGINT


def test_a_forked_function_is_a_worker_too(tmp_path):
    out = tmp_path / "out.json"
    result = tmp_path / "result"

    def probe(tag: str) -> str:
        with open(out, "w") as f:
            json.dump(
                {
                    "sid": os.getsid(0),
                    "pid": os.getpid(),
                    "env": os.environ.get("PROBE"),
                    "sigterm": int(signal.getsignal(signal.SIGTERM)),
                },
                f,
            )
        return tag * 2

    env = {**os.environ, "PROBE": "forked", PARENT_ENV: str(os.getpid())}
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # the child must not keep it
    try:
        process = FunctionFork().spawn(
            SpawnRequest(
                0,
                ["--function", "unused"],
                env,
                stdout=DEVNULL,
                call=(probe, ("ab",), str(result)),
            )
        )
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert process.reap(30) == (0, None)
    seen = json.loads(out.read_text())
    assert seen["sid"] == seen["pid"] == process.pid and seen["env"] == "forked"
    assert seen["sigterm"] == int(signal.SIG_DFL)
    import pickle

    assert pickle.loads(result.read_bytes()) == "abab"


@pytest.mark.parametrize("argv", [[], ["--module"]])
def test_no_target_is_a_clear_error(argv):
    done = worker(argv)
    assert done.returncode != 0
    if not argv:
        assert "no target given" in done.stderr


def test_the_launcher_imports_nothing_heavy_into_workers():
    code = textwrap.dedent("""
        import sys
        import elastic_launch.processes.worker_main
        heavy = [m for m in ("torch", "grpc", "elastic_launch.rendezvous", "numpy") if m in sys.modules]
        print(heavy)
    """)
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.stdout.strip() == "[]", done.stderr


def _store_module(calls: list) -> types.ModuleType:
    """A stand-in for torch.distributed.rendezvous: its store maker records its calls."""
    module = types.ModuleType("fake_rendezvous")
    module._torchelastic_use_agent_store = lambda: os.environ.get(AGENT_STORE_ENV) == "True"

    def _create_c10d_store(hostname, port, rank, world_size, timeout, use_libuv=True):
        calls.append(("create", hostname, port, rank))
        return "store"

    module._create_c10d_store = _create_c10d_store
    return module


@pytest.mark.parametrize(
    ("rank", "local", "agent", "waits"),
    [
        (1, True, False, True),
        (0, True, False, False),
        (1, False, False, False),
        (1, True, True, False),
    ],
)
def test_a_rank_waits_for_a_store_on_its_host_before_torch_connects(
    monkeypatch, rank, local, agent, waits
):
    """torch's TCPStore client that finds rank 0's store refusing sleeps a backoff of 0.25-0.75
    s: a rank other than 0 waits for the store to listen first, when the store is on its host
    (a group started on one node races). Rank 0 hosts it; a store on another host, or the
    agent's store, is torch's to reach as it does."""
    from elastic_launch import net
    from elastic_launch.processes import worker_main

    calls: list = []
    monkeypatch.setattr(net, "names_this_host", lambda host, port: local)
    monkeypatch.setattr(
        net, "await_listening", lambda host, port, t: calls.append(("wait", host, port, t)) or True
    )
    monkeypatch.setenv(AGENT_STORE_ENV, str(agent))
    module = _store_module(calls)
    worker_main._hook_store(module)
    wrapped = module._create_c10d_store
    worker_main._hook_store(module)
    assert module._create_c10d_store is wrapped, "wrapped once"
    timeout = datetime.timedelta(seconds=42)
    assert module._create_c10d_store("node0", "29500", rank, 2, timeout) == "store"
    expected = [("wait", "node0", 29500, 42.0)] if waits else []
    assert calls == [*expected, ("create", "node0", "29500", rank)]


def test_a_store_on_its_host_that_never_listens_is_torchs_error_at_torchs_timeout(monkeypatch):
    """Not a second timeout in torch's own wait after ours: torch's error, after ours."""
    from elastic_launch import net
    from elastic_launch.processes import worker_main
    from torch.distributed import DistNetworkError

    calls: list = []
    monkeypatch.setattr(net, "names_this_host", lambda host, port: True)
    monkeypatch.setattr(net, "await_listening", lambda host, port, t: False)
    module = _store_module(calls)
    worker_main._hook_store(module)
    with pytest.raises(DistNetworkError, match=r"timed out after 7 s .*\(node0, 29500\)"):
        module._create_c10d_store(
            "node0", 29500, 1, world_size=2, timeout=datetime.timedelta(seconds=7)
        )
    assert calls == [], "torch's client never waited a second time"


def test_the_store_wait_is_installed_on_torchs_own_module_in_a_worker(tmp_path):
    script = tmp_path / "s.py"
    script.write_text(
        "import sys, torch.distributed\n"
        "r = sys.modules['torch.distributed.rendezvous']\n"
        "print(getattr(r._create_c10d_store, '_elasticrun_waits', False))\n"
    )
    done = worker(["--", str(script)])
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True"]


AGENT_STORE_ENV = "TORCHELASTIC_USE_AGENT_STORE"
