"""How a worker of the group starts: its record and files, its environment (torchrun's
variables, the heartbeat slot, the stack and loop files), its arguments and its standard streams
(a log file, the tee pump, the console or nothing), then its process from the spawner.

One :class:`Startup` serves a group for the whole launch; :meth:`Startup.begin` sets the round
and attempt its workers start in (:meth:`Startup.follow` a new round of the nodes that the
running workers keep), and it owns what outlives one worker: the tee pump and the filtered logs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import IO

import elastic_core

from elastic_launch import compat, learned, spare, untrusted
from elastic_launch.agent import devices
from elastic_launch.agent.context import NodeContext
from elastic_launch.agent.worker import SpawnError, Worker
from elastic_launch.api import Std, std_for
from elastic_launch.processes import worker_main
from elastic_launch.processes.entrypoint import Kind
from elastic_launch.processes.logs import OutputPump, console_streams
from elastic_launch.processes.spawn import Spawner, SpawnRequest
from elastic_launch.rendezvous import team
from elastic_launch.rendezvous.api import RendezvousInfo

logger = logging.getLogger(__name__)


class Startup:
    """Starts the workers of one launch (see the module's docstring)."""

    def __init__(
        self,
        context: NodeContext,
        heartbeat_path: Callable[[int], str],
        extra_env: dict[str, str],
    ) -> None:
        self.config = context.config
        self.entrypoint = context.entrypoint
        self.run_id = context.run_id
        self.layout = context.layout
        self.heartbeat_path = heartbeat_path  # by local rank
        self.extra_env = dict(extra_env)
        self.host = context.host
        self.info: RendezvousInfo | None = None
        self.attempt = -1
        self.restarts = 0
        self._pump = OutputPump()
        self._filtered: dict[str, IO[bytes]] = {}

    def begin(self, info: RendezvousInfo, attempt: int, restarts: int) -> None:
        """Workers from now on start in round `info`, as attempt `attempt`."""
        self.info, self.attempt, self.restarts = info, attempt, restarts
        try:
            self.layout.make_attempt_dir(attempt)
        except OSError as e:
            raise SpawnError(0, e) from e

    def follow(self, info: RendezvousInfo) -> None:
        """A new round of the nodes that the running workers keep: replacements start in it."""
        self.info = info

    def start(
        self, local_rank: int, generation: int, spawner: Spawner, hot_spare: bool = False
    ) -> Worker:
        """Start worker `local_rank` (the `generation`-th of its rank in this attempt), as a
        hot spare if `hot_spare` or its local rank is beyond the workers'; raises
        :class:`SpawnError` when it cannot be started."""
        try:
            w = self._record(local_rank, generation)
        except OSError as e:  # its directory cannot be made
            raise SpawnError(local_rank, e) from e
        w.hot_spare = hot_spare or w.rank < 0
        try:
            out, err = self._streams(w)
            try:
                argv, env = self._argv(w), self._env(w)
                request = SpawnRequest(local_rank, argv, env, out, err, call=self._call(w))
                w.process = spawner.spawn(request)
            finally:
                for fd in (out, err):
                    if fd >= 0:
                        os.close(fd)  # a log file or a tee pipe: the worker has its own copy
        except Exception as e:
            for f in w._files:
                f.close()
            raise SpawnError(local_rank, e) from e
        w.started_ns = elastic_core.now_ns()
        return w

    def close(self) -> None:
        """The attempt is over: drain the tee pump, close the filtered logs."""
        if not self._pump.wait_drained(timeout=5.0):
            self._pump.drop_all()  # a grandchild still holds a pipe: stop reading it
        for f in self._filtered.values():
            f.close()
        self._filtered = {}

    def _record(self, local_rank: int, generation: int) -> Worker:
        """A worker's record and file paths, before anything is opened or started."""
        assert self.info is not None
        c = self.config
        rank_dir = self.layout.rank_dir(self.attempt, local_rank, generation)
        logs = []
        for which, name in ((Std.OUT, "stdout"), (Std.ERR, "stderr")):
            kept = (std_for(c.tee, local_rank) | std_for(c.redirects, local_rank)) & which
            logs.append(
                os.path.join(rank_dir, f"{name}.log") if kept and self.layout.keep_logs else None
            )
        function = self.entrypoint.kind == Kind.FUNCTION
        return Worker(
            local_rank=local_rank,
            rank=self.rank_of(local_rank),
            process=None,  # type: ignore[arg-type]  # set once started
            started_ns=0,
            rank_dir=rank_dir,
            error_file=os.path.join(rank_dir, "error.json"),
            loop_file=os.path.join(rank_dir, "train_loop"),
            stack_file=os.path.join(rank_dir, "stack.txt"),
            stdout_log=logs[0],
            stderr_log=logs[1],
            result_file=os.path.join(rank_dir, "return.pkl") if function else None,
            generation=generation,
        )

    def rank_of(self, local_rank: int) -> int:
        """The global rank of worker `local_rank` in the current round; -1 for a hot spare
        (a local rank beyond ``--nproc-per-node``), which has none until it is admitted."""
        assert self.info is not None
        if local_rank >= self.config.nproc_per_node:
            return -1
        return self.info.rank_offset + local_rank

    def _env(self, w: Worker) -> dict[str, str]:
        assert self.info is not None
        c, info = self.config, self.info
        env = dict(os.environ)
        env.update(self.extra_env)
        env.update(
            compat.worker_env(
                compat.WorkerPlace(
                    local_rank=w.local_rank,
                    rank=w.rank,
                    group_rank=info.group_rank,
                    local_world_size=c.nproc_per_node,
                    world_size=info.world_size,
                    group_world_size=info.group_world_size,
                    role=c.role,
                    role_rank=None
                    if info.role_rank_offset is None or w.rank < 0
                    else info.role_rank_offset + w.local_rank,
                    role_world_size=info.role_world_size,
                ),
                compat.GroupVars(
                    master_addr=info.master_addr,
                    master_port=info.master_port,
                    restarts=self.restarts,
                    max_restarts=c.max_restarts,
                    run_id=self.run_id,
                    signals_to_handle=c.signals_to_handle,
                ),
                w.error_file,
            )
        )
        env.update(
            {
                elastic_core.HEARTBEAT_FILE_ENV: self.heartbeat_path(w.local_rank),
                elastic_core.HEARTBEAT_SLOT_ENV: "0",
                worker_main.STACK_FILE_ENV: w.stack_file,
                worker_main.PARENT_ENV: str(os.getpid()),
                "ELASTICRUN_ATTEMPT": str(self.attempt),
                "ELASTICRUN_ROUND": str(info.round),
                "ELASTICRUN_REPLACEMENT": str(w.generation),
                team.LOOP_FILE_ENV: w.loop_file,
                learned.IMPORTS_FILE_ENV: learned.imports_file(w.rank_dir),
                # SIGTERM -> SIGKILL: what a worker has to finish (elastic_sampler's saves).
                "ELASTICRUN_SHUTDOWN_TIMEOUT": f"{c.shutdown_timeout:g}",
            }
        )
        env.pop(spare.HOT_SPARE_ENV, None)
        if w.hot_spare:
            env[spare.HOT_SPARE_ENV] = "1"
            env[spare.LEARNED_FILE_ENV] = os.path.join(self.layout.run_dir, learned.NODE_FILE)
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
                log = os.fdopen(self._open_log(path), "ab")
                w._files.append(log)
                r, fd = os.pipe()
                filtered = self._filtered_file(name) if filters else None
                self._pump.add(r, log, console if shown else None, prefix, filtered, filters)
                targets.append(fd)
            elif path is not None:
                targets.append(self._open_log(path))
            else:
                targets.append(worker_main.KEEP if shown else worker_main.DEVNULL)
        return targets[0], targets[1]

    def _filtered_file(self, name: str) -> IO[bytes]:
        f = self._filtered.get(name)
        if f is None:
            path = os.path.join(self.layout.attempt_dir(self.attempt), f"filtered_{name}.log")
            f = self._filtered[name] = os.fdopen(self._open_log(path), "ab")
        return f

    @staticmethod
    def _open_log(path: str) -> int:
        """A log to append to. A worker may have left something else at its path (a FIFO
        would block the launcher's open): that is moved aside, and said."""
        fd, moved = untrusted.open_log(path)
        for what in moved:
            logger.warning("a worker left %s: the log is made anew", what)
        return fd
