"""The zygote: a process with modules already imported that forks new workers (``--preload``).

A restart then costs a fork instead of a new interpreter and ``import torch``. The agent starts
the zygote once, talks to it over a Unix socketpair (one JSON message per datagram, standard
streams passed as file descriptors), and learns each worker's exit status from it, since the
zygote is their parent. A forked worker runs :func:`elastic_launch.bootstrap.run` exactly as a
fresh one does: own session, the worker's environment and standard streams, the target as
``__main__``, and the interpreter's usual exit (exit handlers, non-daemon threads).

Run by the agent as ``python -m elastic_launch.zygote FD MODULE...``.
"""

from __future__ import annotations

import array
import contextlib
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

logger = logging.getLogger(__name__)

_MAX_MESSAGE = 1 << 20
_NO_FD = -1
_DEVNULL = -2


def _send(sock: socket.socket, message: dict[str, Any], fds: list[int] | None = None) -> None:
    data = json.dumps(message).encode()
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.send(data)


def _recv(sock: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(_MAX_MESSAGE, socket.CMSG_LEN(16 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - (len(payload) % fds.itemsize)])
    if not data:
        return None, list(fds)
    return json.loads(data), list(fds)


# ---- the zygote process ----------------------------------------------------------------------


def _child(
    sock: socket.socket,
    sel: selectors.BaseSelector,
    wakeup: tuple[int, int],
    request: dict[str, Any],
    fds: list[int],
) -> None:
    """In the forked worker: become the worker, run it, exit like an interpreter would."""
    code = 1
    try:
        os.setsid()
        signal.set_wakeup_fd(-1)
        sel.close()
        sock.close()
        for fd in wakeup:
            os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_IGN if sig == signal.SIGPIPE else signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        it = iter(fds)
        for target, kind in ((1, request["stdout"]), (2, request["stderr"])):
            if kind == _DEVNULL:
                fd = os.open(os.devnull, os.O_WRONLY)
                os.dup2(fd, target)
                os.close(fd)
            elif kind != _NO_FD:
                fd = next(it)
                os.dup2(fd, target)
                os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ["ELASTICRUN_PARENT_PID"] = str(os.getppid())  # the zygote: its parent
        os.chdir(request["cwd"])
        # A fresh interpreter seeds its random generators from the OS; forked ones would all
        # share the zygote's state. Python's `random` reseeds itself after fork; numpy does not.
        numpy = sys.modules.get("numpy")
        if numpy is not None:
            numpy.random.seed()
        from elastic_launch import bootstrap

        try:
            bootstrap.run(request["argv"])
            code = 0
        except SystemExit as e:
            if e.code is None:
                code = 0
            elif isinstance(e.code, int):
                code = e.code
            else:
                print(e.code, file=sys.stderr)
                code = 1
        except BaseException:
            sys.excepthook(*sys.exc_info())
            code = 1
        # What the interpreter does on the way out: join threads, run exit handlers.
        threading._shutdown()  # type: ignore[attr-defined]
        import atexit

        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code & 0xFF if code >= 0 else 1)


def serve(fd: int, modules: list[str]) -> None:
    """The zygote's main loop: import `modules`, then fork a worker per request."""
    sock = socket.socket(fileno=fd)
    import elastic_core

    elastic_core.die_with_parent(signal.SIGKILL, int(os.environ.get("ELASTICRUN_AGENT_PID", "0")))
    start = time.monotonic()
    failed = {}
    for name in modules:
        try:
            __import__(name)
        except BaseException as e:  # reported to the agent, which then spawns normally
            failed[name] = f"{type(e).__name__}: {e}"
    from elastic_launch import bootstrap  # noqa: F401 - warm for the workers

    _send(sock, {"op": "ready", "seconds": time.monotonic() - start, "failed": failed})
    wakeup_r, wakeup_w = os.pipe()
    os.set_blocking(wakeup_w, False)
    os.set_blocking(wakeup_r, False)
    signal.set_wakeup_fd(wakeup_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(sock, selectors.EVENT_READ, "sock")
    sel.register(wakeup_r, selectors.EVENT_READ, "child")
    # pid -> whether the agent watches it yet. A child is reaped only once watched: until then
    # its zombie keeps the pid, so the agent's pidfd_open always finds the right process.
    children: dict[int, bool] = {}

    def reap_if_exited(pid: int) -> None:
        try:
            if os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None:
                return
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)  # what it left in its group (the pgid is held)
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            children.pop(pid, None)
            return
        children.pop(pid, None)
        _send(sock, {"op": "exited", "pid": pid, "status": status})

    while True:
        for key, _ in sel.select():
            if key.data == "child":
                with contextlib.suppress(BlockingIOError):
                    os.read(wakeup_r, 4096)
                for pid, watched in list(children.items()):
                    if watched:
                        reap_if_exited(pid)
                continue
            request, fds = _recv(sock)
            if request is None:  # the agent is gone: so are we
                os._exit(0)
            if request.get("op") == "watched":
                if request["pid"] in children:
                    children[request["pid"]] = True
                    reap_if_exited(request["pid"])
                continue
            pid = os.fork()
            if pid == 0:
                _child(sock, sel, (wakeup_r, wakeup_w), request, fds)
            for f in fds:
                os.close(f)
            children[pid] = False
            _send(sock, {"op": "spawned", "id": request["id"], "pid": pid})


# ---- the agent's side ------------------------------------------------------------------------


class ZygoteProcess:
    """A worker forked by the zygote; its exit status comes from the zygote, which also ends
    what the worker left in its process group."""

    reaped_by_agent = False

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid

    def reap(self, timeout: float) -> tuple[int | None, int | None]:
        status = self.zygote.wait_status(self.pid, timeout)
        if status is None:
            return None, None
        code = os.waitstatus_to_exitcode(status)
        return (code, None) if code >= 0 else (None, -code)


class Zygote:
    """The agent's handle on its zygote. Starts it in the background: until it is ready (its
    imports can take seconds), workers are spawned the ordinary way."""

    def __init__(self, modules: list[str]) -> None:
        self.modules = modules
        parent, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock = parent
        self._proc = subprocess.Popen(
            [sys.executable, "-u", "-m", __name__, str(child.fileno()), *modules],
            pass_fds=[child.fileno()],
            start_new_session=True,
            env={**os.environ, "ELASTICRUN_AGENT_PID": str(os.getpid())},
        )
        child.close()
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._ready = False
        self._dead = False
        self._statuses: dict[int, int] = {}
        self._spawned: dict[int, int] = {}
        self._next_id = 0
        self.startup_seconds: float | None = None
        self.failed: dict[str, str] = {}
        self._reader = threading.Thread(target=self._read, name="elasticrun-zygote", daemon=True)
        self._reader.start()

    @property
    def ready(self) -> bool:
        with self._lock:
            return self._ready and not self._dead

    def wait_ready(self, timeout: float) -> bool:
        with self._cond:
            self._cond.wait_for(lambda: self._ready or self._dead, timeout)
            return self._ready and not self._dead

    def _read(self) -> None:
        while True:
            try:
                message, fds = _recv(self._sock)
            except OSError:
                message, fds = None, []
            for f in fds:
                os.close(f)
            with self._cond:
                if message is None:
                    self._dead = True
                    self._cond.notify_all()
                    return
                op = message.get("op")
                if op == "ready":
                    self._ready = True
                    self.startup_seconds = message["seconds"]
                    self.failed = message["failed"]
                elif op == "spawned":
                    self._spawned[message["id"]] = message["pid"]
                elif op == "exited":
                    self._statuses[message["pid"]] = message["status"]
                self._cond.notify_all()

    def spawn(
        self, argv: list[str], env: dict[str, str], stdout: Any, stderr: Any
    ) -> ZygoteProcess:
        """Fork a worker running ``bootstrap.run(argv)``; stdout/stderr as for Popen."""
        fds: list[int] = []
        kinds = []
        for target in (stdout, stderr):
            if target is None:
                kinds.append(_NO_FD)
            elif target == subprocess.DEVNULL:
                kinds.append(_DEVNULL)
            else:
                kinds.append(0)
                fds.append(target)
        with self._cond:
            request_id = self._next_id
            self._next_id += 1
        request = {
            "id": request_id,
            "argv": argv,
            "env": env,
            "cwd": os.getcwd(),
            "stdout": kinds[0],
            "stderr": kinds[1],
        }
        _send(self._sock, request, fds)
        with self._cond:
            if not self._cond.wait_for(
                lambda: request_id in self._spawned or self._dead, timeout=30
            ):
                raise RuntimeError("the zygote did not answer a spawn request within 30 s")
            if self._dead:
                raise RuntimeError("the zygote has exited")
            return ZygoteProcess(self, self._spawned.pop(request_id))

    @property
    def dead(self) -> bool:
        with self._lock:
            return self._dead

    def acknowledge(self, pid: int) -> None:
        """The agent watches `pid` now: the zygote may reap it when it exits."""
        with contextlib.suppress(OSError):
            _send(self._sock, {"op": "watched", "pid": pid})

    def wait_status(self, pid: int, timeout: float) -> int | None:
        with self._cond:
            self._cond.wait_for(lambda: pid in self._statuses or self._dead, timeout)
            return self._statuses.pop(pid, None)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait(timeout=10)
        self._reader.join(timeout=5)


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2:])
