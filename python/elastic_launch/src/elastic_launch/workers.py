"""Starting, watching and stopping one node's group of workers.

Each worker runs in its own session and process group, so that a stop reaches everything it
started. Python workers start through :mod:`elastic_launch.bootstrap` (fresh interpreters), or are
forked from the zygote when modules are preloaded; a function entrypoint with the ``fork`` start
method is forked from the launcher itself. Whoever is a worker's parent reaps it: Popen for
fresh interpreters, the zygote for its children, the agent for forks. The watchdog reads exit
statuses without reaping.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from string import Template
from typing import IO, Any, Protocol

import elastic_core

from elastic_launch import bootstrap
from elastic_launch.api import LaunchConfig, Std
from elastic_launch.config import std_for
from elastic_launch.errors import ERROR_FILE_ENV
from elastic_launch.logs import LogLayout, OutputPump, console_streams
from elastic_launch.rendezvous.api import RendezvousInfo

logger = logging.getLogger(__name__)


@dataclass
class Entrypoint:
    """What each worker runs: a script, a module, a binary, or a Python function."""

    kind: str  # "script" | "module" | "binary" | "function"
    target: str | Callable[..., Any]
    args: list[str] = field(default_factory=list)
    fn_args: tuple[Any, ...] = ()

    @property
    def name(self) -> str:
        if callable(self.target):
            return getattr(self.target, "__name__", repr(self.target))
        return os.path.basename(self.target) if self.kind != "module" else self.target

    @property
    def is_python(self) -> bool:
        return self.kind != "binary"


class Process(Protocol):
    pid: int
    #: True if the agent is the parent (it reaps, and ends the worker's process group first);
    #: False for zygote children, whose parent does both.
    reaped_by_agent: bool

    def reap(self, timeout: float) -> tuple[int | None, int | None]:
        """Wait at most `timeout` for the exit and collect it: (exit code, signal)."""


class PopenProcess:
    reaped_by_agent = True

    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    def reap(self, timeout: float) -> tuple[int | None, int | None]:
        try:
            code = self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            return None, None
        return (code, None) if code >= 0 else (None, -code)


class ForkedProcess:
    reaped_by_agent = True

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._status: tuple[int | None, int | None] | None = None

    def reap(self, timeout: float) -> tuple[int | None, int | None]:
        deadline = time.monotonic() + timeout
        while self._status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self._status = (None, None)
                break
            if pid:
                code = os.waitstatus_to_exitcode(status)
                self._status = (code, None) if code >= 0 else (None, -code)
            elif time.monotonic() >= deadline:
                return None, None
            else:
                time.sleep(0.001)
        return self._status


@dataclass
class Worker:
    """One worker of the current attempt."""

    local_rank: int
    rank: int
    process: Process
    started_ns: int
    rank_dir: str
    error_file: str
    stack_file: str
    stdout_log: str | None
    stderr_log: str | None
    result_file: str | None = None
    exited: bool = False
    exit_code: int | None = None
    signal: int | None = None
    open_files: list[IO[bytes]] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.process.pid


def _apply_virtual_local_rank(env: dict[str, str], local_rank: int) -> None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        devices = [d.strip() for d in visible.split(",")]
        if local_rank >= len(devices):
            raise RuntimeError(
                f"local_rank {local_rank} exceeds the GPUs in CUDA_VISIBLE_DEVICES={visible}"
            )
        env["CUDA_VISIBLE_DEVICES"] = devices[local_rank]
    else:
        env["CUDA_VISIBLE_DEVICES"] = str(local_rank)
    env["LOCAL_RANK"] = "0"


class WorkerGroup:
    """The workers of one node, one attempt at a time."""

    def __init__(
        self,
        config: LaunchConfig,
        entrypoint: Entrypoint,
        run_id: str,
        layout: LogLayout,
        table: elastic_core.HeartbeatTable,
        watchdog: elastic_core.Watchdog,
        spawner: Any = None,  # a zygote client, when workers are forked from one
    ) -> None:
        self.config = config
        self.entrypoint = entrypoint
        self.run_id = run_id
        self.layout = layout
        self.table = table
        self.watchdog = watchdog
        self.spawner = spawner
        self.host = socket.gethostname()
        self.workers: list[Worker] = []
        self.pump = OutputPump()
        self.extra_env: dict[str, str] = {}
        self.gpu_count = 0  # devices under GPU checks (set by the agent)
        self._filtered: list[IO[bytes]] = []

    # ---- environment ---------------------------------------------------------------------

    def worker_env(
        self, local_rank: int, info: RendezvousInfo, attempt: int, restarts: int, w: Worker
    ) -> dict[str, str]:
        c = self.config
        rank = info.rank_offset + local_rank
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(
            {
                "LOCAL_RANK": str(local_rank),
                "RANK": str(rank),
                "GROUP_RANK": str(info.group_rank),
                "ROLE_RANK": str(rank),
                "ROLE_NAME": c.role,
                "LOCAL_WORLD_SIZE": str(c.nproc_per_node),
                "WORLD_SIZE": str(info.world_size),
                "GROUP_WORLD_SIZE": str(info.group_world_size),
                "ROLE_WORLD_SIZE": str(info.world_size),
                "MASTER_ADDR": info.master_addr,
                "MASTER_PORT": str(info.master_port),
                "TORCHELASTIC_RESTART_COUNT": str(restarts),
                "TORCHELASTIC_MAX_RESTARTS": str(c.max_restarts),
                "TORCHELASTIC_RUN_ID": self.run_id,
                # Rank 0 hosts the store on MASTER_PORT, a fresh port each attempt: a restarted
                # group never connects to a store that still holds the previous one's keys.
                "TORCHELASTIC_USE_AGENT_STORE": "False",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get(
                    "TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"
                ),
                "TORCHELASTIC_SIGNALS_TO_HANDLE": c.signals_to_handle,
                ERROR_FILE_ENV: w.error_file,
                elastic_core.HEARTBEAT_FILE_ENV: self.table.path,
                elastic_core.HEARTBEAT_SLOT_ENV: str(local_rank),
                bootstrap.STACK_FILE_ENV: w.stack_file,
                "ELASTICRUN_ATTEMPT": str(attempt),
                "ELASTICRUN_ROUND": str(info.round),
                bootstrap.PARENT_ENV: str(os.getpid()),
            }
        )
        if c.virtual_local_rank:
            _apply_virtual_local_rank(env, local_rank)
        return env

    def command(self, local_rank: int, result_file: str | None) -> list[str]:
        ep = self.entrypoint
        python = [os.environ.get("PYTHON_EXEC", sys.executable), "-u", "-m", bootstrap.__name__]
        # torchrun's macro: ${local_rank} (and $local_rank) in any argument.
        args = [Template(a).safe_substitute(local_rank=str(local_rank)) for a in ep.args]
        if ep.kind == "binary":
            return [str(ep.target), *args]
        if ep.kind == "module":
            return [*python, "--module", str(ep.target), *args]
        if ep.kind == "function":
            return [*python, "--function", self._function_spec(result_file)]
        return [*python, "--", str(ep.target), *args]

    def _function_spec(self, result_file: str | None) -> str:
        assert result_file is not None
        spec = result_file + ".spec"
        with open(spec, "wb") as f:
            pickle.dump((self.entrypoint.target, self.entrypoint.fn_args, result_file), f)
        return spec

    # ---- output --------------------------------------------------------------------------

    def _new_worker(self, local_rank: int, rank: int, rank_dir: str) -> Worker:
        """A worker's record and file paths, before anything is opened or started."""
        c = self.config
        logs = []
        for which, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
            kept = (std_for(c.tee, local_rank) | std_for(c.redirects, local_rank)) & which
            logs.append(
                os.path.join(rank_dir, f"{name}.log") if kept and self.layout.keep_logs else None
            )
        return Worker(
            local_rank=local_rank,
            rank=rank,
            process=None,  # type: ignore[arg-type]  # set once started
            started_ns=0,
            rank_dir=rank_dir,
            error_file=os.path.join(rank_dir, "error.json"),
            stack_file=os.path.join(rank_dir, "stack.txt"),
            stdout_log=logs[0],
            stderr_log=logs[1],
            result_file=os.path.join(rank_dir, "return.pkl")
            if self.entrypoint.kind == "function"
            else None,
        )

    def _streams(self, w: Worker) -> tuple[Any, Any]:
        """Where the worker's stdout and stderr go: the Popen targets (file descriptors the
        caller closes once the worker has them, or None/DEVNULL)."""
        c = self.config
        shown = c.local_ranks_filter is None or w.local_rank in c.local_ranks_filter
        out_console, err_console = console_streams()
        prefix = self._prefix(w.local_rank, w.rank)
        targets: list[Any] = []
        for which, path, console, filters, name in (
            (Std.OUT, w.stdout_log, out_console, c.duplicate_stdout_filters, "stdout"),
            (Std.ERR, w.stderr_log, err_console, c.duplicate_stderr_filters, "stderr"),
        ):
            tee = bool(std_for(c.tee, w.local_rank) & which)
            if path is not None and tee:
                log = open(path, "ab")  # noqa: SIM115 - closed by close() after the attempt
                w.open_files.append(log)
                r, fd = os.pipe()
                filtered = self._filtered_file(name) if filters else None
                self.pump.add(r, log, console if shown else None, prefix, filtered, filters)
                targets.append(fd)
            elif path is not None:
                targets.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
            else:
                targets.append(None if shown else subprocess.DEVNULL)
        return targets[0], targets[1]

    def _prefix(self, local_rank: int, rank: int) -> str:
        template = os.environ.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
        if template:
            return Template(template).safe_substitute(
                role_name=self.config.role, rank=rank, local_rank=local_rank, host=self.host
            )
        return f"[{self.host}:{self.config.role}{local_rank}]:"

    def _filtered_file(self, name: str) -> IO[bytes]:
        path = os.path.join(self._attempt_dir, f"filtered_{name}.log")
        f = open(path, "ab")  # noqa: SIM115 - closed after the attempt
        self._filtered.append(f)
        return f

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, info: RendezvousInfo, attempt: int, restarts: int) -> None:
        """Start every worker of `attempt` and register it with the watchdog."""
        c = self.config
        self._attempt_dir = self.layout.attempt_dir(attempt)
        os.makedirs(self._attempt_dir, exist_ok=True)
        self.table.reset()
        self.workers = []
        for local_rank in range(c.nproc_per_node):
            rank = info.rank_offset + local_rank
            rank_dir = self.layout.rank_dir(attempt, local_rank)
            w = self._new_worker(local_rank, rank, rank_dir)
            env = self.worker_env(local_rank, info, attempt, restarts, w)
            stdout, stderr = self._streams(w)
            try:
                w.process = self._spawn(env, stdout, stderr, w)
            finally:
                for fd in (stdout, stderr):
                    if isinstance(fd, int) and fd >= 0:
                        os.close(fd)  # a log file or a tee pipe: the worker has its own copy
            w.started_ns = elastic_core.now_ns()
            self.workers.append(w)
            self.watchdog.watch(
                local_rank, w.pid, self.table, slot=local_rank, gpu=self.gpu_of(local_rank)
            )
            if not w.process.reaped_by_agent:
                self.spawner.acknowledge(w.pid)

    def _spawn(self, env: dict[str, str], stdout: Any, stderr: Any, w: Worker) -> Process:
        ep = self.entrypoint
        if ep.kind == "function" and self.config.start_method == "fork":
            return self._fork_function(env, stdout, stderr, w)
        cmd = self.command(w.local_rank, w.result_file)
        if self.spawner is not None and ep.is_python:
            try:
                process: Process = self.spawner.spawn(cmd[4:], env, stdout, stderr)
                return process
            except (OSError, RuntimeError) as e:  # e.g. an environment too big for a message
                logger.warning("forking from the zygote failed (%s); starting a fresh one", e)
        popen = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
        return PopenProcess(popen)

    def _fork_function(self, env: dict[str, str], stdout: Any, stderr: Any, w: Worker) -> Process:
        """start_method='fork': the child is a copy of the launcher (closures work)."""
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # child
            code = 1
            try:
                os.setsid()
                for fd, target in ((1, stdout), (2, stderr)):
                    source = (
                        os.open(os.devnull, os.O_WRONLY) if target == subprocess.DEVNULL else target
                    )
                    if isinstance(source, int) and source >= 0:
                        os.dup2(source, fd)
                os.environ.clear()
                os.environ.update(env)
                bootstrap.die_with_parent()
                from elastic_launch.config import parse_signals

                for sig in {
                    *parse_signals(self.config.signals_to_handle),
                    signal.SIGTERM,
                    signal.SIGHUP,
                    signal.SIGQUIT,
                }:
                    signal.signal(sig, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                bootstrap.install_hooks()
                value = self.entrypoint.target(*self.entrypoint.fn_args)  # type: ignore[operator]
                assert w.result_file is not None
                with open(w.result_file + ".tmp", "wb") as f:
                    pickle.dump(value, f)
                os.replace(w.result_file + ".tmp", w.result_file)
                code = 0
            except SystemExit as e:
                code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            except BaseException as e:
                from elastic_launch.errors import write_error_file

                write_error_file(e)
                import traceback

                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        return ForkedProcess(pid)

    def gpu_of(self, local_rank: int) -> int | None:
        """The NVML index of the GPU a worker uses (its local rank, through
        CUDA_VISIBLE_DEVICES when that lists indices), None without GPU checks."""
        if self.gpu_count == 0:
            return None
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            entries = [e.strip() for e in visible.split(",")]
            if local_rank < len(entries) and entries[local_rank].isdigit():
                index = int(entries[local_rank])
                return index if index < self.gpu_count else None
            return None
        return local_rank if local_rank < self.gpu_count else None

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if not w.exited]

    def by_local_rank(self, local_rank: int) -> Worker | None:
        for w in self.workers:
            if w.local_rank == local_rank:
                return w
        return None

    def mark_exited(self, w: Worker, event: elastic_core.Event | None) -> None:
        """Record an exit seen by the watchdog; end what the worker left in its process group
        (its unreaped zombie keeps the group id from being reused), then reap it."""
        if w.process.reaped_by_agent:
            _killpg(w.pid, signal.SIGKILL)
        code, sig = w.process.reap(timeout=5.0)
        if event is not None and (event.exit_code is not None or event.signal is not None):
            code, sig = event.exit_code, event.signal
        w.exited = True
        w.exit_code, w.signal = code, sig

    def dump_stacks(self, timeout: float) -> dict[int, str]:
        """Ask every live Python worker for its threads' stacks (faulthandler); by local rank."""
        if not self.entrypoint.is_python:
            return {}
        sizes = {}
        for w in self.alive():
            sizes[w.local_rank] = _size(w.stack_file)
            try:
                os.kill(w.pid, bootstrap.STACK_SIGNAL)
            except ProcessLookupError:
                continue
        stacks: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        pending = dict(sizes)
        last_growth = time.monotonic()
        previous = {r: s for r, s in sizes.items()}
        while pending and time.monotonic() < deadline:
            time.sleep(0.02)
            for rank in list(pending):
                worker = self.by_local_rank(rank)
                assert worker is not None
                size = _size(worker.stack_file)
                if size != previous[rank]:
                    previous[rank] = size
                    last_growth = time.monotonic()
                elif size > sizes[rank] and time.monotonic() - last_growth > 0.1:
                    del pending[rank]
        for rank, start in sizes.items():
            worker = self.by_local_rank(rank)
            assert worker is not None
            text = _read_from(worker.stack_file, start)
            if text:
                stacks[rank] = text
                self._append_to_log(worker, text)
        return stacks

    def _append_to_log(self, w: Worker, stack: str) -> None:
        header = f"elasticrun: Python stacks of rank {w.rank} (pid {w.pid}) before stopping it:\n"
        if w.stderr_log:
            with open(w.stderr_log, "a") as f:
                f.write(header + stack)
        else:
            prefix = self._prefix(w.local_rank, w.rank)
            lines = (header + stack).splitlines()
            sys.stderr.write("".join(f"{prefix}{line}\n" for line in lines))
            sys.stderr.flush()

    def signal_all(self, sig: int) -> None:
        """Send `sig` to every live worker's whole process group."""
        for w in self.alive():
            _killpg(w.pid, sig)

    def close(self) -> None:
        """After an attempt: end every worker still running (whole process groups), reap
        them, stop watching, and close the log files."""
        for w in self.workers:
            if not w.exited:
                _killpg(w.pid, signal.SIGKILL)
                w.exit_code, w.signal = w.process.reap(timeout=5.0)
                w.exited = True
            self.watchdog.unwatch(w.local_rank)
        if not self.pump.wait_drained(timeout=5.0):
            self.pump.drop_all()  # a grandchild still holds a pipe: stop reading it
        for w in self.workers:
            for f in w.open_files:
                f.close()
            w.open_files = []
        for f in self._filtered:
            f.close()
        self._filtered = []


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def _read_from(path: str, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")
    except OSError:
        return ""
