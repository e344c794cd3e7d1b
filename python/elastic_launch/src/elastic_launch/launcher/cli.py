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
from elastic_launch.launcher.config import (
    check_memory_limit,
    check_range,
    check_role,
    parse_hang_timeout,
    parse_list,
    parse_nnodes,
    parse_nproc_per_node,
    parse_preload,
    parse_ranks_filter,
    parse_rdzv_conf,
    parse_signals,
    parse_std,
    random_id,
)
from elastic_launch.rendezvous import conf as rdzv_conf
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


def _add(parser: argparse._ActionsContainer, name: str, *extra: str, **kw: Any) -> None:
    """Add --dash-case with its --under_score twin (and any short names)."""
    names = [f"--{name}"]
    if "-" in name:
        names.append(f"--{name.replace('-', '_')}")
    kw.setdefault("action", _EnvDefault)
    parser.add_argument(*extra, *names, dest=name.replace("-", "_"), **kw)


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="elasticrun",
        description="Elastic, fault-tolerant launcher for PyTorch distributed training: a "
        "torchrun drop-in that sees dead and hung workers at once.",
        epilog="Exit status: 0 success, 1 job failed, 2 usage error, 128+N stopped by signal N. "
        "Every flag also reads its default from PET_<FLAG_NAME>.",
    )
    p.add_argument("--version", "-V", action=_Version)
    g = p.add_argument_group("torchrun flags")
    _add(g, "nnodes", default="1:1", help="number of nodes, or MIN:MAX (default 1:1)")
    _add(
        g,
        "nproc-per-node",
        default="1",
        help="workers per node: a number, or auto, cpu, gpu (default 1)",
    )
    _add(
        g,
        "rdzv-backend",
        default="static",
        help="rendezvous backend: embedded (alias c10d), static, or a registered one",
    )
    _add(
        g,
        "rdzv-endpoint",
        default="",
        help="rendezvous endpoint, HOST:PORT; several, comma-separated: every etcd member, "
        "or the nodes that may host the embedded service, in order",
    )
    _add(g, "rdzv-id", default="none", help="the job's id (run id)")
    _add(g, "rdzv-conf", default="", help=rdzv_conf.help_text())
    _add(
        g,
        "standalone",
        action=_EnvFlag,
        help="single node, no external service: an in-process rendezvous, a fresh run id",
    )
    _add(g, "max-restarts", default=0, help="worker group restarts before failing")
    _add(
        g,
        "monitor-interval",
        default=0.1,
        help="seconds between the agent's housekeeping passes (deaths are seen at once anyway)",
    )
    _add(
        g,
        "start-method",
        default="spawn",
        choices=["spawn", "fork", "forkserver"],
        help="spawn: fresh interpreters; fork/forkserver: forked from a pre-started Python",
    )
    _add(g, "event-log-handler", default="null", help="null or console")
    _add(g, "role", default="default", help="the workers' role name (ROLE_NAME)")
    _add(g, "module", "-m", action=_EnvFlag, help="run the script argument as a module (-m)")
    _add(g, "no-python", action=_EnvFlag, help="run the script argument directly, not with python")
    _add(g, "run-path", action=_EnvFlag, help="run the script with runpy.run_path")
    _add(g, "log-dir", default=None, help="base directory for logs (default: a temporary one)")
    _add(
        g,
        "redirects",
        "-r",
        default="0",
        help="streams to log files: 0 none, 1 stdout, 2 stderr, 3 both, or RANK:N,...",
    )
    _add(
        g,
        "tee",
        "-t",
        default="0",
        help="streams to log files and the console, with a [host:roleN]: prefix",
    )
    _add(g, "local-ranks-filter", default="", help="show only these local ranks on the console")
    _add(
        g,
        "duplicate-stdout-filters",
        default=[],
        type=parse_list,
        help="copy tee'd stdout lines containing any of these (comma-separated) to a file",
    )
    _add(g, "duplicate-stderr-filters", default=[], type=parse_list, help="the same for stderr")
    _add(g, "node-rank", default=0, help="this node's rank (static rendezvous)")
    _add(g, "master-addr", default="127.0.0.1", help="rank 0's address (static rendezvous)")
    _add(g, "master-port", default=None, help="rank 0's port (static; default 29500)")
    _add(g, "local-addr", default=None, help="this node's address, as others reach it")
    _add(
        g,
        "logs-specs",
        default=None,
        help="default (elasticrun's log layout is torch's default; others are refused)",
    )
    _add(
        g,
        "numa-binding",
        default=None,
        choices=["node", "socket", "exclusive", "core-complex"],
        help="(not supported yet)",
    )
    _add(
        g,
        "signals-to-handle",
        default="SIGTERM,SIGINT,SIGHUP,SIGQUIT",
        help="signals forwarded to the workers",
    )
    _add(
        g,
        "shutdown-timeout",
        default=None,
        help="seconds between the stop signal and SIGKILL (default "
        "$TORCH_ELASTIC_SHUTDOWN_TIMEOUT or 30)",
    )
    _add(
        g,
        "virtual-local-rank",
        action=_EnvFlag,
        help="LOCAL_RANK=0 in every worker, each seeing only its own GPU",
    )

    e = p.add_argument_group("elasticrun flags")
    _add(
        e,
        "memory-checkpoint-limit",
        default=None,
        help="bytes one worker's memory-tier checkpoints may take (elastic_sampler's "
        "CheckpointManager(memory=True) keeps two copies), as 8GiB; default: no limit",
    )
    _add(
        e,
        "hang-timeout",
        default="auto",
        help="seconds without a beat before a worker counts as hung; 'auto' (default) learns "
        "it as max(floor, factor x p99 step interval); 'off' disables",
    )
    _add(
        e,
        "hang-timeout-floor",
        default=60.0,
        help="automatic mode: the smallest timeout, seconds (default 60)",
    )
    _add(
        e,
        "hang-timeout-factor",
        default=10.0,
        help="automatic mode: multiple of the p99 step interval (default 10)",
    )
    _add(
        e,
        "preload",
        action=_Append,
        default=[],
        help="auto (default): Python workers are forked from a zygote that has imported torch "
        "(when the script imports it), so a start or restart skips the interpreter and import "
        "torch; module names (comma-separated, repeatable) are imported on top; none: fresh "
        "interpreters",
    )
    _add(
        e,
        "min-workers",
        default=None,
        help="the classic train loop (elastic_launch.train_loop): when a worker dies, the "
        "others go on while at least this many remain, and its replacement joins later "
        "(default: --nnodes MIN x --nproc-per-node: they wait for the replacement)",
    )
    _add(
        e,
        "loop-max-restarts",
        default=100,
        help="the classic train loop: the most restarts its max_failures (which the workers "
        "report) may give the job beyond --max-restarts (default 100, the loop's own default)",
    )
    _add(
        e,
        "warm-spares",
        default=None,
        help="workers the --preload zygote keeps forked ahead of need, so that a start or "
        "restart skips the fork (about 2 MB each; default: one per local worker; 0: none)",
    )
    _add(e, "events-file", default=None, help="append agent events as JSON lines to this file")
    _add(e, "metrics-port", default=None, help="serve Prometheus metrics on [HOST:]PORT")
    _add(e, "health-port", default=None, help="serve /healthz on [HOST:]PORT")
    _add(
        e,
        "gpu-check-interval",
        default=5.0,
        help="seconds between GPU health checks through NVML; 0 disables (default 5)",
    )

    p.add_argument("training_script", help="the script (or module, or program) to run")
    p.add_argument("training_script_args", nargs=argparse.REMAINDER)
    return p


def config_from_args(args: argparse.Namespace) -> tuple[LaunchConfig, Any]:
    """Turn parsed flags into a LaunchConfig and an Entrypoint, checking every value."""
    from elastic_launch.processes.entrypoint import Entrypoint

    _refuse_unsupported(args)
    entrypoint = Entrypoint.from_command_line(
        args.training_script,
        list(args.training_script_args),
        args.module,
        args.no_python,
        args.run_path,
    )
    min_nodes, max_nodes = parse_nnodes(str(args.nnodes), source(args, "nnodes"))
    nproc = parse_nproc_per_node(str(args.nproc_per_node), source(args, "nproc_per_node"))
    backend, endpoint, run_id = _rendezvous_target(args, max_nodes)
    parse_signals(args.signals_to_handle)  # checked now, installed by the agent
    check_role(args.role)
    rdzv_configs = parse_rdzv_conf(args.rdzv_conf)
    if source(args, "rdzv_conf") == "--rdzv-conf":
        for warning in command_line_secrets(rdzv_configs):
            logger.warning(warning)
    config = LaunchConfig(
        min_nodes=min_nodes,
        max_nodes=max_nodes,
        nproc_per_node=nproc,
        run_id=run_id,
        role=args.role,
        rdzv_endpoint=endpoint,
        rdzv_backend=backend,
        rdzv_configs=rdzv_configs,
        start_method=args.start_method,
        log_dir=args.log_dir,
        redirects=parse_std(str(args.redirects), source(args, "redirects")),
        tee=parse_std(str(args.tee), source(args, "tee")),
        local_ranks_filter=parse_ranks_filter(
            args.local_ranks_filter, source(args, "local_ranks_filter")
        ),
        duplicate_stdout_filters=list(args.duplicate_stdout_filters),
        duplicate_stderr_filters=list(args.duplicate_stderr_filters),
        master_addr=args.master_addr,
        local_addr=args.local_addr,
        signals_to_handle=args.signals_to_handle,
        virtual_local_rank=args.virtual_local_rank,
        event_log_handler=args.event_log_handler,
        hang_timeout=parse_hang_timeout(str(args.hang_timeout), source(args, "hang_timeout")),
        preload=parse_preload(args.preload if isinstance(args.preload, list) else [args.preload]),
        events_file=args.events_file,
        metrics_port=args.metrics_port,
        health_port=args.health_port,
        **_numbers(args),
    )
    if compat.set_omp_default(nproc):
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


def _rendezvous_target(args: argparse.Namespace, max_nodes: int) -> tuple[str, str, str]:
    """The backend, endpoint and run id: ``--standalone`` (and a one-node static launch with
    no master port, as torchrun) is the in-process embedded rendezvous under a fresh id."""
    backend, endpoint, run_id = args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id
    if args.standalone and max_nodes > 1:
        raise ConfigError(
            f"{source(args, 'standalone')} runs one node, but {source(args, 'nnodes')} "
            f"'{args.nnodes}' asks for up to {max_nodes}: leave out --standalone and give "
            "--rdzv-backend c10d (or etcd) with --rdzv-endpoint HOST:PORT and --rdzv-id, or "
            "--nnodes 1"
        )
    if args.standalone or (
        backend == "static" and not endpoint and args.master_port is None and max_nodes == 1
    ):
        return "embedded", "localhost:0", random_id()
    if backend != "static" and (args.node_rank != 0 or args.master_addr != "127.0.0.1"):
        logger.warning("--node-rank and --master-addr are only used by the static rendezvous")
    return backend, endpoint, run_id


#: LaunchConfig's numbers the command line takes, each checked against its Range.
_FLOATS = ("monitor_interval", "hang_timeout_floor", "hang_timeout_factor", "gpu_check_interval")
_INTS = ("max_restarts", "node_rank", "loop_max_restarts")
_OPTIONAL_INTS = ("master_port", "min_workers", "warm_spares")


def _numbers(args: argparse.Namespace) -> dict[str, Any]:
    """The flags that are numbers, checked (the message names the flag, or the PET_ variable
    it came from)."""

    def num(dest: str) -> float:
        return check_range(dest, getattr(args, dest), source(args, dest))

    out: dict[str, Any] = {d: num(d) for d in _FLOATS}
    out.update({d: int(num(d)) for d in _INTS})
    out.update({d: None if getattr(args, d) is None else int(num(d)) for d in _OPTIONAL_INTS})
    limit = args.memory_checkpoint_limit
    if limit is not None:
        out["memory_checkpoint_limit"] = check_memory_limit(
            limit, source(args, "memory_checkpoint_limit")
        )
    shutdown = args.shutdown_timeout
    out["shutdown_timeout"] = (
        compat.shutdown_timeout() if shutdown is None else num("shutdown_timeout")
    )
    return out


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
    from elastic_launch.agent.summary import format_summary
    from elastic_launch.launcher.api import torch_catchable
    from elastic_launch.launcher.runner import run

    config, entrypoint = config_from_args(build_parser().parse_args(args))
    result = run(config, entrypoint)
    if result.state == AgentState.SUCCEEDED:
        return
    if result.state == AgentState.STOPPED:
        raise api.LauncherStopped(result.signal or 0)
    # A caller with torch loaded (torch's test_run.py, a script that called torch's main)
    # catches torch's ChildFailedError; the command itself never imports torch.
    failed = torch_catchable() if "torch" in sys.modules else api.WorkerFailedError
    raise failed(format_summary(entrypoint.name, result), result, entrypoint.name)


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
