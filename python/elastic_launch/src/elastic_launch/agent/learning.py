"""The agent's side of learning the workers' imports (:mod:`elastic_launch.learned`):
read each worker's list once it has stepped, have the zygote's heir import what is new, say
what was learned and what was left out (once), and keep it for the job's next run."""

from __future__ import annotations

import logging
import os
from typing import Any

from elastic_launch import learned
from elastic_launch.agent.context import NodeContext
from elastic_launch.agent.events import Events
from elastic_launch.agent.workers import WorkerGroup
from elastic_launch.files import write_atomically
from elastic_launch.processes import preload
from elastic_launch.processes.spawn import Settled, ZygoteFork

logger = logging.getLogger(__name__)

#: Heirs given up for what they imported, at most, before the job stops learning.
MAX_ROUNDS = 3
#: What nearly every worker under elasticrun imports, with what its first DDP model and
#: optimizer step import lazily (1.5 s alone on a CPU): learned ahead of the workers' word
#: when the zygote holds no torch, so that a worker that fails before the workers' own list is
#: learned is still replaced warm. A job that never imports torch pays an heir's memory.
AHEAD = (
    "torch",
    "torch._dynamo",
    "torch.nn.parallel.distributed",
    "torch.optim",
    "torch.utils.data",
)
#: Heirs that took over, at most: each keeps its parent alive (the parent of its workers), so
#: a worker that keeps writing new names cannot grow the node's processes without end.
MAX_HEIRS = 4


class Learning:
    """Learns what the workers of one node import (see the module's docstring)."""

    def __init__(self, group: WorkerGroup, events: Events) -> None:
        context = group.context
        self.group, self.events = group, events
        #: Only ``--preload auto`` learns: an explicit list, or none, keeps its meaning.
        self.enabled = preload.AUTO in context.config.preload
        self.kept = kept_path(context)
        self.key = learned.entrypoint_key(context.entrypoint.kind.value, context.entrypoint.target)
        self.asked: dict[str, None] = {}  # every name asked for, in order
        self.skip: set[str] = set()  # what a heir found unsafe, with what it brought
        self.left_out: dict[str, str] = {}  # the unsafe ones, and why
        self.changed: dict[str, str | None] = {}  # variables the workers changed: digests
        self._seen: dict[str, int] = {}  # imports file -> its mtime when read
        self._said: set[str] = set()  # files found unusable, left out modules: said once
        self._retry: tuple[str, ...] = ()  # what an heir given up was to import
        self.rounds = 0
        self.heirs = 0  # heirs that took over
        self._kept_said = False
        self._ahead_asked = False
        kept = learned.read_kept(self.kept, self.key) if self.kept and self.enabled else None
        if kept is not None:  # the first zygote imports it: no heir is to learn it again
            self.asked.update(dict.fromkeys([*kept.modules, *kept.skip]))
            self.skip.update(kept.skip)
            self.changed.update(kept.differ)
        self.node_file = os.path.join(context.layout.run_dir, learned.NODE_FILE)

    @property
    def _spawner(self) -> ZygoteFork | None:
        """The spawner, if it forks from a zygote that can learn (what has ``learn``)."""
        s = self.group.spawner
        return s if hasattr(s, "learn") else None  # type: ignore[return-value]

    def poll(self, attempt: int) -> None:
        """Once per turn of the agent's loop: report heirs that finished, and start one for
        names the workers imported that no heir was asked for yet."""
        spawner = self._spawner
        if spawner is None or not self.enabled:
            return
        self._first_zygote(spawner, attempt)
        for s in spawner.settled():
            self._settled(s, attempt)
        if spawner.learning or spawner.zygote is None:
            return
        if self.rounds >= MAX_ROUNDS or self.heirs >= MAX_HEIRS:
            return
        new = self._retry or tuple(self._new_names()) or self._ahead(spawner)
        if not new:
            return
        differ = {**self.changed, **dict.fromkeys(spawner.differ, learned.ALWAYS)}
        plan = learned.ImportPlan(new, differ, tuple(sorted(self.skip)))
        if spawner.learn(plan):
            self._retry = ()
            self.asked.update(dict.fromkeys(new))

    def _ahead(self, spawner: ZygoteFork) -> tuple[str, ...]:
        """What to learn before the workers say it, once: :data:`AHEAD`, when the zygote holds
        no torch (its script's text did not show it: a wrapper, a helper installed elsewhere)
        and nothing kept from an earlier run; empty otherwise."""
        if self._ahead_asked or spawner.zygote is None:
            return ()
        self._ahead_asked = True
        z = spawner.zygote
        if preload.TORCH in z.modules or z.learned is not None:
            return ()
        return AHEAD

    def _first_zygote(self, spawner: ZygoteFork, attempt: int) -> None:
        """The event of a zygote that started with what an earlier run learned, once."""
        z = spawner.zygote
        if self._kept_said or z is None or not z.ready:
            return
        self._kept_said = True
        if z.learned is not None:
            self._report(z.pid, z.learned, attempt, kept=True)

    def _new_names(self) -> list[str]:
        """The names in the imports files of workers that have stepped, not asked for yet."""
        steps = self.group.steps()
        new: dict[str, None] = {}
        for w in self.group.workers:
            if steps.get(w.local_rank, 0) < 1:
                continue
            path = learned.imports_file(w.rank_dir)
            try:
                mtime = os.stat(path).st_mtime_ns
                if self._seen.get(path) == mtime:
                    continue
                self._seen[path] = mtime
                imports = learned.read(path)
            except (OSError, ValueError) as e:
                self._say_once(path, "the imports file %s cannot be used (%s): ignored", path, e)
                continue
            if imports is None:
                continue
            self.changed.update(imports.env_changed)
            new.update(dict.fromkeys(m for m in imports.modules if m not in self.asked))
        return list(new)

    def _settled(self, s: Settled, attempt: int) -> None:
        if not s.account:
            logger.warning("the zygote's heir ended before it had learned the workers' imports")
            self.rounds += 1
            return
        left_out = s.account["left_out"]
        self.left_out.update(left_out)
        for name, why in left_out.items():
            self._say_once(
                name,
                "--preload: '%s' is left out of the zygote (%s); workers import it themselves",
                name,
                why,
            )
        if not s.took_over:
            self.rounds += 1
            self.skip.update(s.account["excluded"])
            self._retry = tuple(m for m in s.plan.modules if m not in self.skip)
            return
        self.heirs += 1
        self._report(s.pid, s.account, attempt, kept=False)
        self._keep()

    def _report(self, pid: int, account: dict[str, Any], attempt: int, kept: bool) -> None:
        loaded = account["loaded"]
        logger.info(
            "the zygote %s %d module(s) the workers import (%s%s): replacements and spares "
            "fork with them",
            "holds what an earlier run learned:" if kept else "learned",
            len(loaded),
            ", ".join(loaded[:5]),
            ", ..." if len(loaded) > 5 else "",
        )
        self.events.emit(
            "preload_learned",
            attempt,
            pid=pid,
            kept=kept,
            learned=loaded,
            left_out={**self.left_out, **account["left_out"]},  # every heir's, so far
            holds=account["holds"],
        )

    def _keep(self) -> None:
        """Write what was learned where the spares and the job's next run find it."""
        modules = tuple(m for m in self.asked if m not in self.skip)
        plan = learned.ImportPlan(modules, dict(self.changed), tuple(sorted(self.skip)))
        for path in filter(None, (self.node_file, self.kept)):
            try:
                write_atomically(path, plan.to_json(self.key))
            except OSError as e:
                self._say_once(path, "what was learned cannot be kept at %s (%s)", path, e)

    def _say_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._said:
            self._said.add(key)
            logger.warning(message, *args)


def kept_path(context: NodeContext) -> str | None:
    """Where the next run of the same entrypoint finds what this one learned: beside the run
    directories in ``--log-dir`` (None without one: nothing outlives the run)."""
    log_dir = context.config.log_dir
    if not log_dir or log_dir == os.devnull or preload.AUTO not in context.config.preload:
        return None
    return learned.kept_path(
        log_dir, learned.entrypoint_key(context.entrypoint.kind.value, context.entrypoint.target)
    )
