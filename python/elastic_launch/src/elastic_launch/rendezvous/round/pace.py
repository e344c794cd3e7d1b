"""How often a node asks the store again when what it read does not let it go on: a write that
lost its compare-and-swap, a state that was missing when read but present when created. Between
nodes, such contention settles in a few tries, which go at once; a store whose reads never
match its writes (a member that answers reads from an old copy) would otherwise keep a node
asking hundreds of times a second, past its join timeout. After the first few, a node asks
at most :data:`RATE` times a second, and gives up with a clear error at its deadline.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from elastic_launch.cancel import NEVER, CancelToken, Deadline
from elastic_launch.rendezvous.api import RendezvousTimeoutError

#: Tries a second at most, once the first ones did not settle it.
RATE = 10.0
#: Tries that go at once (contention between nodes settles in a few).
AT_ONCE = 3


class Pace:
    """Paces one loop: call :meth:`again` before each new try; past `deadline` it raises a
    RendezvousTimeoutError saying `why()` (asked only then)."""

    def __init__(
        self, why: Callable[[], str], deadline: Deadline, cancel: CancelToken = NEVER
    ) -> None:
        self._why = why
        self._deadline = deadline
        self._cancel = cancel
        self.tries = 0

    def again(self) -> None:
        """Before another try: at once for the first few, then after a pause (up to
        1.5/RATE s, jittered so that nodes that collided do not collide again)."""
        self.tries += 1
        if self._deadline.passed:
            raise RendezvousTimeoutError(self._why())
        if self.tries > AT_ONCE:
            pause = random.uniform(1.0, 1.5) / RATE
            self._cancel.wait(self._deadline.left(pause))


def write_lost(what: str, store: str, seconds: float) -> Callable[[], str]:
    """The words of a loop's timeout: `what` the node tried to write, for `seconds`."""

    def why() -> str:
        return (
            f"{what} on {store}: every write lost to a newer state for {seconds:g} s; a store "
            "whose reads do not show its own writes (a stale member named in --rdzv-endpoint, "
            "or a proxy that caches reads) cannot hold a rendezvous: name the members of one "
            "healthy cluster"
        )

    return why
