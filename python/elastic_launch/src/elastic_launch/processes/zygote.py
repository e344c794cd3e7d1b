"""The zygote: a process with modules already imported that forks new workers (``--preload``).

A restart then costs a fork instead of a new interpreter and ``import torch``. The agent starts
the zygote once, talks to it over a Unix socketpair (one JSON message per datagram, standard
streams passed as file descriptors), and learns each worker's exit status from it, since the
zygote is their parent. A forked worker becomes a worker through
:func:`elastic_launch.processes.worker_main.run_worker`, the same path as every other worker.

Protocol (agent -> zygote): ``kept {modules, differ, skip}`` first, when started with
``--learned`` (what an earlier run learned: imported after the modules named); ``spares
{count}``: how many warm spares to keep; ``spawn {id, argv, env, cwd, stdout, stderr}`` with
the stream descriptors attached; ``watched {pid}`` once the agent watches a child (from then on
the zygote may reap it: until then its zombie keeps the pid, so the agent's pidfd always finds
the right process); ``learn {modules, differ, skip, idle}`` with the socket of an *heir*
attached (:mod:`elastic_launch.learned`: the heir imports them, then serves on that socket as
a zygote of its own). Zygote (or heir) -> agent: ``learning {pid}`` from an heir as it starts;
``ready {pid, seconds, failed, unsafe, learned}`` once its imports are done; ``spawned {id,
pid}``; ``exited {pid, status}``. Lists of module names travel packed
(:func:`elastic_launch.learned.pack`). End of file on either side ends the other.

A *warm spare* is a child forked ahead of need, while the zygote has nothing else to do, that
waits for a spawn request on a socketpair of its own: a spawn then hands the request to a spare
(no fork on the way to the worker's first line) and a new spare is forked once the zygote is
idle again. A spare is the zygote as it was when forked (nothing changes in the zygote after
its imports), with the stop signals held as a freshly forked child's are.

Run by the agent as ``python -m elastic_launch.processes.zygote FD [--learned] MODULE...``.
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import select
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

from elastic_launch import idle, learned, teardown
from elastic_launch.cancel import join
from elastic_launch.compat import python_executable
from elastic_launch.learned import load
from elastic_launch.processes import cgroup
from elastic_launch.processes.guardian import stat_of
from elastic_launch.processes.proctitle import room_argument, room_environment, set_title
from elastic_launch.processes.worker_main import STOP_SIGNALS, Handover, run_worker

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 1 << 20
#: Seconds the zygote has to answer a spawn (a fork, or a warm spare handed the request: ms);
#: one that does not is stopped or stuck, and is given up for fresh interpreters.
SPAWN_ANSWER_TIMEOUT = 5.0
#: The longest a message to the zygote may wait to be taken (seconds): one that waits longer
#: means the zygote is stopped or stuck, and the agent gives it up for fresh interpreters.
SEND_DEADLINE = 2.0
_MALFORMED = "a message that is not JSON"
#: On the zygote's command line: its first message is what an earlier run learned.
LEARNED_ARG = "--learned"
#: The agent's pid, in the zygote's environment (it dies with the agent), then removed.
AGENT_PID_ENV = "ELASTICRUN_AGENT_PID"


def send(
    sock: socket.socket,
    message: dict[str, Any],
    fds: list[int] | None = None,
    deadline: float | None = None,
) -> None:
    """One message (JSON), with file descriptors attached. With a `deadline` (seconds), one
    not taken within it raises TimeoutError; the socket stays blocking for its other users
    (the agent's reader thread)."""
    data = json.dumps(message).encode()
    if len(data) > _MAX_MESSAGE:
        raise OSError(f"a zygote message of {len(data)} bytes is over {_MAX_MESSAGE}")
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    if deadline is None:
        sock.sendmsg([data], rights)
        return
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    end = time.monotonic() + deadline
    while True:
        try:
            sock.sendmsg([data], rights, socket.MSG_DONTWAIT)
            return
        except BlockingIOError:
            left = end - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise TimeoutError(f"the zygote took no message within {deadline:g} s") from None


def recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """The next message and its descriptors; (None, []) at end of file. What is not JSON
    (or is JSON's null) comes as a string saying so: it is checked by whoever reads it."""
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(_MAX_MESSAGE, socket.CMSG_LEN(16 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    if not data:
        return None, list(fds)
    try:
        message = json.loads(data)
    except (ValueError, RecursionError):
        return _MALFORMED, list(fds)
    return (_MALFORMED if message is None else message), list(fds)


# ---- the zygote process ----------------------------------------------------------------------


def _fork_worker(request: dict[str, Any], fds: list[int]) -> None:
    """In a forked child without the zygote's descriptors: the one worker path."""
    it = iter(fds)
    streams = [next(it) if kind == 0 else kind for kind in (request["stdout"], request["stderr"])]
    handover = Handover(
        env=request["env"],
        stdout=streams[0],
        stderr=streams[1],
        cwd=request["cwd"],
        parent_pid=os.getppid(),  # the zygote: it must die with it
        title=request.get("title"),
    )
    run_worker(handover, request["argv"])


def fork_hazard() -> str | None:
    """Why forking workers from this process would give them less than a fresh interpreter,
    or None. Python threads started at import are not in a forked child (a module that relies
    on them would be broken there), and CUDA cannot be used in a child forked after it was
    initialised. (Native thread pools that handle fork themselves, as OpenBLAS's, are fine.)"""
    others = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if others:
        return (
            f"the preloaded modules started {len(others)} thread(s) ({', '.join(others[:3])}), "
            "which forked workers would not have"
        )
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    if cuda is not None and cuda.is_initialized():
        return "the preloaded modules initialised CUDA, which forked workers cannot use"
    return None


def serve(fd: int, args: list[str]) -> None:
    """The zygote's main loop: import the modules `args` name (and, after ``--learned PATH``,
    what a previous run learned: :mod:`~elastic_launch.learned`), then fork a worker
    per request."""
    cgroup.join()  # first: what a module it imports starts is in the workers' cgroup too
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)  # a program a preloaded module starts does not get it
    kept = LEARNED_ARG in args
    modules = [m for m in args if m.strip() and m != LEARNED_ARG]  # the blank one: room
    set_title(
        [sys.executable, "-u", "-m", "elastic_launch.processes.zygote", str(fd), *modules]
    )  # ps
    import elastic_core

    elastic_core.die_with_parent(signal.SIGKILL, int(os.environ.pop(AGENT_PID_ENV, "0")))
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)  # the agent ends us (end of file, or SIGKILL)
    start = time.monotonic()
    failed = {}
    for name in modules:
        try:
            load(name)
        except BaseException as e:  # reported to the agent, which then spawns normally
            failed[name] = f"{type(e).__name__}: {e}"
    from elastic_launch import errors  # noqa: F401 - warm for the workers (their error file)

    taken = None
    if kept:  # the agent's first message: what an earlier run learned, checked there
        message, fds = recv(sock)
        for f in fds:
            os.close(f)
        plan = learned.plan_of(message) if isinstance(message, dict) else None
        if plan is not None:
            taken = learned.take(plan.modules, plan.differ, plan.skip)
    send(sock, _ready(start, failed, taken))
    _Forks(sock).serve()


def _ready(start: float, failed: dict[str, str], taken: learned.Taken | None) -> dict[str, Any]:
    """The ``ready`` message: how long the imports took, what failed, why forking from this
    process would be wrong, and what it learned (its own account of the modules it holds)."""
    message: dict[str, Any] = {"op": "ready", "pid": os.getpid()}
    message |= {"seconds": time.monotonic() - start, "failed": failed, "unsafe": fork_hazard()}
    if taken is not None:
        message["learned"] = learned.account(taken)
    return message


def _serve_heir(sock: socket.socket, plan: learned.ImportPlan, idle_cpu: bool, parent: int) -> None:
    """An heir (forked by the zygote, `parent`, on a ``learn`` request): import what `plan`
    names (on idle CPU if `idle_cpu`: the job trains meanwhile), then serve on `sock`; one
    that imported what it must not fork with says so and waits for the end of file."""
    signal.set_wakeup_fd(-1)  # the zygote's, closed here
    sock.set_inheritable(False)  # a program a learned module starts does not get it
    import elastic_core

    elastic_core.die_with_parent(signal.SIGKILL, parent)
    set_title([sys.executable, "-m", "elastic_launch.processes.zygote", "(learning)"])
    send(sock, {"op": "learning", "pid": os.getpid()})
    start = time.monotonic()
    with idle.on_idle_cpu(idle_cpu):
        taken = learned.take(plan.modules, plan.differ, plan.skip)
    send(sock, _ready(start, {}, taken))
    if taken.poisoned:  # given up: it lives until the agent has read why (it checks the pid)
        with contextlib.suppress(OSError):
            recv(sock)
        os._exit(0)
    set_title([sys.executable, "-m", "elastic_launch.processes.zygote", "(heir)"])
    _Forks(sock).serve()


class _Forks:
    """The zygote's children: forked on the agent's requests (or handed to a warm spare),
    reaped once the agent watches them (their exit status is then sent to it), woken by
    SIGCHLD through a pipe."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.wakeup = os.pipe()
        for end in self.wakeup:
            os.set_blocking(end, False)
        signal.set_wakeup_fd(self.wakeup[1])
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.sel = selectors.DefaultSelector()
        self.sel.register(sock, selectors.EVENT_READ, "sock")
        self.sel.register(self.wakeup[0], selectors.EVENT_READ, "child")
        self.children: dict[int, bool] = {}  # pid -> whether the agent watches it yet
        self.spares: dict[int, socket.socket] = {}  # pid -> its end of the spare's channel
        self.want_spares = 0
        self.quiet: set[int] = set()  # heirs and ended spares: reaped, never reported

    def serve(self) -> None:
        while True:
            short = len(self.spares) < self.want_spares
            events = self.sel.select(timeout=0 if short else None)
            if not events and short:  # idle: time to fork a spare
                self._fork_spare()
            for key, _ in events:
                if key.data == "child":
                    with contextlib.suppress(BlockingIOError):
                        os.read(self.wakeup[0], 4096)
                    for pid, watched in list(self.children.items()):
                        if watched:
                            self._reap_if_exited(pid)
                    self._reap_dead_spares()
                    self._reap_quiet()
                else:
                    self._request()

    def _request(self) -> None:
        request, fds = recv(self.sock)
        if request is None:  # the agent is gone: so are we
            os._exit(0)
        if request.get("op") == "spares":
            self._want(max(0, int(request["count"])))
            return
        if request.get("op") == "learn":
            self._fork_heir(request, fds)
            return
        if request.get("op") == "watched":
            if request["pid"] in self.children:
                self.children[request["pid"]] = True
                self._reap_if_exited(request["pid"])
            return
        pid = self._to_spare(request, fds)
        if pid is None:
            pid = self._fork(lambda: _fork_worker(request, fds), passing=fds)
        for f in fds:
            os.close(f)
        self.children[pid] = False
        send(self.sock, {"op": "spawned", "id": request["id"], "pid": pid})

    def _fork(
        self, child: Any, passing: Sequence[int] = (), close: socket.socket | None = None
    ) -> int:
        """Fork; the child drops the zygote's descriptors (and `close`) and runs `child` with
        the descriptors `passing` (the zygote's own and those are no files to flush)."""
        # The zygote ignores the stop signals; a child would too until it sets them back, and
        # one sent in between (a job that fails as it starts) would be lost. Held blocked
        # across the fork, it waits in the child until the worker unblocks it.
        held = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        ours = [*self.wakeup, self.sock.fileno(), *(e.fileno() for e in self.spares.values())]
        teardown.freeze(ignore=[*ours, *passing, *([close.fileno()] if close else [])])
        pid = os.fork()
        if pid == 0:
            try:
                self.sel.close()
                self.sock.close()
                for fd in self.wakeup:
                    os.close(fd)
                for end in [*self.spares.values(), *([close] if close else [])]:
                    end.close()
                child()
            finally:
                os._exit(1)  # a child never returns into the zygote's loop
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
        return pid

    def _want(self, count: int) -> None:
        """Keep `count` warm spares: the ones beyond it are ended (end of file on their
        channel), as an heir's take over."""
        self.want_spares = count
        while len(self.spares) > count:
            pid, end = self.spares.popitem()
            end.close()
            self.quiet.add(pid)  # reaped without a word, as an heir is

    def _fork_heir(self, request: dict[str, Any], fds: list[int]) -> None:
        """Fork an heir that learns the request's modules and serves on the socket attached
        (a request without its socket, or without a plan, is dropped)."""
        plan = learned.plan_of(request)
        if len(fds) != 1 or plan is None:
            for f in fds:
                os.close(f)
            return
        theirs = socket.socket(fileno=fds[0])
        me, idle_cpu = os.getpid(), request.get("idle") is not False
        pid = self._fork(lambda: _serve_heir(theirs, plan, idle_cpu, me), [theirs.fileno()])
        theirs.close()
        self.quiet.add(pid)

    def _fork_spare(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = self._fork(lambda: _wait_as_spare(theirs), [theirs.fileno()], close=ours)
        theirs.close()
        self.spares[pid] = ours

    def _to_spare(self, request: dict[str, Any], fds: list[int]) -> int | None:
        """Hand `request` to a warm spare: its pid, or None when no spare could take it."""
        while self.spares:
            pid, end = next(iter(self.spares.items()))
            del self.spares[pid]
            try:
                send(end, request, fds)
            except OSError:  # it died: reaped below, and forked anew when idle
                self._reap_spare(pid)
                continue
            finally:
                end.close()
            return pid
        return None

    def _reap_dead_spares(self) -> None:
        for pid in list(self.spares):
            with contextlib.suppress(ChildProcessError):
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    self.spares.pop(pid).close()
                    # A spare that dies unused (killed from outside) is not forked anew: a
                    # cause that kills each new one would make the zygote fork without end.
                    self.want_spares = 0

    def _reap_quiet(self) -> None:
        for pid in list(self.quiet):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    self.quiet.discard(pid)
            except ChildProcessError:
                self.quiet.discard(pid)

    def _reap_spare(self, pid: int) -> None:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        self.want_spares = 0

    def _reap_if_exited(self, pid: int) -> None:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # what it left in its group (the pgid is held)
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            self.children.pop(pid, None)
            return
        self.children.pop(pid, None)
        send(self.sock, {"op": "exited", "pid": pid, "status": status})


def _wait_as_spare(channel: socket.socket) -> None:
    """A warm spare: wait for the one request it will run (end of file: the zygote is gone)."""
    signal.set_wakeup_fd(-1)  # the zygote's, closed here
    set_title([sys.executable, "-m", "elastic_launch.processes.zygote", "(warm spare)"])
    request, fds = recv(channel)
    channel.close()
    if request is None:
        os._exit(0)
    _fork_worker(request, fds)


# ---- the agent's side ------------------------------------------------------------------------


def check_message(message: Any, children: set[int]) -> tuple[str, dict[str, Any]] | str:
    """`message` from the zygote as (op, fields), its fields of the right types; or why it is
    dropped: malformed, or an exit of a process that is not one of its `children`."""
    if not isinstance(message, dict):
        return message if isinstance(message, str) else "a message that is not an object"
    op = message.get("op")
    fields_of = _FIELDS.get(op) if isinstance(op, str) else None
    if fields_of is None:
        return f"a message of an unknown kind ({str(op)[:40]!r})"
    fields = fields_of(message)
    if fields is None:
        return f"a malformed {op!r} message"
    if op == "exited" and fields["pid"] not in children:
        return f"an exit of pid {fields['pid']}, which the zygote did not spawn for this agent"
    return str(op), fields


def _ready_fields(message: dict[str, Any]) -> dict[str, Any] | None:
    seconds: Any = message.get("seconds")
    failed, unsafe = message.get("failed"), message.get("unsafe")
    if not _number(seconds) or not isinstance(failed, dict) or not _text_or_none(unsafe):
        return None
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in failed.items()):
        return None
    pid, account = message.get("pid"), message.get("learned")
    unpacked = learned.unpacked_account(account) if account is not None else None
    if not _count(pid, 1) or (account is not None and unpacked is None):
        return None
    fields = {"seconds": float(seconds), "failed": dict(failed), "unsafe": unsafe}
    return fields | {"pid": pid, "learned": unpacked}


def _learning_fields(message: dict[str, Any]) -> dict[str, Any] | None:
    pid = message.get("pid")
    return {"pid": pid} if _count(pid, 1) else None


def _spawned_fields(message: dict[str, Any]) -> dict[str, Any] | None:
    request_id, pid = message.get("id"), message.get("pid")
    return {"id": request_id, "pid": pid} if _count(request_id) and _count(pid, 1) else None


def _exited_fields(message: dict[str, Any]) -> dict[str, Any] | None:
    pid: Any = message.get("pid")
    status: Any = message.get("status")
    if not (_count(pid, 1) and _count(status) and status < 1 << 16):
        return None
    return {"pid": pid, "status": status}


_FIELDS = {
    "ready": _ready_fields,
    "learning": _learning_fields,
    "spawned": _spawned_fields,
    "exited": _exited_fields,
}


def _io_bytes(pid: int) -> int:
    """Bytes process `pid` read and wrote through system calls (/proc/PID/io), 0 if unknown."""
    try:
        with open(f"/proc/{pid}/io", "rb") as f:
            return sum(int(line.split()[1]) for line in f if line.startswith((b"rchar", b"wchar")))
    except (OSError, IndexError, ValueError):
        return 0


def _count(value: Any, least: int = 0) -> bool:
    return type(value) is int and least <= value < 1 << 31


def _number(value: Any) -> bool:
    return type(value) in (int, float) and value >= 0


def _text_or_none(value: Any) -> bool:
    return value is None or isinstance(value, str)


class ZygoteUnavailableError(RuntimeError):
    """The zygote is not ready, failed, or is gone; the caller starts a fresh interpreter."""


class Zygote:
    """The agent's handle on its zygote. Starts it in the background: its imports (seconds for
    torch) overlap the rendezvous."""

    #: The pid of the zygote that forked it (an :class:`Heir`'s; 0: the agent started it).
    _parent_pid = 0

    def __init__(
        self,
        modules: list[str],
        spares: int = 0,
        cgroup_path: str | None = None,
        kept: learned.ImportPlan | None = None,
    ) -> None:
        """`spares`: how many warm spares the zygote keeps forked (see the module's doc);
        `cgroup_path`: the job's cgroup, which it joins before it imports anything (and whose
        mark its environment carries, as every process it forks does); `kept`: what an
        earlier run learned, imported (checked) after `modules`."""
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = dict(os.environ)
        # The interpreter fresh workers would run ($PYTHON_EXEC, as torchrun honours it).
        command = [python_executable(sys.executable), "-u", "-m", __name__, str(child.fileno())]
        command += [LEARNED_ARG] if kept else []
        started = {**env, **room_environment(), AGENT_PID_ENV: str(os.getpid())}
        if cgroup_path:
            started[cgroup.CGROUP_ENV] = cgroup_path
        try:
            self._proc = subprocess.Popen(
                [*command, *modules, room_argument()],
                pass_fds=[child.fileno()],
                start_new_session=True,
                env=started,
            )
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()
        if kept is not None:  # its first message; a zygote gone already is found at the spawn
            with contextlib.suppress(OSError):
                send(parent, {"op": "kept", **kept.to_message()}, deadline=SEND_DEADLINE)
        self._begin(parent, self._proc.pid, modules, env, spares)

    def _begin(
        self, sock: socket.socket, pid: int, modules: list[str], env: dict[str, str], spares: int
    ) -> None:
        self.modules = modules
        #: The environment it started with: what a forked worker keeps of it is read at start.
        self.env = env
        self._sock = sock
        self.pid = pid
        self._cond = threading.Condition()
        self._ready = False
        self._dead = False
        self._stuck = False  # a message was not taken within SEND_DEADLINE
        self._statuses: dict[int, int] = {}
        self._spawned: dict[int, int] = {}
        self._spawned_pids: set[int] = set()  # its children the agent has not seen exit
        self._malformed_said = False
        #: (CPU ticks, I/O bytes), and when they last moved.
        self._progress: tuple[tuple[int, int], float] | None = None
        self._next_id = 0
        self.startup_seconds: float | None = None
        self.failed: dict[str, str] = {}
        self.unsafe: str | None = None  # why forking from it would be wrong (fork_hazard)
        #: What it learned (:func:`elastic_launch.learned.account`), if asked to.
        self.learned: dict[str, Any] | None = None
        self._reader = threading.Thread(target=self._read, name="elasticrun-zygote", daemon=True)
        self._reader.start()
        if spares:
            self.keep_spares(spares)

    def keep_spares(self, count: int) -> None:
        """Have it keep `count` warm spares forked (fewer: the others end)."""
        with contextlib.suppress(OSError):  # a zygote gone already is found at the spawn
            send(self._sock, {"op": "spares", "count": count}, deadline=SEND_DEADLINE)

    @property
    def reported(self) -> bool:
        """Whether its 'ready' came (its account is in, whether it lives on or not)."""
        with self._cond:
            return self._ready

    @property
    def busy(self) -> bool:
        """Whether children it forked for the agent still run (it must live while they do:
        they die with it)."""
        with self._cond:
            return bool(self._spawned_pids)

    def _read(self) -> None:
        while True:
            try:
                message, fds = recv(self._sock)
            except OSError:
                message, fds = None, []
            for f in fds:
                os.close(f)
            if message is None:
                with self._cond:
                    self._dead = True
                    self._cond.notify_all()
                return
            self._take(message)

    def _take(self, message: Any) -> None:
        """One message from the zygote's socket, checked like a store value: the socket is
        shared with whatever the zygote forked before it closed it, so a malformed message is
        dropped (and said once), never the launcher's reader."""
        checked = check_message(message, self._spawned_pids)
        why = checked if isinstance(checked, str) else self._forged(*checked)
        if why is not None:
            if not self._malformed_said:
                self._malformed_said = True
                logger.warning("the zygote's socket carried %s: dropped", why)
            return
        assert not isinstance(checked, str)
        op, fields = checked
        with self._cond:
            if op == "learning":
                self.pid = fields["pid"]
            elif op == "ready":
                self._ready = True
                self.pid = fields["pid"]
                self.learned = fields["learned"]
                self.startup_seconds = fields["seconds"]
                self.failed = fields["failed"]
                self.unsafe = fields["unsafe"]
            elif op == "spawned":
                self._spawned[fields["id"]] = fields["pid"]
                self._spawned_pids.add(fields["pid"])
            else:
                self._statuses[fields["pid"]] = fields["status"]
                self._spawned_pids.discard(fields["pid"])
            self._cond.notify_all()

    def _forged(self, op: str, fields: dict[str, Any]) -> str | None:
        """Why a well-formed message cannot be the zygote's: a 'spawned' naming a process that
        is not its child, an 'exited' for a child of it that still runs (it sends that once it
        reaped the child); None if it can be."""
        if op in ("ready", "learning"):
            return self._forged_ready(op, fields["pid"])
        if op not in ("spawned", "exited"):
            return None
        pid = fields["pid"]
        found = stat_of(pid)
        child = found is not None and found.ppid == self.pid
        if op == "spawned" and not child:
            return f"a 'spawned' naming pid {pid}, which is not the zygote's child"
        if op == "exited" and child and found is not None and found.alive:
            return f"an exit of pid {pid}, which still runs"
        return None

    def _forged_ready(self, op: str, pid: int) -> str | None:
        """A 'ready' (or an heir's 'learning') comes once and names the zygote: an heir by a
        child of the zygote that forked it, a zygote the agent started by its known pid."""
        if self._ready:
            return f"a second {op!r}"
        if self.pid:
            return None if pid == self.pid else f"a {op!r} naming pid {pid}, not the zygote's"
        found = stat_of(pid)
        if found is None or found.ppid != self._parent_pid:
            return f"a {op!r} naming pid {pid}, which is not the zygote's heir"
        return None

    def stalled(self, quiet: float) -> str | None:
        """Why the zygote's imports make no progress, or None while they do: it is stopped,
        or it used no CPU time and read nothing for `quiet` seconds (an import that waits, not
        one that works: a slow machine, or a cold disk, is still seen working)."""
        try:
            with open(f"/proc/{self.pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            state, ticks = fields[0], int(fields[11]) + int(fields[12])
        except (OSError, IndexError, ValueError):
            return None  # gone: its end of file says so
        if state in (b"T", b"t"):
            return "it is stopped"
        work = (ticks, _io_bytes(self.pid))
        now = time.monotonic()
        if self._progress is None or work != self._progress[0]:
            self._progress = (work, now)
        if now - self._progress[1] >= quiet:
            return f"it used no CPU time and read nothing for {quiet:g} s (an import that waits)"
        return None

    @property
    def ready(self) -> bool:
        with self._cond:
            return self._ready and not self._dead

    @property
    def dead(self) -> bool:
        with self._cond:
            return self._dead

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to `timeout` for the imports; True once ready (False: not yet, or dead)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._dead, max(timeout, 0.0))
            return self._ready and not self._dead

    def spawn(
        self,
        argv: list[str],
        env: dict[str, str],
        stdout: int,
        stderr: int,
        title: list[str] | None = None,
    ) -> int:
        """Fork a worker running ``worker_main.run_target(argv)``; the streams are descriptors,
        KEEP or DEVNULL; `title` is the command line it shows (``ps``). Returns its pid."""
        fds = [t for t in (stdout, stderr) if t >= 0]
        kinds = [0 if t >= 0 else t for t in (stdout, stderr)]
        with self._cond:
            if self._dead:
                raise ZygoteUnavailableError("the zygote has exited")
            if self._stuck:
                raise ZygoteUnavailableError(
                    f"the zygote took no message within {SEND_DEADLINE:g} s (stopped?)"
                )
            request_id = self._next_id
            self._next_id += 1
        request = {
            "id": request_id,
            "argv": argv,
            "env": env,
            "cwd": os.getcwd(),
            "stdout": kinds[0],
            "stderr": kinds[1],
            "title": title,
        }
        try:
            send(self._sock, request, fds, deadline=SEND_DEADLINE)
        except OSError as e:  # TimeoutError among them: stopped or stuck
            raise ZygoteUnavailableError(f"the zygote cannot take the request: {e}") from None
        with self._cond:
            if not self._cond.wait_for(
                lambda: request_id in self._spawned or self._dead, SPAWN_ANSWER_TIMEOUT
            ):
                raise ZygoteUnavailableError(
                    f"the zygote did not answer a spawn request within {SPAWN_ANSWER_TIMEOUT:g} s"
                )
            if request_id not in self._spawned:
                raise ZygoteUnavailableError("the zygote has exited")
            return self._spawned.pop(request_id)

    def acknowledge(self, pid: int) -> None:
        """The agent watches `pid` now: the zygote may reap it when it exits."""
        try:
            send(self._sock, {"op": "watched", "pid": pid}, deadline=SEND_DEADLINE)
        except TimeoutError:
            with self._cond:
                self._stuck = True  # given up at the next spawn
            logger.warning(
                "the zygote took no message within %g s (stopped?): workers will start as "
                "fresh interpreters",
                SEND_DEADLINE,
            )
        except OSError:
            pass  # gone: found at the next spawn

    def wait_status(self, pid: int, timeout: float) -> int | None:
        """A child's wait status, once the zygote reaped it (None: not within `timeout`)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._statuses or self._dead, timeout)
            return self._statuses.pop(pid, None)

    def close(self) -> None:
        """End it (its children, the workers it forked, die with it)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._end()
        join(self._reader, 5, "the zygote's reader thread")

    def _end(self) -> None:
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=10)


class Heir(Zygote):
    """The agent's handle on an heir: a child its zygote forks to import what the workers were
    seen to import (:mod:`elastic_launch.learned`), which then serves spawns as a zygote of its
    own. Its pid comes with its first message, checked to be a child of that zygote."""

    def __init__(self, parent: Zygote, plan: learned.ImportPlan, idle_cpu: bool = True) -> None:
        """Have `parent` fork it (raises OSError when the request cannot be sent); it imports
        on idle CPU if `idle_cpu`."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.set_inheritable(False)
        request = {"op": "learn", **plan.to_message(), "idle": idle_cpu}
        try:
            send(parent._sock, request, [theirs.fileno()], SEND_DEADLINE)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._parent_pid = parent.pid
        self._begin(ours, 0, parent.modules, parent.env, 0)

    def _end(self) -> None:
        """It ends at end of file and its zygote reaps it; one stopped or stuck is killed (if
        it still is that zygote's child)."""
        found = stat_of(self.pid) if self.pid else None
        if found is not None and found.ppid == self._parent_pid:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2:])
