"""The coordinators of the train loop: every worker is a member of a rendezvous of its own.

:class:`ElasticCoordinator` forms the process group of each round of a workers' rendezvous
(:mod:`elastic_launch.rendezvous`, one member per worker): rank 0 serves the round's TCPStore
on the port it published when it joined, and the group is torn down (aborted on NCCL, where a
communicator may be stuck) before the next round. :func:`from_environment` builds one from what
``elasticrun`` sets; :class:`CoordinatorP2P` is the classic torchelastic constructor, which
joins the rendezvous its ``init_method`` URL names when run by plain ``python`` and follows the
launcher's environment under ``elasticrun``.

Growing at a step boundary costs no collective per step: rank 0 learns from its rendezvous'
watch that a worker waits, and posts "re-form after round step S" (a few steps ahead) as a
note of the round, which every rank's rendezvous watch brings (no request per step), so the
ranks leave together at S. A rank that learns late is in step S+1's collective when the others
leave: it fails, is rolled back to the state after S, and joins the same next round.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import threading
import time
import traceback
import urllib.parse
from typing import Any

from elastic_launch import spare, teardown
from elastic_launch.api import ConfigError
from elastic_launch.net import await_listening
from elastic_launch.rendezvous import RendezvousHandler, RendezvousParameters, create_handler
from elastic_launch.rendezvous.api import (
    CloseReason,
    RendezvousClosedError,
    RendezvousError,
    RestartReason,
    RunIdInUseError,
)
from elastic_launch.rendezvous.conf import (
    URL_KEYS,
    WORKERS_ROLE,
    describe,
    kind_of,
    positive_int,
)
from elastic_launch.rendezvous.team import (
    FATAL,
    LOOP_FILE_ENV,
    RUNNING,
    TEAM_ENV,
    WAITING,
    Team,
    resolve,
    running,
)
from elastic_launch.train_loop import group_sockets
from elastic_launch.train_loop.api import (
    Coordinator,
    NonRetryableException,
    State,
    StopException,
    WorkerStats,
)

logger = logging.getLogger(__name__)

#: How many round steps ahead rank 0 sets a re-formation, at least (the ranks are at most one
#: step apart: every step has a collective) ...
REFORM_MARGIN = 2
#: ... and at least this long ahead, so that the note reaches every rank first even when steps
#: take milliseconds (a watch brings it within a few ms on the embedded service and etcd).
NOTE_LATENCY = 0.1
#: The round's note that carries that decision.
REFORM_NOTE = "reform_at"
#: How often the NCCL abort thread looks at the rendezvous' watch (seconds).
ABORT_POLL = 0.05
#: The workers' rendezvous never closes the job for its failures: the loop's failure budget
#: and the agent's restart budget decide.
_NO_BUDGET = 1 << 30


class ElasticCoordinator(Coordinator):
    """The coordinator over a workers' rendezvous `rendezvous` (one member per worker).

    `backend` is the process group's (gloo, nccl); `timeout` bounds its collectives (a peer
    that vanished without closing its connections is noticed after it); with a backend other
    than gloo, the loop's own barriers run on a gloo group bounded by `coordinator_timeout`;
    `max_num_trainers` caps the world (beyond the rendezvous' own maximum, as the classic
    coordinator did).
    """

    MONITOR_PROGRESS_FREQ = 1000

    def __init__(
        self,
        rendezvous: RendezvousHandler,
        *,
        backend: str = "gloo",
        timeout: datetime.timedelta = datetime.timedelta(seconds=600),
        max_num_trainers: int | None = None,
        loop_file: str | None = None,
        coordinator_timeout: datetime.timedelta | None = None,
    ) -> None:
        self.rendezvous = rendezvous
        self.c10d_backend = backend
        self.timeout = timeout
        self.coordinator_timeout = coordinator_timeout or timeout
        self.max_num_trainers = None if max_num_trainers is None else whole(max_num_trainers)
        self.rank = -1
        self.world_size = 0
        self.round = 0
        self.stop_training = False
        self.is_worker_straggler = False
        self.store: Any = None
        self.coordinator_process_group: Any = None
        self._reason = RestartReason.START
        self._failure = ""
        self._step = 0  # steps of this round
        self._reform_at: int | None = None
        self._monitor_step = 0
        self._loop_file = loop_file
        self._step_started: float | None = None
        self._step_seconds: float | None = None  # rank 0's recent step time
        self._clock = time.monotonic
        self._aborter: threading.Event | None = None
        self._max_failures: int | None = None
        self._group_sockets: group_sockets.Sockets = frozenset()  # the round's gloo connections
        self._said = RUNNING
        self._announce(RUNNING)

    # ---- the loop's hooks -----------------------------------------------------------------

    def rendezvous_barrier(self) -> tuple[Any, int, int]:
        self._destroy_process_group()
        reason, self._reason = self._reason, RestartReason.MEMBERSHIP
        failure, self._failure = self._failure, ""
        # A hot spare has prepared on idle CPU; it waits on a watch (no CPU) at the normal
        # policy, so that a busy machine does not delay its answer when a round needs it.
        spare.prepare()
        spare.leave_idle()
        self._announce(WAITING)  # a hot spare, or a worker between rounds: not training
        try:
            info = self.rendezvous.next_rendezvous(reason, failure=failure)
        except RunIdInUseError as e:
            closed = self.rendezvous.closed()
            if self._loop_file is None or closed is None or closed.reason != CloseReason.SUCCEEDED:
                self._announce(FATAL)
                raise NonRetryableException(str(e)) from None
            # Under elasticrun: a replacement that came after the others finished.
            self.stop_training = True
            raise StopException("the job finished before this worker could join") from None
        except RendezvousClosedError as e:
            self.stop_training = True
            self.close()
            if e.closed.reason == CloseReason.SUCCEEDED:
                raise StopException(str(e)) from None
            self._announce(FATAL)
            raise NonRetryableException(f"rank {self.rank}: {e}") from None
        except RendezvousError as e:
            self._announce(FATAL)
            raise NonRetryableException(
                f"rank {self.rank} cannot rejoin the workers' rendezvous: {e}"
            ) from e
        self.rank, self.world_size, self.round = info.group_rank, info.group_world_size, info.round
        self._announce(RUNNING)
        self._step, self._reform_at, self.is_worker_straggler = 0, None, False
        self._step_started = None
        from torch.distributed import TCPStore  # type: ignore[attr-defined]

        if self.rank != 0:  # rank 0 starts the store as this call returns there too
            seconds, broken = self.timeout.total_seconds(), self.rendezvous.round_broken
            await_listening(info.master_addr, info.master_port, seconds, broken)
        self.store = TCPStore(
            info.master_addr,
            info.master_port,
            self.world_size,
            is_master=self.rank == 0,
            timeout=self.timeout,
            wait_for_workers=False,
        )
        logger.info(
            "round %d: rank %d of %d (the group's store at %s:%d)",
            self.round,
            self.rank,
            self.world_size,
            info.master_addr,
            info.master_port,
        )
        return self.store, self.rank, self.world_size

    def init_process_group(self) -> None:
        import torch.distributed as dist

        self._monitor_step = 0
        before = group_sockets.open_sockets()
        dist.init_process_group(
            self.c10d_backend,
            store=self.store,
            rank=self.rank,
            world_size=self.world_size,
            timeout=self.timeout,
        )
        if self.c10d_backend == "gloo":
            self.coordinator_process_group = dist.group.WORLD
        else:
            self.coordinator_process_group = dist.new_group(
                backend="gloo", timeout=self.coordinator_timeout
            )
            self._watch_for_abort()
        self._group_sockets = group_sockets.open_sockets() - before

    def _watch_for_abort(self) -> None:
        """NCCL: a collective whose peer died may block this rank's main thread for good (NCCL
        does not see a closed connection as gloo does). A thread aborts the communicators as
        soon as the rendezvous' watch says the round is broken (a member gone, the round
        reopened): the stuck collective then raises, and the loop rolls back and re-forms."""
        stop = self._aborter = threading.Event()

        def watch() -> None:
            while not stop.wait(ABORT_POLL):
                if self.rendezvous.round_broken():
                    logger.warning("the round is broken: aborting the NCCL communicators")
                    try:
                        from torch.distributed.distributed_c10d import _abort_process_group

                        _abort_process_group()
                    except Exception as e:  # already torn down
                        logger.debug("abort: %s", e)
                    return

        threading.Thread(target=watch, name="elasticrun-nccl-abort", daemon=True).start()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier(group=self.coordinator_process_group)

    def should_rendezvous(self, state: State) -> bool:
        """Whether the group re-forms now: at the round step rank 0 chose when it saw a
        worker waiting (a note every rank's rendezvous watch brings; no request per step)."""
        self._step += 1
        now = self._clock()
        if self._step_started is not None:
            took = now - self._step_started
            self._step_seconds = (
                took if self._step_seconds is None else 0.8 * self._step_seconds + 0.2 * took
            )
        self._step_started = now
        if self._reform_at is None:
            if self.rank == 0 and self._room():
                waiting = self.rendezvous.num_nodes_waiting()
                if waiting:
                    self._plan_reform(waiting)
            else:
                at = self.rendezvous.note(REFORM_NOTE)
                self._reform_at = int(at) if at is not None else None
        return self._reform_at is not None and self._step >= self._reform_at

    def _plan_reform(self, waiting: int) -> None:
        step = self._step_seconds or 0.0
        ahead = max(REFORM_MARGIN, math.ceil(NOTE_LATENCY / step) if step > 0 else 0)
        at = self._step + min(ahead, 100_000)
        try:
            self.rendezvous.post_note(REFORM_NOTE, str(at))
        except Exception as e:  # the store is away: try again after the next step
            logger.warning("cannot tell the others to re-form (%s): trying again", e)
            return
        self._reform_at = at
        logger.warning(
            "%d worker(s) wait to join: the group re-forms after round step %d", waiting, at
        )

    def expected_failure(self, e: BaseException) -> bool:
        """A collective that failed because the others left at the planned step while this
        rank, learning of it late, went on: the planned re-formation, not a failure."""
        at = self._reform_at
        if at is None:
            note = self.rendezvous.note(REFORM_NOTE)
            at = int(note) if note is not None else None
        return at is not None and self._step >= at

    def should_stop_training(self) -> bool:
        return self.stop_training

    def signal_training_done(self) -> None:
        """The data ended: close the workers' job, so that the others end too (at their own
        end of data, or at their next rendezvous)."""
        self.rendezvous.set_closed(CloseReason.SUCCEEDED)
        self.stop_training = True
        self.close()

    def monitor_progress(self, state: State, worker_stats: WorkerStats | None) -> None:
        """Every MONITOR_PROGRESS_FREQ steps, compare the ranks' progress rates (one
        all_gather) and warn about a straggler, as the classic coordinator did."""
        self._monitor_step += 1
        if self._monitor_step % self.MONITOR_PROGRESS_FREQ:
            return
        import torch
        import torch.distributed as dist

        rate = worker_stats.get_progress_rate() if worker_stats is not None else None
        mine = torch.tensor([rate or 0.0, 1.0 if rate is not None else 0.0])
        rates = [torch.zeros(2) for _ in range(self.world_size)]
        dist.all_gather(rates, mine, group=self.coordinator_process_group)
        known = [float(r[0]) for r in rates if r[1] > 0]
        if rate is None or not known or max(known) <= 0:
            return
        relative = rate / max(known)
        self.last_relative_prog_rate = relative
        self.is_worker_straggler = relative < 0.8
        if self.is_worker_straggler:
            logger.warning(
                "straggler: rank %d progresses at %.0f%% of the fastest rank",
                self.rank,
                100 * relative,
            )

    def on_error(self, e: BaseException) -> None:
        logger.error(
            "rank %d: %s: %s\n%s", self.rank, type(e).__name__, e, traceback.format_exc().rstrip()
        )
        if isinstance(e, NonRetryableException) or not isinstance(e, RuntimeError):
            self._announce(FATAL)
            return
        if self.expected_failure(e):
            self._reason = RestartReason.MEMBERSHIP  # the planned re-formation
            return
        self._reason = RestartReason.FAILURE
        self._failure = f"rank {self.rank}: {type(e).__name__}: {e}"[:500]

    # ---- the group ------------------------------------------------------------------------

    def _room(self) -> bool:
        return self.max_num_trainers is None or self.world_size < self.max_num_trainers

    def _destroy_process_group(self) -> None:
        """Tear the group down before the next round, so that no peer waits for this rank: its
        gloo connections are shut down (an object of the state, a DDP model, may still hold
        the group, and gloo closes them only when the group is freed: see
        :mod:`.group_sockets`), then the group is aborted (a NCCL communicator may be stuck in
        a collective with a dead peer) and forgotten."""
        if self._aborter is not None:
            self._aborter.set()
            self._aborter = None
        group_sockets.shut_down(self._group_sockets)
        self._group_sockets = frozenset()
        try:
            import torch.distributed as dist
        except ImportError:
            return
        if dist.is_available() and dist.is_initialized():
            # The State's DDP model holds the group until sync replaces it: never let it hold
            # the last reference (its teardown could deadlock, see teardown).
            teardown.keep(teardown.live_groups())
            try:
                from torch.distributed.distributed_c10d import _abort_process_group

                _abort_process_group()
            except Exception as e:  # a broken group is still to be replaced
                logger.warning("aborting the process group: %s", e)
                if dist.is_initialized():
                    with contextlib.suppress(Exception):
                        dist.destroy_process_group()
        elif dist.is_available():
            _forget_failed_init()
        self.coordinator_process_group = None
        self.store = None

    def set_failure_budget(self, max_failures: int) -> None:
        self._max_failures = max_failures
        self._announce(self._said)

    def _announce(self, what: str) -> None:
        self._said = what
        said = running(self._max_failures, what) if what in (RUNNING, WAITING) else what
        announce(self._loop_file, said)

    def close(self) -> None:
        """Leave: the process group and the rendezvous session."""
        self._destroy_process_group()
        self.rendezvous.shutdown()


# ---- building one ---------------------------------------------------------------------------


def announce(path: str | None, what: str) -> None:
    """Tell the agent (through this worker's loop file) that it runs the loop, or that it
    failed for good: the agent replaces a dead loop worker alone, and never a fatal one."""
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(what)
    except OSError as e:
        logger.warning("cannot write %s=%s: %s", LOOP_FILE_ENV, path, e)


#: The classic URL's own parameters; the rendezvous keys it takes are conf.URL_KEYS.
_URL_PARAMS = {
    "min_workers": "at least this many workers (required)",
    "max_workers": "at most (default: min_workers)",
    "etcd_prefix": "accepted for compatibility; keys live under /elasticrun/<run id>",
}
_SCHEMES = {"etcd": "etcd", "etcd-v2": "etcd-v2", "etcd2": "etcd-v2", "embedded": "embedded"}


def whole(value: Any, name: str = "max_num_trainers") -> int:
    """A count given as an int or as an int-like str (as 0.1 scripts read it from the
    environment, and 0.1 accepted)."""
    try:
        n = int(str(value).strip()) if isinstance(value, str) else int(value)
    except (TypeError, ValueError):
        n = 0
    if n < 1 or isinstance(value, bool) or (not isinstance(value, str) and n != value):
        raise ConfigError(f"{name}={value!r}: give a whole number of trainers, 1 or more")
    return n


def parse_init_method(init_method: str) -> RendezvousParameters:
    """The classic rendezvous URL, ``etcd://HOST:PORT/RUN_ID?min_workers=N&max_workers=M``
    (also ``etcd-v2://`` and ``embedded://``), as the workers' rendezvous parameters."""
    url = urllib.parse.urlsplit(init_method)
    scheme = url.scheme.lower()
    where = f"init_method '{init_method}'"
    if scheme not in _SCHEMES:
        raise ConfigError(
            f"{where}: the scheme must be one of {', '.join(s + '://' for s in _SCHEMES)} "
            "(etcd:// uses etcd's v3 API; etcd-v2:// the v2 API of the classic package)"
        )
    run_id = url.path.strip("/")
    if not url.netloc or not run_id:
        raise ConfigError(f"{where}: give HOST:PORT and a run id, as in etcd://etcd0:2379/myjob")
    query = urllib.parse.parse_qs(url.query, keep_blank_values=True)
    unknown = sorted(set(query) - set(_URL_PARAMS) - set(URL_KEYS))
    if unknown:
        taken = {**_URL_PARAMS, **{k.name: describe(k) for k in URL_KEYS.values()}}
        known = "; ".join(f"{k}: {v}" for k, v in taken.items())
        raise ConfigError(f"{where}: unknown parameter(s) {', '.join(unknown)} (it takes {known})")
    raw = {k: v[-1] for k, v in query.items()}
    if "min_workers" not in raw:
        raise ConfigError(f"{where}: min_workers=N is required, as in ?min_workers=2")
    lo = _count(raw["min_workers"], "min_workers", where)
    hi = _count(raw.get("max_workers", str(lo)), "max_workers", where)
    if hi < lo:
        raise ConfigError(f"{where}: max_workers={hi} is less than min_workers={lo}")
    backend = _SCHEMES[scheme]
    kind = kind_of(backend, hi)
    conf = {k: v for k, v in raw.items() if k in URL_KEYS and kind in URL_KEYS[k].backends}
    return _workers(backend, url.netloc, run_id, lo, hi, conf)


def _workers(
    backend: str, endpoint: str, run_id: str, lo: int, hi: int, conf: dict[str, str]
) -> RendezvousParameters:
    """A workers' rendezvous: one member per worker; its failures spend no budget of its own."""
    return RendezvousParameters(
        backend=backend,
        endpoint=endpoint,
        run_id=run_id,
        min_nodes=lo,
        max_nodes=hi,
        max_restarts=_NO_BUDGET,
        local_world_size=1,
        config=conf,
        role=WORKERS_ROLE,
    )


def _count(text: str, name: str, where: str) -> int:
    try:
        return positive_int(text)
    except ValueError:
        raise ConfigError(f"{where}: {name}={text!r} must be a whole number, 1 or more") from None


def team_parameters(
    team: Team, min_workers: int | None = None, max_workers: int | None = None
) -> RendezvousParameters:
    """The workers' rendezvous of an elasticrun job (`team`, from its environment); a script
    may narrow the range of workers it trains with. A service the agent starts on demand is
    waited for (this worker has announced the loop already)."""
    team = resolve(team)
    if team.unavailable:
        raise ConfigError(f"the train loop cannot run in this job: {team.unavailable}")
    lo = team.min_workers if min_workers is None else min_workers
    hi = team.max_workers if max_workers is None else max_workers
    if not 1 <= lo <= hi <= team.max_workers:
        raise ConfigError(
            f"min_workers={lo}, max_workers={hi}: the job runs between {team.min_workers} and "
            f"{team.max_workers} workers (--nnodes x --nproc-per-node); choose 1 <= min <= max "
            f"<= {team.max_workers}"
        )
    return _workers(team.backend, team.endpoint, team.run_id, lo, hi, dict(team.config))


def _team_or_fatal(
    loop_file: str | None, team: Team, lo: int | None = None, hi: int | None = None
) -> RendezvousParameters:
    """team_parameters(); a worker that cannot take part tells the agent it failed for good
    (it would fail the same way again)."""
    try:
        return team_parameters(team, lo, hi)
    except ConfigError:
        announce(loop_file, FATAL)
        raise


def under_elasticrun() -> Team | None:
    """The team of the elasticrun job this process is a worker of, or None."""
    text = os.environ.get(TEAM_ENV)
    if not text:
        return None
    try:
        return Team.from_env(text)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"${TEAM_ENV}={text!r} is not what elasticrun sets ({e})") from None


def from_environment(
    backend: str | None = None,
    *,
    timeout: datetime.timedelta = datetime.timedelta(seconds=600),
    min_workers: int | None = None,
    max_workers: int | None = None,
) -> ElasticCoordinator:
    """The coordinator of an elasticrun worker: the workers' rendezvous the launcher set up.
    `backend` defaults to nccl when CUDA is available, else gloo."""
    team = under_elasticrun()
    if team is None:
        raise ConfigError(
            f"${TEAM_ENV} is not set: from_environment() is for scripts run by elasticrun; "
            "run the script with elasticrun, or build CoordinatorP2P(init_method=...)"
        )
    loop_file = os.environ.get(LOOP_FILE_ENV)
    announce(loop_file, RUNNING)  # first: a service started on demand waits for it
    params = _team_or_fatal(loop_file, team, min_workers, max_workers)
    return ElasticCoordinator(
        create_handler(params),
        backend=backend or _default_backend(),
        timeout=timeout,
        loop_file=loop_file,
    )


def _default_backend() -> str:
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


class CoordinatorP2P(ElasticCoordinator):
    """The classic torchelastic coordinator's constructor: `c10d_backend`, the rendezvous URL
    `init_method` (``etcd://HOST:PORT/RUN_ID?min_workers=N&max_workers=M``), the most
    trainers, and the process group's timeout in milliseconds. Under elasticrun the launcher's
    environment says where the workers meet, and the URL is not used."""

    def __init__(
        self,
        c10d_backend: str,
        init_method: str,
        max_num_trainers: int,
        process_group_timeout: int = 10000,
        coordinator_pg_timeout: int = 600000,
    ) -> None:
        if process_group_timeout <= 0 or coordinator_pg_timeout <= 0:
            raise ConfigError(
                f"process_group_timeout={process_group_timeout} and coordinator_pg_timeout="
                f"{coordinator_pg_timeout} are milliseconds: give more than 0"
            )
        team = under_elasticrun()
        loop_file = os.environ.get(LOOP_FILE_ENV) if team is not None else None
        if team is not None:
            announce(loop_file, RUNNING)  # first: a service started on demand waits for it
            params = _team_or_fatal(loop_file, team)
            logger.info(
                "under elasticrun: the workers meet at %s (run %s), not at %s",
                params.endpoint,
                params.run_id,
                init_method,
            )
        else:
            params = parse_init_method(init_method)
        super().__init__(
            create_handler(params),
            backend=c10d_backend,
            timeout=datetime.timedelta(milliseconds=process_group_timeout),
            coordinator_timeout=datetime.timedelta(milliseconds=coordinator_pg_timeout),
            max_num_trainers=max_num_trainers,
            loop_file=loop_file,
        )


def _forget_failed_init() -> None:
    """torch names the default group by a counter that ``init_process_group`` raises before it
    connects and resets only when the group is destroyed: after an init that failed (a peer
    that left mid-handshake) this rank's next group would carry another name than its peers',
    and every later init would wait for keys no peer writes. Reset it as destroying would."""
    from torch.distributed import distributed_c10d

    world = getattr(distributed_c10d, "_world", None)
    if world is not None and hasattr(world, "group_count"):
        world.group_count = 0
