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

import logging
import os
import pickle
import signal
import sys
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import elastic_core

from elastic_launch import compat, untrusted
from elastic_launch.agent import devices
from elastic_launch.agent.context import NodeContext
from elastic_launch.agent.decide import Happening, Loop
from elastic_launch.agent.startup import Startup
from elastic_launch.agent.watch import Monitors
from elastic_launch.agent.worker import (
    Happened,
    SpawnError,
    Stopped,
    UnusableGpu,
    Watcher,
    Worker,
)
from elastic_launch.api import WorkerState
from elastic_launch.cancel import NEVER, CancelToken, Deadline, Notice, clock
from elastic_launch.processes import worker_main
from elastic_launch.processes.spawn import Spawner
from elastic_launch.rendezvous.api import RendezvousInfo

if TYPE_CHECKING:
    from elastic_launch.processes.fence import FenceWriter
    from elastic_launch.processes.guardian import Guardian

logger = logging.getLogger(__name__)

KILL_WAIT = 10.0  # after SIGKILL, how long to wait for the kernel to report the exits
REAP_WAIT = 5.0


class WorkerGroup:
    """The workers of one node, one attempt at a time."""

    def __init__(
        self,
        context: NodeContext,
        watch: Monitors,
        spawner: Spawner,
        guardian: Guardian | None = None,
        extra_env: dict[str, str] | None = None,
        fence: FenceWriter | None = None,
    ) -> None:
        self.context = context
        self.config = context.config
        self.entrypoint = context.entrypoint
        self.heartbeats = watch.heartbeats
        self.watchdog = watch.watchdog
        self.gpu = watch.gpu
        self.gpu_count = watch.gpu_count
        self.spawner = spawner
        self.guardian = guardian
        self.host = context.host
        self.startup = Startup(context, self.heartbeats.path, extra_env or {})
        self._fence = fence  # written before a worker starts: it holds a rank from its start
        self._workers: dict[int, Worker] = {}
        self._retired: list[Worker] = []  # replaced workers of this attempt, for the results
        self._generations: dict[int, int] = {}  # the next generation of a place left empty
        self._hang_timeout = 0.0  # the watchdog's heartbeat limit for every worker (0: off)

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
            slot = self.heartbeats.read(w.local_rank)
            if slot is not None:
                out[w.local_rank] = slot
        return out

    def health(self) -> list[dict[str, Any]]:
        """Each worker as ``/healthz`` shows it."""
        now = elastic_core.now_ns()
        beats = self.beats()
        out = []
        for w in self.workers:
            b = beats.get(w.local_rank)
            quiet = (now - b.last_beat_ns) / 1e9 if b and b.last_beat_ns else None
            out.append(
                {
                    "rank": w.rank,
                    "local_rank": w.local_rank,
                    "pid": w.pid,
                    "state": w.state.value,
                    "running": not w.exited,
                    "exit_code": w.exit_code,
                    "step": b.step if b else None,
                    "seconds_since_beat": quiet,
                }
            )
        return out

    @staticmethod
    def _training(workers: Iterable[Worker]) -> list[Worker]:
        """`workers`, those waiting for a round of the train loop aside."""
        return [w for w in workers if w.train_loop() != Loop.WAITING]

    def all_beating(self) -> bool:
        """Whether every worker has beaten, hot spares waiting aside."""
        beats = self.beats()
        training = self._training(self._workers.values())
        return bool(training) and all(
            w.local_rank in beats and beats[w.local_rank].last_beat_ns != 0 for w in training
        )

    def steps(self) -> dict[int, int]:
        """Each live worker's step (its beats' count), by local rank."""
        return {local_rank: b.step for local_rank, b in self.beats().items()}

    def all_stepped_past(self, steps: dict[int, int]) -> bool:
        """Whether every worker that trains has made a step past `steps` (by local rank; a
        worker not in it, past 0), hot spares waiting aside."""
        now = self.steps()
        training = self._training(self.alive())
        return bool(training) and all(
            now.get(w.local_rank, 0) > steps.get(w.local_rank, 0) for w in training
        )

    def hot_spares(self) -> list[Worker]:
        """The hot spares that wait in the train loop's rendezvous for a round to take them:
        started as spares, never stepped (a spare a round took, and any other worker, waits
        between rounds only as a member the round needs; a wait's own beat is no step)."""
        steps = self.steps()
        return [
            w
            for w in self.alive()
            if w.hot_spare and w.train_loop() == Loop.WAITING and steps.get(w.local_rank, 0) == 0
        ]

    def gpu_of(self, local_rank: int) -> int | None:
        return devices.nvml_index(local_rank, self.gpu_count)

    def in_train_loop(self) -> bool:
        """Whether the workers run the train loop (one said so: the script is the same for
        all), so that a dead one is replaced alone."""
        return any(w.train_loop() != Loop.NONE for w in self.workers)

    # ---- starting ----------------------------------------------------------------------------

    def start_all(self, info: RendezvousInfo, attempt: int, restarts: int) -> None:
        """Start every worker of `attempt`. Raises :class:`UnusableGpu` before starting any
        when a GPU a worker would use needs a reset, and :class:`SpawnError` on a spawn
        failure, with the workers started so far left running (the caller stops them)."""
        self._check_gpus(attempt)
        self.close()
        self.startup.begin(info, attempt, restarts)
        self._workers, self._retired, self._generations = {}, [], {}
        self.heartbeats.reset()
        for local_rank in range(self.config.nproc_per_node):
            self._start(local_rank, generation=0)

    def _check_gpus(self, attempt: int) -> None:
        if self.gpu is None:
            return
        reports = {r.device: r for r in self.gpu.check_all(timeout=5.0)}
        for local_rank in range(self.config.nproc_per_node):
            device = self.gpu_of(local_rank)
            report = reports.get(device) if device is not None else None
            if report is not None and report.state == elastic_core.GpuState.UNHEALTHY:
                raise UnusableGpu(local_rank, f"before starting attempt {attempt}: {report.detail}")

    def follow(self, info: RendezvousInfo) -> None:
        """A new round of the nodes while the workers keep running (the train loop forms
        its own groups): replacements start in it, and the workers' ranks are its own."""
        self.startup.follow(info)
        for w in self._workers.values():
            w.rank = self.startup.rank_of(w.local_rank)

    def fill(self, spares: int) -> list[Worker]:
        """Start a hot spare in every empty place among the workers' and `spares` more (local
        ranks from ``nproc_per_node`` on: rank -1, they have none until a round takes them).
        Raises :class:`SpawnError` as :meth:`start_all` does."""
        return [
            self._start(local_rank, self._generations.get(local_rank, 0), hot_spare=True)
            for local_rank in range(self.config.nproc_per_node + spares)
            if local_rank not in self._workers
        ]

    def replace(self, local_rank: int, hot_spare: bool = False) -> Worker:
        """Stop worker `local_rank` if it still runs and start a new one in its place, with the
        same rank, environment and round (a hot spare if `hot_spare`); the other workers are
        not touched."""
        old = self.retire(local_rank)
        return self._start(local_rank, old.generation + 1, hot_spare=hot_spare)

    def retire(self, local_rank: int, grace: float | None = None) -> Worker:
        """Stop worker `local_rank` if it still runs (its signal, the grace period, SIGKILL)
        and leave its place empty (a hot spare took it: :meth:`fill` starts the one behind)."""
        old = self._workers.pop(local_rank, None)
        if old is None:
            raise KeyError(f"no worker with local rank {local_rank} in this attempt")
        if not old.exited:
            self._stop(
                [old], signal.SIGTERM, self.config.shutdown_timeout if grace is None else grace
            )
        self._release(old)
        self._retired.append(old)
        self._generations[local_rank] = old.generation + 1
        self.heartbeats.reset(local_rank)
        # Those spared while waiting for a peer get a full period from now, when that peer
        # (if it was this one) is gone and their collective fails.
        now = elastic_core.now_ns()
        for w in self._workers.values():
            if w.spared_until_ns is not None:
                w.spared_until_ns = now + w.spare_ns
        return old

    def spare(self, local_rank: int, seconds: float) -> None:
        """Worker `local_rank` is hung inside a collective: it waits for a peer, which is judged
        first. It is judged again in `seconds` (:meth:`still_stuck`) unless it beats."""
        w = self._workers[local_rank]
        beat = self.beats().get(local_rank)
        w.spared_beat_ns = beat.last_beat_ns if beat is not None else 0
        w.spare_ns = int(seconds * 1e9)
        w.spared_until_ns = elastic_core.now_ns() + w.spare_ns

    def still_stuck(self) -> Worker | None:
        """A spared worker whose period ran out without a beat (it is spared no more). Those
        that beat again are forgiven."""
        beats = self.beats()
        now = elastic_core.now_ns()
        for w in self.alive():
            if w.spared_until_ns is None:
                continue
            beat = beats.get(w.local_rank)
            if beat is not None and beat.last_beat_ns != w.spared_beat_ns:
                w.spared_until_ns = None
            elif now >= w.spared_until_ns:
                w.spared_until_ns = None
                return w
        return None

    def _start(self, local_rank: int, generation: int, hot_spare: bool = False) -> Worker:
        if self._fence is not None:
            self._fence.write()  # the round it starts in, before its first line runs
        w = self.startup.start(local_rank, generation, self.spawner, hot_spare)
        self._workers[local_rank] = w
        if self.guardian is not None:
            self.guardian.watch_group(w.pid)
        self.watchdog.watch(
            local_rank,
            w.pid,
            self.heartbeats.table(local_rank),
            slot=0,
            hang_timeout=self._hang_timeout,
            gpu=self.gpu_of(local_rank),
        )
        w.process.watched()
        return w

    # ---- watching ------------------------------------------------------------------------------

    def next_event(self, timeout: float) -> Happened | None:
        """What the watchdog says next of a live worker of this attempt (exits are recorded
        and reaped first): it exited (with 0 or not), hung, or its GPU failed; None if nothing
        came within `timeout`."""
        event = self.watchdog.poll(timeout=timeout)
        if event is None:
            return None
        w = self._workers.get(event.worker)
        if w is None or w.pid != event.pid or w.exited:
            return None  # about a worker that was replaced, or of an earlier attempt
        if event.kind == elastic_core.EventKind.EXITED:
            self._mark_exited(w, event)
            what = Happening.EXITED_OK if w.exit_code == 0 else Happening.FAILED
        elif event.kind == elastic_core.EventKind.HUNG:
            what = Happening.HUNG
        elif event.kind == elastic_core.EventKind.GPU_UNHEALTHY:
            what = Happening.GPU_FAULT
        elif event.kind == elastic_core.EventKind.BAD_HEARTBEAT:
            what = Happening.BROKE_HEARTBEAT
        else:
            return None
        return Happened(what, w, event.time_ns, event.detail)

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

    def stop_all(self, sig: int, grace: float, cancel: CancelToken = NEVER) -> Stopped:
        """End the attempt: `sig` to every live worker's process group, up to `grace`
        seconds (cut short by a forced cancellation), then SIGKILL; then :meth:`close`. The
        workers that were running and were stopped are STOPPED. One whose exit was seen before
        the signal went out (its event was still queued) ended on its own: it keeps its own
        state, and is among :attr:`Stopped.ended` if it failed."""
        running = [w for w in self.alive() if w.state == WorkerState.RUNNING]
        sent_ns = elastic_core.now_ns()
        self._stop(self.alive(), sig, grace, cancel)
        stopped, ended = [], []
        for w in running:
            if w.exited_ns is not None and w.exited_ns < sent_ns:
                if w.state == WorkerState.FAILED:
                    ended.append(w)
                continue
            w.state = WorkerState.STOPPED
            stopped.append(w)
        self.close()
        return Stopped(stopped, ended)

    def finish(self) -> dict[int, Any]:
        """Every worker succeeded: :meth:`close`, and the return values by global rank."""
        self.close()
        return self.return_values()

    def _stop(
        self, targets: list[Worker], sig: int, grace: float, cancel: CancelToken = NEVER
    ) -> None:
        pending = {w.local_rank: w for w in targets if not w.exited}
        if pending and self._fence is not None:
            sig = self._fence.signal_for(sig)
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
        self.startup.close()
        for w in self._workers.values():
            self._release(w)

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
                # What the function returned (its own process wrote it, as torch's does).
                with os.fdopen(untrusted.open_regular(w.result_file, os.O_RDONLY), "rb") as f:
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
            sizes[w.local_rank] = untrusted.size(w.stack_file)
            w.process.signal(worker_main.STACK_SIGNAL)
        previous = dict(sizes)
        pending = set(sizes)
        deadline = Deadline(timeout)
        last_growth = time.monotonic()
        while pending and not deadline.passed:
            time.sleep(0.02)
            for rank in list(pending):
                size = untrusted.size(self._workers[rank].stack_file)
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
            try:
                untrusted.append(w.stderr_log, (header + stack).encode())
            except OSError as e:
                logger.warning("rank %d's stacks not added to its log: %s", w.rank, e)
        else:
            prefix = compat.log_line_prefix(self.config.role, w.rank, w.local_rank, self.host)
            lines = (header + stack).splitlines()
            sys.stderr.write("".join(f"{prefix}{line}\n" for line in lines))
            sys.stderr.flush()


#: The most of a stack dump read: the worker writes the file, so its size is the worker's.
STACK_LIMIT = 1 << 20


def _read_from(path: str, offset: int) -> str:
    try:
        return untrusted.read(path, STACK_LIMIT, offset).decode(errors="replace")
    except OSError:
        return ""


__all__ = [
    "SpawnError",
    "Stopped",
    "UnusableGpu",
    "Watcher",
    "Worker",
    "WorkerGroup",
]
