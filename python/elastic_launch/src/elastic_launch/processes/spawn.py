"""Starting one worker process: the :class:`Spawner` interface and its three implementations.

- :class:`FreshInterpreter`: ``python -u -m elastic_launch.processes.worker_main ...`` (or the
  binary).
- :class:`ZygoteFork`: forked from the zygote, which has the ``--preload`` modules imported;
  falls back to a fresh interpreter, saying why once, when the zygote cannot serve.
- :class:`FunctionFork`: a Python function forked from the launcher itself
  (``start_method="fork"``: closures work).

Whoever is a worker's parent reaps it: Popen for fresh interpreters, the zygote for its children,
the agent for its forks; :class:`Process` hides which. Every child becomes a worker through
:mod:`elastic_launch.processes.worker_main`.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic_launch import learned
from elastic_launch.api import Cancelled
from elastic_launch.cancel import NEVER, CancelToken, Deadline
from elastic_launch.processes.entrypoint import Entrypoint, Kind, main_path
from elastic_launch.processes.preload import PreloadPlan, import_time_mismatch
from elastic_launch.processes.worker_main import DEVNULL, KEEP, FunctionCall, Handover, run_worker

if TYPE_CHECKING:
    from elastic_launch.processes.guardian import Guardian
    from elastic_launch.processes.zygote import Zygote

logger = logging.getLogger(__name__)

#: Seconds a spawn waits at most for the zygote's imports while they progress.
ZYGOTE_START_TIMEOUT = 300.0
#: Seconds without progress (a stopped zygote, an import that waits and uses no CPU time)
#: after which spawns stop waiting for it: workers start as fresh interpreters until it is
#: ready, and later spawns use it only if it is.
ZYGOTE_STALL = 3.0
#: Seconds an heir may go without CPU time or reads before it is given up (stopped: at once).
#: Far longer than the zygote's: an heir imports on idle CPU, which a busy node may not give
#: it for a while.
HEIR_STALL = 120.0


@dataclass
class SpawnRequest:
    """One worker to start. `argv` is :meth:`Entrypoint.worker_argv`'s; the streams are file
    descriptors (the spawner's caller closes its copies afterwards), KEEP or DEVNULL."""

    local_rank: int
    argv: list[str]
    env: dict[str, str]
    stdout: int = KEEP
    stderr: int = KEEP
    call: FunctionCall | None = None  # a function entrypoint: (function, arguments, result)

    def write_spec(self) -> None:
        """A function for another process: pickled into the spec file its argv names
        (``--function SPEC``). A fork of the launcher runs `call` from memory instead."""
        if self.call is not None and self.argv[:1] == ["--function"]:
            import pickle

            # The caller's import path too, as multiprocessing's spawn sends it: a function
            # of a module found through it (a test's directory) is found again.
            spec = {
                "main": main_path(self.call[0]),
                "sys_path": list(sys.path),
                "call": pickle.dumps(self.call),
            }
            with open(self.argv[1], "wb") as f:
                pickle.dump(spec, f)


class Process(abc.ABC):
    """A started worker process."""

    pid: int
    #: Whether the agent is its parent: then the agent reaps it (after ending what the worker
    #: left in its process group); otherwise its parent does both and reports the status.
    reaped_by_agent: bool = True

    @abc.abstractmethod
    def reap(self, timeout: float) -> tuple[int | None, int | None]:
        """Wait at most `timeout` for the exit and collect it: (exit code, signal)."""

    def watched(self) -> None:  # noqa: B027 - only the zygote's children need it
        """The agent watches the process now (a parent that reaps may do so from now on)."""

    def signal(self, sig: int) -> None:
        """Send `sig` to the process itself (gone already: nothing happens)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, sig)

    def signal_group(self, sig: int) -> None:
        """Send `sig` to the process's whole group: everything the worker started (its group
        id is its pid, held until the process is reaped). A stopped process acts on a signal
        only once continued: SIGCONT follows (as a shell's kill does), so a SIGSTOPped worker
        ends at its SIGTERM instead of sitting out the whole grace before SIGKILL.

        A worker forked a moment ago may not have made its group yet (the zygote answers with
        its pid at once): the process itself gets the signal then. It holds the stop signals
        blocked until its handlers are set, so the signal waits for it, and is not lost."""
        try:
            os.killpg(self.pid, sig)
        except ProcessLookupError:
            self.signal(sig)  # no such group (yet): the process, if it still runs
            return
        except PermissionError:
            return
        if sig not in (signal.SIGKILL, signal.SIGCONT, signal.SIGSTOP):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signal.SIGCONT)


def _status(code: int) -> tuple[int | None, int | None]:
    return (code, None) if code >= 0 else (None, -code)


class PopenProcess(Process):
    def __init__(self, popen: subprocess.Popen[bytes]) -> None:
        self.popen = popen
        self.pid = popen.pid

    def reap(self, timeout: float) -> tuple[int | None, int | None]:
        try:
            return _status(self.popen.wait(timeout))
        except subprocess.TimeoutExpired:
            return None, None


class ForkedProcess(Process):
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._status: tuple[int | None, int | None] | None = None

    def reap(self, timeout: float) -> tuple[int | None, int | None]:
        deadline = time.monotonic() + timeout
        while self._status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self._status = (None, None)
                break
            if pid:
                self._status = _status(os.waitstatus_to_exitcode(status))
            elif time.monotonic() >= deadline:
                return None, None
            else:
                time.sleep(0.001)
        return self._status


@dataclass(frozen=True)
class Settled:
    """An heir done learning: what it was asked (`plan`), its own account of what it imported
    and left out (:func:`~elastic_launch.learned.account`; empty: it died), and
    whether it took over the spawns."""

    plan: learned.ImportPlan
    account: dict[str, Any]
    took_over: bool
    pid: int


class Spawner(abc.ABC):
    """Starts worker processes."""

    #: Shown in events and /healthz: "fresh", "zygote" or "fork".
    name: str = ""

    @abc.abstractmethod
    def spawn(self, request: SpawnRequest) -> Process:
        """Start one worker; raises OSError (or RuntimeError) if it cannot."""

    @property
    def forks(self) -> bool:
        """Whether the next spawn is a fork (for the events)."""
        return False

    def close(self) -> None:  # noqa: B027 - most spawners hold nothing
        """Release what the spawner holds (the zygote)."""


def _popen_stream(target: int) -> int | None:
    if target == KEEP:
        return None
    if target == DEVNULL:
        return subprocess.DEVNULL
    return target


class FreshInterpreter(Spawner):
    name = "fresh"

    def __init__(self, entrypoint: Entrypoint) -> None:
        self.entrypoint = entrypoint

    def spawn(self, request: SpawnRequest) -> Process:
        request.write_spec()
        popen = subprocess.Popen(
            self.entrypoint.command(request.argv),
            env=request.env,
            stdout=_popen_stream(request.stdout),
            stderr=_popen_stream(request.stderr),
            start_new_session=True,
        )
        return PopenProcess(popen)


class ZygoteProcess(Process):
    reaped_by_agent = False

    def __init__(self, zygote: Zygote, pid: int) -> None:
        self.zygote = zygote
        self.pid = pid

    def reap(self, timeout: float) -> tuple[int | None, int | None]:
        status = self.zygote.wait_status(self.pid, timeout)
        if status is None:
            return None, None
        return _status(os.waitstatus_to_exitcode(status))

    def watched(self) -> None:
        self.zygote.acknowledge(self.pid)


class ZygoteFork(Spawner):
    """Forks from a zygote started at once (its imports overlap the rendezvous). Spawns wait
    for it to be ready (no longer than a fresh interpreter would take: it has a head start);
    when it failed, died or cannot take a request, workers start as fresh interpreters and the
    reason is said once."""

    name = "zygote"

    def __init__(
        self,
        chosen: PreloadPlan,
        fallback: FreshInterpreter,
        cancel: CancelToken = NEVER,
        guardian: Guardian | None = None,
        spares: int = 0,
    ) -> None:
        """`spares`: warm spares the zygote keeps forked ahead of need (``--warm-spares``)."""

        self.fallback = fallback
        self.cancel = cancel
        self.guardian = guardian
        self.chosen, self.spares = chosen, spares
        self.zygote: Zygote | None = None
        self.why_not: str | None = None  # why workers are not forked, once known
        self._waited = False  # a spawn waited for the zygote's imports: none waits again
        self._heir: tuple[Zygote, learned.ImportPlan] | None = None  # learning, and what
        self._retired: list[Zygote] = []  # zygotes an heir took over from: parents, kept
        self._settled: list[Settled] = []
        #: Variables a worker's environment has another value of than the zygote's.
        self.differ: set[str] = set()
        self._start(chosen.modules)

    def _start(self, modules: list[str]) -> None:
        from elastic_launch.processes.zygote import Zygote

        # The job's cgroup is the one its guardian ends: the launcher tells it first.
        job = self.guardian.cgroup if self.guardian is not None else None
        try:
            self.zygote = Zygote(modules, self.spares, job, self.chosen.kept)
        except OSError as e:
            self._give_up(f"the --preload zygote cannot start ({e})")
        else:
            if self.guardian is not None:
                self.guardian.watch_group(self.zygote.pid)

    @property
    def pid(self) -> int | None:
        return self.zygote.pid if self.zygote is not None else None

    def _give_up(self, why: str) -> None:
        """Spawn no more from the zygote (nor from an heir learning), saying why once. One
        that still has workers running is kept, as their parent, until the launch ends."""
        if self.why_not is None:
            logger.warning("%s; starting workers as fresh interpreters", why)
            self.why_not = why
        if self._heir is not None:
            self._heir[0].close()
            self._heir = None
        z, self.zygote = self.zygote, None
        if z is not None and (z.busy or self._retired):
            z.keep_spares(0)
            self._retired.append(z)
        elif z is not None:
            self._close(z)

    def _ready_zygote(self) -> Zygote | None:
        z = self.zygote
        if z is None:
            return None
        deadline = Deadline(0.0 if self._waited else ZYGOTE_START_TIMEOUT)
        while not z.wait_ready(deadline.left(0.1)):
            if z.dead:
                self._give_up("the --preload zygote exited while importing")
                return None
            if self.cancel.cancelled:
                raise Cancelled(self.cancel.signum)
            stalled = None if deadline.passed else z.stalled(ZYGOTE_STALL)
            if deadline.passed or stalled:
                if not self._waited:
                    logger.warning(
                        "the --preload zygote has not finished its imports (%s): %s; workers "
                        "start as fresh interpreters until it has",
                        ", ".join(self.chosen.modules) or "none",
                        stalled or f"not in {ZYGOTE_START_TIMEOUT:g} s",
                    )
                self._waited = True
                return None
        self._waited = True
        for name, error in z.failed.items():
            logger.warning("--preload: importing '%s' failed in the zygote: %s", name, error)
        z.failed = {}
        return self._checked(z)

    def _checked(self, z: Zygote) -> Zygote | None:
        """`z`, ready, if forking from it is safe; else a zygote started again without what
        made it unsafe (the script's packages ``auto`` added, what an earlier run learned), or
        None (workers start as fresh interpreters)."""
        if z.learned and z.learned["left_out"] and self.chosen.kept is not None:
            return self._without_left_out(z.learned)
        if z.unsafe and self.chosen.optional:
            return self._without_optional(z.unsafe)
        if z.unsafe:
            self._give_up(f"--preload: {z.unsafe}")
            return None
        return z

    def _without_optional(self, why: str) -> Zygote | None:
        """A zygote without the script's packages that ``auto`` added, when importing them
        made forking unsafe: workers still fork, and import those packages themselves."""
        left_out = self.chosen.optional
        logger.warning(
            "--preload auto: %s; the zygote starts again without %s, which each worker imports "
            "itself (name them with --preload to keep them, or --preload none)",
            why,
            ", ".join(left_out),
        )
        modules = [m for m in self.chosen.modules if m not in left_out]
        return self._again(dataclasses.replace(self.chosen, modules=modules, optional=()))

    def _without_left_out(self, account: dict[str, Any]) -> Zygote | None:
        """A zygote that imported, from what an earlier run learned, what it must not fork
        with: it starts again without it (once), and the warning names it."""
        kept = self.chosen.kept
        assert kept is not None
        left_out = account["left_out"]
        for name, why in left_out.items():
            logger.warning("--preload: '%s' is left out of the zygote (%s)", name, why)
        skip = (*kept.skip, *account["excluded"], *left_out)
        again = dataclasses.replace(kept, skip=skip) if len(kept.skip) < len(skip) else None
        return self._again(dataclasses.replace(self.chosen, kept=again))

    def _again(self, chosen: PreloadPlan) -> Zygote | None:
        """A zygote started again for `chosen`, its imports waited for as the first's were."""
        self.close()
        self.chosen = chosen
        self._start(chosen.modules)
        self._waited = False
        return self._ready_zygote()

    @property
    def forks(self) -> bool:
        return self.zygote is not None

    # ---- learning (:mod:`~elastic_launch.learned`) ---------------------------------

    def learn(self, plan: learned.ImportPlan, idle_cpu: bool = True) -> bool:
        """Have the zygote fork an heir that imports what `plan` names (on idle CPU if
        `idle_cpu`), to serve the spawns from when it is ready; False when it cannot now (no
        zygote ready, an heir learning)."""
        from elastic_launch.processes.zygote import Heir

        z = self.zygote
        if z is None or self._heir is not None or not z.ready:
            return False
        try:
            self._heir = (Heir(z, plan, idle_cpu), plan)
        except OSError as e:
            logger.warning("the zygote cannot learn the workers' imports (%s)", e)
            return False
        return True

    @property
    def learning(self) -> bool:
        """Whether an heir is learning."""
        return self._heir is not None

    def settled(self) -> list[Settled]:
        """What the heirs that finished learning did, since the last call (each once)."""
        self._settle()
        found, self._settled = self._settled, []
        return found

    def _settle(self) -> None:
        """An heir that is ready takes over the spawns (the zygote it left stays: it is the
        parent of the heir and of the workers it forked); one that imported what it must not
        fork with, or died, is given up."""
        if self._heir is None or self.zygote is None:
            return
        heir, plan = self._heir
        reported = heir.reported  # its account, even if it ended since
        if not reported and not heir.dead and not heir.stalled(HEIR_STALL):
            return
        self._heir = None
        account = heir.learned if reported else None
        usable = account is not None and not account["left_out"] and heir.unsafe is None
        took_over = usable and not heir.dead
        self._settled.append(Settled(plan, account or {}, took_over, heir.pid))
        if not took_over:
            heir.close()
            return
        self.zygote.keep_spares(0)
        self._retired.append(self.zygote)
        self.zygote = heir
        heir.keep_spares(self.spares)

    def spawn(self, request: SpawnRequest) -> Process:
        from elastic_launch.processes.zygote import ZygoteUnavailableError

        self._settle()
        z = self._ready_zygote()
        if z is not None:
            keys = z.env.keys() | request.env.keys()
            self.differ |= {k for k in keys if z.env.get(k) != request.env.get(k)}
            mismatch = import_time_mismatch(z.env, request.env)
            if mismatch:
                self._give_up(f"--preload: {mismatch}")
                z = None
        if z is not None:
            request.write_spec()
            try:
                title = self.fallback.entrypoint.command(request.argv)  # as a fresh one shows
                pid = z.spawn(request.argv, request.env, request.stdout, request.stderr, title)
                return ZygoteProcess(z, pid)
            except ZygoteUnavailableError as e:
                self._give_up(str(e))
            except OSError as e:  # e.g. an environment too big for one message
                logger.warning("forking from the zygote failed (%s); starting a fresh one", e)
        return self.fallback.spawn(request)

    def close(self) -> None:
        if self._heir is not None:
            self._heir[0].close()
            self._heir = None
        if self.zygote is not None:
            self.zygote.close()
            if self.guardian is not None:
                self.guardian.forget_group(self.zygote.pid)
            self.zygote = None
        for z in reversed(self._retired):  # the heirs first: they die with their parents
            self._close(z)
        self._retired = []

    def _close(self, z: Zygote) -> None:
        z.close()
        if self.guardian is not None:
            self.guardian.forget_group(z.pid)


class FunctionFork(Spawner):
    """``start_method="fork"``: the child is a copy of the launcher."""

    name = "fork"

    @property
    def forks(self) -> bool:
        return True

    def spawn(self, request: SpawnRequest) -> Process:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child never returns from here
            with contextlib.suppress(BaseException):
                handover = Handover(env=request.env, stdout=request.stdout, stderr=request.stderr)
                run_worker(handover, request.argv, request.call, run_exit_handlers=False)
            os._exit(1)
        return ForkedProcess(pid)


def spawner_for(
    chosen: PreloadPlan,
    start_method: str,
    entrypoint: Entrypoint,
    cancel: CancelToken,
    guardian: Guardian | None = None,
    spares: int = 0,
) -> Spawner:
    """How a launch starts its workers, given what :func:`~.preload.plan` chose: forked from a
    zygote (``--preload``, by default for every Python entrypoint, or ``fork``/``forkserver``),
    forked from the launcher for a function with ``fork``, else fresh interpreters (saying why
    when preloading was asked for). The zygote starts now, so that its imports overlap the
    rendezvous, and keeps `spares` workers forked ahead of need."""
    if entrypoint.kind == Kind.FUNCTION and start_method == "fork":
        return FunctionFork()
    fresh = FreshInterpreter(entrypoint)
    forked_method = start_method == "forkserver" or (
        entrypoint.kind in (Kind.SCRIPT, Kind.MODULE) and start_method == "fork"
    )
    if entrypoint.is_python and (chosen.zygote or forked_method):
        return ZygoteFork(chosen, fresh, cancel, guardian, spares)
    if chosen.why_not:
        logger.warning("%s", chosen.why_not)
    return fresh
