"""Rendezvous: how the agents of a job agree on its membership. See :mod:`.api`.

Owns: the handler interface and registry (``api``, ``registry``), the round's pure decisions
(``round``), the algorithm over a store (``elastic``), the stores (``etcd_v3``, ``etcd_v2``,
``embedded_server``), the fixed backends (``local``, ``static``), the configuration keys
(``conf``), handlers in torch's shape (``torch_shaped``) and the train loop's own rendezvous
of workers (``team``).
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
