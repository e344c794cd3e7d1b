"""``elasticrun``'s command line under its public path (:mod:`elastic_launch.launcher.cli`)."""

from elastic_launch.launcher.cli import (
    build_parser,
    config_from_args,
    console_main,
    exit_status,
    main,
)

__all__ = ["build_parser", "config_from_args", "console_main", "exit_status", "main"]
