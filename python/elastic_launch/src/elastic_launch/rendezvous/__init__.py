"""Rendezvous: how the agents of a job agree on its membership. See :mod:`.api`.

Owns: from the top, the handler interface and registry (``api``, ``registry``), the backends
made from a launch's settings (``backends``, the configuration keys in ``conf``), the fixed
backends (``local``, ``static``), handlers in torch's shape (``torch_shaped``) and the train
loop's own rendezvous of workers (``team``). Below them, one subpackage each: ``round``, the
round protocol (its pure decisions in ``round.state``, the handler in ``round.elastic``), which
runs on ``store``, the key-value interface it needs; ``etcd``, the clients of etcd's v3 and v2
APIs, which implement it; and ``embedded``, the service the agents serve themselves (etcd's
v3 subset, over the v3 client's connections).
May import: the foundation only (``api``, ``cancel``, ``net``); never the agent or the launcher.
"""

from elastic_launch.rendezvous.api import (
    CloseReason,
    JobClosed,
    RendezvousClosedError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousCounters,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
    RendezvousVersionError,
    RestartReason,
    RunIdInUseError,
)
from elastic_launch.rendezvous.registry import backend_names, create_handler, register

__all__ = [
    "CloseReason",
    "JobClosed",
    "RendezvousClosedError",
    "RendezvousConfigError",
    "RendezvousConnectionError",
    "RendezvousCounters",
    "RendezvousError",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousTimeoutError",
    "RendezvousVersionError",
    "RestartReason",
    "RunIdInUseError",
    "backend_names",
    "create_handler",
    "register",
]
