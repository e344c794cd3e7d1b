"""torch's rendezvous API (``torch.distributed.elastic.rendezvous``: ``RendezvousParameters``,
the registry's ``get_rendezvous_handler``) over elasticrun's backends, and the handler an agent
runs for a spec: elasticrun's, or one in torch's shape adapted
(:mod:`elastic_launch.rendezvous.torch_shaped`), with the spec's master address override.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

from elastic_launch.cancel import NEVER, CancelToken
from elastic_launch.rendezvous import api as rdzv
from elastic_launch.rendezvous.registry import adapt, create_handler
from elastic_launch.rendezvous.torch_shaped import TorchShapedRendezvous


class RendezvousParameters:
    """torch's ``RendezvousParameters(backend, endpoint, run_id, min_nodes, max_nodes,
    local_addr=None, **kwargs)``: the keyword arguments are the backend's configuration (what
    ``--rdzv-conf`` gives on the command line)."""

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not backend:
            raise ValueError("RendezvousParameters: give a backend name (c10d, etcd, static...)")
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(
                f"RendezvousParameters: min_nodes {min_nodes} and max_nodes {max_nodes}: need "
                "1 <= min_nodes <= max_nodes"
            )
        self.backend, self.endpoint, self.run_id = backend, endpoint, run_id
        self.min_nodes, self.max_nodes, self.local_addr = min_nodes, max_nodes, local_addr
        self.config = kwargs

    def ours(self, local_world_size: int = 1, role: str = "", max_restarts: int = 0) -> Any:
        """elasticrun's parameters, once the node's workers are known."""
        config = {k: v for k, v in self.config.items() if v is not None}
        return rdzv.RendezvousParameters(
            backend=self.backend,
            endpoint=self.endpoint,
            run_id=self.run_id,
            min_nodes=self.min_nodes,
            max_nodes=self.max_nodes,
            local_world_size=local_world_size,
            config=config,
            local_addr=self.local_addr,
            max_restarts=max_restarts,
            role=role,
            node_rank=int(config.get("rank", 0)),
        )

    def get(self, key: str, default: Any = None) -> Any:
        return self.ours().get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        value: bool | None = self.ours().get_as_bool(key, default)
        return value

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        value: int | None = self.ours().get_as_int(key, default)
        return value


class RendezvousHandle:
    """What :func:`get_rendezvous_handler` returns: a handler in torch's shape whose
    elasticrun handler is made when an agent first runs with it (a node joins with its worker
    count and role, which the spec gives). Shut it down once done, as torch's."""

    def __init__(self, params: RendezvousParameters) -> None:
        self.params = params
        self.handler: rdzv.RendezvousHandler | None = None

    def bind(self, local_world_size: int, role: str, max_restarts: int) -> rdzv.RendezvousHandler:
        if self.handler is None:
            self.handler = create_handler(self.params.ours(local_world_size, role, max_restarts))
        return self.handler

    def get_backend(self) -> str:
        return self.params.backend

    def get_run_id(self) -> str:
        return self.params.run_id

    def next_rendezvous(self) -> Any:
        raise NotImplementedError(
            "elasticrun's rendezvous hands out no torch store: run it through "
            "LocalElasticAgent(spec).run(), which joins the rounds"
        )

    def is_closed(self) -> bool:
        return self.handler is not None and self.handler.is_closed()

    def set_closed(self) -> None:
        if self.handler is not None:
            self.handler.set_closed(rdzv.CloseReason.FAILED, "closed through the agent API")

    def num_nodes_waiting(self) -> int:
        return self.handler.num_nodes_waiting() if self.handler is not None else 0

    def shutdown(self) -> bool:
        if self.handler is not None:
            self.handler.shutdown()
        return True


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandle:
    """torch's ``registry.get_rendezvous_handler``: any registered backend by name."""
    return RendezvousHandle(params)


def node_handler(spec: Any, exit_barrier_timeout: float) -> rdzv.RendezvousHandler:
    """The handler an agent runs for `spec` (a ``WorkerSpec``): elasticrun's, made for the
    spec's workers, or the spec's own in torch's shape, adapted; with the spec's master
    address and port when it gives them."""
    h = spec.rdzv_handler
    if isinstance(h, RendezvousHandle):
        handler = h.bind(spec.local_world_size, spec.role, spec.max_restarts)
    else:
        params = rdzv.RendezvousParameters(
            backend=backend_of(h),
            endpoint="",
            run_id=str(h.get_run_id()),
            min_nodes=1,
            max_nodes=1,
            local_world_size=spec.local_world_size,
            local_addr=spec.local_addr,
            max_restarts=spec.max_restarts,
            role=spec.role,
        )
        handler = adapt(params, h)
    if isinstance(handler, TorchShapedRendezvous):
        handler.exit_barrier_timeout = exit_barrier_timeout
    if spec.master_addr is not None or spec.master_port is not None:
        override = MasterOverride(handler, spec.master_addr, spec.master_port)
        return cast(rdzv.RendezvousHandler, override)
    return handler


def backend_of(handler: Any) -> str:
    name = getattr(handler, "get_backend", None)
    return str(name()) if callable(name) else type(handler).__name__


class MasterOverride:
    """A handler whose rounds give the spec's MASTER_ADDR/MASTER_PORT (torch's
    ``master_addr``/``master_port`` override), on any backend; everything else is the inner
    handler's (delegated, so that a method the interface gains is never left out)."""

    def __init__(self, inner: rdzv.RendezvousHandler, addr: str | None, port: int | None) -> None:
        self.inner, self.addr, self.port = inner, addr, port

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (a copy being made): never recurse
            raise AttributeError(name)
        return getattr(self.inner, name)

    def next_rendezvous(
        self,
        reason: rdzv.RestartReason = rdzv.RestartReason.START,
        *,
        cancel: CancelToken = NEVER,
        failure: str = "",
    ) -> rdzv.RendezvousInfo:
        info = self.inner.next_rendezvous(reason, cancel=cancel, failure=failure)
        return dataclasses.replace(
            info,
            master_addr=info.master_addr if self.addr is None else self.addr,
            master_port=info.master_port if self.port is None else self.port,
        )


rdzv.RendezvousHandler.register(MasterOverride)
