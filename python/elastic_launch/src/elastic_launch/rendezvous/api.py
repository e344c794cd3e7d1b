"""The rendezvous interface: how the agents of a job agree on who is in it.

An agent calls :meth:`RendezvousHandler.next_rendezvous` before it starts (and restarts) its
workers; the answer says which node it is (group rank), how many nodes there are and how many
workers each has, and where rank 0 worker's store lives (MASTER_ADDR/MASTER_PORT). Backends are
registered by name (:mod:`elastic_launch.rendezvous.registry`), including outside ones through the
entry-point group ``elastic_launch.rendezvous``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from elastic_launch.api import ConfigError, LaunchError


class RendezvousError(LaunchError):
    """The rendezvous failed."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """Not enough nodes joined in time."""


class RendezvousClosedError(RendezvousError):
    """The rendezvous is closed: the job has finished or failed."""


class RendezvousConnectionError(RendezvousError, ConnectionError):
    """The rendezvous service or store cannot be reached."""


class RendezvousConfigError(ConfigError):
    """A bad rendezvous setting (backend name, endpoint, --rdzv-conf key or value)."""


@dataclass(frozen=True)
class RendezvousParameters:
    """Everything a backend needs to join a job; from the command line or LaunchConfig."""

    backend: str
    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_world_size: int
    config: Mapping[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    max_restarts: int = 0  # the job-wide restart budget
    # Only the static backend uses these.
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None


@dataclass(frozen=True)
class RendezvousInfo:
    """The outcome of one round."""

    round: int
    group_rank: int
    group_world_size: int
    local_world_sizes: tuple[int, ...]  # by group rank
    master_addr: str
    master_port: int
    restart_count: int = 0  # restarts after failures so far (job-wide where the store allows)

    @property
    def world_size(self) -> int:
        return sum(self.local_world_sizes)

    @property
    def rank_offset(self) -> int:
        """Global rank of this node's local rank 0."""
        return sum(self.local_world_sizes[: self.group_rank])


class RendezvousHandler(abc.ABC):
    """One agent's view of the job's membership (torch's ``RendezvousHandler``, simplified)."""

    @abc.abstractmethod
    def get_backend(self) -> str:
        """The backend's registered name."""

    @abc.abstractmethod
    def next_rendezvous(self, reason: str = "start") -> RendezvousInfo:
        """Join the next round and wait until it closes. `reason` is "start", "failure" (a
        worker failed: counts against the restart budget; RendezvousClosedError once it is
        spent) or "membership" (nodes came or went). May raise RendezvousTimeoutError,
        RendezvousClosedError or RendezvousConnectionError."""

    @abc.abstractmethod
    def is_closed(self) -> bool:
        """True once the job has finished or failed: no more rounds."""

    @abc.abstractmethod
    def set_closed(self, reason: str = "closed") -> None:
        """Close the rendezvous for every agent (the job is over)."""

    def membership_changed(self) -> bool:
        """True once the current round is over for this node: a node joined, left or
        failed, or the job was closed. The agent then restarts its workers."""
        return False

    def mark_done(self) -> bool:
        """This node's workers all succeeded; True if the whole job has finished."""
        self.set_closed("succeeded")
        return True

    @abc.abstractmethod
    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join: when > 0, running agents restart their workers to admit them."""

    @abc.abstractmethod
    def get_run_id(self) -> str:
        """The job's run id."""

    def shutdown(self) -> bool:
        """Release this agent's resources (connections, leases, servers)."""
        return True


class FixedRendezvous(RendezvousHandler):
    """Base of the backends whose membership never changes (one node, static): each round
    returns `_round_info()`; closing is local."""

    def __init__(self, params: RendezvousParameters) -> None:
        self._params = params
        self._round = 0
        self._restarts = 0
        self._closed = False

    def get_backend(self) -> str:
        return self._params.backend

    def next_rendezvous(self, reason: str = "start") -> RendezvousInfo:
        if self._closed:
            raise RendezvousClosedError(f"rendezvous of run '{self._params.run_id}' is closed")
        if reason == "failure":
            self._restarts += 1
            if self._restarts > self._params.max_restarts:
                self._closed = True
                raise RendezvousClosedError(f"restarts exhausted ({self._params.max_restarts})")
        self._round += 1
        return self._round_info(self._round)

    @abc.abstractmethod
    def _round_info(self, round_: int) -> RendezvousInfo:
        """The outcome of round `round_`."""

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self, reason: str = "closed") -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self._params.run_id


#: A backend factory: builds a handler from parameters, after checking them.
HandlerFactory = Callable[[RendezvousParameters], RendezvousHandler]


def check_config_keys(
    params: RendezvousParameters, allowed: Mapping[str, Callable[[str], object]]
) -> dict[str, object]:
    """Validate ``--rdzv-conf`` against a backend's keys; returns the converted values."""
    out: dict[str, object] = {}
    for key, raw in params.config.items():
        convert = allowed.get(key)
        if convert is None:
            known = ", ".join(sorted(allowed)) or "none"
            raise RendezvousConfigError(
                f"--rdzv-conf: '{key}' is not an option of the {params.backend} rendezvous "
                f"(it takes: {known})"
            )
        try:
            out[key] = convert(raw)
        except (TypeError, ValueError) as e:
            raise RendezvousConfigError(
                f"--rdzv-conf: {key}='{raw}' is not valid for the {params.backend} rendezvous: {e}"
            ) from None
    return out


def positive_seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError("give seconds, more than 0")
    return value


def as_bool(raw: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "t", "yes", "y"):
        return True
    if text in ("0", "false", "f", "no", "n"):
        return False
    raise ValueError("give true or false")
