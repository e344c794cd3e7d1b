"""A rendezvous handler in torch's shape (``torch.distributed.elastic.rendezvous.
RendezvousHandler``: ``next_rendezvous()``, ``is_closed``, ``set_closed``,
``num_nodes_waiting``, ``get_run_id``, ``shutdown``), run by elasticrun's agent.

Such a handler says only which node this is and how many there are, and hands out a store
(torch's ``RendezvousInfo``, or the older ``(store, rank, world_size)`` tuple). What torch's agent
then learns through that store, this adapter learns the same way: every node writes its
workers' count, role and address under its group rank, and reads the others'; ranks and role
ranks count in group rank order, as torch assigns them; rank 0's address comes from the
handler's ``bootstrap_store_info`` when it gives one, else node 0 publishes its own. The store
must be the round's own (as torch's handlers give a per-round store): keys are not versioned.

Restarts are counted on this node (the handler has no shared budget), as for ``static``.
Nodes waiting to join (``num_nodes_waiting() > 0``) restart the workers into a new round.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any

from elastic_launch.api import Cancelled
from elastic_launch.cancel import NEVER, CancelToken, foreign_call
from elastic_launch.net import free_port
from elastic_launch.rendezvous.api import (
    CloseReason,
    JobClosed,
    RendezvousConfigError,
    RendezvousInfo,
    RendezvousParameters,
    RestartReason,
)
from elastic_launch.rendezvous.fixed import FixedRendezvous
from elastic_launch.rendezvous.round.state import MAX_LOCAL_WORKERS
from elastic_launch.rendezvous.round.values import Fields

#: The handler's methods torch's agent calls: an object with them all is torch-shaped.
TORCH_METHODS = (
    "next_rendezvous",
    "is_closed",
    "set_closed",
    "num_nodes_waiting",
    "get_run_id",
    "shutdown",
)
_NODE_KEY = "elasticrun/node/{}"
_DONE_KEY = "elasticrun/done"
_ALL_DONE_KEY = "elasticrun/done/all"
#: Set by a node that closes the handler because the job failed: torch's handlers close on
#: success too (its etcd handler's shutdown()), which must not stop the other nodes' workers.
_FAILED_KEY = "elasticrun/failed"
#: torch's LocalElasticAgent waits as long for the other nodes to finish.
EXIT_BARRIER_TIMEOUT = 300.0

logger = logging.getLogger(__name__)


def is_torch_shaped(handler: object) -> bool:
    return all(callable(getattr(handler, m, None)) for m in TORCH_METHODS)


class TorchShapedRendezvous(FixedRendezvous):
    """elasticrun's handler over a handler in torch's shape (see the module's docstring)."""

    def __init__(self, params: RendezvousParameters, handler: Any) -> None:
        if not is_torch_shaped(handler):
            missing = [m for m in TORCH_METHODS if not callable(getattr(handler, m, None))]
            raise RendezvousConfigError(
                f"rendezvous backend '{params.backend}' gave {type(handler).__name__}, which "
                f"lacks {', '.join(missing)}: a handler implements torch's RendezvousHandler "
                "(or elasticrun's)"
            )
        super().__init__(params)
        self.handler = handler
        self._store: Any = None
        self._group: tuple[int, int] = (0, 0)  # group rank, nodes
        self.exit_barrier_timeout = EXIT_BARRIER_TIMEOUT

    def get_backend(self) -> str:
        name = getattr(self.handler, "get_backend", None)
        return str(name()) if callable(name) else self._params.backend

    def get_run_id(self) -> str:
        return str(self.handler.get_run_id())

    def next_rendezvous(
        self,
        reason: RestartReason = RestartReason.START,
        *,
        cancel: CancelToken = NEVER,
        failure: str = "",
    ) -> RendezvousInfo:
        if self._closed is None and self.handler.is_closed():
            self._closed = JobClosed(CloseReason.FAILED, "closed by the rendezvous handler")
        return super().next_rendezvous(reason, cancel=cancel, failure=failure)

    def _round_info(self, round_: int) -> RendezvousInfo:
        with foreign_call():  # it takes no cancel token: a signal must still end the wait
            answer = self.handler.next_rendezvous()
        if isinstance(answer, tuple):  # torch before 2.4: (store, rank, world_size)
            store, group_rank, nodes = answer
            bootstrap = None
        else:
            store, group_rank, nodes = answer.store, answer.rank, answer.world_size
            bootstrap = getattr(answer, "bootstrap_store_info", None)
        self._store, self._group = store, (int(group_rank), int(nodes))
        return self._exchange(round_, store, int(group_rank), int(nodes), bootstrap)

    def _exchange(
        self, round_: int, store: Any, group_rank: int, nodes: int, bootstrap: Any
    ) -> RendezvousInfo:
        """Tell the other nodes about this one through the round's store and read theirs."""
        p = self._params
        host = p.local_addr or "127.0.0.1"
        me = {"lws": p.local_world_size, "role": p.role, "addr": host, "port": free_port(host)}
        store.set(_NODE_KEY.format(group_rank), json.dumps(me))
        rows = [_node_row(store, r) for r in range(nodes)]
        world = sum(r["lws"] for r in rows)
        rank_offset = sum(r["lws"] for r in rows[:group_rank])
        same_role = [r["lws"] for r in rows if r["role"] == p.role]
        role_offset = sum(r["lws"] for r in rows[:group_rank] if r["role"] == p.role)
        # The workers do not share the agents' store (TORCHELASTIC_USE_AGENT_STORE=False):
        # their MASTER_PORT is the free port node 0 published, on torch's address for it.
        addr = getattr(bootstrap, "master_addr", None) or rows[0]["addr"]
        return RendezvousInfo(
            round=round_,
            group_rank=group_rank,
            group_world_size=nodes,
            world_size=world,
            rank_offset=rank_offset,
            master_addr=str(addr),
            master_port=int(rows[0]["port"]),
            restart_count=self._restarts,
            role_rank_offset=role_offset,
            role_world_size=sum(same_role),
        )

    def membership_changed(self) -> bool:
        """Nodes wait to join (torch's agent restarts then), or another node closed the
        handler because the job failed. A node that finished closes it too (torch's etcd
        handler's ``shutdown``): its workers succeeded, and ours go on, as under torch's."""
        return self.num_nodes_waiting() > 0 or self._failed_elsewhere()

    def _failed_elsewhere(self) -> bool:
        if not self.handler.is_closed():
            return False
        store = self._store
        if store is None:
            return True
        with foreign_call():
            return bool(store.check([_FAILED_KEY]))

    def num_nodes_waiting(self) -> int:
        return int(self.handler.num_nodes_waiting())

    def mark_done(self) -> bool:
        """torch's exit barrier: wait (up to :attr:`exit_barrier_timeout`) until every node's
        workers finished, since the store may live in one of the agents; a barrier that fails
        or times out does not fail the job."""
        store, nodes = self._store, self._group[1]
        if store is not None and nodes > 1 and self.exit_barrier_timeout > 0:
            try:
                with foreign_call():
                    if int(store.add(_DONE_KEY, 1)) >= nodes:
                        store.set(_ALL_DONE_KEY, "1")
                    timeout = datetime.timedelta(seconds=self.exit_barrier_timeout)
                    store.wait([_ALL_DONE_KEY], timeout)
            except Cancelled:
                raise  # a signal: the launcher stops
            except Exception as e:  # torch's stores raise RuntimeError, DistStoreError...
                logger.warning("the exit barrier did not complete (%s); this node is done", e)
        return super().mark_done()

    def set_closed(self, reason: CloseReason, detail: str = "") -> None:
        if reason != CloseReason.SUCCEEDED:
            self._say_failed(detail or reason.value)
            self.handler.set_closed()
        super().set_closed(reason, detail)

    def _say_failed(self, why: str) -> None:
        """Tell the round's other nodes that the job failed, before closing the handler."""
        if self._store is None:
            return
        try:
            with foreign_call():
                self._store.set(_FAILED_KEY, why)
        except Cancelled:
            raise
        except Exception as e:  # the store may have gone with the node that hosted it
            logger.warning("could not tell the other nodes that the job failed (%s)", e)

    def shutdown(self, cancel: CancelToken = NEVER) -> None:
        self.handler.shutdown()


def _node_row(store: Any, group_rank: int) -> dict[str, Any]:
    """What node `group_rank` said about itself in the round's store, checked."""
    key = _NODE_KEY.format(group_rank)
    f = Fields.of(store.get(key), key)
    return {
        "lws": f.integer("lws", 0, 1, MAX_LOCAL_WORKERS),
        "role": f.text("role"),
        "addr": f.text("addr"),
        "port": f.port("port"),
    }
