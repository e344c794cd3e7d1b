"""``elasticrun``: the command line, a drop-in for ``torchrun``.

Every torchrun (torch 2.13) flag is accepted in both ``--dash-case`` and ``--under_score``
spellings, with the same default, read from ``PET_<NAME>`` when the flag is absent (so that
Kubeflow-style configuration works unchanged); elasticrun's own flags follow the same rule.
Exit status: 0 when the job succeeds, 1 when it fails (the summary names the root cause), 2 for
a usage error, 128 + N when stopped by signal N.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Sequence
from typing import Any

from elastic_launch import api, compat
from elastic_launch.api import AgentState, ConfigError, LaunchConfig
from elastic_launch.errors import record
from elastic_launch.launcher.options import OPTIONS, Option
from elastic_launch.launcher.parse import random_id
from elastic_launch.processes.entrypoint import Entrypoint
from elastic_launch.rendezvous.secrets import command_line_secrets

logger = logging.getLogger("elasticrun")


class _EnvDefault(argparse.Action):
    """A flag whose default comes from PET_<DEST> (torch's ``env`` action)."""

    def __init__(self, dest: str, default: Any = None, required: bool = False, **kw: Any) -> None:
        value = compat.pet_value(dest)
        if value is not None:
            default = value
            required = False
        super().__init__(dest=dest, default=default, required=required, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, values)
        _given(namespace).add(self.dest)


def _given(namespace: Any) -> set[str]:
    """The flags given on the command line (the others may come from PET_ variables)."""
    given: set[str] = namespace.__dict__.setdefault("_given", set())
    return given


def given(args: argparse.Namespace, dest: str) -> bool:
    """Whether the user gave `dest`: its flag, or its PET_ variable."""
    return dest in _given(args) or compat.pet_value(dest) is not None


def source(args: argparse.Namespace, dest: str) -> str:
    """Where a value came from, for error messages: ``--flag``, or ``PET_FLAG`` when the
    flag was absent and the variable set it."""
    if dest not in _given(args) and compat.pet_value(dest) is not None:
        return compat.pet_name(dest)
    return "--" + dest.replace("_", "-")


class _EnvFlag(argparse.Action):
    """A boolean flag whose default comes from PET_<DEST> (1/0/true/false)."""

    def __init__(self, dest: str, default: bool = False, **kw: Any) -> None:
        value = compat.pet_flag(dest)
        if value is not None:
            default = value
        super().__init__(dest=dest, default=default, nargs=0, **kw)

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        setattr(namespace, self.dest, True)
        _given(namespace).add(self.dest)


class _Append(_EnvDefault):
    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        current = getattr(namespace, self.dest, None)
        items = list(current) if isinstance(current, list) else []
        items.append(values)
        setattr(namespace, self.dest, items)
        _given(namespace).add(self.dest)


_ACTIONS: dict[str, type[argparse.Action]] = {
    "value": _EnvDefault,
    "switch": _EnvFlag,
    "append": _Append,
}


def _add(parser: argparse._ActionsContainer, option: Option) -> None:
    """Add `option`: --dash-case with its --under_score twin and any short names."""
    kw: dict[str, Any] = {"action": _ACTIONS[option.kind], "help": option.help_text()}
    if option.kind != "switch":
        kw.update(default=option.cli_default(), choices=option.choices)
        if option.argtype is not None:
            kw["type"] = option.argtype
    parser.add_argument(*option.names, dest=option.dest, **kw)


def versions() -> str:
    """The three packages' versions (and the core library's), for ``--version``."""
    from importlib import metadata

    def dist(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    from elastic_launch._version import __version__

    parts = [f"elasticrun {__version__}", f"elasticrun-launch {dist('elasticrun-launch')}"]
    try:
        import elastic_core

        core = (
            f"elasticrun-core {dist('elasticrun-core')} (C++ library {elastic_core.LIBRARY_VERSION}"
            f", C ABI {elastic_core.ABI_VERSION})"
        )
    except ImportError as e:
        core = f"elasticrun-core: cannot be imported ({e})"
    parts += [core, f"elasticrun-sampler {dist('elasticrun-sampler')}"]
    return "\n".join(parts)


class _Version(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, **kw: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print the versions and exit")

    def __call__(self, parser: Any, namespace: Any, values: Any, option: Any = None) -> None:
        print(versions())
        parser.exit()


def get_args_parser() -> argparse.ArgumentParser:
    """torch's ``get_args_parser``: every option of :data:`~.options.OPTIONS`, then the script
    and its arguments."""
    p = argparse.ArgumentParser(
        prog="elasticrun",
        description="Elastic, fault-tolerant launcher for PyTorch distributed training: a "
        "torchrun drop-in that sees dead and hung workers at once.",
        epilog="Exit status: 0 success, 1 job failed, 2 usage error, 128+N stopped by signal N. "
        "Every flag also reads its default from PET_<FLAG_NAME>.",
    )
    p.add_argument("--version", "-V", action=_Version)
    groups = {
        "torchrun": p.add_argument_group("torchrun flags"),
        "elasticrun": p.add_argument_group("elasticrun flags"),
    }
    for option in OPTIONS:
        _add(groups[option.group], option)
    p.add_argument("training_script", help="the script (or module, or program) to run")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


#: Whether each launcher flag takes the next argument as its value (help and version do not).
_TAKES_VALUE = {"-h": False, "--help": False, "-V": False, "--version": False} | {
    name: option.kind != "switch" for option in OPTIONS for name in option.names
}


def _takes_value(token: str) -> bool:
    """Whether the launcher flag `token` (as typed: abbreviated, ``--flag=value``, ``-r3``,
    or short switches run together, ``-mr 3``) takes the next argument. Unknown or
    ambiguous: no (argparse then names the error)."""
    if not token.startswith("--"):
        for i, letter in enumerate(token[1:], start=1):
            takes = _TAKES_VALUE.get("-" + letter)
            if takes is None:
                return False
            if takes:  # a value flag: its value is the rest of the token, or the next one
                return i == len(token) - 1
        return False
    if "=" in token:
        return False
    if token in _TAKES_VALUE:
        return _TAKES_VALUE[token]
    found = {v for name, v in _TAKES_VALUE.items() if name.startswith(token)}
    return found == {True}


def split_command_line(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's arguments (its flags, then the script or module name) and the script's
    own: everything after the name, untouched, whatever it looks like (``--log``, ``-h``,
    ``--nnodes``). argparse alone would take ``--log`` after the script for an abbreviation
    of ``--log-dir``, as torchrun does."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return [*argv[: i + 2]], list(argv[i + 2 :])
        if not token.startswith("-") or token == "-":
            return [*argv[: i + 1]], list(argv[i + 1 :])
        i += 2 if _takes_value(token) else 1
    return list(argv), []


def parse_args(args: Sequence[str] | None) -> argparse.Namespace:
    """torch's ``parse_args``: the command line (``sys.argv[1:]`` when None), parsed; what
    follows the script's name is the script's (:func:`split_command_line`)."""
    ours, theirs = split_command_line(sys.argv[1:] if args is None else list(args))
    parsed = get_args_parser().parse_args(ours)
    parsed.training_script_args = [*parsed.training_script_args, *theirs]
    return parsed


def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, Any, list[Any]]:
    """torch's ``config_from_args``: the config, the command and its arguments (the
    interpreter with ``-u`` and the script, or ``-m`` and the module; the program itself with
    ``--no-python``). Every value is checked."""
    config, entrypoint = launch_from_args(args)
    cmd, cmd_args = entrypoint.torch_command()
    return config, cmd, cmd_args


def launch_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, Entrypoint]:
    """The parsed flags as a LaunchConfig and an Entrypoint, every value checked."""
    _refuse_unsupported(args)
    entrypoint = Entrypoint.from_command_line(
        args.training_script,
        list(args.training_script_args),
        args.module,
        args.no_python,
        args.run_path,
    )
    values: dict[str, Any] = {}
    for option in OPTIONS:
        values.update(option.take(getattr(args, option.dest), source(args, option.dest)))
    _rendezvous_target(args, values)
    if given(args, "max_restarts") and not given(args, "loop_max_restarts"):
        # The restarts the user asked for are the job's, a train loop's too: a worker's
        # max_failures (100 by default) widens the budget only when none was asked for.
        values["loop_max_restarts"] = values["max_restarts"]
    if source(args, "rdzv_conf") == "--rdzv-conf":
        for warning in command_line_secrets(values["rdzv_configs"]):
            logger.warning(warning)
    config = LaunchConfig(**values)
    if compat.set_omp_default(config.nproc_per_node):
        logger.warning(compat.OMP_WARNING)
    return config, entrypoint


def _refuse_unsupported(args: argparse.Namespace) -> None:
    if args.logs_specs and args.logs_specs != "default":
        _refuse_logs_specs(args.logs_specs)
    if args.numa_binding:
        raise ConfigError(
            f"--numa-binding {args.numa_binding} is not supported by elasticrun yet; bind "
            "workers with numactl in your script, or leave the flag out"
        )


def _refuse_logs_specs(name: str) -> None:
    """torchrun's ``--logs-specs NAME`` loads a class from the ``torchrun.logs_specs`` entry
    points; elasticrun keeps its own layout (torch's ``default``, which it takes)."""
    from importlib import metadata

    found = [e for e in metadata.entry_points(group="torchrun.logs_specs") if e.name == name]
    if not found:
        raise ConfigError(
            f"--logs-specs '{name}': Could not find entrypoint under "
            f"'torchrun.logs_specs[{name}]' key"
        )
    raise ConfigError(
        f"--logs-specs '{name}' is not supported: elasticrun keeps its own log layout (torch's "
        "'default'; see --log-dir, --redirects, --tee)"
    )


def _rendezvous_target(args: argparse.Namespace, values: dict[str, Any]) -> None:
    """The backend, endpoint and run id in `values`: ``--standalone`` (and a one-node static
    launch with no master port, as torchrun) is the in-process embedded rendezvous under a
    fresh id."""
    max_nodes = values["max_nodes"]
    if args.standalone and max_nodes > 1:
        raise ConfigError(
            f"{source(args, 'standalone')} runs one node, but {source(args, 'nnodes')} "
            f"'{args.nnodes}' asks for up to {max_nodes}: leave out --standalone and give "
            "--rdzv-backend c10d (or etcd) with --rdzv-endpoint HOST:PORT and --rdzv-id, or "
            "--nnodes 1"
        )
    static = values["rdzv_backend"] == "static"
    if args.standalone or (
        static and not values["rdzv_endpoint"] and values["master_port"] is None and max_nodes == 1
    ):
        values.update(rdzv_backend="embedded", rdzv_endpoint="localhost:0", run_id=random_id())
    elif not static and (values["node_rank"] != 0 or values["master_addr"] != "127.0.0.1"):
        logger.warning("--node-rank and --master-addr are only used by the static rendezvous")


def run(args: argparse.Namespace) -> None:
    """torch's ``run``: launch what `args` (from :func:`parse_args`) say, on this node, until
    the job ends. Raises as :func:`main` does."""
    from elastic_launch.agent.summary import format_summary
    from elastic_launch.launcher import runner
    from elastic_launch.launcher.api import torch_catchable

    config, entrypoint = launch_from_args(args)
    result = runner.run(config, entrypoint)
    if result.state == AgentState.SUCCEEDED:
        return
    if result.state == AgentState.STOPPED:
        raise api.LauncherStopped(result.signal or 0)
    # A caller with torch loaded (torch's test_run.py, a script that called torch's main)
    # catches torch's ChildFailedError; the command itself never imports torch.
    failed = torch_catchable() if "torch" in sys.modules else api.WorkerFailedError
    raise failed(format_summary(entrypoint.name, result), result, entrypoint.name)


@record
def main(args: Sequence[str] | None = None) -> None:
    """Parse, launch, report, as ``torch.distributed.run.main``: None when the job succeeded.

    Raises :class:`~elastic_launch.api.ConfigError` (a ValueError) for a bad value before
    anything starts, ``SystemExit(2)`` for what argparse refuses,
    :class:`~elastic_launch.api.WorkerFailedError` (a ``ChildFailedError``: the failed
    processes by rank, the summary as its message; torch's ``ChildFailedError`` as well when
    torch is loaded) when the job fails,
    :class:`~elastic_launch.api.LauncherStopped` when a signal stopped it, and the
    rendezvous' errors (:class:`~elastic_launch.api.LaunchError`) when it cannot be formed.
    """
    logging.basicConfig(level=logging.WARNING, format="elasticrun: %(levelname)s: %(message)s")
    run(parse_args(args))


def exit_status(argv: Sequence[str] | None = None) -> int:
    """:func:`main`, as the ``elasticrun`` command: its exit status, the error on stderr
    (0 success, 1 the job failed, 2 a usage error, 128 + N stopped by signal N)."""
    try:
        main(argv)
    except ConfigError as e:
        print(f"elasticrun: error: {e}", file=sys.stderr)
        return api.EXIT_USAGE
    except api.WorkerFailedError as e:
        print(str(e), file=sys.stderr)
        return api.EXIT_FAILED
    except api.LauncherStopped as e:
        print(f"elasticrun: stopped by signal {e.signum}; workers stopped", file=sys.stderr)
        return api.EXIT_SIGNAL_BASE + e.signum
    except (api.LaunchError, OSError) as e:  # rendezvous, log directory, ports...
        print(f"elasticrun: error: {type(e).__name__}: {e}", file=sys.stderr)
        return api.EXIT_FAILED
    except KeyboardInterrupt:  # SIGINT left out of --signals-to-handle: everything was released
        print("elasticrun: interrupted", file=sys.stderr)
        return api.EXIT_SIGNAL_BASE + signal.SIGINT
    return api.EXIT_OK


def console_main() -> None:
    """Entry point of the ``elasticrun`` console script."""
    sys.exit(exit_status())
