"""One node's group of workers: start them all, stop them all, or replace one by its local rank
while the others keep running.

The group owns its workers: their processes (each in its own session and process group, so that a
stop reaches everything a worker started), their watchdog registrations, heartbeat slots, log
files and output pipes. Nothing outside changes a :class:`Worker`; the agent reads them and acts
through the group's methods. Processes come from a
:class:`~elastic_launch.processes.spawn.Spawner`; the watchdog (``elastic_core.Watchdog``, or a
test double with ``watch``/``unwatch``/``poll``/``set_hang_timeout``) tells the group about
deaths, hangs and GPU faults.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import pickle
import signal
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any, Protocol

import elastic_core

from elastic_launch import compat
from elastic_launch.agent import devices
from elastic_launch.api import LaunchConfig, Std, WorkerState, std_for
from elastic_launch.cancel import NEVER, CancelToken, Deadline, Notice, clock
from elastic_launch.processes import worker_main
from elastic_launch.processes.entrypoint import Entrypoint, Kind
from elastic_launch.processes.logs import LogLayout, OutputPump, console_streams
from elastic_launch.processes.spawn import Process, Spawner, SpawnRequest
from elastic_launch.rendezvous import team
from elastic_launch.rendezvous.api import RendezvousInfo

if TYPE_CHECKING:
    from elastic_launch.processes.guardian import Guardian

logger = logging.getLogger(__name__)

KILL_WAIT = 10.0  # after SIGKILL, how long to wait for the kernel to report the exits
REAP_WAIT = 5.0


class Watcher(Protocol):
    """What the group needs of a watchdog (``elastic_core.Watchdog`` has it)."""

    def watch(
        self,
        worker: int,
        pid: int,
        table: elastic_core.HeartbeatTable | None = None,
        slot: int | None = None,
        hang_timeout: float = 0.0,
        gpu: int | None = None,
    ) -> None: ...

    def unwatch(self, worker: int) -> bool: ...

    def set_hang_timeout(self, worker: int, seconds: float) -> bool: ...

    def poll(self, timeout: float | None = None) -> Any: ...


@dataclass
class Worker:
    """One worker process of the current attempt (read-only outside the group)."""

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
    loop_file: str = ""  # where it says it runs the train loop (team.LOOP_FILE_ENV)
    generation: int = 0  # 0, then 1, 2... for replacements within the attempt
    state: WorkerState = WorkerState.RUNNING
    exited: bool = False  # the process is gone (and reaped)
    exit_code: int | None = None
    signal: int | None = None
    exited_ns: int | None = None  # when its exit was seen (CLOCK_MONOTONIC)
    _files: list[IO[bytes]] = field(default_factory=list, repr=False)

    @property
    def pid(self) -> int:
        return self.process.pid

    def train_loop(self) -> str | None:
        """What the worker said of the train loop: None (it does not run it), team.RUNNING,
        or team.FATAL (it failed for good)."""
        try:
            with open(self.loop_file) as f:
                return f.read().strip() or None
        except OSError:
            return None


class Finding(str, enum.Enum):
    """What the watchdog found about a worker."""

    EXITED = "exited"
    HUNG = "hung"
    GPU = "gpu"


@dataclass(frozen=True)
class WorkerEvent:
    """A finding about a live worker of this attempt (stale ones never reach the agent)."""

    finding: Finding
    worker: Worker
    time_ns: int
    detail: str


class SpawnError(RuntimeError):
    """A worker could not be started; `local_rank` says which."""

    def __init__(self, local_rank: int, error: BaseException) -> None:
        super().__init__(f"{type(error).__name__}: {error}")
        self.local_rank = local_rank


class WorkerGroup:
    """The workers of one node, one attempt at a time."""

    def __init__(
        self,
        config: LaunchConfig,
        entrypoint: Entrypoint,
        run_id: str,
        layout: LogLayout,
        table: elastic_core.HeartbeatTable,
        watchdog: Watcher,
        spawner: Spawner,
        *,
        gpu_count: int = 0,
        guardian: Guardian | None = None,
        extra_env: dict[str, str] | None = None,
        host: str | None = None,
    ) -> None:
        self.config = config
        self.entrypoint = entrypoint
        self.run_id = run_id
        self.layout = layout
        self.table = table
        self.watchdog = watchdog
        self.spawner = spawner
        self.gpu_count = gpu_count
        self.guardian = guardian
        self.extra_env = dict(extra_env or {})
        self.host = host or socket.gethostname()
        self._workers: dict[int, Worker] = {}
        self._retired: list[Worker] = []  # replaced workers of this attempt, for the results
        self._pump = OutputPump()
        self._filtered: dict[str, IO[bytes]] = {}
        self._info: RendezvousInfo | None = None
        self._hang_timeout = 0.0  # the watchdog's heartbeat limit for every worker (0: off)
        self._attempt = -1
        self._restarts = 0

    # ---- reading ---------------------------------------------------------------------------

    @property
    def workers(self) -> list[Worker]:
        """The current workers, by local rank."""
        return [self._workers[r] for r in sorted(self._workers)]

    def get(self, local_rank: int) -> Worker | None:
        return self._workers.get(local_rank)

    def alive(self) -> list[Worker]:
        return [w for w in self.workers if not w.exited]

    @property
    def succeeded(self) -> bool:
        """Every worker of the attempt exited with 0."""
        return bool(self._workers) and all(
            w.state == WorkerState.SUCCEEDED for w in self._workers.values()
        )

    def beats(self) -> dict[int, elastic_core.SlotInfo]:
        """Each live worker's heartbeat slot, by local rank."""
        out = {}
        for w in self.alive():
            with contextlib.suppress(ValueError):  # the table closed meanwhile
                out[w.local_rank] = self.table.read(w.local_rank)
        return out

    def all_beating(self) -> bool:
        beats = self.beats()
        return (
            bool(self._workers)
            and len(beats) == len(self._workers)
            and all(b.last_beat_ns != 0 for b in beats.values())
        )

    def gpu_of(self, local_rank: int) -> int | None:
        return devices.nvml_index(local_rank, self.gpu_count)

    # ---- starting ----------------------------------------------------------------------------

    def start_all(self, info: RendezvousInfo, attempt: int, restarts: int) -> None:
        """Start every worker of `attempt`. On a spawn failure, raises :class:`SpawnError`
        with the workers started so far left running (the caller stops them)."""
        self.close()
        self._info, self._attempt, self._restarts = info, attempt, restarts
        self._workers, self._retired = {}, []
        os.makedirs(self.layout.attempt_dir(attempt), exist_ok=True)
        self.table.reset()
        for local_rank in range(self.config.nproc_per_node):
            self._start(local_rank, generation=0)

    def follow(self, info: RendezvousInfo) -> None:
        """A new round of the nodes while the workers keep running (the train loop forms
        its own groups): replacements start in it, and the workers' ranks are its own."""
        self._info = info
        for w in self._workers.values():
            w.rank = info.rank_offset + w.local_rank

    def replace(self, local_rank: int, grace: float | None = None) -> Worker:
        """Stop worker `local_rank` if it still runs (its signal, the grace period, SIGKILL)
        and start a new one in its place, with the same rank, environment and round; the
        other workers are not touched."""
        old = self._workers.get(local_rank)
        if old is None or self._info is None:
            raise KeyError(f"no worker with local rank {local_rank} in this attempt")
        if not old.exited:
            self._stop(
                [old], signal.SIGTERM, self.config.shutdown_timeout if grace is None else grace
            )
        self._release(old)
        self._retired.append(old)
        self.table.reset_slot(local_rank)
        return self._start(local_rank, generation=old.generation + 1)

    def _start(self, local_rank: int, generation: int) -> Worker:
        assert self._info is not None
        w = self._new_worker(local_rank, generation)
        try:
            request = SpawnRequest(
                local_rank, self._argv(w), self._env(w), *self._streams(w), call=self._call(w)
            )
            try:
                w.process = self.spawner.spawn(request)
            finally:
                for fd in (request.stdout, request.stderr):
                    if fd >= 0:
                        os.close(fd)  # a log file or a tee pipe: the worker has its own copy
        except Exception as e:
            for f in w._files:
                f.close()
            raise SpawnError(local_rank, e) from e
        w.started_ns = elastic_core.now_ns()
        self._workers[local_rank] = w
        if self.guardian is not None:
            self.guardian.watch_group(w.pid)
        self.watchdog.watch(
            local_rank,
            w.pid,
            self.table,
            slot=local_rank,
            hang_timeout=self._hang_timeout,
            gpu=self.gpu_of(local_rank),
        )
        w.process.watched()
        return w

    def _new_worker(self, local_rank: int, generation: int) -> Worker:
        """A worker's record and file paths, before anything is opened or started."""
        assert self._info is not None
        c = self.config
        rank_dir = self.layout.rank_dir(self._attempt, local_rank, generation)
        logs = []
        for which, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
            kept = (std_for(c.tee, local_rank) | std_for(c.redirects, local_rank)) & which
            logs.append(
                os.path.join(rank_dir, f"{name}.log") if kept and self.layout.keep_logs else None
            )
        return Worker(
            local_rank=local_rank,
            rank=self._info.rank_offset + local_rank,
            process=None,  # type: ignore[arg-type]  # set once started
            started_ns=0,
            rank_dir=rank_dir,
            error_file=os.path.join(rank_dir, "error.json"),
            loop_file=os.path.join(rank_dir, "train_loop"),
            stack_file=os.path.join(rank_dir, "stack.txt"),
            stdout_log=logs[0],
            stderr_log=logs[1],
            result_file=os.path.join(rank_dir, "return.pkl")
            if self.entrypoint.kind == Kind.FUNCTION
            else None,
            generation=generation,
        )

    def _env(self, w: Worker) -> dict[str, str]:
        assert self._info is not None
        c, info = self.config, self._info
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(
            compat.worker_env(
                local_rank=w.local_rank,
                rank=w.rank,
                group_rank=info.group_rank,
                role=c.role,
                local_world_size=c.nproc_per_node,
                world_size=info.world_size,
                group_world_size=info.group_world_size,
                master_addr=info.master_addr,
                master_port=info.master_port,
                restarts=self._restarts,
                max_restarts=c.max_restarts,
                run_id=self.run_id,
                signals_to_handle=c.signals_to_handle,
                error_file=w.error_file,
            )
        )
        env.update(
            {
                elastic_core.HEARTBEAT_FILE_ENV: self.table.path,
                elastic_core.HEARTBEAT_SLOT_ENV: str(w.local_rank),
                worker_main.STACK_FILE_ENV: w.stack_file,
                worker_main.PARENT_ENV: str(os.getpid()),
                "ELASTICRUN_ATTEMPT": str(self._attempt),
                "ELASTICRUN_ROUND": str(info.round),
                "ELASTICRUN_REPLACEMENT": str(w.generation),
                team.LOOP_FILE_ENV: w.loop_file,
                # SIGTERM -> SIGKILL: what a worker has to finish (elastic_sampler's saves).
                "ELASTICRUN_SHUTDOWN_TIMEOUT": f"{c.shutdown_timeout:g}",
            }
        )
        if c.virtual_local_rank:
            env.update(devices.single_device_env(w.local_rank))
            env["LOCAL_RANK"] = "0"
        return env

    def _argv(self, w: Worker) -> list[str]:
        spec = w.result_file + ".spec" if w.result_file is not None else None
        return self.entrypoint.worker_argv(w.local_rank, spec)

    def _call(self, w: Worker) -> worker_main.FunctionCall | None:
        if self.entrypoint.kind != Kind.FUNCTION:
            return None
        assert w.result_file is not None
        assert callable(self.entrypoint.target)
        return (self.entrypoint.target, self.entrypoint.fn_args, w.result_file)

    # ---- output ------------------------------------------------------------------------------

    def _streams(self, w: Worker) -> tuple[int, int]:
        """Where the worker's stdout and stderr go: file descriptors (a log file, or a pipe to
        the tee pump) the caller closes once the worker has them, KEEP or DEVNULL."""
        c = self.config
        shown = c.local_ranks_filter is None or w.local_rank in c.local_ranks_filter
        out_console, err_console = console_streams()
        prefix = compat.log_line_prefix(c.role, w.rank, w.local_rank, self.host)
        targets: list[int] = []
        for which, path, console, filters, name in (
            (Std.OUT, w.stdout_log, out_console, c.duplicate_stdout_filters, "stdout"),
            (Std.ERR, w.stderr_log, err_console, c.duplicate_stderr_filters, "stderr"),
        ):
            tee = bool(std_for(c.tee, w.local_rank) & which)
            if path is not None and tee:
                log = open(path, "ab")  # noqa: SIM115 - closed with the worker
                w._files.append(log)
                r, fd = os.pipe()
                filtered = self._filtered_file(name) if filters else None
                self._pump.add(r, log, console if shown else None, prefix, filtered, filters)
                targets.append(fd)
            elif path is not None:
                targets.append(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644))
            else:
                targets.append(worker_main.KEEP if shown else worker_main.DEVNULL)
        return targets[0], targets[1]

    def _filtered_file(self, name: str) -> IO[bytes]:
        f = self._filtered.get(name)
        if f is None:
            path = os.path.join(self.layout.attempt_dir(self._attempt), f"filtered_{name}.log")
            f = self._filtered[name] = open(path, "ab")  # noqa: SIM115 - closed by close()
        return f

    # ---- watching ------------------------------------------------------------------------------

    def next_event(self, timeout: float) -> WorkerEvent | None:
        """The watchdog's next finding about a live worker of this attempt (exits are recorded
        and reaped first); None if none came within `timeout`."""
        event = self.watchdog.poll(timeout=timeout)
        if event is None:
            return None
        w = self._workers.get(event.worker)
        if w is None or w.pid != event.pid or w.exited:
            return None  # about a worker that was replaced, or of an earlier attempt
        if event.kind == elastic_core.EventKind.EXITED:
            self._mark_exited(w, event)
            return WorkerEvent(Finding.EXITED, w, event.time_ns, event.detail)
        if event.kind == elastic_core.EventKind.HUNG:
            return WorkerEvent(Finding.HUNG, w, event.time_ns, event.detail)
        if event.kind == elastic_core.EventKind.GPU_UNHEALTHY:
            return WorkerEvent(Finding.GPU, w, event.time_ns, event.detail)
        return None

    def set_hang_timeout(self, seconds: float) -> None:
        """Every worker's heartbeat limit in the watchdog, now and for those started later
        (0: off)."""
        self._hang_timeout = seconds
        for w in self.alive():
            self.watchdog.set_hang_timeout(w.local_rank, seconds)

    def _mark_exited(self, w: Worker, event: Any = None) -> None:
        """Record an exit; end what the worker left in its process group (its unreaped zombie
        keeps the group id from being reused), then reap it."""
        w.process.signal_group(signal.SIGKILL)
        code, sig = w.process.reap(timeout=REAP_WAIT)
        if event is not None and (event.exit_code is not None or event.signal is not None):
            code, sig = event.exit_code, event.signal
        w.exit_code, w.signal = code, sig
        w.exited = True
        w.exited_ns = event.time_ns if event is not None else elastic_core.now_ns()
        if w.state == WorkerState.RUNNING:
            w.state = WorkerState.SUCCEEDED if code == 0 else WorkerState.FAILED
        if self.guardian is not None:
            self.guardian.forget_group(w.pid)

    def mark_failed(self, w: Worker) -> None:
        """The agent judged a live worker failed (hung, its GPU): it stays FAILED when it is
        stopped."""
        if w.state == WorkerState.RUNNING:
            w.state = WorkerState.FAILED

    # ---- stopping ------------------------------------------------------------------------------

    def stop_all(self, sig: int, grace: float, cancel: CancelToken = NEVER) -> list[Worker]:
        """The stop sequence: `sig` to every live worker's process group, up to `grace`
        seconds (cut short by a forced cancellation), then SIGKILL. Returns the workers that
        were running and were stopped (their state is STOPPED). A worker whose exit was seen
        before the signal went out (its event was still queued) ended on its own: it keeps its
        own state (SUCCEEDED or FAILED) and is not among them."""
        running = [w for w in self.alive() if w.state == WorkerState.RUNNING]
        sent_ns = elastic_core.now_ns()
        self._stop(self.alive(), sig, grace, cancel)
        stopped = []
        for w in running:
            if w.exited_ns is not None and w.exited_ns < sent_ns:
                continue
            w.state = WorkerState.STOPPED
            stopped.append(w)
        return stopped

    def _stop(
        self, targets: list[Worker], sig: int, grace: float, cancel: CancelToken = NEVER
    ) -> None:
        pending = {w.local_rank: w for w in targets if not w.exited}
        for w in pending.values():
            w.process.signal_group(sig)
            if sig != signal.SIGKILL:
                w.process.signal_group(signal.SIGCONT)  # a stopped worker acts on it too
        deadline = Deadline(grace)
        notice = Notice(
            lambda: (
                f"waiting for {len(pending)} worker(s) to stop after signal {int(sig)}: "
                + ", ".join(f"rank {w.rank} (pid {w.pid})" for w in pending.values())
                + f"; SIGKILL at {clock(deadline)} (--shutdown-timeout {grace:g} s)"
            ),
            logger.warning,
        )
        self._await_exits(pending, deadline, cancel, notice)
        if pending:
            for w in pending.values():
                w.process.signal_group(signal.SIGKILL)
            self._await_exits(pending, Deadline(KILL_WAIT), NEVER)
        for w in pending.values():  # the kernel never said: reap what can be reaped
            self._mark_exited(w)

    def _await_exits(
        self,
        pending: dict[int, Worker],
        deadline: Deadline,
        cancel: CancelToken,
        notice: Notice | None = None,
    ) -> None:
        while pending and not deadline.passed and not cancel.forced:
            if notice is not None:
                notice.check()
            event = self.watchdog.poll(timeout=deadline.left(0.05))
            if event is None or event.kind != elastic_core.EventKind.EXITED:
                continue
            w = pending.get(event.worker)
            if w is not None and w.pid == event.pid:
                self._mark_exited(w, event)
                del pending[event.worker]

    def _release(self, w: Worker) -> None:
        self.watchdog.unwatch(w.local_rank)
        for f in w._files:
            f.close()
        w._files = []

    def close(self) -> None:
        """End the attempt: kill every worker still running (whole process groups), reap them,
        stop watching, close the log files. Safe at any point, and twice."""
        for w in self._workers.values():
            if not w.exited:
                w.process.signal_group(signal.SIGKILL)
                if w.state == WorkerState.RUNNING:
                    w.state = WorkerState.STOPPED
                self._mark_exited(w)
            self.watchdog.unwatch(w.local_rank)
        if not self._pump.wait_drained(timeout=5.0):
            self._pump.drop_all()  # a grandchild still holds a pipe: stop reading it
        for w in self._workers.values():
            self._release(w)
        for f in self._filtered.values():
            f.close()
        self._filtered = {}

    def __enter__(self) -> WorkerGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- results and stacks ----------------------------------------------------------------------

    def return_values(self) -> dict[int, Any]:
        """A function entrypoint's return values by global rank (None for programs)."""
        values: dict[int, Any] = {}
        for w in self.workers:
            if w.result_file and os.path.exists(w.result_file):
                with open(w.result_file, "rb") as f:
                    values[w.rank] = pickle.load(f)
            else:
                values[w.rank] = None
        return values

    def dump_stacks(self, timeout: float, only: set[int] | None = None) -> dict[int, str]:
        """Ask every live Python worker (or those of local ranks `only`) for its threads'
        stacks (faulthandler); by local rank. Each stack is also appended to the worker's
        stderr log (or the console)."""
        if not self.entrypoint.is_python:
            return {}
        sizes: dict[int, int] = {}
        for w in self.alive():
            if only is not None and w.local_rank not in only:
                continue
            sizes[w.local_rank] = _size(w.stack_file)
            w.process.signal(worker_main.STACK_SIGNAL)
        previous = dict(sizes)
        pending = set(sizes)
        deadline = Deadline(timeout)
        last_growth = time.monotonic()
        while pending and not deadline.passed:
            time.sleep(0.02)
            for rank in list(pending):
                size = _size(self._workers[rank].stack_file)
                if size != previous[rank]:
                    previous[rank] = size
                    last_growth = time.monotonic()
                elif size > sizes[rank] and time.monotonic() - last_growth > 0.1:
                    pending.discard(rank)
        stacks: dict[int, str] = {}
        for rank, start in sizes.items():
            w = self._workers[rank]
            text = _read_from(w.stack_file, start)
            if text:
                stacks[rank] = text
                self._append_to_log(w, text)
        return stacks

    def _append_to_log(self, w: Worker, stack: str) -> None:
        header = f"elasticrun: Python stacks of rank {w.rank} (pid {w.pid}) before stopping it:\n"
        if w.stderr_log:
            with open(w.stderr_log, "a") as f:
                f.write(header + stack)
        else:
            prefix = compat.log_line_prefix(self.config.role, w.rank, w.local_rank, self.host)
            lines = (header + stack).splitlines()
            sys.stderr.write("".join(f"{prefix}{line}\n" for line in lines))
            sys.stderr.flush()


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
