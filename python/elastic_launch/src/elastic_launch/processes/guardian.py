"""The guardian: a tiny process that outlives the launcher by a moment to clean up after it.

A launcher that is SIGKILLed runs no clean-up code. Its workers die with it (``PR_SET_PDEATHSIG``),
but what they started (data-loader workers, a ``subprocess``) would be orphaned, and the heartbeat
file in ``/dev/shm`` and the temporary log directory would stay. The launcher starts the guardian
first and tells it, as it goes, which process groups and paths are live; the guardian watches the
launcher's pid (a pidfd) and, should the launcher die without saying ``done``, kills those
process groups (and any process still in the workers' sessions), the workers' cgroup and every
process of the job that left it (:func:`end_strays`), and removes those paths.

The guardian runs as ``python -I -S guardian.py FD PID``: standard library only, so it starts in
milliseconds and needs nothing importable.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

#: The longest a message to the guardian may wait to be taken (seconds). Its socket buffers
#: thousands of messages; one that is full means the guardian is stopped or stuck: it is
#: replaced, and told again what it must clean up.
SEND_DEADLINE = 2.0


class Guardian:
    """The launcher's handle on its guardian. Messages are JSON lines on a socket; each is
    acted on only if the launcher dies without :meth:`done`. No send waits longer than
    :data:`SEND_DEADLINE`: a guardian that takes nothing for that long is replaced."""

    def __init__(self) -> None:
        self._groups: set[int] = set()  # what a replacement is told again
        self._paths: list[str] = []
        self._cgroups: list[str] = []
        self._given_up = False  # a replacement was stuck too: nothing more is sent
        self._start()

    def _start(self) -> None:
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._proc = subprocess.Popen(
                [
                    sys.executable,
                    "-I",
                    "-S",
                    os.path.abspath(__file__),
                    str(child.fileno()),
                    str(os.getpid()),
                ],
                pass_fds=[child.fileno()],
                start_new_session=True,  # a Ctrl-C or a kill of the launcher's group spares it
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        parent.settimeout(SEND_DEADLINE)
        self._sock = parent
        self.pid = self._proc.pid

    def _send(self, op: str, arg: int | str | None = None, replaying: bool = False) -> None:
        if self._given_up:
            return
        # One JSON object a line: a path with a newline (or any character) stays one path.
        line = json.dumps({"op": op, "arg": arg}).encode() + b"\n"
        try:
            self._sock.sendall(line)
        except TimeoutError:
            self._replace(replaying)
        except OSError:
            pass  # a dead guardian cannot help; never fail for it

    def _replace(self, replaying: bool) -> None:
        """The guardian took nothing for SEND_DEADLINE (stopped, or stuck): a new one, told
        again every live process group and path. A second stuck one is reported, and the
        launcher goes on without."""
        log = logging.getLogger("elastic_launch")
        stuck = self.pid
        self._proc.kill()  # a stopped process dies of SIGKILL too
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=5)
        self._sock.close()
        if replaying:
            self._given_up = True
            log.warning(
                "the new guardian (pid %d) took nothing within %g s either: a SIGKILL of the "
                "launcher may now leave what the workers started",
                stuck,
                SEND_DEADLINE,
            )
            return
        self._start()
        log.warning(
            "the guardian (pid %d) took nothing within %g s (stopped?): replaced by pid %d",
            stuck,
            SEND_DEADLINE,
            self.pid,
        )
        for group in sorted(self._groups):
            self._send("group", group, replaying=True)
        for path in self._paths:
            self._send("path", path, replaying=True)
        for cgroup in self._cgroups:
            self._send("cgroup", cgroup, replaying=True)

    def watch_group(self, pgid: int) -> None:
        """Kill process group (and session) `pgid` if the launcher dies."""
        self._groups.add(pgid)
        self._send("group", pgid)

    def forget_group(self, pgid: int) -> None:
        """`pgid` ended normally: its number may be reused, never kill it."""
        self._groups.discard(pgid)
        self._send("forget", pgid)

    def remove_path(self, path: str) -> None:
        """Remove `path` (a file or a directory tree) if the launcher dies."""
        self._paths.append(path)
        self._send("path", path)

    def kill_cgroup(self, path: str) -> None:
        """Kill everything in cgroup `path`, and every process of the job that left it, and
        remove it if the launcher dies."""
        self._cgroups.append(path)
        self._send("cgroup", path)

    @property
    def cgroup(self) -> str | None:
        """The job's cgroup (the last one it was told to kill): where the zygote starts."""
        return self._cgroups[-1] if self._cgroups else None

    def done(self) -> None:
        """The launcher cleaned up itself: the guardian exits without doing anything."""
        if self._given_up:
            return
        self._send("done")
        if self._given_up:
            return
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_WR)
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            logging.getLogger("elastic_launch").warning(
                "the guardian (pid %d) did not end within 5 s of being told: killed", self.pid
            )
            self._proc.kill()
            self._proc.wait(timeout=5)
        self._sock.close()

    def __enter__(self) -> Guardian:
        return self

    def __exit__(self, *exc: object) -> None:
        self.done()


# ---- the guardian process (standard library only) ---------------------------------------------


@dataclass(frozen=True)
class ProcStat:
    """One process: its id and the fields of its stat line that say whose it is."""

    pid: int
    state: str  # R, S, D, ... Z (zombie: ended, not reaped), X (dead)
    ppid: int
    pgrp: int
    session: int

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def processes() -> Iterator[ProcStat]:
    """Every process /proc lists now (one that ends while it is read is left out): the one
    reader of /proc/<pid>/stat, here because the guardian imports nothing of the project (the
    tests that check what a run leaves behind use it too)."""
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found = stat_of(int(entry))
            if found is not None:
                yield found


def stat_of(pid: int) -> ProcStat | None:
    """Process `pid` as /proc/<pid>/stat shows it; None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # pid (comm) state ppid pgrp session ...: comm may hold spaces and ')'
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if len(fields) <= 3:
        return None
    return ProcStat(pid, fields[0], int(fields[1]), int(fields[2]), int(fields[3]))


def cmdline(pid: int) -> bytes | None:
    """The command line of `pid` (NUL-separated), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def _sessions_of(sids: set[int]) -> list[int]:
    """Pids of the live processes (zombies are dead) whose session is one of `sids`."""
    return [p.pid for p in processes() if p.session in sids and p.alive]


def clean_up(groups: set[int], paths: list[str], cgroups: tuple[str, ...] = ()) -> None:
    """Kill everything in `cgroups` and the processes of the job that left them (each named
    on stderr: the launcher's), `groups` and everything in their sessions, remove `paths`
    (again while a dying process may still write into them), then the emptied cgroups."""
    for cgroup in cgroups:
        signal_cgroup(cgroup)
    for cgroup in cgroups:
        for stray in end_strays(cgroup):
            _say(f"elasticrun guardian: ended {stray.describe(cgroup)}")
    _kill_groups(groups)
    for _ in range(50):
        for path in paths:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        if not any(os.path.lexists(path) for path in paths):
            break
        time.sleep(0.01)
    for cgroup in cgroups:
        remove_cgroup(cgroup)


def _kill_groups(groups: set[int]) -> None:
    """Kill process groups `groups` and everything in their sessions."""
    for _ in range(3):  # a process may fork while we kill: look again
        for pgid in groups:
            with contextlib.suppress(OSError):
                os.killpg(pgid, signal.SIGKILL)
        left = _sessions_of(groups) if groups else []
        for pid in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if not left:
            break
        time.sleep(0.01)


def _say(line: str) -> None:
    """`line` on the launcher's stderr, if it is still there: nothing stops the clean-up."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def signal_cgroup(path: str) -> None:
    """Kill everything in cgroup `path` at once (``cgroup.kill``)."""
    with contextlib.suppress(OSError), open(os.path.join(path, "cgroup.kill"), "w") as f:
        f.write("1")


def remove_cgroup(path: str, timeout: float = 5.0) -> bool:
    """Remove cgroup `path`, and the cgroups a worker made inside it, once the kernel has
    emptied them (``rmdir`` is refused until then), waiting up to `timeout`; whether it is
    gone. The launcher's way too (processes.cgroup): the guardian imports nothing of the
    project."""
    deadline = time.monotonic() + timeout
    while True:
        for below in _cgroups_below(path):
            with contextlib.suppress(OSError):
                os.rmdir(below)
        try:
            os.rmdir(path)
            return True
        except FileNotFoundError:
            return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)


def _cgroups_below(path: str) -> list[str]:
    """The cgroups inside cgroup `path`, the deepest first."""
    return [os.path.join(top, d) for top, dirs, _ in os.walk(path, topdown=False) for d in dirs]


# ---- the job's processes that left its cgroup -------------------------------------------------

#: Every process of the job carries ``ELASTICRUN_CGROUP=<its cgroup>`` in the environment it
#: started with (``/proc/<pid>/environ``), as what it forks does: processes.cgroup.CGROUP_ENV.
JOB_MARK = "ELASTICRUN_CGROUP"


@dataclass(frozen=True)
class Stray:
    """A process of the job found outside its cgroup."""

    pid: int
    command: str
    where: str  # its cgroup now

    def describe(self, cgroup: str) -> str:
        return (
            f"pid {self.pid} ({self.command}), a process of the job outside the workers' cgroup "
            f"{cgroup} (in {self.where})"
        )


def _marked(pid: int, mark: bytes) -> bool:
    """Whether `pid` started with `mark` (``NAME=value``) in its environment."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return b"\0" + mark + b"\0" in b"\0" + f.read() + b"\0"
    except OSError:  # gone, or not ours to read (then not ours to kill either)
        return False


def _members(cgroup: str) -> set[int]:
    """The processes in cgroup `cgroup` and the cgroups inside it."""
    found: set[int] = set()
    for top, _, _ in os.walk(cgroup):
        with contextlib.suppress(OSError, ValueError), open(os.path.join(top, "cgroup.procs")) as f:
            found.update(int(line) for line in f if line.strip())
    return found


def _cgroup_of(pid: int) -> str:
    """The cgroup v2 path of `pid`, as /proc shows it."""
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return next((line[3:].strip() for line in f if line.startswith("0::")), "?")
    except OSError:
        return "?"


def find_strays(cgroup: str) -> list[Stray]:
    """The live processes marked as the job's (:data:`JOB_MARK`) outside `cgroup`: they moved
    themselves out of it (or never got in)."""
    mark = f"{JOB_MARK}={cgroup}".encode()
    marked = [
        p.pid for p in processes() if p.alive and p.pid != os.getpid() and _marked(p.pid, mark)
    ]
    inside = _members(cgroup)  # read after: one forked inside meanwhile is in it by now
    below = _hierarchy_path(cgroup)
    found = []
    for pid in marked:
        where = _cgroup_of(pid)  # a dying process leaves cgroup.procs, not this
        if pid in inside or (below is not None and (where + "/").startswith(below + "/")):
            continue
        line = (cmdline(pid) or b"").replace(b"\0", b" ").strip()
        found.append(Stray(pid, line.decode(errors="replace")[:200], where))
    return found


def _hierarchy_path(cgroup: str) -> str | None:
    """Cgroup directory `cgroup` as /proc/<pid>/cgroup names it (below the mount point of
    the cgroup v2 hierarchy it is in), or None if it is in none."""
    try:
        with open("/proc/self/mounts") as f:
            mounts = [line.split()[1] for line in f if line.split()[2:3] == ["cgroup2"]]
    except OSError:
        return None
    for mount in mounts:
        if cgroup.startswith(mount.rstrip("/") + "/"):
            return "/" + cgroup[len(mount.rstrip("/")) :].strip("/")
    return None


def _kill_marked(pid: int, mark: bytes) -> bool:
    """SIGKILL `pid` if it is still the marked process (a pidfd holds it while it is looked
    at again, so a reused pid is never killed); whether it was."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return False
    except OSError:  # no pidfds: the mark is looked at just before the kill
        fd = -1
    try:
        if not _marked(pid, mark):
            return False
        if fd >= 0:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True
    except OSError:  # gone meanwhile, or not ours
        return False
    finally:
        if fd >= 0:
            os.close(fd)


def end_strays(cgroup: str, timeout: float = 5.0) -> list[Stray]:
    """Kill every process of the job outside `cgroup`; what they fork meanwhile is found at
    the next look, until one finds nothing new and those killed are gone (at most
    `timeout`). Returns those killed."""
    mark = f"{JOB_MARK}={cgroup}".encode()
    tried: set[int] = set()
    ended: list[Stray] = []
    deadline = time.monotonic() + timeout
    while True:
        new = [s for s in find_strays(cgroup) if s.pid not in tried]
        for stray in new:
            tried.add(stray.pid)
            if _kill_marked(stray.pid, mark):
                ended.append(stray)
        killed = {s.pid for s in ended}
        dying = any(p.pid in killed and p.alive for p in processes())
        if (not new and not dying) or time.monotonic() >= deadline:
            return ended
        time.sleep(0.01)


class _Orders:
    """What the launcher asked the guardian to clean up, should it die."""

    def __init__(self) -> None:
        self.groups: set[int] = set()
        self.paths: list[str] = []
        self.cgroups: list[str] = []
        self._buffer = b""

    def take(self, data: bytes) -> bool:
        """Take the messages in `data` (lines may arrive in pieces); True on ``done``."""
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
                if message["op"] == "done":
                    return True
                self._act(message["op"], message["arg"])
            except (ValueError, KeyError, TypeError):
                continue  # not from our launcher: nothing to act on
        return False

    def _act(self, op: str, arg: object) -> None:
        if op in ("group", "forget") and type(arg) is int:
            (self.groups.add if op == "group" else self.groups.discard)(arg)
        elif op == "path" and isinstance(arg, str):
            self.paths.append(arg)
        elif op == "cgroup" and isinstance(arg, str) and arg.startswith("/"):
            self.cgroups.append(arg)


def _pidfd(launcher: int) -> int:
    """A pidfd of the launcher; -1 if it is gone already, -2 without pidfds (then its death
    is noticed by being reparented)."""
    try:
        return os.pidfd_open(launcher)
    except ProcessLookupError:
        return -1
    except (AttributeError, OSError):
        return -2


def serve(fd: int, launcher: int) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    orders = _Orders()
    pidfd = _pidfd(launcher)
    launcher_gone = pidfd == -1  # gone already: clean up what we are told, then leave
    eof = False
    while True:
        watch = ([] if eof else [sock]) + ([pidfd] if pidfd >= 0 and not launcher_gone else [])
        timeout = 0.0 if launcher_gone else (0.1 if pidfd == -2 else None)
        readable, _, _ = select.select(watch, [], [], timeout)
        if pidfd in readable or (pidfd == -2 and os.getppid() != launcher):
            launcher_gone = True
        if sock in readable:
            data = sock.recv(65536)
            if not data:
                eof = launcher_gone = True  # closed without `done`: it died (or gave up on us)
            if orders.take(data):
                return
        if launcher_gone and (eof or sock not in readable):
            clean_up(orders.groups, orders.paths, tuple(orders.cgroups))
            return


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]))
