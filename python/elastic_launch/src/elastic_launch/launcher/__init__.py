"""The launcher: the ``elasticrun`` command line, the checking of every setting, and
:func:`run`, the one owner of everything a launch opens.

Owns: the options, declared once (``options``), parsing and checking (``parse``, ``cli``,
``config``), the resources of a launch (``runner``), and
torch's launcher and agent APIs over them (``api``, ``agent_api``).
May import: everything below it (``agent``, ``processes``, ``rendezvous``, the foundation:
``api``, ``cancel``, ``compat``, ``errors``, ``net``). Nothing imports it but the entry points.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from elastic_launch.launcher.runner import launch, run

_NAMES = ("launch", "run")


def __getattr__(name: str) -> Any:
    # Imported on first use: `elasticrun --help` and workers never pay for the runner's imports.
    if name in _NAMES:
        from elastic_launch.launcher import runner

        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["launch", "run"]
