"""Test doubles for the node side: a spawner whose "processes" are records, a watchdog the test
feeds events to, and a rendezvous the test scripts. With them the agent and the worker group run
every branch in milliseconds, without a process (the way torch tests its agent with a double).
"""

from __future__ import annotations

import itertools
import queue
import threading
from dataclasses import dataclass, field

from elastic_launch.api import Cancelled, RestartBudget
from elastic_launch.cancel import NEVER, CancelToken
from elastic_launch.processes.spawn import Process, Spawner, SpawnRequest
from elastic_launch.rendezvous.api import (
    CloseReason,
    JobClosed,
    RendezvousClosedError,
    RendezvousCounters,
    RendezvousHandler,
    RendezvousInfo,
    RestartReason,
)

# Far above pid_max's default: never a real process (signals to them are only recorded anyway).
_PIDS = itertools.count(50_000_000)


class FakeProcess(Process):
    def __init__(self, watchdog: FakeWatchdog, request: SpawnRequest) -> None:
        self.pid = next(_PIDS)
        self.request = request
        self.watchdog = watchdog
        self.signals: list[int] = []  # to the process itself
        self.group_signals: list[int] = []  # to its process group
        self.status: tuple[int | None, int | None] | None = None
        self.exits_on: set[int] = {15, 9, 2, 1}  # signals it dies of (SIGTERM, SIGKILL...)
        self.is_watched = False
        self.stack: str | None = None  # what it dumps when asked for its stacks

    def reap(self, timeout: float) -> tuple[int | None, int | None]:
        return self.status if self.status is not None else (None, None)

    def watched(self) -> None:
        self.is_watched = True

    def signal(self, sig: int) -> None:
        from elastic_launch.processes import worker_main

        self.signals.append(sig)
        if sig == worker_main.STACK_SIGNAL and self.stack is not None:
            with open(self.request.env[worker_main.STACK_FILE_ENV], "a") as f:
                f.write(self.stack)

    def signal_group(self, sig: int) -> None:
        self.group_signals.append(sig)
        if self.status is None and sig in self.exits_on:
            self.watchdog.exit_process(self, signal=sig)


class FakeSpawner(Spawner):
    name = "fake"

    def __init__(self, watchdog: FakeWatchdog, fail_ranks: set[int] | None = None) -> None:
        self.watchdog = watchdog
        self.fail_ranks = fail_ranks or set()
        self.spawned: list[FakeProcess] = []
        self.closed = False

    def spawn(self, request: SpawnRequest) -> Process:
        if request.local_rank in self.fail_ranks:
            raise FileNotFoundError(2, "No such file or directory", "/nonexistent/python")
        p = FakeProcess(self.watchdog, request)
        self.spawned.append(p)
        return p

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeEvent:
    """What elastic_core.Watchdog.poll returns, field for field."""

    worker: int
    kind: int
    pid: int
    time_ns: int = 0
    exit_code: int | None = None
    signal: int | None = None
    gpu: int | None = None
    step: int = 0
    detail: str = ""


class FakeWatchdog:
    """Has what the worker group needs of ``elastic_core.Watchdog``; the test makes processes
    exit, hang or lose their GPU."""

    def __init__(self) -> None:
        self.watched: dict[int, int] = {}  # worker -> pid
        self.timeouts: dict[int, float] = {}
        self.events: queue.Queue[FakeEvent] = queue.Queue()
        self.history: list[tuple[str, int]] = []

    def watch(self, worker, pid, table=None, slot=None, hang_timeout=0.0, gpu=None) -> None:
        self.watched[worker] = pid
        self.history.append(("watch", worker))
        if hang_timeout:
            self.timeouts[worker] = hang_timeout

    def unwatch(self, worker: int) -> bool:
        self.history.append(("unwatch", worker))
        return self.watched.pop(worker, None) is not None

    def set_hang_timeout(self, worker: int, seconds: float) -> bool:
        self.timeouts[worker] = seconds
        return worker in self.watched

    def poll(self, timeout: float | None = None) -> FakeEvent | None:
        try:
            return self.events.get(timeout=timeout or 0.0001)
        except queue.Empty:
            return None

    def exit_process(
        self, p: FakeProcess, code: int | None = None, signal: int | None = None
    ) -> None:
        import elastic_core

        p.status = (code, signal)
        worker = p.request.local_rank
        self.events.put(
            FakeEvent(worker, 1, p.pid, elastic_core.now_ns(), exit_code=code, signal=signal)
        )

    def hang(self, p: FakeProcess) -> None:
        import elastic_core

        self.events.put(
            FakeEvent(p.request.local_rank, 2, p.pid, elastic_core.now_ns(), detail="no beat")
        )

    def gpu_fault(self, p: FakeProcess) -> None:
        import elastic_core

        self.events.put(
            FakeEvent(p.request.local_rank, 3, p.pid, elastic_core.now_ns(), detail="XID 79")
        )


@dataclass
class FakeRendezvous(RendezvousHandler):
    """Answers rounds at once as a job of `nodes` nodes (this one group rank `group_rank`),
    counts failures against `max_restarts` with the real budget, and does what the test sets:
    raise, wait until cancelled, report a membership change or lost members, be closed."""

    nodes: int = 1
    group_rank: int = 0
    lws: int = 2
    max_restarts: int = 0
    calls: list[tuple[RestartReason, str]] = field(default_factory=list)
    changed: bool = False
    lost: list[str] = field(default_factory=list)
    raise_next: list[BaseException] = field(default_factory=list)
    block_until_cancelled: bool = False
    done: int = 0
    restarts: int = 0
    spends: list[int] = field(default_factory=list)  # the limit of each spend_restart
    _closed: JobClosed | None = None
    _round: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get_backend(self) -> str:
        return "fake"

    def get_run_id(self) -> str:
        return "fake-run"

    def next_rendezvous(
        self,
        reason: RestartReason = RestartReason.START,
        *,
        cancel: CancelToken = NEVER,
        failure: str = "",
    ) -> RendezvousInfo:
        self.calls.append((reason, failure))
        self.changed = False
        if self.block_until_cancelled:
            cancel.wait(60)
            raise Cancelled(cancel.signum)
        if self.raise_next:
            raise self.raise_next.pop(0)
        if self._closed is not None:
            raise RendezvousClosedError(f"closed: {self._closed}", self._closed)
        if reason == RestartReason.FAILURE:
            budget = RestartBudget(self.restarts, self.max_restarts)
            spent = budget.spend()
            if spent is None:
                self._closed = JobClosed(CloseReason.FAILED, budget.exhausted(failure))
                raise RendezvousClosedError(f"closed: {self._closed}", self._closed)
            self.restarts = spent.spent
        self._round += 1
        return self._info()

    def spend_restart(self, limit: int, cancel: CancelToken = NEVER) -> RestartBudget | None:
        """The one count group restarts spend too (the store's, in a real backend)."""
        with self._lock:
            spent = RestartBudget(self.restarts, limit).spend()
            if spent is not None:
                self.restarts = spent.spent
            self.spends.append(limit)
            return spent

    def _info(self) -> RendezvousInfo:
        return RendezvousInfo(
            round=self._round,
            group_rank=self.group_rank,
            group_world_size=self.nodes,
            world_size=self.lws * self.nodes,
            rank_offset=self.lws * self.group_rank,
            master_addr="10.0.0.1",
            master_port=29500 + self._round,
            restart_count=self.restarts,
        )

    def membership_changed(self) -> bool:
        return self.changed

    def lost_members(self, cancel: CancelToken = NEVER) -> list[str]:
        return list(self.lost)

    def mark_done(self) -> bool:
        self.done += 1
        self._closed = JobClosed(CloseReason.SUCCEEDED)
        return True

    def set_closed(self, reason: CloseReason, detail: str = "") -> None:
        self._closed = self._closed or JobClosed(reason, detail)

    def closed(self) -> JobClosed | None:
        return self._closed

    def counters(self) -> RendezvousCounters:
        return RendezvousCounters(rounds=self._round, store_requests=None, phase="fake")


def embedded_login(channel, token: str | None, dialed: str) -> list[tuple[str, str]]:
    """The metadata a raw gRPC client of the embedded service it reached at `dialed` sends:
    none without a token, else the credential its challenge gives (the token itself is never
    sent)."""
    if not token:
        return []
    from elastic_launch.rendezvous.etcdpb import rpc_pb2, rpc_pb2_grpc
    from elastic_launch.rendezvous.store import challenge

    asked = challenge.ask(dialed)
    reply = rpc_pb2_grpc.AuthStub(channel).Authenticate(
        rpc_pb2.AuthenticateRequest(name=challenge.USER, password=asked.password), timeout=10
    )
    return [("token", challenge.respond(token, asked, reply.token))]
