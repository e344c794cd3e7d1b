"""What the workers import, learned: the zygote's preload once the workers have made a step.

``--preload auto`` guesses a script's imports from its text; a guess misses what is imported
through a wrapper (``runpy``, ``python -m pkg.train``, a console script, a config framework),
inside a function, or lazily by torch itself (the first DDP model and optimizer step import
``torch._dynamo``). So each worker writes the names of the modules it holds once it has made
its first step (and again at step 100, for what evaluation or ``torch.compile`` brought), to
``$ELASTICRUN_IMPORTS_FILE``; the agent reads the file as untrusted input (:func:`parse`) and
has the zygote fork an *heir* that imports them, in the background, while the job trains. The
heir serves every spawn from then on: replacements and spares fork with those modules
imported.

What must not be imported before a fork is found as the heir imports, one module at a time
(:func:`take`): one whose import starts a thread, opens a device, or reads a variable that
differs in the workers (``RANK``, what the launcher sets per worker, what the script set
itself). Each is left out, with the modules its import brought, and named once; an heir that
imported one is given up for another that leaves it out.

What was learned is kept beside the run's log directory (``--log-dir``): the same job started
again (a requeue, the launcher restarted) has its first zygote import it, checked the same way.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

#: The file a worker writes its modules to (set by the agent for each worker).
IMPORTS_FILE_ENV = "ELASTICRUN_IMPORTS_FILE"
#: The file in the run directory of what a node's workers were seen to import (a
#: :class:`ImportPlan`): the launcher writes it, its hot spares read it.
NODE_FILE = "learned_imports.json"
#: The steps after which a worker writes it (the optimizer's post-step hook).
RECORD_AT_STEPS = frozenset({1, 100})
#: At most this many names are taken from a file, of at most this many bytes.
MAX_NAMES = 20000
MAX_FILE_BYTES = 2 << 20
#: At most this many names of the modules a zygote holds are in its account (one message).
MAX_HELD = 8000
#: A module's name: dotted parts (a file's stem may hold a '-', as _sysconfigdata's does).
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,99}(\.[A-Za-z_][A-Za-z0-9_-]{0,99}){0,19}")
_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
#: Never imported for a worker: what is not a module to import by name, and what acts as it
#: is imported (opens a browser, prints, starts a GUI): a worker's list is its own to write.
_NEVER = {
    "__main__",
    "__mp_main__",
    "__future__",
    "site",
    "sitecustomize",
    "usercustomize",
    "this",
    "antigravity",
    "__hello__",
    "__phello__",
    "idlelib",
    "turtledemo",
    "tkinter",
    "turtle",
}
#: Variables the launcher sets for each worker (torchrun's, and its own by prefix): a module
#: that reads one at import would keep the zygote's value in every worker.
PER_WORKER = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "CUDA_VISIBLE_DEVICES",
    }
)
_PER_WORKER_PREFIXES = ("TORCHELASTIC_", "ELASTICRUN_", "ELASTIC_", "TORCH_NCCL_", "SLURM_PROCID")
#: Devices whose opening at import is harmless in a fork (every process may share them).
_SHAREABLE_DEVICES = {"/dev/null", "/dev/zero", "/dev/random", "/dev/urandom", "/dev/tty"}

# ---- the worker's side (lean: run in every worker) ---------------------------------------------

_start_env: dict[str, str] = {}


def remember_start() -> None:
    """The environment the worker was given: what its script changes is reported beside its
    modules (a module imported after such a change must not be imported without it)."""
    _start_env.clear()
    _start_env.update(os.environ)


def at_step(step: int) -> None:
    """After optimizer step `step`: write the modules held, at the steps that say."""
    path = os.environ.get(IMPORTS_FILE_ENV)
    if path and step in RECORD_AT_STEPS:
        with contextlib.suppress(OSError):  # the launcher learns nothing of it; it trains on
            record(path)


def record(path: str) -> None:
    """Write the names of the modules this process holds (in the order they were loaded), and
    the variables its script changed, to `path`."""
    import json

    from elastic_launch.files import write_atomically

    names = [n for n, m in list(sys.modules.items()) if m is not None]
    keys = os.environ.keys() | _start_env.keys()
    changed = {k: digest(os.environ.get(k)) for k in keys if os.environ.get(k) != _start_env.get(k)}
    write_atomically(path, json.dumps({"modules": names[:MAX_NAMES], "env_changed": changed}))


def digest(value: str | None) -> str | None:
    """What the imports file says of a variable's value: a digest (never the value: it may
    be a secret), None for unset."""
    if value is None:
        return None
    import hashlib

    return hashlib.sha256(value.encode("utf-8", "surrogateescape")).hexdigest()[:32]


# ---- the launcher's side ---------------------------------------------------------------------


@dataclass(frozen=True)
class Imports:
    """What a worker said it imported (module names, in load order) and which variables it
    changed since it started, with a :func:`digest` of each one's value (its script's doing,
    or an import's)."""

    modules: tuple[str, ...]
    env_changed: dict[str, str | None] = field(default_factory=dict)


def parse(data: bytes) -> Imports:
    """A worker's imports file, checked: raises ValueError saying what is wrong with it."""
    import json

    try:
        found = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(found, dict):
        raise ValueError("not a JSON object")
    modules, changed = found.get("modules"), found.get("env_changed", {})
    if not isinstance(modules, list) or not isinstance(changed, dict):
        raise ValueError("'modules' must be a list, 'env_changed' an object")
    names = [m for m in modules[:MAX_NAMES] if isinstance(m, str) and _NAME.fullmatch(m)]
    if len(names) < min(len(modules), MAX_NAMES):
        raise ValueError("'modules' holds what is not a module name")
    if len(changed) > MAX_NAMES or not all(
        _KEY.fullmatch(k) and (v is None or (isinstance(v, str) and len(v) <= 64))
        for k, v in changed.items()
    ):
        raise ValueError("'env_changed' holds what is not a variable's name and digest")
    return Imports(tuple(n for n in names if n.split(".")[0] not in _NEVER), dict(changed))


def read(path: str) -> Imports | None:
    """The imports file at `path` (a worker's: read as untrusted), or None when there is none
    yet; raises ValueError (or OSError) for one that cannot be used."""
    from elastic_launch import untrusted

    try:
        data = untrusted.read(path, MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return None
    if len(data) > MAX_FILE_BYTES:
        raise ValueError(f"over {MAX_FILE_BYTES} bytes")
    return parse(data)


#: In a plan's `differ`: a variable whose value differs in every worker (what the launcher sets
#: for each), whatever this process holds.
ALWAYS = "*"


def differs_in_workers(key: str, differ: Mapping[str, str | None]) -> bool:
    """Whether variable `key` has another value in the workers than in this process: one the
    launcher sets per worker, or one a worker changed (`differ`: the digests of the workers'
    values) to a value this process does not hold."""
    if key in PER_WORKER or key.startswith(_PER_WORKER_PREFIXES):
        return True
    if key not in differ:
        return False
    return differ[key] == ALWAYS or differ[key] != digest(os.environ.get(key))


# ---- the heir's side: importing, checked -------------------------------------------------------


def load(name: str) -> None:
    """Import module `name`; ``MODULE:NAME`` also loads what ``from MODULE import NAME`` gets
    (a package that imports its parts lazily, as transformers does, loads them only then)."""
    import importlib

    module_name, _, attr = name.partition(":")
    module = importlib.import_module(module_name)
    if attr and not hasattr(module, attr):  # not an attribute: a submodule
        importlib.import_module(f"{module_name}.{attr}")


@dataclass
class Taken:
    """What :func:`take` imported, what it left out and why, and whether this process holds
    something it must not fork with (`poisoned`: it is given up for another)."""

    loaded: list[str] = field(default_factory=list)
    left_out: dict[str, str] = field(default_factory=dict)
    #: Every module a left-out one brought: none is imported by the next heir either.
    excluded: list[str] = field(default_factory=list)
    failed: int = 0  # names that could not be imported here (not installed, not a module)

    @property
    def poisoned(self) -> bool:
        return bool(self.left_out)


class _Reads(os._Environ):  # type: ignore[type-arg]
    """``os.environ`` as imports see it: the same variables, each read recorded."""

    def __init__(self, real: os._Environ) -> None:  # type: ignore[type-arg]
        super().__init__(
            real._data,  # type: ignore[attr-defined]
            real.encodekey,
            real.decodekey,
            real.encodevalue,
            real.decodevalue,
        )
        self.read: set[str] = set()
        self._copying = 0  # iterations under way: a copy of the whole reads no one variable

    def __getitem__(self, key: str) -> str:
        if not self._copying:
            self.read.add(key)
        value: str = super().__getitem__(key)
        return value

    def __iter__(self) -> Iterator[str]:
        self._copying += 1
        try:
            yield from super().__iter__()
        finally:
            self._copying -= 1


@dataclass(frozen=True)
class _State:
    """What a fork would not carry or must not share: Python threads (native pools, as
    torch's and OpenBLAS's, handle a fork themselves, as the zygote's own check holds), and
    devices open."""

    python_threads: int
    devices: frozenset[str]
    modules: int


def _state() -> _State:
    return _State(threading.active_count(), _open_devices(), len(sys.modules))


def _open_devices() -> frozenset[str]:
    found = set()
    try:
        fds = os.listdir("/proc/self/fd")
    except OSError:
        return frozenset()
    for fd in fds:
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        shared = target in _SHAREABLE_DEVICES or target.startswith(("/dev/pts/", "/dev/shm/"))
        if target.startswith("/dev/") and not shared:
            found.add(target)
    return frozenset(found)


def hazard(before: _State, after: _State, read: Iterable[str]) -> str | None:
    """Why a module whose import took this process from `before` to `after`, reading the
    variables in `read` that differ in the workers, must not be imported before a fork."""
    if after.python_threads > before.python_threads:
        return "its import starts a thread, which forked workers would not have"
    opened = sorted(after.devices - before.devices)
    if opened:
        return f"its import opens {opened[0]}, which forked workers would share"
    if read:
        return f"its import reads ${sorted(read)[0]}, which each worker has its own value of"
    return None


def take(
    names: Iterable[str], differ: Mapping[str, str | None] | None = None, skip: Iterable[str] = ()
) -> Taken:
    """Import each of `names` not held yet (and not in `skip`), found on this process's path,
    one at a time, each checked with :func:`hazard` (`differ`: what :func:`differs_in_workers`
    takes, besides what the launcher sets per worker)."""
    differ, skip = dict(differ or {}), frozenset(skip)
    taken = Taken()
    reads = _Reads(os.environ)
    real, os.environ = os.environ, reads  # the same variables, shared: reads are recorded
    try:
        for name in names:
            if name in sys.modules or name in skip or not importable(name):
                continue
            before = _state()
            reads.read.clear()
            try:
                load(name)
            except BaseException:  # the worker's order or state made it work: not here
                taken.failed += 1
                continue
            after = _state()
            read = {k for k in reads.read if differs_in_workers(k, differ)}
            why = hazard(before, after, read)
            if why is None:
                taken.loaded.append(name)
                continue
            taken.left_out[name] = why
            taken.excluded += [name, *list(sys.modules)[before.modules :]]
    finally:
        os.environ = real  # noqa: B003 - the same variables: nothing is to be cleared
    return taken


_installed: dict[str, bool] = {}


def importable(name: str) -> bool:
    """Whether `name` belongs to the standard library or to an installed distribution: never
    a module of the script's own (its import is the script's code, which may depend on what
    the script did before)."""
    root = name.split(".", maxsplit=1)[0]
    if root in _NEVER:
        return False
    if root in sys.stdlib_module_names or root in sys.builtin_module_names:
        return True
    if not _installed:
        import importlib.metadata

        _installed.update(dict.fromkeys(importlib.metadata.packages_distributions(), True))
        _installed["elastic_launch"] = _installed["elastic_core"] = True
        _installed["elastic_sampler"] = True
    return _installed.get(root, False)


def account(taken: Taken) -> dict[str, object]:
    """What an heir (or a zygote given a previous run's list) says it learned: the modules it
    imported, what it left out and why, what the next one must leave out too, and every
    module it holds (its own account)."""
    holds = sorted(n for n, m in list(sys.modules.items()) if m is not None)
    return {
        "loaded": taken.loaded[:MAX_NAMES],
        "left_out": taken.left_out,
        "excluded": taken.excluded[:MAX_NAMES],
        "failed": taken.failed,
        "holds": holds[:MAX_HELD],
    }


class on_idle_cpu:  # noqa: N801 - used as a context manager, as a function would be
    """Run the body at the lowest CPU priority there is (SCHED_IDLE), then at normal again:
    what is learned in the background never slows the workers that train."""

    def __enter__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))


# ---- kept for the next run ---------------------------------------------------------------------


@dataclass(frozen=True)
class ImportPlan:
    """What an heir (or the next run's zygote) is to import: `modules` in order, `differ` the
    variables the workers' scripts changed, `skip` what an earlier one found unsafe."""

    modules: tuple[str, ...]
    differ: dict[str, str | None] = field(default_factory=dict)
    skip: tuple[str, ...] = ()

    def to_json(self, entrypoint: str) -> str:
        import json

        fields = {"modules": self.modules, "differ": self.differ, "skip": self.skip}
        return json.dumps({"version": 1, "entrypoint": entrypoint, **fields})


def imports_file(rank_dir: str) -> str:
    """Where the worker of `rank_dir` writes its modules."""
    return os.path.join(rank_dir, "imports.json")


def entrypoint_key(kind: str, target: object) -> str:
    """What a kept list is kept for: an entrypoint's kind and target (a script by its absolute
    path, a function by its qualified name), so that another script never starts with this
    one's modules."""
    if isinstance(target, str):
        name = os.path.abspath(target) if os.path.exists(target) else target
    else:
        name = f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', '')}"
    return f"{kind}:{name}"


def kept_path(log_dir: str, key: str) -> str:
    """Where what the runs of entrypoint `key` (:func:`entrypoint_key`) learned is kept:
    beside the run directories in `log_dir`, one file per entrypoint (a run id changes from
    run to run with ``--standalone``; the script does not)."""
    import hashlib

    name = hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(log_dir, f"elasticrun_imports_{name}.json")


def read_kept(path: str, entrypoint: str | None = None) -> ImportPlan | None:
    """What an earlier run kept at `path` (a file workers could write: checked as any
    worker's), if it was kept for `entrypoint` (None: whatever it was kept for); None when
    there is none or it cannot be used."""
    import json

    from elastic_launch import untrusted

    try:
        data = untrusted.read(path, MAX_FILE_BYTES + 1)
        found = json.loads(data) if len(data) <= MAX_FILE_BYTES else None
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(found, dict) or found.get("version") != 1:
        return None
    if entrypoint is not None and found.get("entrypoint") != entrypoint:
        return None
    modules, differ, skip = found.get("modules"), found.get("differ"), found.get("skip")
    if not isinstance(skip, list) or not all(isinstance(v, str) for v in skip):
        return None
    try:
        names = parse(json.dumps({"modules": modules, "env_changed": differ}).encode())
    except ValueError:
        return None
    return ImportPlan(
        names.modules, names.env_changed, tuple(s for s in skip if _NAME.fullmatch(s))
    )
