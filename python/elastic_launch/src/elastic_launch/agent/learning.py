"""The agent's side of learning the workers' imports (:mod:`elastic_launch.learned`): read each
worker's list once it has stepped, have the zygote's heir import what is new, say what was
learned and what was left out (once), and keep it for the next run of the same entrypoint."""

from __future__ import annotations

import logging
import os
from typing import Any

from elastic_launch import learned, untrusted
from elastic_launch.agent.context import NodeContext
from elastic_launch.agent.events import Events
from elastic_launch.agent.workers import WorkerGroup
from elastic_launch.processes import preload
from elastic_launch.processes.spawn import Settled, ZygoteFork

logger = logging.getLogger(__name__)

#: Heirs given up (for what they imported, or dead, or stalled), at most, before the job
#: stops learning.
MAX_ROUNDS = 3
#: What nearly every worker under elasticrun imports, with what its first DDP model and
#: optimizer step import lazily (1.5 s alone on a CPU): learned ahead of the workers' word
#: when the zygote holds no torch, at the normal CPU policy (it competes with the first
#: workers' own start, once), so that a worker that fails before the workers' own list is
#: learned is still replaced warm. A job that never imports torch pays an heir's memory.
AHEAD = (
    preload.TORCH,
    preload.DYNAMO,
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
        entrypoint = context.entrypoint
        self.key = learned.entrypoint_key(entrypoint.kind.value, entrypoint.target)
        self.asked: dict[str, None] = {}  # every name an heir was asked for, in order
        self.reported: dict[str, None] = {}  # every name a worker reported, in order
        self.pending: tuple[str, ...] = ()  # asked for next (an heir given up, or capped)
        self.skip: set[str] = set()  # what a heir found unsafe, with what it brought
        self.left_out: dict[str, str] = {}  # the unsafe ones, and why
        self.changed: dict[str, str | None] = {}  # variables the workers changed: digests
        self._reads: dict[str, int] = {}  # imports file -> times read (one per record step)
        self._said: set[str] = set()  # files found unusable, left out modules: said once
        self.rounds = self.heirs = 0  # heirs given up; heirs that took over
        self._kept_said = self._ahead_asked = False
        self.node_file = os.path.join(context.layout.run_dir, learned.NODE_FILE)
        spawner = self._spawner
        earlier = spawner.chosen.kept if spawner is not None and self.enabled else None
        if earlier is not None:  # the first zygote imports it: no heir is to learn it again
            self.asked.update(dict.fromkeys([*earlier.modules, *earlier.skip]))
            self.reported.update(dict.fromkeys(earlier.modules))
            self.skip.update(earlier.skip)
            self.changed.update(earlier.differ)

    @property
    def _spawner(self) -> ZygoteFork | None:
        """The spawner, if it forks from a zygote (what has ``learn``: tests' fakes too)."""
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
        z = spawner.zygote
        if spawner.learning or z is None or not z.ready:
            return  # what is new waits in the files (and in `pending`) until it can be asked
        if self.rounds >= MAX_ROUNDS or self.heirs >= MAX_HEIRS:
            return
        ahead = not self.pending and not self._new_names() and self._ahead(spawner)
        if ahead:
            self.pending = AHEAD
        if not self.pending:
            return
        held = set(z.learned["holds"]) if z.learned else set()
        new = [m for m in self.pending if m not in held]
        plan_names, rest = new[: learned.MAX_PER_HEIR], new[learned.MAX_PER_HEIR :]
        differ = dict(self.changed) | dict.fromkeys(spawner.differ, learned.ALWAYS)
        plan = learned.ImportPlan(tuple(plan_names), differ, tuple(sorted(self.skip)))
        if plan_names and spawner.learn(plan, idle_cpu=not ahead):
            self.asked.update(dict.fromkeys(plan_names))
            self.pending = tuple(rest)
        elif not plan_names:
            self.pending = ()

    def _ahead(self, spawner: ZygoteFork) -> bool:
        """Whether to learn :data:`AHEAD` before the workers say it (once): the zygote holds no
        torch (its script's text did not show it: a wrapper, a helper installed elsewhere)
        and nothing kept from an earlier run."""
        if self._ahead_asked or spawner.zygote is None:
            return False
        self._ahead_asked = True
        z = spawner.zygote
        return preload.TORCH not in z.modules and z.learned is None

    def _first_zygote(self, spawner: ZygoteFork, attempt: int) -> None:
        """The event of a zygote that started with what an earlier run learned, once."""
        z = spawner.zygote
        if self._kept_said or z is None or not z.ready:
            return
        self._kept_said = True
        if z.learned is not None:
            self._report(z.pid, z.learned, attempt, kept=True)

    def _new_names(self) -> bool:
        """Read the imports files of workers that have stepped (each at most once per step in
        :data:`~elastic_launch.learned.RECORD_AT_STEPS` it passed: a worker that rewrites its
        file costs the agent nothing more), and add the names not asked for yet to
        `pending`; whether any was."""
        steps = self.group.steps()
        due = sorted(learned.RECORD_AT_STEPS)
        new: dict[str, None] = {}
        for w in self.group.workers:
            path = learned.imports_file(w.rank_dir)
            reads = self._reads.get(path, 0)
            if reads >= len(due) or steps.get(w.local_rank, 0) < due[reads]:
                continue
            try:
                imports = learned.read(path)
            except (OSError, ValueError) as e:
                self._reads[path] = reads + 1
                self._say_once(path, "the imports file %s cannot be used (%s): ignored", path, e)
                continue
            if imports is None:
                continue  # not written yet: read again at the next turn
            self._reads[path] = reads + 1
            for key, value in imports.env_changed.items():  # two workers' values: no one's
                known = self.changed.setdefault(key, value)
                self.changed[key] = known if known == value else learned.ALWAYS
            self.reported.update(dict.fromkeys(imports.modules))
            new.update(dict.fromkeys(m for m in imports.modules if m not in self.asked))
        self.pending = tuple(new)
        return bool(new)

    def _settled(self, s: Settled, attempt: int) -> None:
        if not s.took_over:
            self.rounds += 1
        if not s.account:
            logger.warning(
                "the zygote's heir ended, or stopped, before it had learned the workers' imports"
            )
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
            self.skip.update(s.account["excluded"])
            self.pending = tuple(m for m in s.plan.modules if m not in self.skip)
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
        """Write what the workers reported (not what was learned ahead of them), safe to
        import, where the spares and the next run find it."""
        modules = tuple(m for m in self.reported if m not in self.skip)
        spawner = self._spawner
        always = dict.fromkeys(spawner.differ, learned.ALWAYS) if spawner is not None else {}
        plan = learned.ImportPlan(modules, {**self.changed, **always}, tuple(sorted(self.skip)))
        for path in filter(None, (self.node_file, self.kept)):
            try:
                untrusted.replace(path, plan.to_json(self.key).encode())
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
    entrypoint = context.entrypoint
    return learned.kept_path(
        log_dir, learned.entrypoint_key(entrypoint.kind.value, entrypoint.target)
    )
