"""Cancellation: the token every blocking wait of the launcher takes, and the relay that turns a
signal into a cancelled token.

A signal handler may run between any two bytecodes of the main thread, even while that thread
holds a lock a callback would need; so the handler only writes the signal number to a pipe, and a
relay thread cancels the token (waking every wait registered with it) outside any handler. The
one exception is code that takes no token (a rendezvous handler of torch's): around it,
:func:`foreign_call` lets the handler raise :class:`Cancelled` in the main thread, so that a
signal ends the wait there too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType, TracebackType
from typing import Any

from elastic_launch.api import Cancelled

logger = logging.getLogger(__name__)


class CancelToken:
    """Set once, by a signal or by the code that owns the wait; thread-safe.

    Waits check :attr:`cancelled` or sleep with :meth:`wait`; code blocked elsewhere (a queue, a
    gRPC call) registers a callback with :meth:`on_cancel` that wakes it. A second cancellation
    (a second Ctrl-C) sets :attr:`forced`: stop without grace periods.
    """

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], None]] = {}
        self._next = 0
        self.signum: int | None = None
        self.forced = False

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self, signum: int | None = None) -> None:
        """Cancel (the first time) or force (every later time)."""
        with self._lock:
            if self._event.is_set():
                self.forced = True
                callbacks: list[Callable[[], None]] = []
            else:
                self.signum = signum
                self._event.set()
                callbacks = list(self._callbacks.values())
        for cb in callbacks:
            cb()

    def on_cancel(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` on cancellation (at once if already cancelled); returns the function
        that unregisters it."""
        with self._lock:
            if not self._event.is_set():
                key = self._next
                self._next += 1
                self._callbacks[key] = callback

                def unregister() -> None:
                    with self._lock:
                        self._callbacks.pop(key, None)

                return unregister
        callback()
        return lambda: None

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds; True (at once) if cancelled."""
        return self._event.wait(max(timeout, 0.0))

    def check(self) -> None:
        """Raise :class:`Cancelled` if cancelled."""
        if self._event.is_set():
            raise Cancelled(self.signum)


class _Never(CancelToken):
    def cancel(self, signum: int | None = None) -> None:
        raise RuntimeError("NEVER is shared by every caller that does not cancel: use a token")


#: A token that is never cancelled, for callers that do not cancel (tests, tools).
NEVER: CancelToken = _Never()


class Deadline:
    """A point in time on the monotonic clock (None: no limit) with the time left to it."""

    def __init__(self, seconds: float | None) -> None:
        self.at = None if seconds is None else time.monotonic() + seconds

    def left(self, cap: float | None = None) -> float:
        """Seconds left (never below 0), at most `cap`."""
        left = float("inf") if self.at is None else max(0.0, self.at - time.monotonic())
        return left if cap is None else min(left, cap)

    @property
    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at

    @staticmethod
    def earliest(*deadlines: Deadline | None) -> Deadline:
        """The first to come of `deadlines` (None entries ignored)."""
        found = [d for d in deadlines if d is not None]
        if not found:
            return Deadline(None)
        return min(found, key=lambda d: float("inf") if d.at is None else d.at)


def clock(deadline: Deadline) -> str:
    """When `deadline` comes, as wall-clock time for a message ("no time limit" for none)."""
    if deadline.at is None:
        return "no time limit"
    return time.strftime("%H:%M:%S", time.localtime(time.time() + deadline.left()))


def join(thread: threading.Thread, timeout: float, what: str) -> bool:
    """Wait (up to `timeout`) for `thread` to end; a thread that does not is said, by `what`
    it is, since the launcher's stop then takes that long. True if it ended."""
    thread.join(timeout=timeout)
    if thread.is_alive():
        logger.warning("%s did not end within %.0f s; going on without it", what, timeout)
        return False
    return True


class Notice:
    """Says what a long wait waits for, where and until when: first once it has lasted `after`
    seconds, then every `every` seconds, so no wait is silent for long. `describe` builds the
    message when it is due (it sees the wait's current state)."""

    AFTER = 5.0
    EVERY = 30.0

    def __init__(
        self,
        describe: Callable[[], str],
        log: Callable[[str], None],
        after: float | None = None,
        every: float | None = None,
    ) -> None:
        self._describe = describe
        self._log = log
        self._every = self.EVERY if every is None else every
        self._next = Deadline(self.AFTER if after is None else after)
        self.said = 0

    def due(self) -> Deadline:
        """When the next message is due: a wait wakes then (see :meth:`Deadline.earliest`)."""
        return self._next

    def check(self) -> None:
        """Say it if it is due."""
        if self._next.passed:
            self._log(self._describe())
            self.said += 1
            self._next = Deadline(self._every)


class SignalRelay:
    """Installs handlers for `signals` (main thread only) that cancel `token`; restores the old
    handlers on exit. Outside the main thread it does nothing (the caller owns signals)."""

    def __init__(self, token: CancelToken, signals: Iterable[int]) -> None:
        self.token = token
        self.signals = list(dict.fromkeys(signals))
        self._previous: dict[int, Any] = {}
        self._thread: threading.Thread | None = None
        self._r = self._w = -1

    def __enter__(self) -> SignalRelay:
        if threading.current_thread() is not threading.main_thread() or not self.signals:
            return self
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        self._thread = threading.Thread(target=self._relay, name="elasticrun-signals", daemon=True)
        self._thread.start()
        try:
            for sig in self.signals:
                self._previous[sig] = signal.signal(sig, self._handle)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        with contextlib.suppress(OSError):  # a full pipe: a signal is pending anyway
            os.write(self._w, bytes([signum]))
        if _foreign_calls:
            raise Cancelled(signum)  # the main thread is in code that no token can wake

    def _relay(self) -> None:
        while True:
            try:
                data = os.read(self._r, 64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum == 0:  # __exit__'s sentinel
                    return
                self.token.cancel(signum)

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        if self._thread is not None:
            with contextlib.suppress(OSError):
                os.write(self._w, b"\0")
            join(self._thread, 5, "the signal relay thread")
            self._thread = None
        for fd in (self._r, self._w):
            if fd >= 0:
                os.close(fd)
        self._r = self._w = -1


#: How deep the main thread is in calls that take no cancel token (see :func:`foreign_call`).
_foreign_calls = 0


@contextlib.contextmanager
def foreign_call() -> Iterator[None]:
    """Around a blocking call that takes no cancel token (a handler of torch's, its store):
    in the main thread, a signal the relay handles raises :class:`Cancelled` there, which
    abandons the call. Elsewhere it changes nothing (signals reach the main thread only)."""
    global _foreign_calls
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _foreign_calls += 1
    try:
        yield
    finally:
        _foreign_calls -= 1
