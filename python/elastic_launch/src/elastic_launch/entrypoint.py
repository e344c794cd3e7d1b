"""What each worker runs, built in one place from either front door (the command line, or
:func:`elastic_launch.launch`), checked before anything starts, and turned into the arguments of
:mod:`elastic_launch.worker_main`."""

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

    def check(self) -> None:
        """A missing script, module or program is reported before any worker starts."""
        if self.kind == Kind.SCRIPT and not os.path.isfile(str(self.target)):
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

    def worker_argv(self, local_rank: int, function_spec: str | None = None) -> list[str]:
        """The arguments of :func:`elastic_launch.worker_main.run_target` (Python kinds), or the
        program's own command (binaries)."""
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

    def command(self, argv: list[str]) -> list[str]:
        """The command of a fresh process for `argv` (from :meth:`worker_argv`)."""
        if self.kind == Kind.BINARY:
            return argv
        python = python_executable(sys.executable)
        return [python, "-u", "-m", "elastic_launch.worker_main", *argv]
