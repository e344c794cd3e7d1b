"""Rendezvous backends by name: the built-in ones, and outside ones from entry points.

An outside package provides a backend with an entry point in the group
``elastic_launch.rendezvous`` whose object is a factory ``(RendezvousParameters) ->
RendezvousHandler``, elasticrun's or one in torch's shape (:mod:`.torch_shaped`)::

    [project.entry-points."elastic_launch.rendezvous"]
    mystore = "my_package.rdzv:create_handler"
"""

from __future__ import annotations

import logging

from elastic_launch.rendezvous.api import (
    HandlerFactory,
    RendezvousConfigError,
    RendezvousHandler,
    RendezvousParameters,
)

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "elastic_launch.rendezvous"

_factories: dict[str, HandlerFactory] = {}


def _local(params: RendezvousParameters) -> RendezvousHandler:
    from elastic_launch.rendezvous.local import LocalRendezvous

    return LocalRendezvous(params)


def _static(params: RendezvousParameters) -> RendezvousHandler:
    from elastic_launch.rendezvous.static import StaticRendezvous

    return StaticRendezvous(params)


def _embedded(params: RendezvousParameters) -> RendezvousHandler:
    if params.max_nodes == 1:  # one node: in-process, no server to start
        return _local(params)
    from elastic_launch.rendezvous.backends import EmbeddedRendezvous

    return EmbeddedRendezvous(params)


def _etcd(params: RendezvousParameters) -> RendezvousHandler:
    from elastic_launch.rendezvous.backends import create_etcd

    return create_etcd(params)


def _etcd_v2(params: RendezvousParameters) -> RendezvousHandler:
    from elastic_launch.rendezvous.backends import create_etcd_v2

    return create_etcd_v2(params)


_BUILTIN: dict[str, HandlerFactory] = {
    "embedded": _embedded,
    "c10d": _embedded,  # torchrun's default dynamic backend: same role, same command lines
    "static": _static,
    "etcd": _etcd,
    "etcd-v2": _etcd_v2,
}


def register(name: str, factory: HandlerFactory) -> None:
    """Register (or replace) a backend under `name`."""
    _factories[name] = factory


def backend_names() -> list[str]:
    """Every backend name: built-in, registered and from entry points."""
    return sorted(set(_BUILTIN) | set(_factories) | set(_entry_points()))


def _entry_points() -> dict[str, object]:
    from importlib.metadata import entry_points

    return {ep.name: ep for ep in entry_points(group=ENTRY_POINT_GROUP)}


def check_parameters(params: RendezvousParameters) -> None:
    """A built-in backend's settings, parsed without connecting or binding: a bad one is a
    RendezvousConfigError before the launcher opens anything. A registered or outside backend
    checks its own when it is created."""
    if params.backend in _factories or params.backend not in _BUILTIN:
        return
    from elastic_launch.rendezvous.backends import check_parameters as check_builtin

    check_builtin(params)


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """Build the handler of `params.backend`; a clear error for an unknown name."""
    factory = _factories.get(params.backend) or _BUILTIN.get(params.backend)
    if factory is None:
        ep = _entry_points().get(params.backend)
        if ep is None:
            raise RendezvousConfigError(
                f"--rdzv-backend '{params.backend}' is not a rendezvous backend: choose one of "
                f"{', '.join(backend_names())}"
            )
        factory = ep.load()  # type: ignore[attr-defined]
    return adapt(params, factory(params))


def adapt(params: RendezvousParameters, handler: object) -> RendezvousHandler:
    """`handler` as elasticrun's agent runs it: one in torch's shape is adapted."""
    if isinstance(handler, RendezvousHandler):
        return handler
    from elastic_launch.rendezvous.torch_shaped import TorchShapedRendezvous

    return TorchShapedRendezvous(params, handler)
