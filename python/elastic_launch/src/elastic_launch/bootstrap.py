"""The first code a worker runs: installs elasticrun's hooks, then runs the user's target.

Workers start as ``python -u -m elastic_launch.bootstrap [--module|--function] TARGET ARGS...``
(or are forked from the zygote, which calls :func:`run`). The hooks:

- a heartbeat on every optimizer step: a ``torch.optim`` post-step hook, installed when (and
  only if) the script imports torch, so hangs are found without changing the script;
- a Python stack dump of every thread (faulthandler) into ``$ELASTIC_STACK_FILE`` on
  :data:`STACK_SIGNAL`, which the agent sends before it stops a hung group;
- an error file (torch's format, ``$TORCHELASTIC_ERROR_FILE``) for an uncaught exception, so the
  failure summary shows the traceback without ``@record``.

The target then runs as ``__main__`` with the ``sys.argv`` and ``sys.path`` that ``python
script.py`` or ``python -m module`` would give it; the bootstrap's own frames are left out of
tracebacks.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import sys
import types
from typing import TYPE_CHECKING, Any

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
_OPTIMIZER_MODULE = "torch.optim.optimizer"

_stack_file: Any = None  # kept open for faulthandler


def _beat_after_step(optimizer: object, args: object, kwargs: object) -> None:
    import elastic_core

    elastic_core.beat()


def _hook_optimizer(module: types.ModuleType) -> None:
    register = getattr(module, "register_optimizer_step_post_hook", None)
    if register is not None:
        register(_beat_after_step)


class _HookingLoader:
    """Runs the real loader of torch.optim.optimizer, then registers the beat hook."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        module: types.ModuleType | None = self._loader.create_module(spec)
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _hook_optimizer(module)


class _OptimizerHookFinder:
    """Waits for torch.optim.optimizer to be imported; costs nothing if it never is."""

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _OPTIMIZER_MODULE:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # one shot, then the real finders
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _HookingLoader(spec.loader)  # type: ignore[assignment]
        return spec


def die_with_parent() -> None:
    """Never outlive the agent: a worker in its own session survives its parent otherwise."""
    parent = int(os.environ.get(PARENT_ENV, "0") or 0)
    if not parent:
        return
    import elastic_core

    try:
        elastic_core.die_with_parent(signal.SIGKILL, parent)
    except elastic_core.NotFoundError:
        os._exit(1)  # the agent is gone already


def install_hooks() -> None:
    """Install the beat hook and the stack dump; safe to call more than once."""
    global _stack_file
    stack_path = os.environ.get(STACK_FILE_ENV)
    if stack_path and _stack_file is None:
        _stack_file = open(stack_path, "w")  # noqa: SIM115 - faulthandler needs it open
        faulthandler.register(STACK_SIGNAL, file=_stack_file, all_threads=True, chain=False)
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)
    if _OPTIMIZER_MODULE in sys.modules:
        _hook_optimizer(sys.modules[_OPTIMIZER_MODULE])
    elif not any(isinstance(f, _OptimizerHookFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _OptimizerHookFinder())


_OWN_FILES = {os.path.abspath(__file__), os.path.abspath(runpy.__file__), "<frozen runpy>"}


def _trim(tb: types.TracebackType | None) -> types.TracebackType | None:
    """Drop the leading frames of the bootstrap and runpy from a traceback."""
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name not in _OWN_FILES and os.path.abspath(name) not in _OWN_FILES:
            break
        tb = tb.tb_next
    return tb


def _excepthook(
    kind: type[BaseException], value: BaseException, tb: types.TracebackType | None
) -> None:
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


def _run_function(spec_path: str) -> None:
    import pickle

    with open(spec_path, "rb") as f:
        fn, args, result_path = pickle.load(f)
    value = fn(*args)
    tmp = result_path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(value, f)
    os.replace(tmp, result_path)


def run(argv: list[str]) -> None:
    """Install the hooks and run the target described by `argv` (see the module docstring)."""
    if not argv:
        raise SystemExit("elastic_launch.bootstrap: no target given")
    die_with_parent()
    install_hooks()
    sys.excepthook = _excepthook
    try:
        if argv[0] == "--module":
            _run_module(argv[1], argv[2:])
        elif argv[0] == "--function":
            _run_function(argv[1])
        else:
            target = argv[1] if argv[0] == "--" else argv[0]
            rest = argv[2:] if argv[0] == "--" else argv[1:]
            _run_script(target, rest)
    except SystemExit:
        raise
    except BaseException as e:
        from elastic_launch.errors import write_error_file

        write_error_file(e, _trim(e.__traceback__) or e.__traceback__)
        raise


if __name__ == "__main__":
    run(sys.argv[1:])
