"""What the zygote imports (``--preload``), and when workers must not be forked from it.

``--preload auto`` (the default) forks every Python worker from a zygote, and has the zygote
import torch when the entrypoint imports torch (read from its source, never executed), the
classic train loop's modules when it runs the loop, and the installed packages the script
imports at its top (Lightning, Accelerate, transformers, torchvision...; never the script's own
modules, whose import may read a worker's environment): a start or restart then costs a fork
instead of a new interpreter and those imports. Modules named with
``--preload`` are imported on top; ``--preload none`` starts fresh interpreters.

Forking gives a worker what a fresh interpreter would (the parity tests prove it) except where
this module says otherwise: a program that is not Python (:func:`plan`), and a worker whose
environment differs from the zygote's in a variable read when the interpreter or torch starts
(:func:`import_time_mismatch`). The zygote itself reports threads and CUDA
(:func:`elastic_launch.processes.zygote.fork_hazard`).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from elastic_launch import learned
from elastic_launch.processes.entrypoint import Entrypoint, Kind, main_path

AUTO = "auto"
NONE = "none"
#: What --preload auto adds for an entrypoint that imports torch, or runs the classic train loop
#: (whose workers meet in a rendezvous of their own, over gRPC).
TORCH = "torch"
TRAIN_LOOP = "elastic_launch.train_loop"
LOOP_RENDEZVOUS = "elastic_launch.rendezvous.etcd.v3"
#: What the first optimizer or DDP model imports: 1.5 s alone, 3-5 s when several workers import
#: it at once on this 2-core machine, paid by every new worker before its first step. ``auto``
#: preloads it for a script that builds one (a worker's teardown cannot deadlock on it since the
#: workers keep the groups they end and skip the interpreter's teardown: ``teardown``).
DYNAMO = "torch._dynamo"
_DYNAMO_USERS = ("torch.optim", "torch.nn.parallel", "torch.distributed.optim")
_DYNAMO_MENTIONS = {"optim", "DistributedDataParallel"}
#: The project's sampler and checkpoints: 45 ms to import with torch loaded, on every new
#: worker's way to its first step; it starts no thread. Preloaded for a script that imports it.
SAMPLER = "elastic_sampler"
#: At most this many of the entrypoint's own files are read to find whether it imports torch.
_MAX_SCANNED_FILES = 200
#: Variables read when the interpreter, the C runtime or torch's libraries start (a forked worker
#: keeps the zygote's values): by prefix, and by name.
_IMPORT_TIME_PREFIXES = (
    "PYTHON",
    "LD_",
    "OMP_",
    "KMP_",
    "GOMP_",
    "MKL_",
    "OPENBLAS_",
    "MALLOC_",
    "TORCHDYNAMO_",
    "TORCHINDUCTOR_",
    "TORCH_COMPILE",
)
_IMPORT_TIME_NAMES = (
    "GLIBC_TUNABLES",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_LOGS",
    "TORCH_SHOW_CPP_STACKTRACES",
)
#: What the launcher sets only for the workers, never read before the script runs.
_PER_WORKER = ("PYTHON_EXEC",)


@dataclass(frozen=True)
class PreloadPlan:
    """How a launch starts its workers: forked from a zygote importing `modules`, or (`why_not`
    set) fresh interpreters, and why."""

    modules: list[str]
    zygote: bool
    why_not: str | None = None
    #: What ``auto`` added for the packages the script imports: left out of the zygote, rather
    #: than giving up forking, when importing them makes forking unsafe (a thread they start).
    optional: tuple[str, ...] = ()
    #: What an earlier run of the entrypoint learned its workers import (``auto``): imported
    #: after `modules`, checked (:mod:`~elastic_launch.learned`).
    kept: learned.ImportPlan | None = None


def plan(preload: list[str], entrypoint: Entrypoint, kept: str | None = None) -> PreloadPlan:
    """The zygote for `preload` (``LaunchConfig.preload``: module names, with ``auto`` for
    the automatic choice; empty: none) and `entrypoint`; with ``auto``, what an earlier run
    learned is imported too when the file at `kept` (read here, once) holds it for this
    entrypoint."""
    auto = AUTO in preload
    named = [m for m in preload if m != AUTO]
    if not preload:
        return PreloadPlan([], zygote=False)
    if not entrypoint.is_python:
        what = "--preload auto" if not named else f"--preload {','.join(named)}"
        return PreloadPlan(
            [],
            zygote=False,
            why_not=f"{what}: '{entrypoint.target}' is not run by Python (a program, or "
            "--no-python); its workers start as fresh processes",
        )
    if not auto:
        return PreloadPlan(named, zygote=True)
    base, packages = _auto(read_sources(entrypoint))
    modules = [m for m in base + packages if m not in named]
    optional = tuple(m for m in packages if m in modules)
    key = learned.entrypoint_key(entrypoint.kind.value, entrypoint.target)
    earlier = learned.read_kept(kept, key) if kept is not None else None
    return PreloadPlan(modules + named, zygote=True, optional=optional, kept=earlier)


def _source_files(entrypoint: Entrypoint) -> tuple[list[str], str | None, str | None]:
    """The entrypoint's own source files to read first, the directory its sibling modules
    are found in (None: follow nothing), and the directory what is followed must be inside
    (a module of a package: that package, never the whole of site-packages or the stdlib)."""
    target = entrypoint.target
    if entrypoint.kind == Kind.FUNCTION:
        path = main_path(target) or _file_of(inspect.getmodule(target))
        return ([path], os.path.dirname(path), None) if path else ([], None, None)
    if entrypoint.kind == Kind.MODULE:
        name = str(target)
        if name.split(".", maxsplit=1)[0] == TORCH:
            return ["<torch>"], None, None
        try:
            spec = importlib.util.find_spec(name)  # Entrypoint.check found it the same way
        except (ImportError, ValueError):
            return [], None, None
        origin = spec.origin if spec is not None else None
        if not origin or not origin.endswith(".py"):
            return [], None, None
        top = origin
        for _ in name.split(".")[1:]:
            top = os.path.dirname(top)
        return [origin], os.path.dirname(top), top if "." in name else None
    path = str(target)
    if os.path.isdir(path):
        path = os.path.join(path, "__main__.py")
    return [path], os.path.dirname(os.path.abspath(path)), None


def _file_of(module: object) -> str | None:
    path = getattr(module, "__file__", None)
    return os.path.abspath(path) if path and path.endswith(".py") else None


def _parse(path: str) -> ast.AST | None:
    try:
        with open(path, "rb") as f:
            return ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return None


def _imported_names(tree: ast.AST) -> Iterable[tuple[str, int]]:
    """(module name, relative level) of every import statement in the file, wherever it is
    (functions and ``if __name__ == "__main__"`` blocks included)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, 0
        elif isinstance(node, ast.ImportFrom):
            yield node.module or "", node.level
            for alias in node.names:  # from pkg import module (or from . import module)
                yield ".".join(filter(None, (node.module, alias.name))), node.level


def _mentioned(tree: ast.AST) -> set[str]:
    """The names and attribute names the file uses (``torch.optim.SGD``: optim, SGD)."""
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.Name):
            found.add(node.id)
    return found


def _top_level(tree: ast.AST) -> Iterable[str]:
    """The modules a file imports when it runs: its module-level imports (inside ``if``,
    ``try`` and ``with`` blocks too, ``if __name__ == "__main__"`` included), not those of
    its functions and classes, which run later if at all. Absolute names only."""
    body = list(getattr(tree, "body", []))
    while body:
        node = body.pop(0)
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module
            # What a package loads lazily (transformers' Trainer) loads only when asked for.
            yield from (f"{node.module}:{a.name}" for a in node.names if a.name != "*")
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", [])]
            for handler in getattr(node, "handlers", []):
                body += handler.body


@dataclass(frozen=True)
class Sources:
    """What the entrypoint's own source files import and mention (read, never run)."""

    imports: set[str]
    mentions: set[str]
    top: set[str] = frozenset()  # type: ignore[assignment]  # what they import as they run
    own: str | None = None  # the directory of the entrypoint's own modules


def read_sources(entrypoint: Entrypoint) -> Sources:
    """The modules the entrypoint imports (absolute names) and the names it uses: its source,
    and that of the modules of its own directory it imports (followed to any depth, at most a
    few hundred files), read but never run. What a module elsewhere imports for it is not
    seen."""
    files, root, inside = _source_files(entrypoint)
    if files == ["<torch>"]:
        return Sources({str(entrypoint.target)}, set())
    found: set[str] = set()
    mentions: set[str] = set()
    top: set[str] = set()
    seen: set[str] = set()
    while files and len(seen) < _MAX_SCANNED_FILES:
        path = files.pop()
        if path in seen:
            continue
        seen.add(path)
        tree = _parse(path)
        if tree is None:
            continue
        mentions |= _mentioned(tree)
        top.update(_top_level(tree))
        here = os.path.dirname(path)
        for name, level in _imported_names(tree):
            if level == 0 and name:
                found.add(name)
            base = here if level else root
            for _ in range(max(level - 1, 0)):
                base = os.path.dirname(base) if base else None
            if base is None:
                continue
            parts = [p for p in name.split(".") if p]
            stem = os.path.join(base, *parts)
            for candidate in (stem + ".py", os.path.join(stem, "__init__.py")):
                if inside is not None and not candidate.startswith(inside + os.sep):
                    continue
                if parts and os.path.isfile(candidate):
                    files.append(candidate)
    return Sources(found, mentions, top, inside or root)


def _auto(sources: Sources) -> tuple[list[str], list[str]]:
    """What ``--preload auto`` imports, in two parts: what the launcher's own knowledge picks
    (torch when the entrypoint imports torch, torch._dynamo when it builds an optimizer or a
    DDP model, elastic_sampler when it uses it, the classic train loop with its rendezvous
    client when it runs the loop), and the script's other installed packages
    (:func:`installed_packages`)."""
    names = sources.imports
    roots = {n.split(".", maxsplit=1)[0] for n in names}
    modules = [TORCH] if TORCH in roots else []
    if modules and _builds_dynamo_users(sources):
        modules.append(DYNAMO)
    if modules and SAMPLER in roots:
        modules.append(SAMPLER)
    if any(n == TRAIN_LOOP or n.startswith(TRAIN_LOOP + ".") for n in names):
        modules += [TRAIN_LOOP, LOOP_RENDEZVOUS]
    return modules, [m for m in installed_packages(sources) if m not in modules]


#: Never imported for a script by --preload auto: the launcher's own packages (loaded as
#: needed), and what is not a package to import.
_NOT_PRELOADED = {TORCH, "elastic_launch", "elastic_core", "__future__", "__main__"}


def installed_packages(sources: Sources) -> list[str]:
    """The modules of installed packages the entrypoint imports as it starts (sorted): not
    the standard library (cheap), not the entrypoint's own modules (their import is the
    script's own code, which may read a worker's environment), not what is not installed."""
    out = []
    for name in sorted(sources.top):
        root = name.split(".", maxsplit=1)[0].split(":", maxsplit=1)[0]
        if root in _NOT_PRELOADED or root in sys.stdlib_module_names:
            continue
        try:
            spec = importlib.util.find_spec(root)  # finds; imports nothing for a top name
        except (ImportError, ValueError):
            continue
        origin = spec.origin if spec is not None else None
        places = (
            [origin] if origin else list(getattr(spec, "submodule_search_locations", None) or [])
        )
        if not places or any(_inside(p, sources.own) for p in places):
            continue
        out.append(name)
    return out


def _inside(path: str, directory: str | None) -> bool:
    if directory is None:
        return False
    return os.path.abspath(path).startswith(os.path.abspath(directory) + os.sep)


def _builds_dynamo_users(sources: Sources) -> bool:
    """Whether the sources build what imports ``torch._dynamo`` on first use: an optimizer
    (``torch.optim``, however imported) or ``DistributedDataParallel``."""
    if any(n.startswith(_DYNAMO_USERS) for n in sources.imports):
        return True
    return bool(sources.mentions & _DYNAMO_MENTIONS)


def import_time_mismatch(
    zygote_env: Mapping[str, str], worker_env: Mapping[str, str]
) -> str | None:
    """Why a worker with `worker_env` must not be forked from a zygote started with
    `zygote_env`, or None: a variable read when the interpreter or a native library starts (a
    forked worker would keep the zygote's value) differs between the two."""
    keys = {
        k
        for k in zygote_env.keys() | worker_env.keys()
        if (k.startswith(_IMPORT_TIME_PREFIXES) or k in _IMPORT_TIME_NAMES) and k not in _PER_WORKER
    }
    differ = sorted(k for k in keys if zygote_env.get(k) != worker_env.get(k))
    if not differ:
        return None
    shown = ", ".join(
        f"{k}={worker_env[k]!r}" if k in worker_env else f"{k} unset" for k in differ[:3]
    )
    return (
        f"the workers' environment ({shown}) differs from the zygote's in what is read when "
        "Python or torch starts"
    )
