"""The rendezvous interface: how the agents of a job agree on who is in it.

An agent calls :meth:`RendezvousHandler.next_rendezvous` before it starts (and restarts) its
workers; the answer says which node it is (group rank), how many nodes there are and how many
workers each has, and where rank 0 worker's store lives (MASTER_ADDR/MASTER_PORT). Backends are
registered by name (:mod:`elastic_launch.rendezvous.registry`), including outside ones through the
entry-point group ``elastic_launch.rendezvous``.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from elastic_launch.api import ConfigError, LaunchError, RestartBudget
from elastic_launch.cancel import NEVER, CancelToken


class RestartReason(str, enum.Enum):
    """Why an agent asks for a new round."""

    START = "start"  # its first round
    FAILURE = "failure"  # a worker failed: a restart counts against the job's budget
    MEMBERSHIP = "membership"  # nodes came or went: free


class CloseReason(str, enum.Enum):
    """Why a job was closed (no more rounds)."""

    SUCCEEDED = "succeeded"  # every node's workers finished
    FAILED = "failed"  # the restart budget was spent, or a node cannot go on
    ERROR = "error"  # the nodes cannot work together (different versions)


@dataclass(frozen=True)
class JobClosed:
    """A closed job: why, and the details (the root cause that spent the budget...)."""

    reason: CloseReason
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.reason.value}: {self.detail}" if self.detail else self.reason.value


class RendezvousError(LaunchError):
    """The rendezvous failed."""


class RendezvousTimeoutError(RendezvousError, TimeoutError):
    """Not enough nodes joined in time."""


class RendezvousClosedError(RendezvousError):
    """The job is over (it finished or failed); :attr:`closed` says how."""

    def __init__(self, message: str, closed: JobClosed) -> None:
        super().__init__(message)
        self.closed = closed


class RunIdInUseError(RendezvousError):
    """The run id names a job that already finished: a new job needs a new run id."""


class RendezvousVersionError(RendezvousError):
    """This node and the job run different elasticrun (or rendezvous protocol) versions."""


class StoreValueError(RendezvousError):
    """A value in the rendezvous store that is not what this job writes there (wrong type, out
    of range, too large, not JSON); the message names the key and the field."""


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
    config: Mapping[str, Any] = field(default_factory=dict)
    local_addr: str | None = None
    max_restarts: int = 0  # the job-wide restart budget
    role: str = ""  # this node's workers' role (ROLE_NAME)
    # Only the static backend uses these.
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None

    # torch's accessors, for backends written against torch's RendezvousParameters.

    def get(self, key: str, default: Any = None) -> Any:
        """The value of `key` in the backend's configuration (``--rdzv-conf``), or `default`."""
        return self.config.get(key, default)

    def get_as_bool(self, key: str, default: bool | None = None) -> bool | None:
        value = self.get(key, default)
        if value is None or isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "t", "yes", "y"):
            return True
        if text in ("0", "false", "f", "no", "n"):
            return False
        raise ValueError(f"--rdzv-conf {key}={value!r} is not a valid boolean: give true or false")

    def get_as_int(self, key: str, default: int | None = None) -> int | None:
        value = self.get(key, default)
        if value is None:
            return None
        try:
            return int(value)
        except ValueError:
            raise ValueError(f"--rdzv-conf {key}={value!r} is not a valid integer") from None


@dataclass(frozen=True)
class RendezvousInfo:
    """The outcome of one round."""

    round: int
    group_rank: int
    group_world_size: int  # nodes
    world_size: int  # workers, all nodes together
    rank_offset: int  # global rank of this node's local rank 0
    master_addr: str
    master_port: int
    restart_count: int = 0  # restarts after failures so far (job-wide where the store allows)
    # Within this node's role (ROLE_RANK of local rank 0, ROLE_WORLD_SIZE); None: one role,
    # the same as rank_offset and world_size.
    role_rank_offset: int | None = None
    role_world_size: int | None = None


@dataclass(frozen=True)
class RendezvousCounters:
    """What a handler has done, for events, /healthz and the benchmarks."""

    rounds: int = 0  # rounds this node took part in
    store_requests: int | None = None  # requests sent to the store (None: no store)
    phase: str = ""  # "joining", "confirming", "spare", "running", "closed" or ""


class RendezvousHandler(abc.ABC):
    """One agent's view of the job's membership (torch's ``RendezvousHandler``, with reasons,
    cancellation and counters)."""

    @abc.abstractmethod
    def get_backend(self) -> str:
        """The backend's registered name."""

    @abc.abstractmethod
    def get_run_id(self) -> str:
        """The job's run id."""

    @abc.abstractmethod
    def next_rendezvous(
        self,
        reason: RestartReason = RestartReason.START,
        *,
        cancel: CancelToken = NEVER,
        failure: str = "",
    ) -> RendezvousInfo:
        """Join the next round and wait until it is final. After a FAILURE (`failure` says
        what failed) the restart counts against the job's budget; once it is spent the job is
        closed. Raises RendezvousClosedError (the job is over), RunIdInUseError,
        RendezvousVersionError, RendezvousTimeoutError, RendezvousConnectionError, or
        :class:`~elastic_launch.api.Cancelled` when `cancel` is."""

    def spend_restart(self, limit: int, cancel: CancelToken = NEVER) -> RestartBudget | None:
        """Spend one of the job's restarts for a worker replaced alone (a group restart spends
        one in :meth:`next_rendezvous`): the budget after it, or None when `limit` are spent.
        A backend with a store keeps one count for the whole job, in the store, which every
        node reads in :attr:`RendezvousInfo.restart_count`; this default counts on this node."""
        spent = RestartBudget(self._spent_restarts, limit).spend()
        if spent is not None:
            self._spent_restarts = spent.spent
        return spent

    _spent_restarts = 0  # the default spend_restart's own count

    def membership_changed(self) -> bool:
        """True once the current round is over for this node: a node joined, left or failed,
        or the job was closed. The agent then restarts its workers."""
        return False

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to be admitted (they are, at the next round)."""
        return 0

    def round_broken(self) -> bool:
        """True once the current round cannot go on as it is: a member left, the round was
        reopened or closed, or this node's lease expired (not: a node waits to join)."""
        return False

    def post_note(self, name: str, value: str) -> None:  # noqa: B027 - one member: nobody to tell
        """Tell the other members of the running round `name` = `value`."""

    def note(self, name: str) -> str | None:
        """A note of the running round (:meth:`post_note`) as this member knows it, without a
        request: backends with a store bring notes with their watch."""
        return None

    def lost_members(self, cancel: CancelToken = NEVER) -> list[str]:
        """After a local worker failure: the other members of the round that are gone (their
        agent died), so that the failure counts as a membership change. Looks for a short
        while only (a dead agent's process is seen at once; a lost host within seconds)."""
        return []

    @abc.abstractmethod
    def mark_done(self) -> bool:
        """This node's workers all succeeded; True if the whole job has finished."""

    @abc.abstractmethod
    def set_closed(self, reason: CloseReason, detail: str = "") -> None:
        """Close the job for every agent (no-op if it is closed already)."""

    @abc.abstractmethod
    def closed(self) -> JobClosed | None:
        """Why the job was closed, once this node knows it is."""

    def is_closed(self) -> bool:
        return self.closed() is not None

    @abc.abstractmethod
    def counters(self) -> RendezvousCounters: ...

    def shutdown(self, cancel: CancelToken = NEVER) -> None:  # noqa: B027 - nothing by default
        """Leave (other nodes see this node go at once) and release connections, leases and
        servers. A node hosting a service others still need may wait for them, unless
        `cancel` is cancelled."""


#: A backend factory: builds a handler from parameters, after checking them.
HandlerFactory = Callable[[RendezvousParameters], RendezvousHandler]
