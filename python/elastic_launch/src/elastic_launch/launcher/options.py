"""Every launcher option, declared once.

An :class:`Option` says everything about one option: its flag (with the ``--under_score``
twin, any short names, and its ``PET_*`` variable, all made from the flag), the LaunchConfig
fields it sets, how its text becomes their value and what is valid (:mod:`.parse`), its help,
and its defaults. The default is LaunchConfig's field default unless the option gives the
command line's own (torchrun's), with the reason; where torch's Python API (``LaunchConfig``,
``WorkerSpec``) has another default, :class:`TorchDefault` says which and why.

The command line's parser (:func:`elastic_launch.launcher.cli.get_args_parser`), the config it
builds, the checks of a config built in Python (:func:`.config.check_config`), the torch-shaped
defaults (:mod:`elastic_launch.launcher.api`, :mod:`elastic_launch.launcher.agent_api`) and the
flag table of docs/launcher.md (``python -m elastic_launch.launcher.options``) are made from
:data:`OPTIONS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from elastic_launch import compat
from elastic_launch.api import LaunchConfig
from elastic_launch.launcher import parse
from elastic_launch.launcher.parse import MAX_LOCAL_WORKERS, MAX_NODES, MAX_SECONDS, Range
from elastic_launch.rendezvous import conf as rdzv_conf

#: An option's default is LaunchConfig's field default (the option gives no other).
FROM_CONFIG: Any = object()

SECONDS = Range(0, 86_400, "seconds")
RESTARTS = Range(0, 1_000_000, "restarts", integer=True)


@dataclass(frozen=True)
class TorchDefault:
    """The default torch's Python API gives an option where it differs from elasticrun's."""

    value: Any
    why: str


@dataclass(frozen=True)
class Option:
    """One launcher option (see the module's docstring)."""

    flag: str  # "max-restarts": --max-restarts, --max_restarts and PET_MAX_RESTARTS
    help: str
    #: (value, where it came from) -> the fields' value; None: the value as given.
    parse: Callable[[Any, str], Any] | None = None
    #: The LaunchConfig fields it sets; None: the field named like the flag. With several,
    #: `parse` returns one value per field.
    fields: tuple[str, ...] | None = None
    default: Any = FROM_CONFIG  # the command line's default (torchrun's), when not the field's
    why: str = ""  # why the command line's default is not the field's
    shown: str = ""  # the default in words, where its value does not say what it means
    absent: Callable[[], Any] | None = None  # the value when the default is None
    torch: TorchDefault | None = None
    short: tuple[str, ...] = ()
    group: str = "torchrun"  # "torchrun": torchrun has it too; "elasticrun": elasticrun's own
    kind: str = "value"  # "value", "switch" (takes no value) or "append" (repeatable)
    choices: tuple[str, ...] | None = None
    argtype: Callable[[str], Any] | None = None  # argparse's type, where torchrun has one

    @property
    def dest(self) -> str:
        return self.flag.replace("-", "_")

    @property
    def names(self) -> list[str]:
        """Its flags: ``--dash-case``, ``--under_score`` and any short names."""
        out = [*self.short, f"--{self.flag}"]
        return [*out, f"--{self.dest}"] if "-" in self.flag else out

    @property
    def pet(self) -> str:
        """The variable the command line reads when the flag is absent."""
        return compat.PET_PREFIX + self.dest.upper()

    @property
    def config_fields(self) -> tuple[str, ...]:
        return (self.dest,) if self.fields is None else self.fields

    @property
    def bounds(self) -> Range | None:
        """The valid range of a number option (checked on a config built in Python too)."""
        return self.parse if isinstance(self.parse, Range) else None

    def cli_default(self) -> Any:
        """What the command line's parser holds when neither the flag nor its variable is
        given (torchrun's default, for torchrun's flags)."""
        if self.kind == "switch":
            return False
        if self.default is not FROM_CONFIG:
            return self.default
        return field_default(self.config_fields[0])

    def take(self, raw: Any, source: str) -> dict[str, Any]:
        """LaunchConfig's fields from the parser's `raw` value; `source` names the flag or the
        variable it came from, for errors."""
        fields = self.config_fields
        if not fields:
            return {}
        value: Any = raw
        if raw is None and self.absent is not None:
            value = self.absent()
        elif raw is not None and self.parse is not None:
            value = self.parse(raw, source)
        return dict(zip(fields, value)) if len(fields) > 1 else {fields[0]: value}

    def default_text(self) -> str:
        """The default as help and the docs show it."""
        if self.shown:
            return self.shown
        value = self.cli_default()
        if isinstance(value, (list, str)) and not value:
            return "none"
        return f"{value:g}" if isinstance(value, float) else str(value)

    def default_cell(self) -> str:
        """The default in docs/launcher.md's table: a value as code, words as words."""
        if self.kind == "switch":
            return "off"
        text = self.default_text()
        return text if self.shown or text == "none" else f"`{text}`"

    def help_text(self) -> str:
        if self.kind == "switch":
            return self.help
        return f"{self.help} (default: {self.default_text()})"


_FIELDS = {f.name: f for f in dataclasses.fields(LaunchConfig)}


def field_default(name: str) -> Any:
    """LaunchConfig's default for field `name`."""
    f = _FIELDS[name]
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _flag(
    name: str, text: str, parser: Callable[[Any, str], Any] | None = None, **kw: Any
) -> Option:
    """One of elasticrun's own options (torchrun has no such flag)."""
    return Option(name, text, parser, group="elasticrun", **kw)


OPTIONS: tuple[Option, ...] = (
    Option(
        "nnodes",
        "number of nodes, or MIN:MAX",
        parse.parse_nnodes,
        fields=("min_nodes", "max_nodes"),
        default="1:1",
        why="one text for the two fields",
    ),
    Option(
        "nproc-per-node",
        "workers per node: a number, or auto (GPUs if any, else CPUs), cpu, gpu",
        parse.parse_nproc_per_node,
        default="1",
        why="torchrun's: text, as it may be auto, cpu or gpu",
    ),
    Option(
        "rdzv-backend",
        "rendezvous backend: embedded (alias c10d), etcd (v3 API), etcd-v2, static, or a "
        "registered one",
        default="static",
        why="torchrun's: a one-node static launch without --master-port is the embedded "
        "rendezvous; with more nodes, static needs --master-addr and --node-rank",
        torch=TorchDefault("etcd", "torch's LaunchConfig defaults to its etcd backend"),
    ),
    Option(
        "rdzv-endpoint",
        "rendezvous endpoint, HOST:PORT; several, comma-separated: every etcd member, or the "
        "nodes that may host the embedded service, in order",
    ),
    Option(
        "rdzv-id",
        "the job's id (run id): the same on every node",
        parse.check_run_id,
        fields=("run_id",),
        default="none",
        why="torchrun's; --standalone and a one-node launch take a fresh id",
    ),
    Option(
        "rdzv-conf",
        rdzv_conf.help_text(),
        parse.parse_rdzv_conf,
        fields=("rdzv_configs",),
        default="",
        why="torchrun's text: no option",
    ),
    Option(
        "standalone",
        "single node, no external service: an in-process rendezvous, a fresh run id",
        fields=(),
        kind="switch",
    ),
    Option(
        "max-restarts",
        "worker group restarts before the job fails",
        RESTARTS,
        torch=TorchDefault(3, "torch's LaunchConfig and WorkerSpec restart a group 3 times"),
    ),
    Option(
        "monitor-interval",
        "seconds between the agent's housekeeping passes (deaths are seen at once anyway)",
        Range(0, 60, "seconds", above=True),
    ),
    Option(
        "start-method",
        "spawn: fresh interpreters; fork/forkserver: forked from a pre-started Python",
        choices=("spawn", "fork", "forkserver"),
    ),
    Option("event-log-handler", "where agent events go: null or console"),
    Option(
        "role",
        "the workers' role name (ROLE_NAME)",
        parse.check_role,
        torch=TorchDefault("default_role", "torch's LaunchConfig names the role default_role"),
    ),
    Option(
        "module",
        "run the script argument as a module (python -m)",
        fields=(),
        short=("-m",),
        kind="switch",
    ),
    Option(
        "no-python",
        "run the script argument directly, not with python",
        fields=(),
        kind="switch",
    ),
    Option("run-path", "run the script with runpy.run_path", fields=(), kind="switch"),
    Option("log-dir", "base directory for logs", shown="a temporary one, removed at the end"),
    Option(
        "redirects",
        "streams to log files: 0 none, 1 stdout, 2 stderr, 3 both, or LOCAL_RANK:N,...",
        parse.parse_std,
        short=("-r",),
        default="0",
        why="torchrun's text",
    ),
    Option(
        "tee",
        "streams to log files and the console, with a [host:roleN]: prefix; as --redirects",
        parse.parse_std,
        short=("-t",),
        default="0",
        why="torchrun's text",
    ),
    Option(
        "local-ranks-filter",
        "show only these local ranks (comma-separated) on the console",
        parse.parse_ranks_filter,
        default="",
        why="torchrun's text: every rank",
        shown="every rank",
    ),
    Option(
        "duplicate-stdout-filters",
        "copy tee'd stdout lines containing any of these (comma-separated; ,, for a comma) to "
        "a file",
        argtype=parse.parse_list,
    ),
    Option(
        "duplicate-stderr-filters",
        "the same for stderr",
        argtype=parse.parse_list,
    ),
    Option(
        "node-rank",
        "this node's rank (static rendezvous)",
        Range(0, MAX_NODES - 1, "a node rank", integer=True),
    ),
    Option("master-addr", "rank 0's address (static rendezvous)"),
    Option(
        "master-port",
        "rank 0's port (static rendezvous)",
        Range(1, 65535, "a port", integer=True),
        shown="29500 (static rendezvous of several nodes)",
    ),
    Option("local-addr", "this node's address, as the others reach it", shown="its host name"),
    Option(
        "logs-specs",
        "torchrun's log layout plugin: only default, elasticrun's layout, is taken",
        fields=(),
        default=None,
        shown="default",
    ),
    Option(
        "numa-binding",
        "not supported by elasticrun: bind with numactl in the script",
        fields=(),
        default=None,
        shown="none",
        choices=("node", "socket", "exclusive", "core-complex"),
    ),
    Option(
        "signals-to-handle",
        "signals forwarded to every worker's process group",
        parse.check_signals,
    ),
    Option(
        "shutdown-timeout",
        "seconds between the stop signal and SIGKILL",
        SECONDS,
        default=None,
        why="torchrun's: read from the environment when absent",
        shown=f"${compat.SHUTDOWN_TIMEOUT_ENV} or {compat.DEFAULT_SHUTDOWN_TIMEOUT:g}",
        absent=compat.shutdown_timeout,
    ),
    Option(
        "virtual-local-rank",
        "LOCAL_RANK=0 in every worker, each seeing only its own GPU",
        kind="switch",
    ),
    _flag(
        "memory-checkpoint-limit",
        "bytes one worker's memory-tier checkpoints may take (two copies of its state), as 8GiB",
        parse.check_memory_limit,
        shown="no limit",
    ),
    _flag(
        "hang-timeout",
        "seconds without progress before a worker is hung; auto learns it as max(floor, "
        "factor x p99 step interval); off disables",
        parse.parse_hang_timeout,
        default="auto",
        why="text: a number, auto or off",
    ),
    _flag(
        "hang-timeout-floor",
        "automatic mode: the smallest timeout, seconds",
        Range(0, MAX_SECONDS, "seconds", above=True),
    ),
    _flag(
        "hang-timeout-factor",
        "automatic mode: multiple of the p99 step interval",
        Range(0, 1_000_000, "times the step interval", above=True),
    ),
    _flag(
        "stack-dump-timeout",
        "seconds to wait for a hung worker's Python stacks before stopping it",
        Range(0, 3600, "seconds"),
    ),
    _flag(
        "preload",
        "auto: fork Python workers from a zygote that imported torch (when the script "
        "imports it), and what the workers are seen to import once they step; module names "
        "(comma-separated, repeatable) are imported on top; none: fresh interpreters",
        parse.parse_preload,
        kind="append",
        default=[],
        why="the flags given: none is auto",
        shown="auto",
    ),
    _flag(
        "warm-spares",
        "workers the --preload zygote keeps forked ahead of need (about 2 MB each; 0: none)",
        Range(0, MAX_LOCAL_WORKERS, "a number of workers", integer=True),
        shown="one per local worker",
    ),
    _flag(
        "min-workers",
        "the classic train loop: the others go on while at least this many workers remain",
        Range(1, 1 << 31, "a number of workers", integer=True),
        shown="every worker (--nnodes MIN x --nproc-per-node)",
    ),
    _flag(
        "hot-spares",
        "the classic train loop: workers per node that run the script up to train() and wait "
        "to take a dead worker's place at once (each holds what a worker holds before its "
        "first step: its model and data); 0: none",
        Range(0, MAX_LOCAL_WORKERS, "a number of workers", integer=True),
    ),
    _flag(
        "loop-max-restarts",
        "the classic train loop: the most restarts its max_failures (which the workers "
        "report) may give the job beyond --max-restarts",
        RESTARTS,
        shown="--max-restarts when given, else 100",
    ),
    _flag("events-file", "append agent events as JSON lines to this file", shown="none"),
    _flag("metrics-port", "serve Prometheus metrics on [HOST:]PORT", shown="none"),
    _flag("health-port", "serve /healthz on [HOST:]PORT", shown="none"),
    _flag(
        "gpu-check-interval",
        "seconds between GPU health checks through NVML; 0 disables",
        SECONDS,
    ),
)


def option(flag: str) -> Option:
    """The option of `flag` (``"max-restarts"``)."""
    for o in OPTIONS:
        if o.flag == flag:
            return o
    raise KeyError(flag)


def torch_default(flag: str) -> Any:
    """The default torch's Python API gives `flag`'s field: torch's own where it differs."""
    o = option(flag)
    return o.torch.value if o.torch is not None else field_default(o.config_fields[0])


def check_numbers(config: LaunchConfig) -> None:
    """Every number of `config` within its option's range (the error names the field)."""
    for o in OPTIONS:
        if o.bounds is None:
            continue
        for name in o.config_fields:
            value = getattr(config, name)
            if value is not None:
                o.bounds(value, name)


def markdown_table() -> str:
    """docs/launcher.md's flag table."""
    rows = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for o in OPTIONS:
        flags = ", ".join(f"`{n}`" for n in o.names if "_" not in n)
        meaning = o.help if o.group == "torchrun" else f"elasticrun: {o.help}"
        if o.torch is not None:
            meaning += f"; torch's Python API: `{o.torch.value}` ({o.torch.why})"
        cells = [flags, f"`{o.pet}`", o.default_cell(), meaning]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(markdown_table())
