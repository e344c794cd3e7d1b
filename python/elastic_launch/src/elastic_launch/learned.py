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
from typing import Any

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
#: At most this many bytes of packed names go in one message to or from the zygote: a
#: socketpair's datagram is bounded by its send buffer (208 KiB by default).
MAX_PACKED = 48 << 10
#: At most this many modules an heir is asked to import (what the workers hold beyond it is
#: learned by the next one, or not at all).
MAX_PER_HEIR = 5000
#: At most this many left-out modules, each with a reason of at most 200 characters, in one
#: account.
MAX_LEFT_OUT = 100
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
    """After optimizer step `step` (one of :data:`RECORD_AT_STEPS`): write the modules held."""
    path = os.environ.get(IMPORTS_FILE_ENV)
    if path:
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
    """A worker's imports file, checked. An entry that is not a module's name (``<run_path>``,
    which runpy leaves) or not a variable's name and digest is dropped, and so is a module
    that is a ``__main__`` (its import runs a program); raises ValueError, quoting what is
    wrong, for a file that is not such a list at all."""
    import json

    try:
        found = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(found, dict):
        raise ValueError(f"not a JSON object: {str(found)[:40]!r}")
    return _imports_of(found.get("modules"), found.get("env_changed", {}))


def _imports_of(modules: object, changed: object) -> Imports:
    """The names and digests of a worker's file (or a kept one), checked as :func:`parse`
    says."""
    if not isinstance(modules, list) or not isinstance(changed, dict):
        raise ValueError("'modules' must be a list and 'env_changed' an object")
    names = [m for m in modules[:MAX_NAMES] if _module_name(m)]
    if modules and not names:
        raise ValueError(f"'modules' names no module: {str(modules[0])[:60]!r}...")
    keys = {
        k: v
        for k, v in list(changed.items())[:MAX_NAMES]
        if _KEY.fullmatch(k) and (v is None or (isinstance(v, str) and len(v) <= 64))
    }
    return Imports(tuple(names), keys)


def _module_name(name: object) -> bool:
    """Whether `name` may be imported for a worker: a module's name, no ``__main__`` in it,
    not one of :data:`_NEVER`."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        return False
    parts = name.split(".")
    return parts[0] not in _NEVER and "__main__" not in parts


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
    """Whether variable `key` has another value in the workers than in this process: one a
    worker changed or was given (`differ`: the digests of the workers' values, or
    :data:`ALWAYS`) to a value this process does not hold, or one the launcher sets per worker
    that this process lacks (what an import read as unset, each worker has: ``RANK``)."""
    if key in differ:
        return differ[key] == ALWAYS or differ[key] != digest(os.environ.get(key))
    per_worker = key in PER_WORKER or key.startswith(_PER_WORKER_PREFIXES)
    return per_worker and key not in os.environ


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
        """Whether this process imported what it must not fork with."""
        return bool(self.left_out)


class _Reads(os._Environ):  # type: ignore[type-arg]
    """``os.environ`` as imports see it: the same variables, each read of one recorded. A copy
    of the whole (``dict(os.environ)``, ``os.environ.copy()``, ``{**os.environ}``: the keys
    listed, then each read in their order) or a scan of its items reads no one variable and is
    not recorded."""

    def __init__(self, real: os._Environ) -> None:  # type: ignore[type-arg]
        super().__init__(
            real._data,  # type: ignore[attr-defined]
            real.encodekey,
            real.decodekey,
            real.encodevalue,
            real.decodevalue,
        )
        self.read: set[str] = set()
        self._copying: list[str] = []  # the keys a copy under way reads next, reversed

    def keys(self) -> list[str]:  # type: ignore[override]
        listed = list(super().keys())
        self._copying = listed[::-1]
        return listed

    def items(self) -> list[tuple[str, str]]:  # type: ignore[override]
        return [(k, os._Environ.__getitem__(self, k)) for k in list(super().keys())]

    def values(self) -> list[str]:  # type: ignore[override]
        return [v for _, v in self.items()]

    def __getitem__(self, key: str) -> str:
        if self._copying and self._copying[-1] == key:
            self._copying.pop()
        else:
            self._copying = []
            self.read.add(key)
        value: str = super().__getitem__(key)
        return value


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
    """Import each of `names` :func:`to_import` lets through, one at a time, each checked with
    :func:`hazard` (`differ`: what :func:`differs_in_workers` takes). The imports see a
    neutral ``sys.argv`` (a module that parses it at import would keep the zygote's) and an
    ``os.environ`` that records their reads."""
    differ = dict(differ or {})
    taken = Taken()
    reads = _Reads(os.environ)
    real, os.environ = os.environ, reads  # the same variables, shared: reads are recorded
    argv, sys.argv = sys.argv, [sys.executable]
    try:
        for name in to_import(names, skip):
            before, held = _state(), set(sys.modules)
            reads.read.clear()
            try:
                load(name)
            except BaseException:  # the worker's order or state made it work: not here
                taken.failed += 1
            read = {k for k in reads.read if differs_in_workers(k, differ)}
            why = hazard(before, _state(), read)
            if why is not None:
                taken.left_out[name] = why
                taken.excluded += [name, *(n for n in sys.modules if n not in held)]
            elif name in sys.modules:
                taken.loaded.append(name)
    finally:
        os.environ = real  # noqa: B003 - the same variables: nothing is to be cleared
        sys.argv = argv
    return taken


def to_import(names: Iterable[str], skip: Iterable[str] = ()) -> Iterator[str]:
    """The names of `names` to import here: not held yet, not in `skip` (nor in a package in
    it), of the standard library or an installed distribution (:func:`installed`)."""
    skipped = frozenset(skip)
    for name in names:
        parts = name.split(".")
        if name in sys.modules or any(
            ".".join(parts[:i]) in skipped for i in range(1, 1 + len(parts))
        ):
            continue
        if installed(name):
            yield name


_distributions: dict[str, list[str]] = {}


def installed(name: str) -> bool:
    """Whether module `name` is of the standard library or of an installed distribution not
    found in the working directory: never a module of the script's own, whose import is the
    script's code (it may parse ``sys.argv``, read a worker's environment), nor of a project
    installed in place (``pip install -e``), the launcher's own packages aside."""
    import importlib.metadata
    import importlib.util

    root = name.split(".", maxsplit=1)[0].split(":", maxsplit=1)[0]
    if root in _NEVER or root.startswith("__"):
        return False
    if root in sys.stdlib_module_names or root in sys.builtin_module_names:
        return True
    if not _distributions:
        _distributions.update(importlib.metadata.packages_distributions())
    dists = _distributions.get(root)
    if not dists:
        return False
    try:
        spec = importlib.util.find_spec(root)  # a top-level name: finds, imports nothing
    except (ImportError, ValueError):
        return False
    packages = list(getattr(spec, "submodule_search_locations", None) or []) if spec else []
    origin = spec.origin if spec is not None else None
    # The directory of sys.path it was found in: the script's own directory and the working
    # directory hold the script's modules (a site-packages below them holds installed ones).
    found_in = {os.path.dirname(p) for p in packages} or (
        {os.path.dirname(origin)} if origin else set()
    )
    if not found_in or os.path.abspath(os.getcwd()) in {os.path.abspath(d) for d in found_in}:
        return False
    return root in _OURS or not any(_in_place(d) for d in dists)


#: The launcher's own packages: installed in place in a checkout, and theirs to import.
_OURS = {"elastic_launch", "elastic_core", "elastic_sampler"}


def _in_place(dist: str) -> bool:
    """Whether distribution `dist` is installed in place (an editable install of a project)."""
    import importlib.metadata
    import json

    try:
        text = importlib.metadata.distribution(dist).read_text("direct_url.json")
        return bool(text and json.loads(text).get("dir_info", {}).get("editable"))
    except (importlib.metadata.PackageNotFoundError, ValueError, AttributeError, OSError):
        return False


def account(taken: Taken) -> dict[str, object]:
    """What an heir (or a zygote given a previous run's list) says it learned, packed
    (:func:`pack`): the modules it imported, what it left out and why, what the next one must
    leave out too, and every module it holds (its own account)."""
    holds = sorted(n for n, m in list(sys.modules.items()) if m is not None)
    left_out = {k: v[:200] for k, v in list(taken.left_out.items())[:MAX_LEFT_OUT]}
    return {
        "loaded": pack(taken.loaded),
        "left_out": left_out,
        "excluded": pack(taken.excluded),
        "failed": taken.failed,
        "holds": pack(holds),
    }


def unpacked_account(account: object) -> dict[str, Any] | None:
    """An account as :func:`account` makes it, its lists unpacked; None if it is not one."""
    if not isinstance(account, dict):
        return None
    lists = {k: unpack(account.get(k)) for k in ("loaded", "excluded", "holds")}
    left_out, failed = account.get("left_out"), account.get("failed")
    if any(v is None for v in lists.values()) or type(failed) is not int or failed < 0:
        return None
    if not isinstance(left_out, dict) or len(left_out) > MAX_LEFT_OUT:
        return None
    if not all(_module_name(k) and isinstance(v, str) for k, v in left_out.items()):
        return None
    return {**lists, "left_out": {k: v[:200] for k, v in left_out.items()}, "failed": failed}


def pack(names: Iterable[str]) -> str:
    """`names` as one string (zlib, base64) of at most :data:`MAX_PACKED` bytes: the last
    names are dropped until it fits."""
    import base64
    import zlib

    found = [n for n in names if _NAME.fullmatch(n)]
    while True:
        text = base64.b64encode(zlib.compress("\n".join(found).encode(), 6)).decode()
        if len(text) <= MAX_PACKED or not found:
            return text
        found = found[: len(found) * 3 // 4]


def unpack(text: object) -> list[str] | None:
    """The names :func:`pack` packed in `text`, each a module's name; None for what is not
    such a string (decompressed within a bound: a small string cannot expand without end)."""
    import base64
    import binascii
    import zlib

    if not isinstance(text, str) or len(text) > MAX_PACKED:
        return None
    try:
        inflater = zlib.decompressobj()
        data = inflater.decompress(base64.b64decode(text, validate=True), MAX_FILE_BYTES)
    except (binascii.Error, ValueError, zlib.error):
        return None
    if inflater.unconsumed_tail:
        return None
    names = data.decode("utf-8", "replace").split("\n") if data else []
    return names[:MAX_NAMES] if all(_NAME.fullmatch(n) for n in names) else None


# ---- kept for the next run ---------------------------------------------------------------------


@dataclass(frozen=True)
class ImportPlan:
    """What an heir (or the next run's zygote) is to import: `modules` in order, `differ` the
    digests of the variables the workers changed or were given (:func:`differs_in_workers`),
    `skip` what an earlier one found unsafe."""

    modules: tuple[str, ...]
    differ: dict[str, str | None] = field(default_factory=dict)
    skip: tuple[str, ...] = ()

    def to_json(self, entrypoint: str) -> str:
        """The plan as kept on disk for `entrypoint` (:func:`read_kept` reads it)."""
        import json

        fields = {"modules": self.modules, "differ": self.differ, "skip": self.skip}
        return json.dumps({"version": 1, "entrypoint": entrypoint, **fields})

    def to_message(self) -> dict[str, Any]:
        """The plan as one message to the zygote (:func:`plan_of` reads it back)."""
        differ = dict(list(self.differ.items())[:MAX_LEFT_OUT])
        return {
            "modules": pack(self.modules[:MAX_PER_HEIR]),
            "differ": differ,
            "skip": pack(self.skip),
        }


def plan_of(message: dict[str, Any]) -> ImportPlan | None:
    """The plan a message to the zygote carries; None if it does not carry one."""
    modules, skip, differ = (
        unpack(message.get("modules")),
        unpack(message.get("skip")),
        message.get("differ"),
    )
    if modules is None or skip is None or not isinstance(differ, dict):
        return None
    ok = all(isinstance(k, str) and (v is None or isinstance(v, str)) for k, v in differ.items())
    return ImportPlan(tuple(modules), dict(differ), tuple(skip)) if ok else None


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
        names = _imports_of(modules, differ)
    except ValueError:
        return None
    return ImportPlan(
        names.modules, names.env_changed, tuple(s for s in skip if _NAME.fullmatch(s))
    )
