"""A worker whose daemon leaves the workers' cgroup: rank 0 double-forks a process that leaves
its process group and session (setsid), closes its streams, and moves itself (as root can)
to the parent of its cgroup (``parent``), to a sibling cgroup it makes there (``sibling``), or
to a cgroup it makes inside its own (``child``). It writes "pid, the workers' cgroup, where it
went" (or "refused: why") to OUT, then sleeps. Every worker waits until the file GO exists
(300 s at most) and exits 0.

Usage: escaping_daemon.py OUT GO parent|sibling|child
"""

from __future__ import annotations

import os
import sys
import time


def _cgroup_dir() -> str:
    """This process's cgroup as a directory of the mounted cgroup v2 hierarchy."""
    with open("/proc/self/mounts") as f:
        mount = next(line.split()[1] for line in f if line.split()[2] == "cgroup2")
    with open("/proc/self/cgroup") as f:
        own = next(line[3:].strip() for line in f if line.startswith("0::"))
    return os.path.join(mount, own.lstrip("/"))


def _escape(how: str) -> tuple[str, str]:
    """Move this process as `how` says: (the cgroup it left, the one it is in now)."""
    workers = _cgroup_dir()
    if how == "parent":
        target = os.path.dirname(workers)
    elif how == "sibling":
        target = f"{workers}-escape-{os.getpid()}"
    else:
        target = os.path.join(workers, f"escape-{os.getpid()}")
    if how != "parent":
        os.mkdir(target)
    with open(os.path.join(target, "cgroup.procs"), "w") as f:
        f.write(str(os.getpid()))
    return workers, _cgroup_dir()


def _daemon(out: str, how: str) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    try:
        workers, now = _escape(how)
        said = f"{os.getpid()}\n{workers}\n{now}\n"
    except OSError as e:
        said = f"refused: {e}\n"
    with open(out + ".tmp", "w") as f:
        f.write(said)
    os.replace(out + ".tmp", out)
    time.sleep(600)


def main() -> None:
    out, go, how = sys.argv[1:4]
    if os.environ.get("RANK") == "0":
        middle = os.fork()
        if middle == 0:
            os.setsid()
            if os.fork() == 0:
                _daemon(out, how)
            os._exit(0)
        os.waitpid(middle, 0)
    deadline = time.monotonic() + 300
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)


if __name__ == "__main__":
    main()
