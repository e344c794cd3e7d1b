"""One node's access to a job's keys in the store: their names, and the reads and
compare-and-swap writes of the job's state and of a round's membership.

Keys, under ``/elasticrun/<run id>/``::

    state                  the RoundState (small JSON: no membership); CAS-versioned
    s/v<N>/leader          ephemeral: round N's leader (the first to create it), its name
    s/v<N>/done            round N's leader's workers finished: its leaving is no loss
    s/waiting/<node>       ephemeral: a spare, waiting to be admitted
    m/v<N>/join/<node>     ephemeral (the node's lease): the node joined round N (its Member)
    m/v<N>/members/<shard> round N's membership (ranks, addresses) in shards of 64 nodes,
                           written at its freeze; a node reads its own shard
    m/v<N>/confirm/<node>  ephemeral: the node confirmed frozen round N
    m/done/<node>          the node's workers finished

Every node follows the state and ``s/`` (the shared keys); only a round's leader reads and
watches ``m/``, so that what a node costs the store does not grow with the number of nodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass

from elastic_launch.rendezvous.api import JobClosed
from elastic_launch.rendezvous.round import state as rnd
from elastic_launch.rendezvous.round.known import Known
from elastic_launch.rendezvous.round.state import RoundState, Status
from elastic_launch.rendezvous.store.api import KeyValue, Store, StoreError

#: How long a closed job's state stays in the store (seconds).
CLOSED_TTL = 600.0


@dataclass(frozen=True)
class JobKeys:
    """The names of a job's keys (see the module's docstring)."""

    prefix: str  # /elasticrun/<run id>

    @classmethod
    def of(cls, run_id: str) -> JobKeys:
        return cls(f"/elasticrun/{run_id}")

    @property
    def everything(self) -> str:
        return self.prefix + "/"

    @property
    def state(self) -> str:
        return f"{self.prefix}/state"

    @property
    def m(self) -> str:
        """The rounds' own keys (joins, confirmations, membership) and the finished nodes."""
        return f"{self.prefix}/m/"

    @property
    def shared(self) -> str:
        """What every node follows besides the state: leader keys and spares."""
        return f"{self.prefix}/s/"

    @property
    def waiting(self) -> str:
        return f"{self.shared}waiting/"

    @property
    def done(self) -> str:
        return f"{self.m}done/"

    @property
    def light(self) -> list[str]:
        """What a node that does not lead watches."""
        return [self.state, self.shared]

    def round(self, version: int) -> str:
        return f"{self.m}v{version}/"

    def join(self, version: int) -> str:
        return f"{self.round(version)}join/"

    def confirm(self, version: int) -> str:
        return f"{self.round(version)}confirm/"

    def members(self, version: int) -> str:
        return f"{self.round(version)}members/"

    def leader(self, version: int) -> str:
        """Round `version`'s leader key: where every node looks (with the state), so that the
        nodes that do not lead see the leader come and go on the watch they have anyway."""
        return f"{self.shared}v{version}/leader"

    def leader_done(self, version: int) -> str:
        return f"{self.shared}v{version}/done"


class Job:
    """Node `node`'s reads and writes of the job's state (see the module's docstring)."""

    def __init__(self, store: Store, keys: JobKeys, node: str) -> None:
        self.store = store
        self.keys = keys
        self.node = node
        self.closed: JobClosed | None = None  # the job's end, once this node has seen it
        self.drop: list[str] = []  # finished rounds' keys this node is to delete
        self.confirmed = ""  # the confirmation key this node wrote last
        self._members: tuple[int, RoundState] | None = None  # (round, with its members)
        self.known = Known()  # what it puts back into a store started again empty

    def read(self) -> tuple[RoundState | None, int]:
        return self.state_in([kv] if (kv := self.store.get(self.keys.state)) else [])

    def state_in(self, kvs: list[KeyValue]) -> tuple[RoundState | None, int]:
        kv = next((kv for kv in kvs if kv.key == self.keys.state), None)
        if kv is None:
            return None, 0
        state = RoundState.from_json(kv.value, kv.key)
        self.known.saw(state, kv.value)
        return state, kv.version

    def saw(self, value: bytes, key: str) -> RoundState:
        """A state a watch brought: parsed, and known."""
        state = RoundState.from_json(value, key)
        self.known.saw(state, value)
        return state

    def look(self, leading: bool) -> tuple[list[KeyValue], int]:
        """What a node reads before it watches: the leader the whole job, the others the state
        and the shared keys (the leader keys, the spares), the same whatever N is."""
        if leading:
            return self.store.range(self.keys.everything)
        kvs, revision = self.store.range(self.keys.state)
        shared, shared_revision = self.store.range(self.keys.shared)
        return kvs + shared, min(revision, shared_revision)

    def commit(self, state: RoundState, version: int) -> int:
        """Write `state` if the state key is still at `version` (0: absent): its new version,
        or 0 if someone got there first. A closing state expires after CLOSED_TTL, and the
        job's other keys are removed."""
        if state.status == Status.FROZEN and state.nodes:
            # The membership, in its shards (each node reads its own), with the state that
            # names the round frozen: one transaction on etcd v3. Where the shards go first
            # (v2), a state that loses its CAS leaves those of a round that never froze; the
            # round's keys go with it.
            prefix = self.keys.members(state.version)
            shards = {prefix + str(shard): v for shard, v in state.shard_values().items()}
            written = self.store.cas_with(self.keys.state, state.to_json(), version, shards)
            if written:
                self._members = (state.version, state)
                self.known.saw(state, state.to_json())
                self.known.saw_shards(state.version, shards)
            return written
        if state.status != Status.CLOSED:
            written = self.store.cas(self.keys.state, state.to_json(), version)
            if written:
                self.known.saw(state, state.to_json())
            return written
        state = dataclasses.replace(state, expires_at=time.time() + CLOSED_TTL)
        written = self.store.cas(self.keys.state, state.to_json(), version, ttl=CLOSED_TTL)
        if written:
            self.known.saw(state, state.to_json())
            self.closed = state.closed
            with contextlib.suppress(StoreError):
                self.store.delete(self.keys.m, prefix=True)
                self.store.delete(self.keys.shared, prefix=True)
        return written

    def advance(self, state: RoundState, version: int) -> tuple[RoundState | None, int]:
        """Commit `state` and go on from it at once (not when the watch brings it back), or
        from what got there first. A round made final drops the previous rounds' keys."""
        written = self.commit(state, version)
        if not written:
            found, found_version = self.read()
            if found is not None and found.status in (Status.FROZEN, Status.FINAL):
                found = self.with_members(found)  # None: it moved on again, look again
            return found, found_version
        if state.status == Status.FINAL and state.version > 1:
            # The rounds since the last final one (abandoned ones too), by the follower, off
            # the path to the workers' start.
            rounds = range(state.ran or 1, state.version)
            self.drop = [self.keys.round(v) for v in rounds]
            self.drop += [f"{self.keys.shared}v{v}/" for v in rounds]
        return state, written

    def with_members(
        self, state: RoundState, every: bool = False, confirm: bool = False
    ) -> RoundState | None:
        """`state` (frozen or final) with its round's membership: this node's shard (one read
        per round, kept), or with `every` all of them (the leader, a spare, the job's end);
        None if the shards are gone (the round has moved on: look again). With `confirm`,
        the read of the shard also writes this node's confirmation of the frozen round (one
        request on etcd v3, where a member's part of the freeze is then one round trip);
        :attr:`confirmed` says whether it was written."""
        if not state.size or state.members_complete:
            return state
        cached = self._members
        stale = cached is None or cached[0] != state.version
        if stale or (every and cached is not None and not cached[1].members_complete):
            values = self._read_members(state, every, confirm)
            if not values:
                return None
            cached = self._members = (
                state.version,
                state.with_shards(values, self.keys.members(state.version)),
            )
        assert cached is not None
        # Parsed once per round: the state's other fields may have moved on (notes).
        m = cached[1]
        return dataclasses.replace(
            state,
            nodes=m.nodes,
            ranks=m.ranks,
            offsets=m.offsets,
            role_offsets=m.role_offsets,
            role_worlds=m.role_worlds,
        )

    def _read_members(self, state: RoundState, every: bool, confirm: bool) -> list[bytes]:
        prefix = self.keys.members(state.version)
        if every:
            kvs, _ = self.store.range(prefix)
        else:
            shard = prefix + str(rnd.shard_of(self.node, state.shards))
            if confirm:
                key = self.confirm_key(state.version)
                kv = self.store.put_get(key, b"1", shard, ephemeral=True)
                self.confirmed = key
            else:
                kv = self.store.get(shard)
            kvs = [kv] if kv is not None else []
        self.known.saw_shards(state.version, {kv.key: kv.value for kv in kvs})
        return [kv.value for kv in kvs]

    def confirm_key(self, version: int) -> str:
        return f"{self.keys.confirm(version)}{self.node}"

    def unconfirm(self, version: int) -> None:
        """Take back a confirmation written with the read of a round that turned out not to
        include this node (or to have moved on)."""
        if self.confirmed == self.confirm_key(version):
            self.confirmed = ""
            with contextlib.suppress(StoreError):
                self.store.delete(self.confirm_key(version))

    def ran_ranks(self, ran: int) -> dict[str, int]:
        """The ranks of round `ran` (the last that ran), read from its membership."""
        with contextlib.suppress(StoreError):
            kvs, _ = self.store.range(self.keys.members(ran))
            members = RoundState(ran, Status.FINAL).with_shards(
                [kv.value for kv in kvs], self.keys.members(ran)
            )
            return dict(members.ranks)
        return {}
