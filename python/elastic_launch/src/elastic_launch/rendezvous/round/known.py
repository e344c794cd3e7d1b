"""What one node knows of its job's keys, and putting it back into a store that was started
again empty (the embedded service's host started again at its address with no standby's copy,
or an etcd that lost its data): as a standby's copy would have, the job's state (its round, the
restart count, a closed job's mark), the round's membership, and this node's own keys.

Each node puts back what it saw last; the newest state wins (:func:`rank`: a later round, then
a later phase of it, then more restarts), so that a node that knows less (a replacement that
created a new job's first round in the empty store) never overwrites one that knows more.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from elastic_launch.rendezvous.api import StoreValueError
from elastic_launch.rendezvous.round.state import RoundState, Status
from elastic_launch.rendezvous.store.api import Store, StoreError

_PHASE = {Status.JOINABLE: 0, Status.FROZEN: 1, Status.FINAL: 2, Status.CLOSED: 3}
#: Reads and swaps of the state a put-back makes at most (each lost swap: a write came first).
MAX_TRIES = 10


def rank(state: RoundState) -> tuple[int, int, int]:
    """How far the job had gone when `state` was written: its round, the round's phase, its
    restarts. A closed job ranks above any round of the same number."""
    return (state.version, _PHASE[state.status], state.restarts)


@dataclass
class Known:
    """The newest state this node saw (and its text), the membership shards of that round,
    and the ephemeral keys this node wrote for itself ({what: (key, value)}: its join key,
    the leader key, its waiting key)."""

    state: RoundState | None = None
    text: bytes = b""
    shards: dict[str, bytes] = field(default_factory=dict)
    mine: dict[str, tuple[str, bytes]] = field(default_factory=dict)

    def saw(self, state: RoundState, text: bytes) -> None:
        """A state read or written: kept if it is not older than the one kept."""
        if self.state is None or rank(state) >= rank(self.state):
            if self.state is not None and state.version != self.state.version:
                self.shards = {}
            self.state, self.text = state, text

    def saw_shards(self, version: int, shards: dict[str, bytes]) -> None:
        """Membership shards of round `version` read or written (kept with its state)."""
        if self.state is None or version >= self.state.version:
            self.shards.update(shards)

    def wrote(self, what: str, key: str, value: bytes) -> None:
        """This node wrote its own ephemeral key `key` (its `what`: join, leader, waiting)."""
        self.mine[what] = (key, value)

    def put_back(self, store: Store, state_key: str) -> None:
        """Write the state into `store` if its own is missing or older, and the shards that
        are missing. (This node's own keys: see :meth:`put_back_mine`.)"""
        for _ in range(MAX_TRIES):  # another node may write between the read and the swap
            if self.state is None or not self._older_in(store, state_key):
                break
        for key, value in sorted(self.shards.items()):
            with contextlib.suppress(StoreError):
                store.create(key, value)

    def _older_in(self, store: Store, state_key: str) -> bool:
        """Replace the store's state with this node's if the store's is missing or older:
        True if it was older and another write came first (read it again)."""
        assert self.state is not None
        found = store.get(state_key)
        try:
            theirs = RoundState.from_json(found.value, found.key) if found is not None else None
        except StoreValueError:
            theirs = None  # not a state: this node's replaces it
        if theirs is not None and rank(theirs) >= rank(self.state):
            return False
        ttl = None
        if self.state.status == Status.CLOSED:
            ttl = max(1.0, (self.state.expires_at or time.time()) - time.time())
        version = found.version if found is not None else 0
        return not store.cas(state_key, self.text, version, ttl=ttl)

    def put_back_mine(self, store: Store, *what: str) -> None:
        """Write this node's own ephemeral keys of kinds `what` again (with its lease)."""
        for kind in what:
            if kind in self.mine:
                key, value = self.mine[kind]
                store.put(key, value, ephemeral=True)
