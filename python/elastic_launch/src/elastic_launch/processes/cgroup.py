"""What a worker starts ends with the job, daemons too: the workers and the zygote run in a
cgroup v2 subtree the launcher makes under its own cgroup, and at the end the kernel kills
everything in it at once (``cgroup.kill``). A process that left its process group and session
(``setsid``, a double fork) is still inside. Should the launcher be SIGKILLed, its guardian
does the same.

A process may leave the subtree only by writing its pid into another cgroup's
``cgroup.procs``, which needs write access there: root has it. A cgroup namespace rooted at
the subtree does not stop root unless the hierarchy is mounted with ``nsdelegate`` (measured:
a root process in such a namespace moved itself to the parent and to a sibling). So every
process of the job is marked instead: ``$ELASTICRUN_CGROUP`` is in the environment it started
with (``/proc/<pid>/environ``), which what it forks keeps, wherever it moves. At the end the
launcher (or the guardian) kills the subtree, then every marked process outside it, and names
each (:func:`elastic_launch.processes.guardian.end_strays`). A process that both leaves the
subtree and replaces its environment (an ``exec`` with another) is not found.

Where no such subtree can be made (no cgroup v2 hierarchy mounted, no write permission to the
launcher's cgroup, a kernel before 5.14 without ``cgroup.kill``), the workers' process groups
and sessions are what the launcher ends, as before; it says why, once (as a warning when it
runs as root, where a subtree was to be expected).

A worker, and the zygote, join the subtree themselves, first thing (:func:`join`, from
``$ELASTICRUN_CGROUP``), so that what they start is inside from the start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: The workers' cgroup, in every process of the job: also its mark (the guardian's JOB_MARK).
CGROUP_ENV = "ELASTICRUN_CGROUP"
#: How long the kill waits for the kernel to empty the subtree (seconds).
KILL_WAIT = 5.0


def _mount() -> str | None:
    """Where the cgroup v2 hierarchy is mounted, if it is."""
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and parts[2] == "cgroup2":
                    return parts[1]
    except OSError:
        pass
    return None


def _own() -> str | None:
    """This process's cgroup in the v2 hierarchy ("0::/path")."""
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                if line.startswith("0::"):
                    return line[3:].strip()
    except OSError:
        pass
    return None


@dataclass
class Container:
    """The workers' cgroup (`path`), or None and why there is none."""

    path: str | None
    why: str = ""

    @classmethod
    def make(cls) -> Container:
        """A new subtree under this process's cgroup; one without a path where none can be
        (said as a warning as root, where one was to be expected)."""
        made = cls._make()
        if made.path is None and os.geteuid() == 0:
            logger.warning("%s", made.describe())
        return made

    @classmethod
    def _make(cls) -> Container:
        mount, own = _mount(), _own()
        if mount is None or own is None:
            return cls(None, "no cgroup v2 hierarchy is mounted")
        parent = os.path.join(mount, own.lstrip("/"))
        sweep(parent)
        path = os.path.join(parent, f"elasticrun-{os.getpid()}-{os.urandom(3).hex()}")
        try:
            os.mkdir(path)
        except OSError as e:
            return cls(None, f"cannot make {path}: {e.strerror}")
        if not os.path.exists(os.path.join(path, "cgroup.kill")):
            with contextlib.suppress(OSError):
                os.rmdir(path)
            return cls(None, "the kernel has no cgroup.kill (Linux 5.14 or later has it)")
        return cls(path)

    def env(self) -> dict[str, str]:
        """What a worker is told, to join the subtree."""
        return {CGROUP_ENV: self.path} if self.path else {}

    def describe(self) -> str:
        if self.path:
            return (
                f"the workers' cgroup {self.path} (all it holds ends with the job, and so does "
                "a process of the job found outside it)"
            )
        return (
            f"no cgroup for the workers ({self.why}): what they start is ended by process "
            "group and session, so a daemon that left both can outlive the job"
        )

    def kill(self, timeout: float = KILL_WAIT) -> None:
        """End everything in the subtree, and the job's processes outside it, and remove it."""
        if not self.path:
            return
        kill_tree(self.path, timeout)
        self.path = None


_NAME = re.compile(r"^elasticrun-(?P<pid>\d+)-[0-9a-f]{6}$")


def sweep(parent: str) -> int:
    """Remove the empty job cgroups in `parent` whose launcher is gone (one SIGKILLed with its
    guardian leaves its cgroup, empty once the kernel killed what it held): how many. One
    that still holds a process is left as it is."""
    removed = 0
    try:
        names = os.listdir(parent)
    except OSError:
        return 0
    for name in names:
        match = _NAME.match(name)
        if match is None or os.path.exists(f"/proc/{match['pid']}"):
            continue
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(parent, name))
            removed += 1
    if removed:
        logger.info(
            "removed %d empty cgroup(s) of launchers that are gone from %s", removed, parent
        )
    return removed


def kill_tree(path: str, timeout: float = KILL_WAIT) -> bool:
    """Kill everything in cgroup `path` and every process of the job outside it (naming
    each), wait (up to `timeout`) for it to empty, remove it; whether it is gone (the
    guardian's functions: one way for both)."""
    # Here, not at the top: a worker imports this module to join, and needs none of it.
    from elastic_launch.processes.guardian import end_strays, remove_cgroup, signal_cgroup

    signal_cgroup(path)
    for stray in end_strays(path, timeout):
        logger.warning("ended %s", stray.describe(path))
    if remove_cgroup(path, timeout):
        return True
    logger.warning("the workers' cgroup %s did not empty within %g s", path, timeout)
    return False


def join() -> None:
    """In a worker or the zygote: move into the workers' cgroup (``$ELASTICRUN_CGROUP``), if
    there is one; one that cannot stays where it is (its mark still finds it at the end)."""
    path = os.environ.get(CGROUP_ENV)
    if not path:
        return
    with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
