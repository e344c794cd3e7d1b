"""``elasticrun``'s command line under its public path (:mod:`elastic_launch.launcher.cli`),
in the shape of ``torch.distributed.run``."""

from elastic_launch.launcher.cli import (
    config_from_args,
    console_main,
    exit_status,
    get_args_parser,
    launch_from_args,
    main,
    parse_args,
    run,
)

__all__ = [
    "config_from_args",
    "console_main",
    "exit_status",
    "get_args_parser",
    "launch_from_args",
    "main",
    "parse_args",
    "run",
]
