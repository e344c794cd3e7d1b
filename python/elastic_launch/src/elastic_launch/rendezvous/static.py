"""The static backend: fixed node rank and master address, no elasticity (torchrun's ``static``).

Every node is started with the same ``--nnodes N``, its own ``--node-rank``, and the same
``--master-addr``/``--master-port`` (default 29500) where the rank 0 worker hosts its store.
Nodes are assumed to run the same number of workers each.
"""

from __future__ import annotations

import logging

from elastic_launch.rendezvous.api import (
    RendezvousConfigError,
    RendezvousInfo,
    RendezvousParameters,
)
from elastic_launch.rendezvous.conf import parse_conf
from elastic_launch.rendezvous.fixed import FixedRendezvous

DEFAULT_MASTER_PORT = 29500
logger = logging.getLogger("elasticrun")


class StaticRendezvous(FixedRendezvous):
    def __init__(self, params: RendezvousParameters) -> None:
        conf = parse_conf(params.backend, params.config)
        if params.min_nodes != params.max_nodes:
            raise RendezvousConfigError(
                f"--nnodes {params.min_nodes}:{params.max_nodes}: the static rendezvous has a "
                "fixed size; give --nnodes N, or use an elastic backend (embedded, etcd)"
            )
        node_rank = params.node_rank if conf.node_rank is None else conf.node_rank
        if not 0 <= node_rank < params.max_nodes:
            raise RendezvousConfigError(
                f"--node-rank {node_rank} is out of range for --nnodes {params.max_nodes} "
                f"(0..{params.max_nodes - 1})"
            )
        super().__init__(params)
        self._node_rank = node_rank

    def get_backend(self) -> str:
        return "static"

    def _round_info(self, round_: int) -> RendezvousInfo:
        n = self._params.max_nodes
        port = self._params.master_port or DEFAULT_MASTER_PORT
        if n > 1 and round_ == 1:
            # Nothing here waits: the workers do, in init_process_group, for every node's
            # workers to reach rank 0's store. Say so, or a missing node looks like a hang.
            logger.warning(
                "static rendezvous: this is node %d of %d; the workers wait in "
                "init_process_group for the workers of all %d nodes at %s:%d (the store of "
                "node 0's first worker), up to torch's timeout. Start every node with --nnodes "
                "%d, --master-addr %s, --master-port %d and its own --node-rank; for nodes "
                "that come and go, use --rdzv-backend c10d or etcd.",
                self._node_rank,
                n,
                n,
                self._params.master_addr,
                port,
                n,
                self._params.master_addr,
                port,
            )
        return RendezvousInfo(
            round=round_,
            group_rank=self._node_rank,
            group_world_size=n,
            world_size=self._params.local_world_size * n,
            rank_offset=self._params.local_world_size * self._node_rank,
            master_addr=self._params.master_addr,
            master_port=port,
            restart_count=self._restarts,
        )
