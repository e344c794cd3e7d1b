"""What each worker runs, built in one place from either front door (the command line, or
:func:`elastic_launch.launch`), checked before anything starts, and turned into the arguments of
:mod:`elastic_launch.processes.worker_main`."""

from __future__ import annotations

import enum
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from elastic_launch.api import ConfigError
from elastic_launch.compat import python_executable, substitute_local_rank

_PYTHON_FLAGS_WITH_VALUE = {"-W", "-X", "-Q"}


class Kind(str, enum.Enum):
    SCRIPT = "script"
    MODULE = "module"
    BINARY = "binary"
    FUNCTION = "function"


@dataclass(frozen=True)
class Entrypoint:
    """A script, a module, a binary, or a Python function (with its arguments)."""

    kind: Kind
    target: str | Callable[..., Any]
    args: list[str] = field(default_factory=list)
    fn_args: tuple[Any, ...] = ()

    @classmethod
    def from_command_line(
        cls, script: str, args: list[str], module: bool, no_python: bool, run_path: bool
    ) -> Entrypoint:
        """torchrun's ``training_script`` with ``-m``, ``--no-python`` and ``--run-path``."""
        if module and no_python:
            raise ConfigError(
                "Don't use both the '--no-python' flag and the '--module' flag at the same time."
            )
        if args[:1] == ["--"]:
            args = args[1:]
        if module:
            return cls(Kind.MODULE, script, args)
        if no_python and not run_path:
            return cls(Kind.BINARY, script, args)
        return cls(Kind.SCRIPT, script, args)

    @classmethod
    def for_launch(cls, target: str | Callable[..., Any], args: tuple[Any, ...]) -> Entrypoint:
        """torch's ``elastic_launch`` convention: a function, or a program with its arguments.
        A Python interpreter with a script or ``-m module`` runs as a Python entrypoint, so that
        it gets the beat hook and stack dumps like any elasticrun worker."""
        if callable(target):
            return cls(Kind.FUNCTION, target, fn_args=args)
        argv = [str(a) for a in args]
        if target.endswith(".py"):
            return cls(Kind.SCRIPT, target, argv)
        if os.path.basename(target).startswith("python"):
            i = 0
            while i < len(argv) and argv[i].startswith("-") and argv[i] != "-m":
                i += 2 if argv[i] in _PYTHON_FLAGS_WITH_VALUE else 1
            if i < len(argv) - 1 and argv[i] == "-m":
                return cls(Kind.MODULE, argv[i + 1], argv[i + 2 :])
            if i < len(argv):
                return cls(Kind.SCRIPT, argv[i], argv[i + 1 :])
        return cls(Kind.BINARY, target, argv)

    @property
    def name(self) -> str:
        if callable(self.target):
            return getattr(self.target, "__name__", repr(self.target))
        return self.target if self.kind == Kind.MODULE else os.path.basename(self.target)

    @property
    def is_python(self) -> bool:
        return self.kind != Kind.BINARY

    def check(self, start_method: str = "spawn") -> None:
        """A missing script, module or program, or a function a new interpreter cannot be
        given, is reported before any worker starts (never by spending restarts)."""
        if self.kind == Kind.FUNCTION and start_method != "fork":
            self._check_function()
        target = str(self.target)
        if self.kind == Kind.SCRIPT and os.path.isdir(target):
            # A directory runs its __main__.py, as `python DIR` does (a zip application is a
            # file and runs the same way).
            if not os.path.isfile(os.path.join(target, "__main__.py")):
                raise ConfigError(
                    f"training script '{target}' is a directory without a __main__.py; give the "
                    "script inside it, or add __main__.py to run the directory as python does"
                )
        elif self.kind == Kind.SCRIPT and not os.path.isfile(target):
            raise ConfigError(
                f"training script '{self.target}' does not exist (looked in {os.getcwd()}); "
                "check the path, or pass -m for a module"
            )
        if self.kind == Kind.BINARY:
            target = str(self.target)
            found = shutil.which(target) if os.sep not in target else target
            if not found or not os.access(found, os.X_OK):
                raise ConfigError(
                    f"program '{target}' is not an executable file or on PATH (with --no-python "
                    "the script is run directly: it needs execute permission and a #! line)"
                )
        if self.kind == Kind.MODULE:
            import importlib.util

            try:
                spec = importlib.util.find_spec(str(self.target))
            except (ImportError, ValueError):
                spec = None
            if spec is None:
                raise ConfigError(
                    f"module '{self.target}' cannot be found (from {os.getcwd()}); check its "
                    "name and that its package is installed"
                )

    def _check_function(self) -> None:
        import pickle

        fn = self.target
        if getattr(fn, "__module__", None) == "__main__" and main_path(fn) is None:
            raise ConfigError(
                f"function {self.name!r} is defined in an interactive session (or python -c), "
                "which a new interpreter cannot import: put it in a file, or use "
                "start_method='fork'"
            )
        try:
            pickle.dumps((fn, self.fn_args))
        except Exception as e:  # pickling raises many kinds (PicklingError, TypeError, ...)
            raise ConfigError(
                f"function {self.name!r} and its arguments cannot be sent to a new interpreter "
                f"({type(e).__name__}: {e}); define it at the top level of a module or of the "
                "main script and pass picklable arguments, or use start_method='fork'"
            ) from None

    def worker_argv(self, local_rank: int, function_spec: str | None = None) -> list[str]:
        """The arguments of :func:`elastic_launch.processes.worker_main.run_target` (Python
        kinds), or the program's own command (binaries)."""
        args = substitute_local_rank(self.args, local_rank)
        if self.kind == Kind.BINARY:
            return [str(self.target), *args]
        if self.kind == Kind.MODULE:
            return ["--module", str(self.target), *args]
        if self.kind == Kind.FUNCTION:
            if function_spec is None:
                raise ValueError("a function entrypoint needs its spec file")
            return ["--function", function_spec]
        return ["--", str(self.target), *args]

    def torch_command(self) -> tuple[str | Callable[..., Any], list[Any]]:
        """What torch's ``config_from_args`` gives for this entrypoint: the program (the
        interpreter for Python kinds, or the function) and its arguments."""
        if self.kind == Kind.BINARY:
            return str(self.target), list(self.args)
        if self.kind == Kind.FUNCTION:
            return self.target, list(self.fn_args)
        python = python_executable(sys.executable)
        module = ["-m"] if self.kind == Kind.MODULE else []
        return python, ["-u", *module, str(self.target), *self.args]

    def command(self, argv: list[str]) -> list[str]:
        """The command of a fresh process for `argv` (from :meth:`worker_argv`)."""
        if self.kind == Kind.BINARY:
            return argv
        python = python_executable(sys.executable)
        return [python, "-u", "-m", "elastic_launch.processes.worker_main", *argv]


def main_path(fn: object) -> str | None:
    """The file of the caller's ``__main__`` when `fn` is defined there: a new interpreter
    runs it as ``__mp_main__`` first (as multiprocessing's spawn does), so that the function
    can be found by reference. None for a function of an importable module."""
    if getattr(fn, "__module__", None) != "__main__":
        return None
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    return os.path.abspath(path) if path else None
