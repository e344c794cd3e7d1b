"""The workers' own rendezvous, for scripts that run the classic train loop
(:mod:`elastic_launch.train_loop`) under elasticrun.

In that loop every worker is a member of the job by itself: when one dies, the others re-form
the process group without it (or with its replacement) and keep their processes. The agents'
rendezvous admits nodes; this one, the *team*, admits workers. It runs on the job's own
rendezvous service under a run id of its own (``<run id>.workers``): the embedded service of the
hosting agent, or etcd. On one node, where the agents' rendezvous is in-process, the launcher
serves one for its workers on 127.0.0.1, started when the first worker announces the loop.

The launcher tells its workers where the team meets through :data:`TEAM_ENV` (JSON), and each
worker where to announce that it runs the loop through :data:`LOOP_FILE_ENV`: the agent reads
that file to replace a dead worker alone instead of restarting the group.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from elastic_launch.api import LaunchConfig
from elastic_launch.files import write_atomically
from elastic_launch.rendezvous.conf import EMBEDDED, ETCD, ETCD_V2, WORKER_KEYS, kind_of

logger = logging.getLogger(__name__)

TEAM_ENV = "ELASTICRUN_TEAM"
LOOP_FILE_ENV = "ELASTICRUN_LOOP_FILE"
#: What a worker writes to its loop file: it runs the loop (``running``, then ``running N``
#: once the loop's failure budget N is known: the agent replaces up to N workers); it waits in
#: the workers' rendezvous for a round to take it (``waiting`` or ``waiting N``: a hot spare,
#: or a worker between rounds); it failed for good (no replacement).
RUNNING, WAITING, FATAL = "running", "waiting", "fatal"


def running(max_failures: int | None, what: str = RUNNING) -> str:
    """The loop file's text for a worker that runs the loop (or waits for a round: `what`)
    with `max_failures` (if known)."""
    return what if max_failures is None else f"{what} {max_failures}"


def read_loop_file(text: str) -> tuple[str, int]:
    """(``running``/``waiting``/``fatal``/``""``, the failure budget or 0) from a loop file's
    text; what a worker wrote is read defensively (anything else is nothing said)."""
    said, _, budget = text.strip().partition(" ")
    if said not in (RUNNING, WAITING, FATAL):
        return "", 0
    return said, int(budget) if budget.isascii() and budget.isdigit() and len(budget) < 10 else 0


#: The team's own waits: after MIN workers joined, how long for more (the survivors of a
#: failure go on at once when the rest of the previous round is known gone).
TEAM_LAST_CALL = 1.0


@dataclass(frozen=True)
class Team:
    """Where a job's workers rendezvous among themselves (what :data:`TEAM_ENV` holds)."""

    backend: str  # embedded, etcd or etcd-v2
    endpoint: str
    run_id: str
    min_workers: int
    max_workers: int
    config: Mapping[str, str] = field(default_factory=dict)
    unavailable: str = ""  # why there is none (the coordinator says it)
    file: str = ""  # a service started on demand: where the agent says where it is

    def to_env(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_env(cls, text: str) -> Team:
        raw = json.loads(text)
        return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})


def team_run_id(run_id: str) -> str:
    return f"{run_id}.workers"


def _unavailable(config: LaunchConfig, run_id: str, why: str) -> Team:
    return Team("", "", team_run_id(run_id), 0, 0, unavailable=why)


class TeamService:
    """The team of one launch, and on one node the service it meets in.

    That service is started on demand: the first worker to announce the loop (its loop file)
    makes the agent call :meth:`ensure`, which starts it on a port the kernel picks and
    writes where it is to :attr:`file`, which the workers wait for. A script that does not
    run the loop costs nothing.
    """

    def __init__(self, team: Team, file: str | None = None) -> None:
        self.team = team
        self.file = file
        self._server: Any = None
        self._failed = ""

    @property
    def pending(self) -> bool:
        """Whether the service is still to be started (by :meth:`ensure`)."""
        return self.file is not None and self._server is None and not self._failed

    def ensure(self) -> None:
        """Start the on-demand service and say where it is (once; a failure is written to
        the file, for the workers to report)."""
        if not self.pending:
            return
        assert self.file is not None
        from elastic_launch.rendezvous.embedded.server import EmbeddedServer

        token = os.urandom(16).hex()
        try:
            self._server = EmbeddedServer("127.0.0.1", 0, token)
            where = {"endpoint": f"127.0.0.1:{self._server.port}", "token": token}
        except Exception as e:
            self._failed = f"the train loop's rendezvous service could not start: {e}"
            logger.warning("%s", self._failed)
            where = {"unavailable": self._failed}
        write_atomically(self.file, json.dumps(where))  # the workers see all of it or nothing

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


def resolve(team: Team, timeout: float = 60.0) -> Team:
    """A team whose service is started on demand (:attr:`Team.file`): wait until the agent
    says where it is (after this worker announced the loop)."""
    if team.endpoint or team.unavailable or not team.file:
        return team
    deadline = time.monotonic() + timeout
    while not os.path.exists(team.file):
        if time.monotonic() > deadline:
            return replace(
                team,
                unavailable=f"the agent did not start the workers' rendezvous within "
                f"{timeout:g} s ({team.file} never appeared)",
            )
        time.sleep(0.005)
    with open(team.file) as f:
        where = json.load(f)
    if "unavailable" in where:
        return replace(team, unavailable=where["unavailable"])
    return replace(
        team, endpoint=where["endpoint"], config={**team.config, "token": where["token"]}
    )


@contextlib.contextmanager
def serve_team(
    config: LaunchConfig, run_id: str, run_dir: str = "", *, can_serve: bool = True
) -> Iterator[TeamService]:
    """The team of this launch: the job's own rendezvous service when it has one the workers
    can reach; on one node, a service of the launcher's, started on demand (its address goes
    to a file in `run_dir`). `can_serve` is False where no service may be started (workers
    forked from the launcher, which must not hold gRPC threads)."""
    kind = kind_of(config.rdzv_backend, config.max_nodes)
    lo = config.min_workers or config.min_nodes * config.nproc_per_node
    hi = config.max_nodes * config.nproc_per_node
    shared = {k: v for k, v in config.rdzv_configs.items() if k in WORKER_KEYS}
    conf = {**shared, "last_call_timeout": f"{TEAM_LAST_CALL:g}"}
    if kind in (ETCD, ETCD_V2) or (kind == EMBEDDED and config.max_nodes > 1):
        if kind == EMBEDDED:
            conf["is_host"] = "false"  # the hosting agent serves; its workers are clients
        yield TeamService(Team(kind, config.rdzv_endpoint, team_run_id(run_id), lo, hi, conf))
        return
    if config.max_nodes > 1:
        why = (
            f"the {config.rdzv_backend} rendezvous has no service the workers can share; run "
            "with --rdzv-backend embedded or etcd"
        )
        yield TeamService(_unavailable(config, run_id, why))
        return
    if not can_serve:
        why = "workers forked from the launcher (start_method='fork') cannot use it; use spawn"
        yield TeamService(_unavailable(config, run_id, why))
        return
    conf["is_host"] = "false"
    path = os.path.join(run_dir, "train_loop_rendezvous.json")
    service = TeamService(
        Team(EMBEDDED, "", team_run_id(run_id), lo, hi, conf, file=path), file=path
    )
    try:
        yield service
    finally:
        service.close()
