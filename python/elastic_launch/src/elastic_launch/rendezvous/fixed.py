"""Backends whose membership never changes: one node (``embedded`` with ``--nnodes 1``, and
``--standalone``) and ``static``. Each round is answered at once; the job's restarts (group
restarts and workers replaced alone, one count) are counted on this node (there is no shared
store), by :class:`~elastic_launch.api.RestartBudget` like everywhere else."""

from __future__ import annotations

import abc

from elastic_launch.api import RestartBudget
from elastic_launch.cancel import NEVER, CancelToken
from elastic_launch.rendezvous.api import (
    CloseReason,
    JobClosed,
    RendezvousClosedError,
    RendezvousCounters,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RestartReason,
)


class FixedRendezvous(RendezvousHandler):
    def __init__(self, params: RendezvousParameters) -> None:
        self._params = params
        self._round = 0
        self._restarts = 0
        self._closed: JobClosed | None = None

    def get_backend(self) -> str:
        return self._params.backend

    def get_run_id(self) -> str:
        return self._params.run_id

    def next_rendezvous(
        self,
        reason: RestartReason = RestartReason.START,
        *,
        cancel: CancelToken = NEVER,
        failure: str = "",
    ) -> RendezvousInfo:
        cancel.check()
        if self._closed is not None:
            raise RendezvousClosedError(
                f"rendezvous of run '{self._params.run_id}' is closed: {self._closed}",
                self._closed,
            )
        if reason == RestartReason.FAILURE:
            budget = RestartBudget(self._restarts, self._params.max_restarts)
            spent = budget.spend()
            if spent is None:
                self.set_closed(CloseReason.FAILED, budget.exhausted(failure))
                assert self._closed is not None
                raise RendezvousClosedError(f"the job is over: {self._closed}", self._closed)
            self._restarts = spent.spent
        self._round += 1
        return self._round_info(self._round)

    def spend_restart(self, limit: int, cancel: CancelToken = NEVER) -> RestartBudget | None:
        spent = RestartBudget(self._restarts, limit).spend()
        if spent is not None:
            self._restarts = spent.spent
        return spent

    @abc.abstractmethod
    def _round_info(self, round_: int) -> RendezvousInfo:
        """The outcome of round `round_`."""

    def mark_done(self) -> bool:
        self.set_closed(CloseReason.SUCCEEDED)
        return True

    def set_closed(self, reason: CloseReason, detail: str = "") -> None:
        if self._closed is None:
            self._closed = JobClosed(reason, detail)

    def closed(self) -> JobClosed | None:
        return self._closed

    def counters(self) -> RendezvousCounters:
        return RendezvousCounters(rounds=self._round, phase="closed" if self._closed else "")
