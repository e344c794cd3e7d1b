"""The elastic train loop: run train_step until the data ends, rolling a failed step back to
its snapshot and re-forming the group, as the classic torchelastic loop did."""

from __future__ import annotations

import logging
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import elastic_core

from elastic_launch.train_loop import metrics
from elastic_launch.train_loop.api import (
    Coordinator,
    NonRetryableException,
    State,
    StopException,
    UserMethodError,
    WorkerStats,
)
from elastic_launch.train_loop.checkpoint import CheckpointUtil
from elastic_launch.train_loop.metrics import GROUP

logger = logging.getLogger(__name__)

#: Failed steps (rolled back and retried) before the loop gives up, as in the classic loop.
#: Read when train() starts, here or on the package (``elastic_launch.train_loop``), as
#: classic scripts set it.
MAX_FAILURES = 100
_CLASSIC_MAX_FAILURES = MAX_FAILURES
#: ``1``: a RuntimeError from ``state.sync`` fails the job at once (it is most often a bug);
#: by default it is retried after a rollback, as in the classic loop.
STRICT_SYNC_ENV = "ELASTICRUN_TRAIN_LOOP_STRICT_SYNC"

# What a collective raises when a peer died or the group was torn down under it: a failure of
# the group, not of the user's method (gloo raises RuntimeError with its transport's message).
_GROUP_FAILURE = re.compile(
    r"gloo|nccl|connection (reset|closed|refused)|broken pipe|timed out|timeout|socket|"
    r"process group|ProcessGroup|peer",
    re.IGNORECASE,
)


class TooManyFailures(NonRetryableException, RuntimeError):  # noqa: N818 - as the rest
    """The loop's failure budget is spent (a RuntimeError, as the classic loop raised; not
    retryable: the job fails)."""


def is_group_failure(e: BaseException) -> bool:
    """Whether `e` comes from the process group (a peer gone, a torn-down group), so that
    rolling back and re-forming can cure it."""
    try:
        import torch.distributed as dist

        if isinstance(e, dist.DistError):
            return True
    except (ImportError, AttributeError):
        pass
    return isinstance(e, (RuntimeError, ConnectionError, TimeoutError)) and bool(
        _GROUP_FAILURE.search(str(e))
    )


def _user(method: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call the user's `method`; an exception that is not the group's fails the job at once
    (retrying a bug would only repeat it), naming the method."""
    try:
        return fn(*args)
    except (StopIteration, StopException, NonRetryableException):
        raise
    except Exception as e:
        if is_group_failure(e):
            raise
        raise UserMethodError(f"{method} raised {type(e).__name__}: {e}") from e


def _unpack(result: Any, state: State) -> tuple[State, WorkerStats | None]:
    """train_step returns the state, or (state, worker_stats) as in the classic loop."""
    if isinstance(result, State):
        return result, None
    if isinstance(result, tuple) and len(result) == 2 and isinstance(result[0], State):
        return result[0], result[1]
    if result is None:
        return state, None
    raise UserMethodError(
        f"train_step returned {result!r} ({type(result).__name__}); it must return the state, "
        "or (state, worker_stats), or None"
    )


@dataclass
class _Run:
    """What the loop carries across steps and rounds (a failed step rolls `state` back to
    `snapshot`, the one taken before it)."""

    state: State
    snapshot: Any = None
    rank: int = -1
    failures: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.state, State):
            raise TypeError(
                "train() needs an elastic_launch.train_loop.State, got "
                f"{type(self.state).__name__}: subclass State (sync, capture_snapshot, "
                "apply_snapshot)"
            )


def train(
    elastic_coordinator: Coordinator,
    train_step: Callable[[State], Any],
    state: State,
    *,
    max_failures: int | None = None,
) -> State:
    """Run `train_step(state)` until it raises StopIteration or the coordinator says stop.

    As the classic torchelastic loop: a snapshot is taken before each step; a step that
    raises RuntimeError (what a collective raises when a peer died) is rolled back to it with
    ``apply_snapshot``, and the group re-forms through the coordinator, where ``state.sync``
    brings every worker to one view; after `max_failures` such failures the loop gives up.
    Any other exception (:class:`NonRetryableException`, :class:`StopException` from a step,
    a bug) is reported to ``on_error`` and raised; a State method that fails, or a step that
    returns what the loop cannot use, fails at once with :class:`UserMethodError`. With a
    checkpoint manager set (:mod:`.checkpoint`), rank 0 loads the newest checkpoint before
    the first sync and saves one whenever ``state.should_save_checkpoint`` says so. Returns
    the final state.
    """
    coordinator = elastic_coordinator
    if max_failures is None:
        max_failures = max_failures_setting()
    # Under elasticrun, the launcher replaces up to this many dead workers: no extra flag.
    getattr(coordinator, "set_failure_budget", lambda n: None)(max_failures)
    run = _Run(state)
    checkpoints = CheckpointUtil(coordinator)
    while not coordinator.should_stop_training():
        _check_budget(coordinator, run, max_failures)
        outer = time.time()
        run.snapshot = _user("capture_snapshot", run.state.capture_snapshot)
        forming = True  # the classic loop ends on a StopException only while forming
        try:
            _form(coordinator, run, checkpoints)
            forming = False
            _steps(coordinator, train_step, run, checkpoints)
        except StopException as e:
            if forming:
                break  # the job was closed: training is over
            coordinator.on_error(e)
            raise
        except StopIteration as e:
            if forming:
                coordinator.on_error(e)
                raise
            coordinator.signal_training_done()
        except RuntimeError as e:
            if isinstance(e, NonRetryableException):
                coordinator.on_error(e)
                raise
            if not coordinator.expected_failure(e):
                run.failures += 1
            _recover(coordinator, run, e, max_failures)
        except Exception as e:
            coordinator.on_error(e)
            raise
        finally:
            ms = (time.time() - outer) * 1000
            metrics.publish_metric(GROUP, "outer_train_loop.duration.ms", ms)
    return run.state


def _check_budget(coordinator: Coordinator, run: _Run, max_failures: int) -> None:
    """Give up once `max_failures` failures were rolled back."""
    if run.failures >= max_failures:
        e = TooManyFailures(
            f"Exceeded max number of recoverable failures: {max_failures} (the loop's "
            "failure budget, MAX_FAILURES or train(max_failures=...)): the job fails"
        )
        coordinator.on_error(e)
        raise e


def max_failures_setting() -> int:
    """MAX_FAILURES as the script set it, on this module or on the package."""
    package = sys.modules.get("elastic_launch.train_loop")
    for value in (getattr(package, "MAX_FAILURES", MAX_FAILURES), MAX_FAILURES):
        if value != _CLASSIC_MAX_FAILURES:
            return int(value)
    return _CLASSIC_MAX_FAILURES


def _sync(state: State, world_size: int, rank: int) -> None:
    """``state.sync``: a RuntimeError is retried as the classic loop did (unless strict:
    :data:`STRICT_SYNC_ENV`); anything else from it is a bug, which fails at once."""
    if os.environ.get(STRICT_SYNC_ENV) == "1":
        _user("sync", state.sync, world_size, rank)
        return
    try:
        state.sync(world_size, rank)
    except (RuntimeError, StopException, NonRetryableException):
        raise
    except Exception as e:
        raise UserMethodError(f"sync raised {type(e).__name__}: {e}") from e


def _form(coordinator: Coordinator, run: _Run, checkpoints: CheckpointUtil) -> None:
    """Form the group (the rendezvous, the process group), load the newest checkpoint, and
    bring every worker to one view (``state.sync``)."""
    t0 = time.time()
    # Waiting for peers here is not a hang: the rendezvous and the group's timeout bound it,
    # not the launcher's hang detection.
    with elastic_core.quiet():
        _, run.rank, world_size = coordinator.rendezvous_barrier()
        coordinator.init_process_group()
        formed = time.time()
        checkpoints.load_checkpoint(run.state, run.rank)
        _sync(run.state, world_size, run.rank)
        checkpoints.set_checkpoint_loaded()
        coordinator.barrier()
    synced = time.time()
    metrics.publish_metric(GROUP, "rendezvous.duration.ms", (formed - t0) * 1000)
    metrics.publish_metric(GROUP, "state_sync.duration.ms", (synced - formed) * 1000)
    metrics.event(
        "train_loop_round",
        rank=run.rank,
        world_size=world_size,
        rendezvous_seconds=formed - t0,
        sync_seconds=synced - formed,
        failures=run.failures,
    )


def _steps(
    coordinator: Coordinator,
    train_step: Callable[[State], Any],
    run: _Run,
    checkpoints: CheckpointUtil,
) -> None:
    """Run steps until the coordinator asks for a new round or says stop (a step's exception
    goes up to the loop)."""
    inner = time.time()
    try:
        while not coordinator.should_stop_training():
            run.snapshot = _user("capture_snapshot", run.state.capture_snapshot)
            began, beats = time.time(), elastic_core.current_step()
            run.state, stats = _unpack(train_step(run.state), run.state)
            metrics.publish_metric(GROUP, "train_step.duration.ms", (time.time() - began) * 1000)
            if elastic_core.current_step() == beats:  # no optimizer step beat for it
                elastic_core.beat()
            coordinator.monitor_progress(run.state, stats)
            checkpoints.save_checkpoint(run.state, run.rank)
            if coordinator.should_rendezvous(run.state):
                return
            coordinator.report_progress(run.state)
    finally:
        ms = (time.time() - inner) * 1000
        metrics.publish_metric(GROUP, "inner_train_loop.duration.ms", ms)


def _recover(coordinator: Coordinator, run: _Run, e: BaseException, max_failures: int) -> None:
    """A retryable failure: report it, roll the state back; the caller re-forms the group."""
    began = time.time()
    coordinator.on_error(e)
    logger.warning(
        "step failed (%s: %s); rolled back to its snapshot, re-forming the group (failure %d "
        "of at most %d)",
        type(e).__name__,
        e,
        run.failures,
        max_failures,
    )
    _user("apply_snapshot", run.state.apply_snapshot, run.snapshot)
    metrics.publish_metric(GROUP, "rollbacks", 1)
    metrics.publish_metric(GROUP, "rollback.duration.ms", (time.time() - began) * 1000)
    metrics.event("train_loop_rollback", rank=run.rank, failures=run.failures, error=f"{e}"[:300])
