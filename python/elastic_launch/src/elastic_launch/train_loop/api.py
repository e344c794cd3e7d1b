"""The classic torchelastic programming model: interfaces, data and errors.

A script written for torchelastic 0.1 implements a :class:`State` and a ``train_step``, and
hands both to :func:`elastic_launch.train_loop.train` with a :class:`Coordinator`. The names,
signatures and defaults here are the classic package's, so such a script runs after changing
its imports only.
"""

from __future__ import annotations

import abc
from typing import IO, Any


class StopException(Exception):  # noqa: N818 - the classic name
    """Raised by a coordinator to stop training on this worker (for example, the job was
    closed by another worker). The loop returns the state as it is."""


class NonRetryableException(Exception):  # noqa: N818 - the classic name
    """A failure that rolling back and re-forming cannot cure: the loop fails the job at once,
    with this exception in the failure summary, instead of retrying."""


class UserMethodError(NonRetryableException):
    """A method of the user's State (or train_step) raised or returned what the loop cannot
    use: retrying would fail the same way, so the job fails at once, naming the method."""


class State:
    """Everything a worker needs to go on training: model, optimizer, data position.

    Every worker builds its State from the same constructor arguments (the bootstrap state).
    Override what applies; the defaults mean "nothing to synchronise" and "no rollback".
    """

    def sync(self, world_size: int, rank: int) -> None:
        """A collective, called on every worker at start and after every membership change or
        rollback: bring all workers to one consistent view (typically a broadcast from the
        most tenured worker, then rebuilding data loaders and the model for `world_size`)."""

    def capture_snapshot(self) -> Any:
        """An object from which :meth:`apply_snapshot` restores the state as it is now; taken
        before each step. None (the default) means no rollback."""
        return None

    def apply_snapshot(self, capture_snapshot: Any) -> None:
        """Restore the state from a snapshot; acts like a setter: assumes nothing about the
        state it is called on. The default accepts only None (no rollback): a snapshot that
        :meth:`capture_snapshot` made needs this method too."""
        if capture_snapshot is not None:
            raise NotImplementedError(
                f"{type(self).__name__}.capture_snapshot returned a snapshot but "
                "apply_snapshot is not implemented: implement both, or neither"
            )

    def save(self, stream: IO[bytes]) -> None:
        """Persist the state to a binary stream (default: the snapshot, with torch.save)."""
        import torch

        torch.save(self.capture_snapshot(), stream)

    def load(self, stream: IO[bytes]) -> None:
        """Restore the state from a stream written by :meth:`save`. Only tensors, containers,
        plain values and numpy arrays are rebuilt (torch's ``weights_only=True``); a snapshot
        holding other objects needs this method overridden, for files you trust."""
        try:
            from elastic_sampler import load_checkpoint
        except ImportError:  # elastic_sampler is optional: torch's own refusal then
            import torch

            self.apply_snapshot(torch.load(stream, weights_only=True))
            return
        self.apply_snapshot(load_checkpoint(stream))

    def should_save_checkpoint(self, rank: int) -> bool:
        """Whether the loop should checkpoint after the step just taken (default: never). Must
        answer the same on every worker: the checkpoint ends with a barrier."""
        return False


class WorkerStats(abc.ABC):
    """What a train_step returns beside the state, for progress reports."""

    @abc.abstractmethod
    def get_progress_rate(self) -> float | None:
        """How fast this worker goes (larger is faster), or None if not measured."""


class SimpleWorkerStats(WorkerStats):
    """A progress rate measured by the step itself."""

    def __init__(self, progress_rate: float | None) -> None:
        self.progress_rate = progress_rate

    def get_progress_rate(self) -> float | None:
        return self.progress_rate


class Coordinator(abc.ABC):
    """Forms the process group, decides when to re-form it and when to stop.

    The loop calls, in this order: :meth:`rendezvous_barrier`, :meth:`init_process_group`,
    ``state.sync``, :meth:`barrier`; then per step the step, :meth:`monitor_progress`,
    :meth:`should_rendezvous`, :meth:`report_progress`; :meth:`on_error` on a failure and
    :meth:`signal_training_done` at the end of the data.
    """

    @abc.abstractmethod
    def rendezvous_barrier(self) -> tuple[Any, int, int]:
        """Join the next round and form its process group: (store, rank, world_size)."""

    def init_process_group(self) -> None:  # noqa: B027 - ours form it in rendezvous_barrier
        """Form the process group of the round just joined (the classic coordinator did it
        here, after :meth:`rendezvous_barrier`)."""

    def barrier(self) -> None:
        """Wait until every worker of the current group gets here. By default the process
        group's own barrier, when one is formed (a coordinator written for 0.1 has none)."""
        try:
            import torch.distributed as dist
        except ImportError:
            return
        if dist.is_available() and dist.is_initialized():
            dist.barrier()

    def should_save_checkpoint(self) -> bool:
        """Whether the loop must checkpoint after this step whatever the state says (a
        platform's request, before a preemption); every worker answers the same."""
        return False

    def set_failure_budget(self, max_failures: int) -> None:  # noqa: B027 - optional hook
        """The loop tells the coordinator its failure budget as it starts (elasticrun's
        coordinator passes it to the launcher, which replaces up to that many workers)."""

    @abc.abstractmethod
    def should_rendezvous(self, state: State) -> bool:
        """Whether the group must re-form before the next step (every worker answers the same
        at the same step)."""

    @abc.abstractmethod
    def should_stop_training(self) -> bool:
        """Whether training is over (for this worker)."""

    @abc.abstractmethod
    def signal_training_done(self) -> None:
        """This worker ran out of data: training is over."""

    def monitor_progress(self, state: State, worker_stats: WorkerStats | None) -> None:  # noqa: B027
        """Called after each step with what train_step returned beside the state."""

    def report_progress(self, state: State) -> None:  # noqa: B027
        """Called after each step (the classic hook for progress reports)."""

    def on_error(self, e: BaseException) -> None:  # noqa: B027
        """Called with the exception of a failed step, before the loop rolls back."""

    def expected_failure(self, e: BaseException) -> bool:
        """Whether a failed step is the group re-forming as planned (this rank learned of the
        planned step late, and its collective failed when the others left): it is rolled back
        but not counted against the loop's failure budget."""
        return False
