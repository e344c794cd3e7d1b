"""Becoming a worker: the one path of every worker process, checked in fresh interpreters
(``python -m elastic_launch.processes.worker_main``) and in forks of this process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

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


def test_ranks_other_than_0_wait_for_the_store_to_listen_before_torch_connects(tmp_path):
    """torch's TCPStore client that finds rank 0's store refusing sleeps a backoff of 0.25-0.75
    s before it tries again: a worker's rank other than 0 waits for the store to listen
    first, so torch's one try connects (a fake torch.distributed.rendezvous tries once). Rank
    0 (it hosts the store) and a job on the agent's store do not wait."""
    fake = tmp_path / "torch" / "distributed"
    fake.mkdir(parents=True)
    (tmp_path / "torch" / "__init__.py").write_text("")
    (fake / "__init__.py").write_text("")
    (fake / "rendezvous.py").write_text(
        textwrap.dedent(
            """
            import os, socket

            def _torchelastic_use_agent_store():
                return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"

            def _create_c10d_store(hostname, port, rank, world_size, timeout, use_libuv=True):
                try:  # torch's client would back off here
                    socket.create_connection((hostname, port), timeout=5).close()
                    return "connected"
                except OSError:
                    return "refused"
            """
        )
    )
    script = tmp_path / "s.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import datetime, json, sys
            from torch.distributed import rendezvous

            port, ranks = int(sys.argv[1]), json.loads(sys.argv[2])
            found = []
            for rank in ranks:
                if rank:
                    open({str(tmp_path / "calling")!r}, "w").close()
                timeout = datetime.timedelta(seconds=60)
                found.append(rendezvous._create_c10d_store("127.0.0.1", port, rank, 2, timeout))
            print(json.dumps(found))
            """
        )
    )
    env = {"PYTHONPATH": str(tmp_path)}
    with socket.socket() as store:  # bound, not listening: connections are refused
        store.bind(("127.0.0.1", 0))
        port = store.getsockname()[1]
        done = worker(["--", str(script), str(port), "[0]"], env)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == ["refused"], "rank 0 hosts the store: no wait"
        agent = worker(["--", str(script), str(port), "[1]"], {**env, **AGENT_STORE})
        assert json.loads(agent.stdout) == ["refused"], "on the agent's store: no wait"
        (tmp_path / "calling").unlink()
        command = ["-m", "elastic_launch.processes.worker_main", "--", str(script), str(port)]
        proc = subprocess.Popen(
            [sys.executable, *command, "[1]"],
            env={**os.environ, **env},
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            deadline = time.monotonic() + 60
            while not (tmp_path / "calling").exists():
                assert proc.poll() is None and time.monotonic() < deadline, "never called"
                time.sleep(0.005)
            store.listen()
            out, _ = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.wait(30)
    assert json.loads(out) == ["connected"], "rank 1 waited for the store, then connected"


AGENT_STORE = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
