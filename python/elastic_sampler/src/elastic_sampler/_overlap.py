"""Copies to the memory tier that overlap the next step: a save starts the copy on a thread
and returns; the copy must be over before anything changes the state it reads.

What changes a training state in place is the optimizer's step, so a hook before every
``torch.optim`` step waits for the copies in flight. Whatever else changes a large tensor
meanwhile (torch's version counters tell) makes that copy void: the slot keeps the previous
step, and the manager copies later steps before save() returns.
"""

from __future__ import annotations

import os
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from elastic_sampler import _payload
from elastic_sampler._memory import MemorySlot

_in_flight: weakref.WeakSet[Copy] = weakref.WeakSet()
_hook_lock = threading.Lock()
_hooked = False
#: How long an optimizer step waits for a copy before it goes on (the copy is then void).
STEP_WAIT = 300.0


def _before_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    for copy in list(_in_flight):
        copy.join_local(STEP_WAIT)


def _install_hook() -> None:
    global _hooked
    with _hook_lock:
        if not _hooked:
            from torch.optim.optimizer import register_optimizer_step_pre_hook

            register_optimizer_step_pre_hook(_before_step)
            _hooked = True


class _Worker:
    """The one thread that runs this process's copies, in order: starting a thread per save
    would block save() until the new thread is scheduled (about 0.6 ms on a busy machine)."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[Copy] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid = 0

    def submit(self, job: Copy) -> None:
        with self._lock:
            if self._pid != os.getpid():  # none yet, or a forked child's parent had it
                self._jobs = queue.SimpleQueue()
                self._pid = os.getpid()
                threading.Thread(
                    target=self._serve, args=(self._jobs,), name="elastic-memory-copy", daemon=True
                ).start()
            self._jobs.put(job)

    @staticmethod
    def _serve(jobs: queue.SimpleQueue[Copy]) -> None:
        while True:
            jobs.get()._run()


_worker = _Worker()


class Copy:
    """One planned state being copied into `slot` as checkpoint `step`, on the copy thread;
    then `then(kept)` runs there (the copy sent to a peer: it reads the slot, not the state,
    so the next optimizer step need not wait for it). `then(False)` when the slot did not take
    the copy."""

    def __init__(
        self,
        slot: MemorySlot,
        plan: _payload.Plan,
        step: int,
        then: Callable[[bool], None] | None = None,
    ) -> None:
        _install_hook()
        self.step = step
        self.kept: bool | None = None  # once copied: whether the slot took it
        self.error: BaseException | None = None
        self._slot, self._plan, self._then = slot, plan, then
        self._local = threading.Event()  # the state is copied: training may change it
        self._over = threading.Event()
        _in_flight.add(self)
        _worker.submit(self)

    def _run(self) -> None:
        try:
            self.kept = self._slot.put_plan(self._plan, self.step)
        except BaseException as e:
            self.error = e
        finally:
            self._plan = None  # type: ignore[assignment]  # the state's tensors let go
            _in_flight.discard(self)
            self._local.set()
        try:
            if self._then is not None:  # also after a failed copy: the peer waits for word
                self._then(bool(self.kept) and self.error is None)
        except BaseException as e:
            self.error = self.error or e
        finally:
            self._then = None
            self._over.set()

    def join_local(self, timeout: float | None = None) -> bool:
        """Wait until the state is copied; True once it is."""
        return self._local.wait(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the copy and what follows it; True once both are over."""
        return self._over.wait(timeout)
