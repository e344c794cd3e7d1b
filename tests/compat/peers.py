"""Processes for the torchelastic 0.1 compatibility tests, as 0.1's tests ran them (one
``multiprocessing`` process per trainer), forked from a server that has torch imported already
(``forkserver`` with a preload): a trainer costs a fork, not an interpreter and a torch
import. Each reports what it returned, or the type and text of what it raised, on a queue."""

from __future__ import annotations

import multiprocessing
import queue
import time
import traceback
from collections.abc import Callable
from typing import Any

_CTX = multiprocessing.get_context("forkserver")
_CTX.set_forkserver_preload(["torch", "torch.distributed", "elastic_launch.train_loop"])


def context() -> Any:
    return _CTX


def _run(out: Any, index: int, fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    try:
        out.put((index, "ok", fn(*args)))
    except BaseException as e:  # reported, as 0.1's tests put the exception on a queue
        out.put((index, "raised", (type(e).__name__, str(e), traceback.format_exc())))


class Group:
    """Trainer processes started one by one; their outcomes by the order they were started."""

    def __init__(self) -> None:
        self.out = _CTX.Queue()
        self.procs: list[Any] = []

    def start(self, fn: Callable[..., Any], *args: Any) -> int:
        index = len(self.procs)
        p = _CTX.Process(target=_run, args=(self.out, index, fn, args), daemon=True)
        p.start()
        self.procs.append(p)
        return index

    def outcomes(self, count: int | None = None, timeout: float = 120) -> dict[int, tuple]:
        """The first `count` outcomes (all processes' by default), by index."""
        want = len(self.procs) if count is None else count
        got: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        while len(got) < want:
            try:
                index, kind, value = self.out.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(
                    f"only {len(got)} of {want} trainers reported: {got}"
                ) from None
            got[index] = (kind, value)
        return got

    def join(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))

    def end(self) -> None:
        """Kill what still runs (a stuck trainer, one that never reported)."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(10)


def result(outcome: tuple) -> Any:
    kind, value = outcome
    if kind != "ok":
        name, message, tb = value
        raise AssertionError(f"the trainer raised {name}: {message}\n{tb}")
    return value
