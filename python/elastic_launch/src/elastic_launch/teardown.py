"""How a worker lets go of its process groups and ends, so that torch's teardown never deadlocks.

``ProcessGroupGloo``'s destructor joins its work thread. When the last reference to a group is
dropped by an object that pybind frees with the GIL held (a ``DistributedDataParallel`` model's
Reducer, freed after the script called ``destroy_process_group``), the join runs with the GIL
held; if the work thread is at that moment freeing a finished work whose saved thread-local
state holds a Python object (every backward stashes one since torch 2.12) or a tensor Python
sees, it waits for the GIL: a deadlock. Interpreter finalization frees everything in an order
nobody chooses, and torch's objects freed then have crashed processes too (SIGABRT).

So a worker

- keeps every group that is ended (by the script's ``destroy_process_group``, by the train
  loop's re-forming) referenced until the process ends (:func:`keep`): the last reference is
  then never a holder's, whatever order the script drops them in;
- ends without the interpreter's teardown (:func:`end_process`): its threads are joined, its
  exit handlers run, its open files and streams flushed, then ``os._exit``. Python does not
  promise ``__del__`` for objects alive at exit; exit handlers (``atexit``,
  ``weakref.finalize``, ``logging``) run as before.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any, NoReturn

_kept: list[Any] = []  # every process group ended in this process, until it ends


def keep(groups: Iterable[Any]) -> None:
    """Keep `groups` (process groups about to be ended) referenced until the process ends."""
    for group in groups:
        if group is not None and not any(group is g for g in _kept):
            _kept.append(group)


def kept() -> list[Any]:
    """The groups kept so far (for tests)."""
    return list(_kept)


def live_groups(c10d: ModuleType | None = None) -> list[Any]:
    """The process groups torch knows in this process (its default group among them)."""
    c10d = c10d or sys.modules.get("torch.distributed.distributed_c10d")
    world = getattr(c10d, "_world", None)
    return list(getattr(world, "pg_map", {}) or {})


def keep_destroyed_groups(c10d: ModuleType) -> None:
    """Make ``destroy_process_group`` keep the groups it destroys (:func:`keep`), in torch's
    ``distributed_c10d`` and, if loaded, ``torch.distributed``; once."""
    original: Callable[..., Any] | None = getattr(c10d, "destroy_process_group", None)
    if original is None or getattr(original, "_elasticrun_keeps", False):
        return

    @functools.wraps(original)
    def destroy_process_group(group: Any = None) -> Any:
        keep(live_groups(c10d) if group is None else [group])
        return original(group)

    destroy_process_group._elasticrun_keeps = True  # type: ignore[attr-defined]
    c10d.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]
    dist = sys.modules.get("torch.distributed")
    if dist is not None and getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group  # type: ignore[attr-defined]


def _flush_open_files() -> None:
    """Flush every open file object (text first, then the buffers below them): what the
    interpreter's teardown would have done as it freed them."""
    import gc
    import io

    # By type, not isinstance: an object's __class__ may be a property (torch's deprecated
    # names warn when it is read), and every object alive passes here.
    files = [o for o in gc.get_objects() if issubclass(type(o), io.IOBase)]
    files.sort(key=lambda f: not issubclass(type(f), io.TextIOBase))
    for f in files:
        with contextlib.suppress(Exception):
            if not f.closed:
                f.flush()


def end_process(code: int, run_exit_handlers: bool = True) -> NoReturn:
    """End this process as an interpreter would, without its teardown: join its threads and
    run threading's exit hooks (they finish background checkpoint saves), run the exit
    handlers (not in a copy of the launcher: a forked function must not run the launcher's),
    flush what is buffered, and exit with `code`."""
    try:
        threading = sys.modules.get("threading")
        if threading is not None:
            threading._shutdown()
        if run_exit_handlers:
            import atexit

            atexit._run_exitfuncs()
    finally:
        _flush_open_files()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF if code >= 0 else 1)
