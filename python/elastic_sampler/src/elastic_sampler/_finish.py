"""Background saves outlive a script that forgets ``close()``.

A background write runs on a daemon thread. Left alone at interpreter exit it dies inside
torch (SIGABRT or SIGSEGV) and the checkpoint is lost. So the process waits for unfinished
writes, bounded: at exit (``sys.exit``, the script returning, a forked worker ending) and on
SIGTERM (a launcher stopping the worker: bounded by the grace the launcher gives before
SIGKILL). Past the bound a write is abandoned: its temporary file is removed and the process
says so. Only the default SIGTERM disposition is replaced, and only while a write is pending.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

# How long a stopping launcher waits before SIGKILL: elasticrun tells its workers; torchrun's
# default is $TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30 s, as is Slurm's KillWait.
GRACE_ENV = ("ELASTICRUN_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
DEFAULT_GRACE = 30.0
JOIN_AFTER_ABANDON = 2.0  # a write stops at its next block once abandoned


class Pending(Protocol):
    finish_timeout: float

    def finish(self, timeout: float, why: str, hint: str) -> bool:
        """Wait up to `timeout` s for the write, else abandon it; say what happened. False if
        the abandoned write's thread still runs."""


_pending: dict[int, Pending] = {}  # id -> manager with a write in flight
_lock = threading.Lock()
_exit_hook = False


def say(message: str) -> None:
    with contextlib.suppress(OSError, ValueError):  # stderr closed: nothing to tell
        print(f"elastic_sampler: {message}", file=sys.stderr, flush=True)


def grace() -> float:
    """Seconds a SIGTERM leaves before SIGKILL, minus a margin to clean up."""
    for name in GRACE_ENV:
        raw = os.environ.get(name)
        if raw:
            try:
                seconds = float(raw)
            except ValueError:
                continue
            if math.isfinite(seconds) and seconds >= 0:
                return max(0.0, min(seconds - 1.0, seconds * 0.9))
    return DEFAULT_GRACE - 1.0


def started(manager: Pending) -> None:
    """A background write of `manager` began: make sure exit and SIGTERM wait for it."""
    global _exit_hook
    with _lock:
        _pending[id(manager)] = manager
        hook = not _exit_hook
        _exit_hook = True
    if hook:
        _register_exit(_at_exit)
    _take_sigterm()


def finished(manager: Pending) -> None:
    with _lock:
        _pending.pop(id(manager), None)
        idle = not _pending
    if idle:
        _give_back_sigterm()


def _register_exit(hook: Callable[[], None]) -> None:
    # threading's exit hooks run before the interpreter joins its threads, and also when a
    # forked child ends the way multiprocessing's do (threading._shutdown); atexit as fallback.
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError
        register(hook)
    except RuntimeError:
        import atexit

        atexit.register(hook)


def _finish_all(limit: float, why: str, hint: str) -> bool:
    with _lock:
        managers = list(_pending.values())
    deadline = time.monotonic() + limit
    stopped = True
    for m in managers:
        bound = max(0.0, min(m.finish_timeout, deadline - time.monotonic()))
        stopped &= m.finish(bound, why, hint)
    return stopped


def _at_exit() -> None:
    why = "the script ended without CheckpointManager.close()"
    if not _finish_all(float("inf"), why, "raise its finish_timeout, or call close() first"):
        # A thread still inside torch.save would crash the interpreter's finalisation.
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(1)


def _take_sigterm() -> None:
    if threading.current_thread() is not threading.main_thread():
        return  # only the main thread may set handlers; exit still waits
    try:
        if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):
        pass


def _give_back_sigterm() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    try:
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except (ValueError, OSError):
        pass


def _on_sigterm(signum: int, frame: Any) -> None:
    hint = "the time between SIGTERM and SIGKILL was too short: raise --shutdown-timeout"
    _finish_all(grace(), "SIGTERM arrived", hint)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGTERM)  # die of it, as without us
