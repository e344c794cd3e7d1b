"""The elastic agent: one per node. Rendezvous, start the workers, watch them, restart them.

The agent never imports torch: it is elastic_core (heartbeats, the pidfd watchdog, NVML) plus
the standard library, so that launching and restarting cost as little as the workers allow.
"""

from __future__ import annotations

import enum
import logging
import os
import pickle
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import elastic_core

from elastic_launch.api import (
    FailureKind,
    LaunchConfig,
    RunResult,
    RunState,
    WorkerFailure,
)
from elastic_launch.config import random_id
from elastic_launch.errors import read_error_file
from elastic_launch.events import Events
from elastic_launch.hang import StepIntervalLearner
from elastic_launch.logs import LogLayout
from elastic_launch.rendezvous.api import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
)
from elastic_launch.workers import Entrypoint, Worker, WorkerGroup

if TYPE_CHECKING:
    from elastic_launch.zygote import Zygote

logger = logging.getLogger(__name__)

_KILL_WAIT = 10.0  # after SIGKILL, how long to wait for the kernel to report the exits
_ZYGOTE_START_TIMEOUT = 300.0


class _Outcome(enum.Enum):
    SUCCEEDED = 1
    FAILED = 2
    SIGNALED = 3
    MEMBERSHIP = 4  # nodes came or went: restart without counting it


class ElasticAgent:
    """Runs one node's share of a job until it succeeds, fails for good, or is stopped."""

    def __init__(
        self,
        config: LaunchConfig,
        entrypoint: Entrypoint,
        rendezvous: RendezvousHandler,
        events: Events,
        run_id: str,
    ) -> None:
        self.config = config
        self.entrypoint = entrypoint
        self.rdzv = rendezvous
        self.events = events
        self.run_id = run_id
        self.host = socket.gethostname()
        self.layout = LogLayout(config.log_dir, run_id)
        self.state = "starting"
        self.attempt = -1
        self.restarts = 0
        self.failures: list[WorkerFailure] = []
        self._signal: int | None = None
        self._force = False
        self._lock = threading.Lock()
        self.learner = StepIntervalLearner(config.hang_timeout_floor, config.hang_timeout_factor)
        self._hang_timeout_set: float | None = None
        self.table = elastic_core.HeartbeatTable.create(
            f"/dev/shm/elasticrun-{os.getpid()}-{os.urandom(4).hex()}", config.nproc_per_node
        )
        self.zygote: Zygote | None = None
        self._file_timer: Any = None
        try:
            self.gpu = self._open_gpu()
            self.watchdog = elastic_core.Watchdog(
                default_hang_timeout=0.0,
                gpu=self.gpu,
                gpu_check_interval=config.gpu_check_interval if self.gpu is not None else 0.0,
            )
            self.group = WorkerGroup(
                config, entrypoint, run_id, self.layout, self.table, self.watchdog, None
            )
            if self.gpu is not None:
                self.group.gpu_count = self.gpu.device_count
            self.zygote = self._start_zygote()
            self._file_timer = self._start_file_timer()
        except BaseException:
            self.close()
            raise

    # ---- set-up ----------------------------------------------------------------------------

    def _open_gpu(self) -> elastic_core.GpuHealth | None:
        if self.config.gpu_check_interval <= 0:
            return None
        gpu = elastic_core.GpuHealth(timeout=5.0)
        if gpu.state != elastic_core.GpuState.HEALTHY:
            logger.debug("GPU checks off: %s", gpu.detail)
            return None
        return gpu

    def _start_zygote(self) -> Zygote | None:
        c = self.config
        wants_fork = c.preload or (
            self.entrypoint.kind in ("script", "module")
            and c.start_method in ("fork", "forkserver")
        )
        if self.entrypoint.kind == "function" and c.start_method == "forkserver":
            wants_fork = True
        if not wants_fork or not self.entrypoint.is_python:
            return None
        from elastic_launch.zygote import Zygote

        return Zygote(c.preload)

    def _zygote_if_ready(self) -> Zygote | None:
        """The zygote, once its imports are done (waiting for them costs no more than a fresh
        interpreter would); None, with a warning, if it failed."""
        z = self.zygote
        if z is None:
            return None
        deadline = time.monotonic() + _ZYGOTE_START_TIMEOUT
        while not z.wait_ready(0.1) and time.monotonic() < deadline and not z.dead:
            if self._signal is not None:
                return None  # the monitor loop handles the signal at once
        if not z.ready:
            logger.warning("the --preload zygote did not start; spawning fresh interpreters")
            self.zygote = None
            z.close()
            return None
        if z.failed:
            for name, error in z.failed.items():
                logger.warning("--preload: importing '%s' failed in the zygote: %s", name, error)
            z.failed = {}
        return z

    def _start_file_timer(self) -> Any:
        """torch's file timer (TORCHELASTIC_ENABLE_FILE_TIMER=1), for scripts that use
        ``expires()``; it is the only thing that makes the agent import torch."""
        if os.environ.get("TORCHELASTIC_ENABLE_FILE_TIMER") != "1":
            return None
        from torch.distributed.elastic.timer.file_based_local_timer import FileTimerServer

        path = os.environ.get("TORCHELASTIC_TIMER_FILE") or os.path.join(
            self.layout.run_dir, f"watchdog_timer_{random_id()}"
        )
        server = FileTimerServer(path, self.run_id, max_interval=0.1, daemon=True)
        server.start()
        self.group.extra_env["TORCHELASTIC_TIMER_FILE"] = path
        return server

    # ---- state for /healthz --------------------------------------------------------------------

    def health(self) -> dict[str, Any]:
        workers = []
        now = elastic_core.now_ns()
        for w in list(self.group.workers):
            try:
                info = self.table.read(w.local_rank)
            except ValueError:  # closed while we looked
                info = None
            workers.append(
                {
                    "rank": w.rank,
                    "local_rank": w.local_rank,
                    "pid": w.pid,
                    "running": not w.exited,
                    "exit_code": w.exit_code,
                    "step": info.step if info else None,
                    "seconds_since_beat": (now - info.last_beat_ns) / 1e9
                    if info and info.last_beat_ns
                    else None,
                }
            )
        return {
            "state": self.state,
            "run_id": self.run_id,
            "host": self.host,
            "attempt": self.attempt,
            "restarts": self.restarts,
            "max_restarts": self.config.max_restarts,
            "hang_timeout": self._hang_timeout_set,
            "workers": workers,
        }

    # ---- signals -------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._signal is not None:
            self._force = True  # a second signal: no more grace
        else:
            self._signal = signum

    def _install_signals(self) -> dict[int, Any]:
        previous: dict[int, Any] = {}
        if threading.current_thread() is not threading.main_thread():
            return previous
        from elastic_launch.config import parse_signals

        for sig in parse_signals(self.config.signals_to_handle):
            previous[sig] = signal.signal(sig, self._on_signal)
        return previous

    # ---- the main loop -------------------------------------------------------------------------

    def run(self) -> RunResult:
        previous = self._install_signals()
        self.watchdog.start()
        self.events.emit(
            "job_started",
            0,
            nproc_per_node=self.config.nproc_per_node,
            entrypoint=self.entrypoint.name,
            host=self.host,
            log_dir=self.layout.run_dir,
        )
        try:
            return self._run()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            if self.group.alive():  # an exception got here: never leave workers running
                self.group.signal_all(signal.SIGKILL)
                self.group.close()
            self.close()

    def _run(self) -> RunResult:
        detected_ns: int | None = None
        reason = "start"
        while True:
            joined_at = time.time()
            try:
                info = self.rdzv.next_rendezvous(reason)
            except RendezvousClosedError as e:
                return self._closed(e)
            self.events.emit(
                "rendezvous_done",
                self.attempt + 1,
                round=info.round,
                nodes=info.group_world_size,
                group_rank=info.group_rank,
                joined_at=joined_at,
                formed_at=time.time(),
                store_requests=getattr(getattr(self.rdzv, "store", None), "requests", None),
            )
            self.attempt += 1
            self.restarts = info.restart_count
            if reason == "failure":
                logger.warning(
                    "restarting the workers (restart %d of %d) after: %s",
                    self.restarts,
                    self.config.max_restarts,
                    self._root_line(),
                )
            elif reason == "membership":
                logger.warning(
                    "restarting the workers: the job now has %d node(s), %d worker(s); this "
                    "node is group rank %d",
                    info.group_world_size,
                    info.world_size,
                    info.group_rank,
                )
            self.failures = []
            self.learner.reset()
            self._hang_timeout_set = None
            t0 = elastic_core.now_ns()
            self.group.spawner = self._zygote_if_ready()
            if self._gpus_unusable(info):
                self.state = "failed"
                self.events.emit("job_failed", self.attempt, restarts=self.restarts)
                self.rdzv.set_closed(f"failed: an unusable GPU on {self.host}")
                return self._result(RunState.FAILED)
            try:
                self.group.start(info, self.attempt, self.restarts)
            except Exception as e:  # could not start a worker: a failure like any other
                self._spawn_failed(e, info)
                outcome = _Outcome.FAILED
            else:
                started = elastic_core.now_ns()
                self.state = "running"
                self.events.emit(
                    "group_started",
                    self.attempt,
                    workers=len(self.group.workers),
                    world_size=info.world_size,
                    nodes=info.group_world_size,
                    group_rank=info.group_rank,
                    restarts=self.restarts,
                    spawn_seconds=(started - t0) / 1e9,
                    forked=self.group.spawner is not None,
                )
                if detected_ns is not None:
                    self.events.emit(
                        "group_restarted",
                        self.attempt,
                        restarts=self.restarts,
                        reason=reason,
                        recovery_seconds=(started - detected_ns) / 1e9,
                    )
                outcome = self._monitor(info)
            if outcome == _Outcome.SUCCEEDED:
                self.state = "succeeded"
                self.group.close()
                values = self._return_values()
                self.rdzv.mark_done()
                self.events.emit("job_succeeded", self.attempt, restarts=self.restarts)
                return self._result(RunState.SUCCEEDED, values)
            if outcome == _Outcome.SIGNALED:
                assert self._signal is not None
                self.state = "stopping"
                self._stop_group(self._signal)
                self.state = "stopped"
                self.events.emit("job_stopped", self.attempt, signal=self._signal)
                return self._result(RunState.STOPPED, signal=self._signal)
            if outcome == _Outcome.MEMBERSHIP:
                detected_ns = elastic_core.now_ns()
                self.events.emit(
                    "membership_changed", self.attempt, waiting=self.rdzv.num_nodes_waiting()
                )
                reason = "membership"
            else:
                detected_ns = min(f.time_ns for f in self.failures) if self.failures else None
                reason = "failure"
            self.state = "restarting"
            self._stop_group(signal.SIGTERM)
            if self._signal is not None:
                self.state = "stopped"
                self.events.emit("job_stopped", self.attempt, signal=self._signal)
                return self._result(RunState.STOPPED, signal=self._signal)
            if reason == "failure" and self.restarts >= self.config.max_restarts:
                self.state = "failed"
                self.events.emit("job_failed", self.attempt, restarts=self.restarts)
                why = (
                    f"failed: restarts exhausted ({self.config.max_restarts}); root cause on "
                    f"{self.host}: {self._root_line()}"
                )
                self.rdzv.set_closed(why)  # (a no-op if another node closed it first)
                result = self._result(RunState.FAILED)
                result.message = f"the job {why}"
                return result

    def _closed(self, error: RendezvousClosedError) -> RunResult:
        """The job was closed (by another node, or by the budget): stop as it says."""
        reason = getattr(self.rdzv, "closed_reason", lambda: None)() or str(error)
        if reason == "succeeded":
            self.state = "succeeded"
            self.events.emit("job_succeeded", self.attempt, restarts=self.restarts)
            return self._result(RunState.SUCCEEDED)
        self.state = "failed"
        self.events.emit("job_failed", self.attempt, restarts=self.restarts, reason=reason)
        result = self._result(RunState.FAILED)
        result.message = f"the job was closed: {reason}"
        return result

    def _root_line(self) -> str:
        from elastic_launch.summary import describe

        own = [f for f in self.failures if f.kind != FailureKind.STOPPED]
        if not own:
            return "unknown failure"
        f = min(own, key=lambda f: f.time_ns)
        return f"rank {f.rank} {describe(f)}"

    def _monitor(self, info: RendezvousInfo) -> _Outcome:
        c = self.config
        ready = False
        while True:
            if self._signal is not None:
                return _Outcome.SIGNALED
            if self.rdzv.membership_changed():
                return _Outcome.MEMBERSHIP
            event = self.watchdog.poll(timeout=c.monitor_interval)
            if event is not None:
                outcome = self._on_event(event)
                if outcome is not None:
                    return outcome
            self._learn_hang_timeout()
            if not ready and self._all_beating():
                ready = True
                self.events.emit(
                    "group_ready",
                    self.attempt,
                    seconds=(elastic_core.now_ns() - self.group.workers[0].started_ns) / 1e9,
                )

    def _on_event(self, event: elastic_core.Event) -> _Outcome | None:
        w = self.group.by_local_rank(event.worker)
        if w is None or w.pid != event.pid or w.exited:
            return None  # about a worker of an earlier attempt
        if event.kind == elastic_core.EventKind.EXITED:
            self.group.mark_exited(w, event)
            if w.exit_code == 0:
                if all(x.exited and x.exit_code == 0 for x in self.group.workers):
                    return _Outcome.SUCCEEDED
                return None
            kind = FailureKind.SIGNAL if w.signal is not None else FailureKind.EXIT_CODE
            self._record_failure(w, kind, event)
            return _Outcome.FAILED
        if event.kind == elastic_core.EventKind.HUNG:
            failure = self._record_failure(w, FailureKind.HUNG, event)
            stacks = self.group.dump_stacks(self.config.stack_dump_timeout)
            failure.stack = stacks.get(w.local_rank, "(no Python stack: the worker did not answer)")
            return _Outcome.FAILED
        if event.kind == elastic_core.EventKind.GPU_UNHEALTHY:
            self._record_failure(w, FailureKind.GPU, event)
            return _Outcome.FAILED
        return None

    def _failure(
        self,
        kind: FailureKind,
        rank: int,
        local_rank: int,
        pid: int = 0,
        time_ns: int | None = None,
        **details: Any,
    ) -> WorkerFailure:
        """A failure of this attempt on this host, seen at `time_ns` (default: now)."""
        now = elastic_core.now_ns()
        seen = now if time_ns is None else time_ns
        return WorkerFailure(
            kind=kind,
            rank=rank,
            local_rank=local_rank,
            pid=pid,
            attempt=self.attempt,
            host=self.host,
            time_ns=seen,
            wall_time=time.time() - (now - seen) / 1e9,
            **details,
        )

    def _record_failure(
        self, w: Worker, kind: FailureKind, event: elastic_core.Event | None
    ) -> WorkerFailure:
        now_ns = event.time_ns if event is not None else elastic_core.now_ns()
        failure = self._failure(
            kind,
            w.rank,
            w.local_rank,
            w.pid,
            now_ns,
            exit_code=w.exit_code,
            signal=w.signal,
            detail=event.detail if event is not None else "",
            error_file=w.error_file if os.path.exists(w.error_file) else "",
            stdout_log=w.stdout_log,
            stderr_log=w.stderr_log,
        )
        data = read_error_file(w.error_file)
        if data is not None:
            failure.message = data.message
            failure.traceback = data.traceback
            failure.failed_at_ns = data.monotonic_ns
        detection: float | None = None
        if kind == FailureKind.HUNG and event is not None:
            info = self.table.read(w.local_rank)
            failure.failed_at_ns = info.last_beat_ns
        if failure.failed_at_ns:
            detection = max(0.0, (now_ns - failure.failed_at_ns) / 1e9)
        self.failures.append(failure)
        self.events.emit(
            "worker_failed",
            self.attempt,
            rank=w.rank,
            local_rank=w.local_rank,
            kind=kind.value,
            exit_code=w.exit_code,
            signal=w.signal,
            detection_seconds=detection,
            detail=failure.detail,
        )
        return failure

    def _spawn_failed(self, error: Exception, info: RendezvousInfo) -> None:
        local_rank = len(self.group.workers)
        self.failures.append(
            self._failure(
                FailureKind.SPAWN,
                info.rank_offset + local_rank,
                local_rank,
                detail=f"{type(error).__name__}: {error}",
            )
        )
        self.events.emit(
            "worker_failed", self.attempt, local_rank=local_rank, kind="spawn", detail=str(error)
        )

    def _gpus_unusable(self, info: RendezvousInfo) -> bool:
        """Before (re)starting: a GPU a worker would use is unhealthy (a lost GPU or a
        critical XID needs a reset); starting on it again cannot succeed."""
        if self.gpu is None:
            return False
        reports = {r.device: r for r in self.gpu.check_all(timeout=5.0)}
        for local_rank in range(self.config.nproc_per_node):
            device = self.group.gpu_of(local_rank)
            report = reports.get(device) if device is not None else None
            if report is None or report.state != elastic_core.GpuState.UNHEALTHY:
                continue
            self.failures.append(
                self._failure(
                    FailureKind.GPU,
                    info.rank_offset + local_rank,
                    local_rank,
                    detail=f"before starting attempt {self.attempt}: {report.detail}",
                )
            )
            return True
        return False

    def _all_beating(self) -> bool:
        return bool(self.group.workers) and all(
            self.table.read(w.local_rank).last_beat_ns != 0 for w in self.group.workers
        )

    def _learn_hang_timeout(self) -> None:
        """Fixed --hang-timeout, or learned from the step interval (automatic mode)."""
        c = self.config
        if c.hang_timeout is not None:
            timeout = c.hang_timeout
        else:
            for w in self.group.alive():
                info = self.table.read(w.local_rank)
                self.learner.observe(w.local_rank, info.step, info.last_beat_ns)
            timeout = self.learner.timeout()
        if timeout == float("inf"):
            timeout = 0.0  # off
        if self._hang_timeout_set is None or abs(timeout - self._hang_timeout_set) > max(
            0.1 * self._hang_timeout_set, 0.001
        ):
            for w in self.group.alive():
                self.watchdog.set_hang_timeout(w.local_rank, timeout)
            self._hang_timeout_set = timeout

    # ---- stopping ------------------------------------------------------------------------------

    def _stop_group(self, sig: int) -> None:
        """The stop sequence: `sig` to every process group, the grace period, then SIGKILL."""
        t0 = elastic_core.now_ns()
        failed_ranks = {f.local_rank for f in self.failures}
        alive_before = {w.local_rank for w in self.group.alive()}
        self.group.signal_all(sig)
        self._await_exits(self.config.shutdown_timeout)
        if self.group.alive():
            self.group.signal_all(signal.SIGKILL)
            self._await_exits(_KILL_WAIT, force_ok=False)
        self.group.close()
        for w in self.group.workers:
            if w.local_rank in alive_before and w.local_rank not in failed_ranks:
                how = "SIGKILL" if w.signal == signal.SIGKILL else signal.Signals(sig).name
                self.failures.append(
                    self._failure(
                        FailureKind.STOPPED,
                        w.rank,
                        w.local_rank,
                        w.pid,
                        exit_code=w.exit_code,
                        signal=w.signal,
                        detail=how,
                    )
                )
        self.events.emit(
            "group_stopped", self.attempt, stop_seconds=(elastic_core.now_ns() - t0) / 1e9
        )

    def _await_exits(self, timeout: float, force_ok: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while self.group.alive():
            left = deadline - time.monotonic()
            if left <= 0 or (force_ok and self._force):
                return
            event = self.watchdog.poll(timeout=min(left, 0.05))
            if event is not None and event.kind == elastic_core.EventKind.EXITED:
                w = self.group.by_local_rank(event.worker)
                if w is not None and w.pid == event.pid and not w.exited:
                    self.group.mark_exited(w, event)

    # ---- results and clean-up ------------------------------------------------------------------

    def _return_values(self) -> dict[int, Any]:
        values: dict[int, Any] = {}
        for w in self.group.workers:
            if w.result_file and os.path.exists(w.result_file):
                with open(w.result_file, "rb") as f:
                    values[w.rank] = pickle.load(f)
            else:
                values[w.rank] = None
        return values

    def _result(
        self, state: RunState, values: dict[int, Any] | None = None, signal: int | None = None
    ) -> RunResult:
        return RunResult(
            state=state,
            return_values=values or {},
            failures=list(self.failures),
            attempts=self.attempt + 1,
            restarts=self.restarts,
            signal=signal,
            log_dir=self.layout.run_dir if self.layout.keep_logs else None,
        )

    def close(self) -> None:
        """Release everything the agent holds; safe after a partial set-up, and twice."""
        if getattr(self, "watchdog", None) is not None:
            self.watchdog.close()
        if self.zygote is not None:
            self.zygote.close()
            self.zygote = None
        if self._file_timer is not None:
            self._file_timer.stop()
            self._file_timer = None
        self.table.close()
        self.rdzv.shutdown()
        self.layout.cleanup()
