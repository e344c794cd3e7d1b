"""A rendezvous backend written against torch's RendezvousHandler, as a user of torch would
write one: a fixed number of nodes, each told its rank (``--rdzv-conf rank=N``), meeting in a
TCPStore that node 0 hosts at the endpoint. The compatibility tests run it under elasticrun's
agent, through the agent API and through ``elasticrun --rdzv-backend fixed-store`` (this
directory is a package installed by path: its entry point names the backend)."""

from __future__ import annotations

import datetime

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousInfo
from torch.distributed.elastic.rendezvous.api import RendezvousStoreInfo


class FixedStoreRendezvous(RendezvousHandler):
    def __init__(self, params) -> None:
        host, port = params.endpoint.rsplit(":", 1)
        self.host, self.port = host, int(port)
        self.rank = int(params.get_as_int("rank", 0))
        self.nodes = params.max_nodes
        self.run_id = params.run_id
        self.rounds = 0
        self.closed = False
        self.tcp = None

    def get_backend(self) -> str:
        return "fixed-store"

    def next_rendezvous(self) -> RendezvousInfo:
        if self.tcp is None:
            self.tcp = TCPStore(
                self.host,
                self.port,
                None,
                self.rank == 0,
                datetime.timedelta(seconds=60),
                wait_for_workers=False,
            )
        self.rounds += 1
        store = PrefixStore(f"{self.run_id}/{self.rounds}", self.tcp)
        return RendezvousInfo(
            store, self.rank, self.nodes, RendezvousStoreInfo(self.host, self.port)
        )

    def is_closed(self) -> bool:
        return self.closed

    def set_closed(self) -> None:
        self.closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        return True


def create(params) -> FixedStoreRendezvous:
    return FixedStoreRendezvous(params)
