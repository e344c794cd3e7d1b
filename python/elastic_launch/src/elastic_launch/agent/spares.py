"""The hot spares of one node (``--hot-spares``): train-loop workers started ahead of need, each
of which runs the script up to ``train()`` on idle CPU (:mod:`elastic_launch.spare`) and waits
in the workers' rendezvous beyond its maximum until a round takes it.

They start once the workers train (each has made a step, so the first round is theirs). When a
worker dies while a spare waits, that spare is named for its place and the round that follows
takes it at once; the dead worker's place is left empty until the re-formed group has made a
step, and then the spare behind it starts. Before that step it would compete with the group's
re-forming for the CPU, and could join the re-formed round in place of the spare named (both
wait in the same rendezvous, and the first to join is taken).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import elastic_core

from elastic_launch.agent.events import Events
from elastic_launch.agent.worker import SpawnError, Worker
from elastic_launch.agent.workers import WorkerGroup

logger = logging.getLogger(__name__)

#: The longest a place a spare took stays empty while the re-formed group has made no step
#: (seconds). The spare named for it may have stopped answering as it was taken (a process
#: SIGSTOPped, or cut off from the store: a waiting spare is never held hung), so that the
#: round waits for a member; the one behind then starts anyway. Far above a re-forming's time
#: on a loaded machine, so that the one behind never overtakes the spare named.
BEHIND_WAIT = 30.0


@dataclass(frozen=True)
class _Behind:
    """A place a spare took: the one behind it starts later, as that worker's replacement."""

    failed_ns: int  # when the worker failed
    restarts: int  # the job's restarts once its replacement was counted
    taker: int  # the local rank of the spare named for the place


def emit_replaced(
    events: Events,
    attempt: int,
    w: Worker,
    restarts: int,
    started_ns: int,
    failed_ns: int,
    **extra: object,
) -> None:
    """The ``worker_replaced`` event of `w`, started at `started_ns` in the place of a worker
    that failed at `failed_ns` (the job's restarts then: `restarts`)."""
    now = elastic_core.now_ns()
    events.emit(
        "worker_replaced",
        attempt,
        rank=w.rank,
        local_rank=w.local_rank,
        pid=w.pid,
        generation=w.generation,
        restarts=restarts,
        spawn_seconds=(now - started_ns) / 1e9,
        recovery_seconds=(now - failed_ns) / 1e9,
        **extra,
    )


class HotSpares:
    """Starts and refills the node's hot spares (see the module's docstring)."""

    def __init__(self, group: WorkerGroup, events: Events, count: int) -> None:
        self.group, self.events, self.count = group, events, count
        self._failed = False  # a spare could not be started: none are tried again
        self._behind: dict[int, _Behind] = {}  # by local rank
        self._since_ns = 0  # when a spare last took a place
        self._steps: dict[int, int] = {}  # the workers' steps then: the ones behind start after

    def free(self, dead: Worker) -> list[Worker]:
        """The spares that wait and are not named for a place yet (each is named for one
        only), `dead` aside."""
        named = {b.taker for b in self._behind.values()}
        return [w for w in self.group.hot_spares() if w is not dead and w.local_rank not in named]

    def leave_place(self, local_rank: int, failed_ns: int, restarts: int, taker: int) -> None:
        """The spare of local rank `taker` takes the place of worker `local_rank`, which
        failed at `failed_ns` (its replacement, counted: `restarts`): the place stays empty
        until the group trains."""
        self.group.retire(local_rank)
        self._behind[local_rank] = _Behind(failed_ns, restarts, taker)
        self._since_ns = elastic_core.now_ns()
        self._steps = self.group.steps()

    def due(self) -> bool:
        """Whether spares are to start: some are missing, the workers run the loop, and each
        has made a step since a spare last took a place (or :data:`BEHIND_WAIT` passed)."""
        missing = len(self.group.workers) < self.group.config.nproc_per_node + self.count
        if self._failed or not missing or not self.group.in_train_loop():
            return False
        waited = self._behind and elastic_core.now_ns() - self._since_ns > BEHIND_WAIT * 1e9
        return bool(waited) or self.group.all_stepped_past(self._steps)

    def start(self, attempt: int) -> None:
        """Start the missing spares. One that cannot start is reported; the job goes on
        without spares."""
        t0 = elastic_core.now_ns()
        try:
            started = self.group.fill(self.count)
        except SpawnError as e:
            self._failed = True
            logger.warning("a hot spare could not be started (%s): the job goes on without", e)
            return
        for w in started:
            behind = self._behind.pop(w.local_rank, None)
            if behind is None:
                self.events.emit("hot_spare_started", attempt, local_rank=w.local_rank, pid=w.pid)
                continue
            emit_replaced(
                self.events, attempt, w, behind.restarts, t0, behind.failed_ns, hot_spare=True
            )
        logger.info("hot spare(s) started: pids %s", [w.pid for w in started])

    def new_attempt(self) -> None:
        """The group starts again: every place is filled by start_all."""
        self._behind.clear()
        self._since_ns, self._steps = 0, {}
