"""One node's launch as every part of the agent reads it (the group, its startup, the agent, the
observer): one object handed down, not the same parameter list repeated."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from elastic_launch.api import LaunchConfig
from elastic_launch.processes.entrypoint import Entrypoint
from elastic_launch.processes.logs import LogLayout


@dataclass(frozen=True)
class NodeContext:
    """The launch's settings (`config`), the job's run id, what the workers run, where their
    logs go, and this host's name (as the logs and the summary show it)."""

    config: LaunchConfig
    run_id: str
    entrypoint: Entrypoint
    layout: LogLayout
    host: str = field(default_factory=socket.gethostname)

    @property
    def log_dir(self) -> str | None:
        """The run's log directory, if it is kept after the run (else None)."""
        layout = self.layout
        return layout.run_dir if layout.kept and layout.keep_logs else None
