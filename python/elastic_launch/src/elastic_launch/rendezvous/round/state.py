"""The decisions of the elastic rendezvous, as pure functions over a snapshot of a round.

A job's rounds are numbered versions that go joinable -> frozen -> final (etcd's classic
rendezvous), or closed:

- **joinable**: nodes announce themselves; the first to have joined leads. It freezes the round
  once MAX nodes have joined, or MIN have and the last call has passed. Nodes beyond MAX are
  spares.
- **frozen**: the membership and ranks are fixed; when every member has confirmed, the leader
  makes the round final. A member that vanishes meanwhile sends the job to a new joinable round.
- **final**: the workers run. A failure, a lost node or a node waiting to be admitted reopens the
  job (the next version, joinable). A failure counts against the job's restart budget; once it
  is spent the job is closed.
- **closed**: the job is over (succeeded, failed, or its nodes cannot work together).

Nothing here does I/O: :mod:`.elastic` reads the store, asks these functions, and writes what
they return. The job's one restart count is the state's ``restarts``: a group restart spends
it in :func:`reopen`, a worker replaced alone by :func:`spend`, the same count.
"""

from __future__ import annotations

import enum
import json
import math
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from elastic_launch.api import RestartBudget
from elastic_launch.rendezvous.api import (
    CloseReason,
    JobClosed,
    RendezvousInfo,
    RestartReason,
)
from elastic_launch.rendezvous.round.values import (
    MAX_ENTRIES,
    MAX_TEXT,
    Fields,
    bad,
    decode,
    printable,
    row,
)

#: The rendezvous protocol: keys and the state's format. Nodes of another protocol cannot join.
#: 3: the state key is small (no membership: that is in a round's members shards, a node reads
#: its own), the notes travel in it, and the joinable round's leader is elected with a key.
PROTOCOL = 3

#: Members per shard of a round's membership (about 3 KiB): a node reads only its own shard,
#: so what a round sends each node does not grow with the number of nodes.
SHARD_NODES = 64


def shard_count(size: int) -> int:
    """How many shards a round of `size` members is written in."""
    return max(1, math.ceil(size / SHARD_NODES))


def shard_of(node: str, shards: int) -> int:
    """The shard that holds `node` (stable across processes and releases: CRC-32)."""
    return zlib.crc32(node.encode()) % max(shards, 1)


class Status(str, enum.Enum):
    JOINABLE = "joinable"
    FROZEN = "frozen"
    FINAL = "final"
    CLOSED = "closed"


@dataclass(frozen=True)
class Member:
    """What a node says about itself when it joins."""

    addr: str  # where other nodes reach it
    port: int  # a free port there: MASTER_PORT if it becomes group rank 0
    lws: int  # local world size
    release: str = ""  # its elasticrun version
    protocol: int = PROTOCOL
    presence: int = 0  # a port that refuses connections once its agent is gone
    role: str = ""  # its workers' role (ROLE_NAME): ranks within a role count apart

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes, key: str = "a join key") -> Member:
        f = Fields.of(data, key)
        return cls(
            addr=f.text("addr"),
            port=f.port("port"),
            lws=f.integer("lws", 0, 0, MAX_LOCAL_WORKERS),
            release=f.text("release"),
            protocol=f.integer("protocol", PROTOCOL),
            presence=f.port("presence"),
            role=f.text("role"),
        )


@dataclass(frozen=True)
class RoundState:
    """The job's state key, and (in memory) the round's membership.

    The key itself stays small whatever the number of nodes, since every node watches it: it
    holds what every member needs (the size, the world size, rank 0's address). `nodes`,
    `ranks` and `offsets` are written once per round, in the round's members shards
    (:meth:`shard_values`), of which a node reads its own (then `nodes` holds only that
    shard's members: see :attr:`members_complete`) or, where it needs all (the leader, a
    spare, the end of the job), every one. `prev_ranks` are those of round `ran`, read by the
    node that freezes the next round."""

    version: int  # the round
    status: Status
    restarts: int = 0  # job-wide restarts after failures
    nodes: Mapping[str, Member] = field(default_factory=dict)  # frozen and final rounds
    ranks: Mapping[str, int] = field(default_factory=dict)
    prev_ranks: Mapping[str, int] = field(default_factory=dict)
    leader: str = ""  # who finalizes a frozen round and follows a final one: group rank 0
    closed: JobClosed | None = None
    protocol: int = PROTOCOL
    release: str = ""  # the elasticrun version that created the job
    expires_at: float | None = None  # a closed job's keys are removed then (Unix time)
    size: int = 0  # members of a frozen or final round (`nodes` is in its members key)
    ran: int = 0  # the last round that went final (its members key has the previous ranks)
    notes: Mapping[str, str] = field(default_factory=dict)  # a final round's notes
    left: str = ""  # a joinable round's: the member whose leaving ended the round before
    offsets: Mapping[str, int] = field(default_factory=dict)  # global rank of local rank 0
    role_offsets: Mapping[str, int] = field(default_factory=dict)  # its role's rank of it
    role_worlds: Mapping[str, int] = field(default_factory=dict)  # workers by role
    world: int = 0  # a frozen or final round's workers, all nodes together
    master: tuple[str, int] = ("", 0)  # rank 0's address and port
    shards: int = 0  # the members shards of a frozen or final round

    def to_json(self) -> bytes:
        data: dict[str, Any] = {
            "version": self.version,
            "status": self.status.value,
            "restarts": self.restarts,
            "size": self.size,
            "ran": self.ran,
            "leader": self.leader,
            "protocol": self.protocol,
            "release": self.release,
        }
        if self.size:
            data.update(world=self.world, master=list(self.master), shards=self.shards)
        if self.notes:
            data["notes"] = dict(self.notes)
        if self.left:
            data["left"] = self.left
        if self.closed is not None:
            data["closed"] = {"reason": self.closed.reason.value, "detail": self.closed.detail}
            data["expires_at"] = self.expires_at
        return json.dumps(data, separators=(",", ":")).encode()

    def shard_values(self) -> dict[int, bytes]:
        """The membership, by shard: each shard's nodes as {name: [rank, offset, addr, port,
        lws, presence, role, role offset, role's workers]} (release and protocol are the
        job's)."""
        rows: dict[int, dict[str, list[Any]]] = {i: {} for i in range(self.shards)}
        for n, m in self.nodes.items():
            rows[shard_of(n, self.shards)][n] = [
                self.ranks[n],
                self.offsets[n],
                m.addr,
                m.port,
                m.lws,
                m.presence,
                m.role,
                self.role_offsets.get(n, self.offsets[n]),
                self.role_worlds.get(m.role, self.world),
            ]
        return {i: json.dumps(nodes, separators=(",", ":")).encode() for i, nodes in rows.items()}

    def with_shards(self, values: list[bytes], key: str = "a members shard") -> RoundState:
        """This state with the members of the shards in `values` (one, or all of them)."""
        nodes: dict[str, Member] = {}
        ranks: dict[str, int] = {}
        offsets: dict[str, int] = {}
        role_offsets: dict[str, int] = {}
        role_worlds: dict[str, int] = {}
        for value in values:
            shard = decode(value, key)
            if len(shard) > MAX_ENTRIES:
                bad(key, f"{len(shard)} nodes")
            for n, raw_row in shard.items():
                rank, offset, addr, port, lws, presence, role, role_offset, role_world = row(
                    raw_row, key, n, _ROW
                )
                if port > 65535 or presence > 65535 or lws > MAX_LOCAL_WORKERS:
                    bad(
                        key,
                        f"node {n!r}: port {port}, presence {presence} or lws {lws} is out "
                        "of range",
                    )
                nodes[n] = Member(
                    addr=addr,
                    port=port,
                    lws=lws,
                    release=self.release,
                    protocol=self.protocol,
                    presence=presence,
                    role=role,
                )
                ranks[n], offsets[n] = rank, offset
                role_offsets[n], role_worlds[role] = role_offset, role_world
        return replace(
            self,
            nodes=nodes,
            ranks=ranks,
            offsets=offsets,
            role_offsets=role_offsets,
            role_worlds=role_worlds,
        )

    @property
    def members_complete(self) -> bool:
        """Whether every member of a frozen or final round is here (not one shard's)."""
        return len(self.nodes) == self.size

    @classmethod
    def from_json(cls, data: bytes, key: str = "the state key") -> RoundState:
        f = Fields.of(data, key)
        status = f.text("status", "closed")
        if status not in {s.value for s in Status}:
            f.bad("status", status, "joinable, frozen, final or closed")
        master = f.raw.get("master", ["", 0])
        if not (isinstance(master, list) and len(master) == 2):
            f.bad("master", master, "[address, port]")
        where = Fields({"addr": master[0], "port": master[1]}, key)
        return cls(
            version=f.integer("version"),
            status=Status(status),
            restarts=f.integer("restarts"),
            size=f.integer("size"),
            world=f.integer("world"),
            master=(where.text("addr"), where.port("port")),
            shards=f.integer("shards", 0, 0, MAX_ENTRIES),
            ran=f.integer("ran"),
            notes=f.strings("notes"),
            left=f.text("left"),
            leader=f.text("leader"),
            closed=_closed(f),
            # A state without a protocol was written by elasticrun 0.1 (protocol 1).
            protocol=f.integer("protocol", 1),
            release=f.text("release"),
            expires_at=f.number("expires_at"),
        )


#: A members shard's row: rank, offset, addr, port, lws, presence, role, role offset, role world.
_ROW = (int, int, str, int, int, int, str, int, int)
#: More local workers than this on one node is not a job's (torch allows a few hundred).
MAX_LOCAL_WORKERS = 1 << 16


def _closed(f: Fields) -> JobClosed | None:
    closed = f.raw.get("closed")
    if not closed:
        return None
    if isinstance(closed, str):
        return JobClosed(CloseReason.FAILED, printable(closed[:MAX_TEXT]))
    reasons = {r.value for r in CloseReason}
    reason = closed.get("reason") if isinstance(closed, dict) else None
    if not isinstance(reason, str) or reason not in reasons:
        f.bad("closed", closed, f"{{'reason': one of {sorted(reasons)}, 'detail': text}}")
    detail = Fields(closed, f.key).text("detail")
    return JobClosed(CloseReason(reason), detail)


# ---- creating and checking ----------------------------------------------------------------------


def initial(release: str) -> RoundState:
    """A new job's state: round 1, joinable."""
    return RoundState(version=1, status=Status.JOINABLE, release=release)


def version_conflict(state: RoundState, release: str) -> str | None:
    """Why a node of elasticrun `release` cannot join the job of `state`, if it cannot."""
    if state.protocol != PROTOCOL:
        return (
            f"the job runs rendezvous protocol {state.protocol} (elasticrun "
            f"{state.release or '0.1.0 or older'}) and this node protocol {PROTOCOL} (elasticrun "
            f"{release})"
        )
    if state.release and state.release != release:
        return f"the job runs elasticrun {state.release} and this node elasticrun {release}"
    return None


def member_conflict(members: Mapping[str, Member]) -> str | None:
    """Members of different versions in one round (the first pair found), if any."""
    seen: dict[tuple[int, str], str] = {}
    for node, m in members.items():
        seen.setdefault((m.protocol, m.release), node)
    if len(seen) < 2:
        return None
    (pa, ra), (pb, rb) = sorted(seen)[:2]
    return (
        f"node {seen[(pa, ra)]} runs elasticrun {ra or '?'} (protocol {pa}) and node "
        f"{seen[(pb, rb)]} elasticrun {rb or '?'} (protocol {pb})"
    )


# ---- joinable ------------------------------------------------------------------------------


def join_order(joined: Mapping[str, int]) -> list[str]:
    """Nodes by when they joined (their join keys' creation revisions)."""
    return sorted(joined, key=lambda n: (joined[n], n))


def ready_to_freeze(joined: int, min_nodes: int, max_nodes: int, last_call_passed: bool) -> bool:
    return joined >= max_nodes or (joined >= min_nodes and last_call_passed)


def assign_ranks(members: list[str], previous: Mapping[str, int]) -> dict[str, int]:
    """Ranks 0..n-1: a member keeps its previous rank when it is still in range and free; the
    others take the free ranks in join order. Rank 0 is never left to a newcomer while a member
    of the last round is here: its node hosts the workers' store (MASTER_ADDR), and a node
    that ran already starts its workers warm, while torch's clients wait out a backoff of
    seconds for a store that comes up late (a new node's workers start cold)."""
    n = len(members)
    ranks: dict[str, int] = {}
    taken: set[int] = set()
    for m in members:
        r = previous.get(m)
        if r is not None and r < n and r not in taken:
            ranks[m] = r
            taken.add(r)
    if ranks and 0 not in taken:
        first = min(ranks, key=lambda m: ranks[m])
        taken.discard(ranks[first])
        ranks[first] = 0
        taken.add(0)
    free = iter(r for r in range(n) if r not in taken)
    for m in members:
        if m not in ranks:
            ranks[m] = next(free)
    return ranks


def spares(joined: Mapping[str, int], max_nodes: int) -> list[str]:
    """Joined nodes beyond MAX (the last to come): they wait for a place."""
    return join_order(joined)[max_nodes:]


def freeze(
    state: RoundState,
    joined: Mapping[str, int],
    infos: Mapping[str, Member],
    min_nodes: int,
    max_nodes: int,
    freezer: str | None = None,
) -> RoundState | None:
    """Fix the round's members (the node that freezes, `freezer`, and the first others to
    join, MAX in all) and their ranks; None if fewer than MIN are left. Members of different
    versions close the job instead. The freezer (by default the first to join) leads the
    round from here on: the others follow its leader key."""
    order = [n for n in join_order(joined) if n in infos]
    if freezer is not None and freezer in infos:
        order = [freezer] + [n for n in order if n != freezer]
    order = order[:max_nodes]
    if len(order) < min_nodes:
        return None
    members = {n: infos[n] for n in order}
    conflict = member_conflict(members)
    if conflict is not None:
        return close(state, CloseReason.ERROR, f"nodes run different versions: {conflict}")
    ranks = assign_ranks(order, state.prev_ranks)
    by_rank = sorted(order, key=lambda n: ranks[n])
    offsets: dict[str, int] = {}
    role_offsets: dict[str, int] = {}
    role_worlds: dict[str, int] = {}
    world = 0
    for n in by_rank:  # global and role ranks both count in group rank order, as torch's
        role = members[n].role
        offsets[n], role_offsets[n] = world, role_worlds.get(role, 0)
        world += members[n].lws
        role_worlds[role] = role_offsets[n] + members[n].lws
    master = members[by_rank[0]]
    return replace(
        state,
        status=Status.FROZEN,
        nodes=members,
        size=len(members),
        ranks=ranks,
        offsets=offsets,
        role_offsets=role_offsets,
        role_worlds=role_worlds,
        world=world,
        master=(master.addr, master.port),
        shards=shard_count(len(members)),
        leader=order[0],
        left="",
    )


# ---- frozen -----------------------------------------------------------------------------------


def finalize(state: RoundState, confirmed: set[str]) -> RoundState | None:
    """The round goes final once every member confirmed; None until then."""
    if state.status != Status.FROZEN or not state.members_complete:
        return None
    if not set(state.nodes) <= confirmed:
        return None
    return replace(state, status=Status.FINAL)


def abandon(state: RoundState) -> RoundState:
    """A member (or the leader) vanished before the round was final: a new joinable round."""
    return replace(
        state,
        version=state.version + 1,
        status=Status.JOINABLE,
        **_no_members(),
        leader="",
        notes={},
    )


# ---- final --------------------------------------------------------------------------------------


def spend(state: RoundState, limit: int) -> RoundState | None:
    """`state` with one more of the job's restarts spent (a group restart, or a worker replaced
    alone: one count for both), or None when `limit` are spent already."""
    spent = RestartBudget(state.restarts, limit).spend()
    return None if spent is None else replace(state, restarts=spent.spent)


def reopen(
    state: RoundState,
    reason: RestartReason,
    max_restarts: int,
    failure: str = "",
    left: str = "",
) -> RoundState:
    """Leave final round `state` for the next one. A failure spends one restart, or closes the
    job when none is left (`failure` says what failed, for the closing message). `left`: the
    member whose leaving ends the round, so that the others can say who it was."""
    restarts = state.restarts
    if reason == RestartReason.FAILURE:
        spent = spend(state, max_restarts)
        if spent is None:
            exhausted = RestartBudget(restarts, max_restarts).exhausted(failure)
            return close(state, CloseReason.FAILED, exhausted)
        restarts = spent.restarts
    return replace(
        state,
        version=state.version + 1,
        status=Status.JOINABLE,
        restarts=restarts,
        **_no_members(),
        # Only the node that froze the round has them all (the next freezer reads them).
        prev_ranks=dict(state.ranks) if state.members_complete else {},
        ran=state.version,
        leader="",
        notes={},
        left=left,
    )


def _no_members() -> dict[str, Any]:
    """A joinable round's membership fields: none."""
    return dict(
        nodes={},
        ranks={},
        offsets={},
        role_offsets={},
        role_worlds={},
        size=0,
        world=0,
        master=("", 0),
        shards=0,
    )


def admissible(waiting: set[str], size: int, max_nodes: int) -> bool:
    """Whether a running round of `size` members should make room: nodes wait and there is
    room for them."""
    return bool(waiting) and size < max_nodes


def still_runs(state: RoundState | None, version: int) -> bool:
    """Whether `state` is still round `version`, final."""
    return state is not None and state.version == version and state.status == Status.FINAL


def everyone_done(state: RoundState, done: set[str]) -> bool:
    """Whether every member of final round `state` (all of its members, read) is done."""
    return state.status == Status.FINAL and state.members_complete and set(state.nodes) <= done


def close(
    state: RoundState, reason: CloseReason, detail: str = "", expires_at: float | None = None
) -> RoundState:
    return replace(
        state, status=Status.CLOSED, closed=JobClosed(reason, detail), expires_at=expires_at
    )


def round_info(state: RoundState, node: str) -> RendezvousInfo:
    """What the final round means for `node` (its own shard of the membership is enough).
    A membership that does not hold together (this node missing, a rank or an offset out of
    range) is a StoreValueError: it was not written by a member of this job."""
    member = state.nodes.get(node)
    rank, offset = state.ranks.get(node), state.offsets.get(node)
    if member is None or rank is None or offset is None:
        bad(f"round {state.version}'s membership", f"no entry for this node ({node!r})")
    if not (rank < state.size and offset + member.lws <= state.world):
        bad(
            f"round {state.version}'s membership",
            f"rank {rank} of {state.size} nodes, ranks {offset} to {offset + member.lws - 1} of "
            f"{state.world} for node {node!r}",
        )
    return RendezvousInfo(
        round=state.version,
        group_rank=state.ranks[node],
        group_world_size=state.size,
        world_size=state.world,
        rank_offset=state.offsets[node],
        master_addr=state.master[0],
        master_port=state.master[1],
        restart_count=state.restarts,
        role_rank_offset=state.role_offsets.get(node),
        role_world_size=state.role_worlds.get(state.nodes[node].role),
    )
