"""The embedded backend for one node: no server, no store, nothing to install.

Used for ``--standalone`` and any single-node launch. Every round is this node alone, with a free
port for MASTER_PORT chosen afresh (so that a restarted group never meets a socket of the
previous one, and two jobs on one host never collide).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from elastic_launch.rendezvous.api import (
    FixedRendezvous,
    RendezvousConfigError,
    RendezvousInfo,
    RendezvousParameters,
    as_bool,
    check_config_keys,
    positive_seconds,
)

# torch's c10d keys are accepted so that torchrun command lines run unchanged; on one node there
# is nobody to wait for, so the timeouts have nothing to bound.
CONFIG_KEYS: dict[str, Callable[[str], object]] = {
    "timeout": positive_seconds,
    "join_timeout": positive_seconds,
    "last_call_timeout": positive_seconds,
    "close_timeout": positive_seconds,
    "heartbeat_timeout": positive_seconds,
    "keep_alive_interval": positive_seconds,
    "keep_alive_max_attempt": int,
    "read_timeout": positive_seconds,
    "is_host": as_bool,
    "token": str,
}


def free_port(host: str) -> int:
    """A port the kernel says is free on `host` now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class LocalRendezvous(FixedRendezvous):
    def __init__(self, params: RendezvousParameters) -> None:
        check_config_keys(params, CONFIG_KEYS)
        if params.max_nodes != 1:
            raise RendezvousConfigError(
                f"--nnodes {params.min_nodes}:{params.max_nodes}: the in-process rendezvous "
                "serves one node only"
            )
        if params.endpoint:
            from elastic_launch.config import parse_endpoint

            parse_endpoint(params.endpoint, "--rdzv-endpoint", default_port=29400)
        super().__init__(params)
        self._host = params.local_addr or "127.0.0.1"

    def _round_info(self, round_: int) -> RendezvousInfo:
        return RendezvousInfo(
            round=round_,
            group_rank=0,
            group_world_size=1,
            local_world_sizes=(self._params.local_world_size,),
            master_addr=self._host,
            master_port=free_port(self._host),
            restart_count=self._restarts,
        )
