"""Rendezvous: how the agents of a job agree on its membership. See :mod:`.api`."""

from elastic_launch.rendezvous.api import (
    RendezvousClosedError,
    RendezvousConfigError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from elastic_launch.rendezvous.registry import backends, create_handler, register

__all__ = [
    "RendezvousClosedError",
    "RendezvousConfigError",
    "RendezvousConnectionError",
    "RendezvousError",
    "RendezvousHandler",
    "RendezvousInfo",
    "RendezvousParameters",
    "RendezvousTimeoutError",
    "backends",
    "create_handler",
    "register",
]
