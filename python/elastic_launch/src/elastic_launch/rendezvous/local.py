"""The embedded backend for one node: no server, no store, nothing to install.

Used for ``--standalone`` and any single-node launch. Every round is this node alone, with a free
port for MASTER_PORT chosen afresh (so that a restarted group never meets a socket of the
previous one, and two jobs on one host never collide).
"""

from __future__ import annotations

from elastic_launch.net import free_port, parse_endpoint
from elastic_launch.rendezvous.api import (
    RendezvousConfigError,
    RendezvousInfo,
    RendezvousParameters,
)
from elastic_launch.rendezvous.conf import parse_conf
from elastic_launch.rendezvous.fixed import FixedRendezvous
from elastic_launch.rendezvous.store.endpoints import DEFAULT_EMBEDDED_PORT


class LocalRendezvous(FixedRendezvous):
    def __init__(self, params: RendezvousParameters) -> None:
        parse_conf(params.backend, params.config)
        if params.max_nodes != 1:
            raise RendezvousConfigError(
                f"--nnodes {params.min_nodes}:{params.max_nodes}: the in-process rendezvous "
                "serves one node only"
            )
        if params.endpoint:
            parse_endpoint(params.endpoint, "--rdzv-endpoint", default_port=DEFAULT_EMBEDDED_PORT)
        super().__init__(params)
        self._host = params.local_addr or "127.0.0.1"

    def _round_info(self, round_: int) -> RendezvousInfo:
        return RendezvousInfo(
            round=round_,
            group_rank=0,
            group_world_size=1,
            world_size=self._params.local_world_size,
            rank_offset=0,
            master_addr=self._host,
            master_port=free_port(self._host),
            restart_count=self._restarts,
        )
