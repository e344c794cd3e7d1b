"""Becoming a worker: the one path every worker process takes, however it was started.

A fresh interpreter runs ``python -u -m elastic_launch.processes.worker_main [--module|--function]
TARGET ARGS...``; a child forked from the zygote or from the launcher (``start_method="fork"``)
calls :func:`run_worker` with the :class:`Handover` its parent prepared. Either way the worker
gets:

- its own session and process group, its environment, standard streams and working directory;
- default signal dispositions (a fork inherits its parent's handlers);
- death with its parent (``PR_SET_PDEATHSIG``), since its own session outlives the parent;
- a heartbeat on every optimizer step: a ``torch.optim`` post-step hook, installed when (and
  only if) the script imports torch, so hangs are found without changing the script;
- a Python stack dump of every thread (faulthandler) into ``$ELASTIC_STACK_FILE`` on
  :data:`STACK_SIGNAL`, which the agent sends before it stops a hung worker;
- an error file (torch's format, ``$TORCHELASTIC_ERROR_FILE``) for an uncaught exception, so the
  failure summary shows the traceback without ``@record``;
- a rank other than 0 that waits for rank 0's store on its host to listen before torch
  connects to it, so it never sleeps torch's connect backoff;
- process groups kept alive once ended, and an end without the interpreter's teardown, so that
  torch's teardown order cannot deadlock it (:mod:`elastic_launch.teardown`).

The target then runs as ``__main__`` with the ``sys.argv`` and ``sys.path`` that ``python
script.py`` or ``python -m module`` would give it; this module's own frames are left out of
tracebacks.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import os
import runpy
import signal
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from elastic_launch import learned, spare, teardown
from elastic_launch.compat import SIGNALS_TO_HANDLE_ENV
from elastic_launch.files import write_atomically
from elastic_launch.processes import cgroup, fence

if TYPE_CHECKING:
    import importlib.machinery
    from collections.abc import Sequence

# Kept lean on purpose: every worker imports this module before anything else, so each import
# here is paid by every worker start and restart.

#: Signal on which a worker dumps every thread's Python stack into $ELASTIC_STACK_FILE.
STACK_SIGNAL = signal.SIGUSR2
STACK_FILE_ENV = "ELASTIC_STACK_FILE"
#: The pid of the process that started this worker (the agent, or the zygote).
PARENT_ENV = "ELASTICRUN_PARENT_PID"
#: Standard stream targets in a :class:`Handover` besides a file descriptor.
KEEP = -1  # the stream the parent has (the launcher's console)
DEVNULL = -2
_OPTIMIZER_MODULE = "torch.optim.optimizer"
_C10D_MODULE = "torch.distributed.distributed_c10d"
_RENDEZVOUS_MODULE = "torch.distributed.rendezvous"
_RESET_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGCHLD", "SIGALRM")
#: What a zygote ignores (the agent ends it) and holds blocked across a worker's fork.
STOP_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM, signal.SIGHUP})

_stack_file: Any = None  # kept open for faulthandler


@dataclass
class Handover:
    """What a forked child takes over from the request its parent prepared."""

    env: dict[str, str]
    stdout: int = KEEP  # a file descriptor, KEEP or DEVNULL
    stderr: int = KEEP
    cwd: str | None = None
    parent_pid: int | None = None  # who it must die with (the zygote for its children)
    title: list[str] | None = None  # the command line a fresh interpreter would show (ps)
    close_fds: list[int] = field(default_factory=list)  # the parent's own descriptors


# ---- hooks ----------------------------------------------------------------------------------


_steps = 0


def _beat_after_step(optimizer: object, args: object, kwargs: object) -> None:
    global _steps
    import elastic_core

    _steps += 1
    if _steps in learned.RECORD_AT_STEPS:  # before the beat: the agent reads it after
        learned.at_step(_steps)
    elastic_core.beat()


def _hook_optimizer(module: types.ModuleType) -> None:
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None:
        register(_beat_after_step)


def _hook_store(module: types.ModuleType) -> None:
    """A rank other than 0 waits for rank 0's store to listen, when it is on this host, before
    torch's client connects to it (``env://`` and ``tcp://``): a client that comes first finds
    it refusing and sleeps a backoff of 0.25-0.75 s, growing, before it tries again; the ranks
    of a group (re)started on one node start together and race. A store on another host is
    torch's to reach as it does (no probe adds to what its server does per connection)."""
    create = getattr(module, "_create_c10d_store", None)
    if create is None or getattr(create, "_elasticrun_waits", False):
        return

    @functools.wraps(create)
    def _create_c10d_store(hostname: str, port: int, rank: int, *args: Any, **kw: Any) -> Any:
        agent_store = getattr(module, "_torchelastic_use_agent_store", lambda: False)
        if rank != 0 and not agent_store():
            timeout = kw.get("timeout", args[1] if len(args) > 1 else None)
            _await_local_store(hostname, int(port), getattr(timeout, "total_seconds", None))
        return create(hostname, port, rank, *args, **kw)

    _create_c10d_store._elasticrun_waits = True  # type: ignore[attr-defined]
    module._create_c10d_store = _create_c10d_store  # type: ignore[attr-defined]


def _await_local_store(host: str, port: int, seconds: Callable[[], float] | None) -> None:
    """Wait for the store at `host`:`port` when it is on this host; at torch's own timeout,
    torch's error for a store that never came (torch's wait would add a second timeout)."""
    from elastic_launch import net

    if not net.names_this_host(host, port):
        return
    limit = seconds() if seconds is not None else 300.0
    if not net.await_listening(host, port, limit):
        from torch.distributed import DistNetworkError

        raise DistNetworkError(
            f"The client socket has timed out after {limit:g} s while trying to connect to "
            f"({host}, {port}): rank 0's store on this host never listened"
        )


#: What a worker does to torch's modules as they are loaded (or at once, if they are).
_HOOKS: dict[str, Callable[[types.ModuleType], None]] = {
    _OPTIMIZER_MODULE: _hook_optimizer,
    _C10D_MODULE: teardown.keep_destroyed_groups,
    _RENDEZVOUS_MODULE: _hook_store,
}


class _HookingLoader:
    """Runs the real loader of a hooked module, then its hook."""

    def __init__(self, loader: Any, hook: Callable[[types.ModuleType], None]) -> None:
        self._loader = loader
        self._hook = hook

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        self._hook(module)


class _HookFinder:
    """Waits for the hooked modules to be imported; costs nothing if they never are."""

    def __init__(self, waiting: set[str]) -> None:
        self.waiting = waiting

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.waiting:
            return None
        import importlib.util

        self.waiting.discard(fullname)
        sys.meta_path.remove(self)  # the real finders find it; back only if still waiting
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            if self.waiting:
                sys.meta_path.insert(0, self)
        if spec is not None and spec.loader is not None:
            spec.loader = _HookingLoader(spec.loader, _HOOKS[fullname])  # type: ignore[assignment]
        return spec


def install_hooks() -> None:
    """Install the stack dump, the hooks on torch's modules (the beat after each optimizer
    step, the groups kept once ended) and on ``gc.freeze`` (what it freezes is flushed at the
    end too); safe to call more than once."""
    global _stack_file
    stack_path = os.environ.get(STACK_FILE_ENV)
    if stack_path and _stack_file is None:
        _stack_file = open(stack_path, "w")  # noqa: SIM115 - faulthandler needs it open
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
    teardown.watch_freeze()
    waiting = set()
    for name, hook in _HOOKS.items():
        if name in sys.modules:  # a zygote imported it already
            hook(sys.modules[name])
        else:
            waiting.add(name)
    if waiting and not any(isinstance(f, _HookFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _HookFinder(waiting))


def die_with_parent() -> None:
    """Never outlive the agent (or the zygote): a worker in its own session would otherwise."""
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if not parent:
        return
    import elastic_core

    try:
        elastic_core.die_with_parent(signal.SIGKILL, parent)
    except elastic_core.NotFoundError:
        os._exit(1)  # the parent is gone already


def _reset_signals() -> None:
    """Default dispositions, as a new interpreter has them (Ctrl-C raises KeyboardInterrupt,
    SIGPIPE is ignored as Python does)."""
    with contextlib.suppress(ValueError):
        signal.set_wakeup_fd(-1)  # the zygote's
    # The launcher forwards --signals-to-handle (a forked function worker has its handlers).
    forwarded = os.environ.get(SIGNALS_TO_HANDLE_ENV, "").split(",")
    for name in {*_RESET_SIGNALS, *(n.strip() for n in forwarded if n.strip())}:
        sig = getattr(signal, name if name.startswith("SIG") else "SIG" + name, None)
        if sig is not None and sig not in (signal.SIGKILL, signal.SIGSTOP, STACK_SIGNAL):
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    # A zygote forks with these blocked: one sent since is delivered now, to the handlers set.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _take_over(h: Handover) -> None:
    for fd in h.close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    if os.getsid(0) != os.getpid():
        os.setsid()
    for target, source in ((1, h.stdout), (2, h.stderr)):
        if source == DEVNULL:
            fd = os.open(os.devnull, os.O_WRONLY)
            os.dup2(fd, target)
            os.close(fd)
        elif source >= 0:
            os.dup2(source, target)
            if source not in (1, 2):
                os.close(source)
    os.environ.clear()
    os.environ.update(h.env)
    if h.parent_pid:
        os.environ[PARENT_ENV] = str(h.parent_pid)
    if h.title:
        from elastic_launch.processes.proctitle import set_title

        set_title(h.title, os.environ)
    if h.cwd:
        os.chdir(h.cwd)
    # A fresh interpreter seeds its random generators from the OS; forked ones would all share
    # the parent's state. Python's `random` reseeds itself after fork; numpy does not.
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def become_worker(handover: Handover | None = None) -> None:
    """Make this process a worker: `handover` in a forked child; None in a fresh interpreter,
    which got its session, environment and streams from its parent already."""
    if handover is not None:
        _take_over(handover)
    learned.remember_start()
    cgroup.join()  # first: what it starts from here on is inside too
    _reset_signals()
    die_with_parent()
    spare.idle_while_spare()
    if os.environ.get(fence.FENCE_FILE_ENV):  # a rank now: held while the agent's place is
        fence.start_watch(os.environ[fence.FENCE_FILE_ENV])
    install_hooks()
    sys.excepthook = _excepthook


# ---- running the target -----------------------------------------------------------------------

_OWN_FILES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}


def _trim(tb: types.TracebackType | None) -> types.TracebackType | None:
    """Drop the leading frames of this module and runpy from a traceback."""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in _OWN_FILES and os.path.abspath(name) not in _OWN_FILES:
            break
        tb = tb.tb_next
    return tb


def _excepthook(
    kind: type[BaseException], value: BaseException, tb: types.TracebackType | None
) -> None:
    from elastic_launch.errors import shows_traceback

    if not shows_traceback(value):  # a setting to fix: its message says all
        sys.stderr.write(f"{kind.__name__}: {value}\n")
        return
    tb = _trim(tb) or tb
    # The default hook prints value.__traceback__, not its `tb` argument.
    sys.__excepthook__(kind, value.with_traceback(tb), tb)


def _run_script(path: str, args: list[str]) -> None:
    sys.argv = [path, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(path))
    runpy.run_path(path, run_name="__main__")


def _run_module(name: str, args: list[str]) -> None:
    sys.argv = [name, *args]  # run_module replaces argv[0] with the module's file
    sys.path[0] = os.getcwd()
    runpy.run_module(name, run_name="__main__", alter_sys=True)


#: A function entrypoint: (function, arguments, where its pickled return value goes).
FunctionCall = tuple[Callable[..., Any], tuple[Any, ...], str]


def _main_from(path: str) -> None:
    """Make the launching script's module the ``__main__`` the function refers to: run it
    under the name ``__mp_main__`` (its ``if __name__ == "__main__":`` part does not run), as
    multiprocessing's spawn does."""
    import runpy

    module = types.ModuleType("__mp_main__")
    module.__dict__.update(runpy.run_path(path, run_name="__mp_main__"))
    sys.modules["__main__"] = sys.modules["__mp_main__"] = module


def _run_function(spec_path: str, call: FunctionCall | None) -> None:
    import pickle

    if call is None:
        with open(spec_path, "rb") as f:
            spec = pickle.load(f)
        sys.path[:] = spec.get("sys_path") or sys.path
        if spec["main"]:
            _main_from(spec["main"])
        call = pickle.loads(spec["call"])
    fn, args, result_path = call
    value = fn(*args)
    write_atomically(result_path, pickle.dumps(value))


def run_target(argv: list[str], call: FunctionCall | None = None) -> int:
    """Run the target `argv` describes (``--module NAME ARGS``, ``--function SPEC`` or ``--
    SCRIPT ARGS``; `call` replaces the spec file for a function forked in memory) and return
    the exit status an interpreter would give it. An uncaught exception is written to the
    error file and printed; KeyboardInterrupt is re-raised, for the caller to die by SIGINT."""
    if not argv:
        print("elastic_launch.processes.worker_main: no target given", file=sys.stderr)
        return 2
    try:
        if argv[0] == "--module":
            _run_module(argv[1], argv[2:])
        elif argv[0] == "--function":
            _run_function(argv[1], call)
        elif argv[0] == "--":
            _run_script(argv[1], argv[2:])
        else:
            _run_script(argv[0], argv[1:])
    except SystemExit as e:
        if e.code is None:
            return 0
        if isinstance(e.code, int):
            return e.code
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:
        from elastic_launch.errors import write_error_file

        tb = _trim(e.__traceback__) or e.__traceback__
        write_error_file(e, tb)
        if isinstance(e, KeyboardInterrupt):
            raise
        sys.excepthook(type(e), e, tb)
        return 1
    return 0


def run_worker(
    handover: Handover | None,
    argv: list[str],
    call: FunctionCall | None = None,
    run_exit_handlers: bool = True,
) -> NoReturn:
    """The whole life of a worker: become one (`handover`: a forked child's; None: a fresh
    interpreter's), run its target, and end without the interpreter's teardown
    (:func:`elastic_launch.teardown.end_process`)."""
    code = 1
    try:
        become_worker(handover)
        code = run_target(argv, call)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:
        with contextlib.suppress(Exception):
            sys.excepthook(*sys.exc_info())
    teardown.end_process(code, run_exit_handlers)


def main(argv: list[str]) -> None:
    """A fresh interpreter's worker."""
    run_worker(None, argv)


if __name__ == "__main__":
    main(sys.argv[1:])
