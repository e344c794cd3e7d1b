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

A process that forks workers (the zygote) calls :func:`freeze` first: the objects the child
shares with it are then never touched by the child's collections or by its scan for open
files at the end (350k objects in a Lightning worker; touching each copies its page, 140 ms
of a stopped worker's end).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import gc
import itertools
import os
import stat
import sys
import weakref
from collections.abc import Callable, Container, Iterable
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


_inherited: list[weakref.ref[Any]] = []  # file objects frozen by freeze() (or the script's)
_gc_freeze = gc.freeze


def _file_types() -> list[type]:
    """Every class of file object: the subclasses of the C base every ``io`` class shares, and
    of ``_pyio``'s, if loaded (walked directly; ``issubclass`` against the ABC costs more than
    the whole scan)."""
    import _io

    roots: list[type] = [_io._IOBase]
    pyio = sys.modules.get("_pyio")
    if pyio is not None:
        roots.append(pyio.IOBase)
    found: list[type] = []
    todo = list(roots)
    while todo:
        kind = todo.pop()
        if any(kind is k for k in found):
            continue
        found.append(kind)
        subclasses: list[type] = type.__subclasses__(kind)
        todo.extend(subclasses)
    return found


def _files(objects: list[Any]) -> list[Any]:
    """The file objects among `objects`, by type, not isinstance: an object's __class__ may be
    a property (torch's deprecated names warn when it is read). The scan stays in C, one set
    lookup per object (of the type's id: a metaclass may make a type unhashable); a Lightning
    worker holds 350k objects."""
    kinds = {id(kind) for kind in _file_types()}
    chosen = map(kinds.__contains__, map(id, map(type, objects)))
    return list(itertools.compress(objects, chosen))


def _writable_descriptors(ignore: Container[int]) -> bool:
    """Whether this process holds a descriptor (beyond standard output and error, which are
    flushed by name, and `ignore`) that a file object could have buffered writes for: a file,
    pipe, socket or block device open for writing (a character device, ``/dev/null`` or a
    terminal, is not counted)."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return True
    for fd in map(int, names):
        if fd in (1, 2) or fd in ignore:
            continue
        try:
            mode = os.fstat(fd).st_mode
            if not (
                stat.S_ISREG(mode)
                or stat.S_ISFIFO(mode)
                or stat.S_ISSOCK(mode)
                or stat.S_ISBLK(mode)
            ):
                continue
            if stat.S_ISSOCK(mode) or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_ACCMODE != os.O_RDONLY:
                return True
        except OSError:
            continue  # listdir's own descriptor, closed by now
    return False


def _note_files() -> None:
    """Note the file objects among those not yet frozen, for :func:`end_process` to flush."""
    for f in _files(gc.get_objects()):
        with contextlib.suppress(TypeError):
            _inherited.append(weakref.ref(f))


def freeze(ignore: Container[int] = ()) -> None:
    """Before a fork: move every object alive into the collector's permanent generation
    (``gc.freeze``), so that a child's collections, and its scan for open files as it ends,
    never touch the objects it shares with this process: touching one copies its page. The
    file objects among them are noted first (a frozen object is not in ``gc.get_objects()``),
    only when a descriptor open for writing (other than `ignore`) could back one; the noted
    ones are flushed, so that what they hold is written once, not again by every child."""
    if _writable_descriptors(ignore):
        _note_files()
    for ref in _inherited:
        f = ref()
        with contextlib.suppress(Exception):
            if f is not None and not f.closed:
                f.flush()
    _gc_freeze()


@functools.wraps(_gc_freeze)
def _freeze_for_script() -> None:
    _note_files()
    _gc_freeze()


def watch_freeze() -> None:
    """Make the script's own ``gc.freeze()`` note the files it freezes, as :func:`freeze`
    does (its end would not see them otherwise)."""
    gc.freeze = _freeze_for_script


def _flush_open_files() -> None:
    """Flush every open file object (text first, then the buffers below them): what the
    interpreter's teardown would have done as it freed them."""
    import io

    files = _files(gc.get_objects()) + [f for f in (r() for r in _inherited) if f is not None]
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
        with contextlib.suppress(Exception):
            _flush_open_files()
        for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
            with contextlib.suppress(Exception):
                if stream is not None:
                    stream.flush()
        os._exit(code & 0xFF if code >= 0 else 1)
