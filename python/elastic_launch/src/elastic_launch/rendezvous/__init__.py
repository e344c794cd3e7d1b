"""Rendezvous: how the agents of a job agree on its membership. See :mod:`.api`."""

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
from elastic_launch.rendezvous.registry import backends, create_handler, register

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
    "backends",
    "create_handler",
    "register",
]
