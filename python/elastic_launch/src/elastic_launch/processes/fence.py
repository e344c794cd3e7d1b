"""Fencing: a worker holds its rank only while its agent's place in the round is certain.

The others go on without a node once its lease expires in the store. A node whose agent is
stopped (SIGSTOP, a frozen VM's agent thread) or cut off from the store renews nothing, yet its
workers run on: without a fence they keep rank 0 of the old round while the new round gives
rank 0 to another. So the agent writes, into a small file of its own in shared memory, until
when its lease is held for sure (a renewal asked at t and answered with TTL holds until
t + TTL at least), less :data:`MARGIN`; each worker reads it every :data:`CHECK_INTERVAL` and,
once that time has passed, stops itself (SIGSTOP): before the store can drop the lease, so
before any new round can start. The agent wakes its workers (SIGCONT) when a renewal shows the
lease held after all, and ends them when it finds the round gone on: with SIGKILL while the
fence holds (a fenced worker's SIGTERM handler would run as a rank the round gave away).

The file holds one little-endian signed 64-bit number: ``time.monotonic_ns()`` (one clock for
every process of the host) until which the workers may run; 0 for no fence (no round runs, or
the store cannot say), 1 for fenced now.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import signal
import struct
import sys
import threading
import time
from collections.abc import Callable

from elastic_launch.cancel import join

logger = logging.getLogger(__name__)

FENCE_FILE_ENV = "ELASTICRUN_FENCE_FILE"
#: Seconds before the lease's sure end at which the workers stop: the lag of a check, and of a
#: stop, with room to spare.
MARGIN = 0.5
CHECK_INTERVAL = 0.05  # seconds between a worker's reads of the file
WRITE_INTERVAL = 0.1  # seconds between the agent's writes
#: Seconds the agent goes on waking its workers once a fence is lifted: one that read the old
#: fence just before stops just after the first wake.
WAKE_FOR = 1.0
_VALUE = struct.Struct("<q")
NO_FENCE, FENCED = 0, 1


def value_of(held_until: float | None) -> int:
    """What the file holds for a lease held until `held_until` (see :meth:`held_until` of the
    rendezvous): 0 for None, 1 for 0.0, else the time to stop at."""
    if held_until is None:
        return NO_FENCE
    return max(FENCED, int((held_until - MARGIN) * 1e9))


def passed(value: int, now_ns: int) -> bool:
    """Whether workers fenced by `value` must stop at `now_ns`."""
    return value != NO_FENCE and now_ns >= value


class FenceWriter:
    """The agent's side: creates the file at `path` (0600, this user's, no fence yet); once
    started, writes :func:`value_of` ``held_until()`` every WRITE_INTERVAL from a thread, and
    calls `wake` when a fence that had passed is lifted (the workers may have stopped
    themselves)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._held_until: Callable[[], float | None] = lambda: None
        self._wake: Callable[[], None] = lambda: None
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.pwrite(self._fd, _VALUE.pack(NO_FENCE), 0)
        self._value = NO_FENCE
        self._waking_until = 0  # monotonic ns
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="elasticrun-fence", daemon=True)

    def env(self) -> dict[str, str]:
        """What tells a worker where the fence is."""
        return {FENCE_FILE_ENV: self.path}

    def start(self, held_until: Callable[[], float | None], wake: Callable[[], None]) -> None:
        self._held_until, self._wake = held_until, wake
        self._thread.start()

    def _run(self) -> None:
        said = False
        while not self._stop.wait(WRITE_INTERVAL):
            try:
                self.write()
            except Exception as e:  # the fence must not take the agent down; said once
                if not said:
                    said = True
                    logger.warning("the workers' fence could not be written (%s)", e)

    def write(self) -> None:
        """Write the fence now (and wake the workers if one that had passed is lifted): from
        the thread, and from the agent before a worker starts."""
        with self._lock:
            value = value_of(self._held_until())
            was = self._value
            self._value = value
            os.pwrite(self._fd, _VALUE.pack(value), 0)
            now = time.monotonic_ns()
            if passed(value, now):
                self._waking_until = 0
            elif passed(was, now):
                self._waking_until = now + int(WAKE_FOR * 1e9)
            waking = now < self._waking_until
        if waking:
            self._wake()

    def fenced(self) -> bool:
        """Whether the fence holds now: the workers stop, or have stopped, at it."""
        return passed(self._value, time.monotonic_ns())

    def signal_for(self, sig: int) -> int:
        """The signal that ends the workers instead of `sig`: SIGKILL while the fence holds
        (a fenced worker's SIGTERM handler would act as a rank the round gave away)."""
        if sig == signal.SIGKILL or not self.fenced():
            return sig
        logger.warning(
            "the workers are stopped at their fence (their round may have gone on without this "
            "node): SIGKILL, not signal %d: they hold ranks no more",
            int(sig),
        )
        return signal.SIGKILL

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            join(self._thread, 2, "the fence thread")
        os.close(self._fd)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def start_watch(path: str) -> threading.Thread | None:
    """The worker's side: a thread that stops this process (SIGSTOP) whenever the fence in
    `path` has passed; None if the file cannot be read (said on stderr)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        sys.stderr.write(f"elasticrun: the fence file '{path}' cannot be read ({e})\n")
        return None
    thread = threading.Thread(target=_watch, args=(fd,), name="elasticrun-fence", daemon=True)
    thread.start()
    return thread


def read_value(fd: int) -> int | None:
    """The fence in the file at `fd`; NO_FENCE for a file cut short (the agent writes it whole
    again within WRITE_INTERVAL); None if it cannot be read."""
    try:
        raw = os.pread(fd, _VALUE.size, 0)
    except OSError:
        return None
    return _VALUE.unpack(raw)[0] if len(raw) == _VALUE.size else NO_FENCE


def _watch(fd: int) -> None:
    said = False
    while True:
        value = read_value(fd)
        if value is None:
            return
        if passed(value, time.monotonic_ns()):
            if not said:
                said = True
                _say(
                    f"elasticrun: this worker (pid {os.getpid()}) stops: its agent has not "
                    "renewed its place in the round, which may go on without this node\n"
                )
            # This thread's own: the stop takes the whole process at once, before this
            # thread reads again (one sent to the process may be taken later). Woken, it
            # reads again: still fenced, it stops again (the agent ends a fenced worker with
            # SIGKILL, which a stop does not hold up).
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
            continue
        time.sleep(CHECK_INTERVAL)


def _say(text: str) -> None:
    """`text` on stderr, if that takes no wait: a full pipe (its reader, the agent, may be the
    one stopped) must not hold up the stop. A pipe that polls writable has room for a write of
    this size (under PIPE_BUF), which is then whole."""
    with contextlib.suppress(OSError, ValueError):
        fd = sys.stderr.fileno()
        if select.select([], [fd], [], 0)[1]:
            os.write(fd, text.encode(errors="replace")[:512])
