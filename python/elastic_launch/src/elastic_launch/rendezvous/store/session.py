"""A store session: one agent's connection to the store with its lease, and the waits of the
rendezvous over watches, each bounded by a deadline and ended at once by a cancellation or by
the loss of the lease (no polling: every wake-up comes through an :class:`Inbox`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from elastic_launch.cancel import NEVER, CancelToken, Deadline
from elastic_launch.rendezvous.store.api import Change, Inbox, Store


def _nothing() -> None:
    pass


class Session:
    def __init__(self, store: Store, ttl: float) -> None:
        self.store = store
        self.ttl = ttl
        self._lock = threading.Lock()
        self._open = False
        self._lost = False
        self._losses = 0
        self._inboxes: set[Inbox] = set()
        self._cancel: CancelToken = NEVER
        self._unregister: Callable[[], None] = _nothing

    @property
    def cancel(self) -> CancelToken:
        return self._cancel

    def use(self, cancel: CancelToken) -> None:
        """Bind the session (and its store's requests) to `cancel` from now on."""
        if cancel is self._cancel:
            return
        self._unregister()
        self._cancel = cancel
        self.store.cancel = cancel
        self._unregister = cancel.on_cancel(self._wake_all)

    def prepare(self) -> None:
        """Ask for the lease now, without waiting: `open` finds it granted."""
        if not self._open:
            self.store.request_lease(self.ttl)

    def open(self) -> None:
        """Take the lease (once): ephemeral keys can be written from now on."""
        if not self._open:
            self.store.start_liveness(self.ttl, self._lease_lost)
            self._open = True

    def _lease_lost(self) -> None:
        with self._lock:
            self._lost = True
            self._losses += 1
        self._wake_all()

    def _wake_all(self) -> None:
        with self._lock:
            inboxes = list(self._inboxes)
        for inbox in inboxes:
            inbox.wake()

    def take_lost(self) -> bool:
        """True (once) if the lease expired since the last call: ephemeral keys are gone and
        must be written again (a new lease is already in place)."""
        with self._lock:
            lost, self._lost = self._lost, False
            return lost

    @property
    def losses(self) -> int:
        """How many times the lease was lost so far: a loss since a moment is a change of it."""
        with self._lock:
            return self._losses

    @contextmanager
    def watching(self, prefixes: list[str], after_revision: int) -> Iterator[Inbox]:
        """Watch every prefix (a key watches itself) after `after_revision`, into one inbox that
        a cancellation and a lost lease wake too."""
        inbox = Inbox()
        with self._lock:
            self._inboxes.add(inbox)
        try:
            self.store.watch_many(prefixes, after_revision, inbox)
            yield inbox
        finally:
            with self._lock:
                self._inboxes.discard(inbox)
            inbox.close()

    def wait(self, inbox: Inbox, deadline: Deadline, cap: float | None = None) -> list[Change]:
        """The next changes, or [] when woken or when the deadline (or `cap` seconds) passed;
        raises Cancelled when the session's token is. A lost lease wakes each wait under way
        once; a caller that must act on it looks at `take_lost()` before it waits (a wait that
        returned at once for as long as the loss was untaken would spin in every caller
        that has nothing to do about it)."""
        self._cancel.check()
        batch = inbox.next(deadline.left(cap))
        self._cancel.check()
        return batch or []

    def deleted_within(self, keys: list[str], after_revision: int, seconds: float) -> set[str]:
        """Which of `keys` are deleted (or expire) within `seconds`, watching from
        `after_revision` on."""
        gone: set[str] = set()
        deadline = Deadline(seconds)
        with self.watching(sorted(keys), after_revision) as inbox:
            while gone != set(keys) and not deadline.passed:
                for change in self.wait(inbox, deadline):
                    if change.value is None and change.key in keys:
                        gone.add(change.key)
        return gone

    def close(self) -> None:
        self._unregister()
        self.store.close()
