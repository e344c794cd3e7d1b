"""The classic train loop against a fake coordinator: rollback, re-forming, stopping, budgets
and the user's methods that fail (no processes, no store)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from elastic_launch.train_loop import (
    Coordinator,
    NonRetryableException,
    SimpleWorkerStats,
    State,
    StopException,
    UserMethodError,
    WorkerStats,
    train,
)


class FakeCoordinator(Coordinator):
    """Records what the loop asked; `reform_after` steps (in this group) ask for a re-form."""

    def __init__(self, reform_after: int | None = None, world_size: int = 2) -> None:
        self.calls: list[str] = []
        self.rounds = 0
        self.reform_after = reform_after
        self.steps_in_group = 0
        self.world_size = world_size
        self.done = False
        self.errors: list[BaseException] = []
        self.stats: list[WorkerStats | None] = []

    def rendezvous_barrier(self):
        self.rounds += 1
        self.steps_in_group = 0
        self.calls.append("rendezvous")
        return None, 0, self.world_size

    def barrier(self) -> None:
        self.calls.append("barrier")

    def should_rendezvous(self, state: State) -> bool:
        return self.reform_after is not None and self.steps_in_group >= self.reform_after

    def should_stop_training(self) -> bool:
        return self.done

    def signal_training_done(self) -> None:
        self.calls.append("done")
        self.done = True

    def monitor_progress(self, state: State, worker_stats: WorkerStats | None) -> None:
        self.steps_in_group += 1
        self.stats.append(worker_stats)

    def on_error(self, e: BaseException) -> None:
        self.errors.append(e)


class Counter(State):
    """A step counter with a history: snapshots copy both."""

    def __init__(self, steps: int = 6) -> None:
        self.step = 0
        self.seen: list[int] = []
        self.steps = steps
        self.synced: list[tuple[int, int]] = []
        self.applied: list[object] = []

    def sync(self, world_size: int, rank: int) -> None:
        self.synced.append((world_size, rank))

    def capture_snapshot(self):
        return {"step": self.step, "seen": list(self.seen)}

    def apply_snapshot(self, capture_snapshot) -> None:
        self.applied.append(capture_snapshot)
        self.step = capture_snapshot["step"]
        self.seen = list(capture_snapshot["seen"])


def stepper(fail_at: dict[int, BaseException] | None = None, returns=None):
    """A train_step that advances the counter, raising fail_at[step] once at that step (after
    changing the state, as a step that dies half-way does)."""
    pending = dict(fail_at or {})

    def train_step(state: Counter):
        if state.step >= state.steps:
            raise StopIteration
        state.seen.append(state.step)
        state.step += 1
        error = pending.pop(state.step, None)
        if error is not None:
            raise error
        return returns(state) if returns is not None else state

    return train_step


def test_a_run_without_faults_steps_to_the_end_and_signals_done():
    c, s = FakeCoordinator(), Counter()
    assert train(c, stepper(), s) is s
    assert s.seen == [0, 1, 2, 3, 4, 5]
    assert c.calls == ["rendezvous", "barrier", "done"] and s.synced == [(2, 0)]


def test_a_failed_step_is_rolled_back_to_exactly_its_snapshot_and_the_group_reformed():
    c, s = FakeCoordinator(), Counter()
    error = RuntimeError("[gloo/transport/tcp/pair.cc] Connection reset by peer")
    train(c, stepper({3: error}), s)
    assert s.applied == [{"step": 2, "seen": [0, 1]}], "the state before the failed step"
    assert s.seen == [0, 1, 2, 3, 4, 5], "the failed step ran again, once"
    assert (
        c.calls == ["rendezvous", "barrier", "rendezvous", "barrier", "done"] and len(s.synced) == 2
    )
    assert c.errors == [error]


def test_a_step_that_raises_other_than_runtime_error_fails_as_the_classic_loop_did():
    c, s = FakeCoordinator(), Counter()
    error = ValueError("a bad batch")
    with pytest.raises(ValueError, match="a bad batch") as info:
        train(c, stepper({2: error}), s)
    assert info.value is error and c.errors == [error] and c.rounds == 1 and s.applied == []


def test_a_reform_asked_for_by_the_coordinator_syncs_without_rolling_back():
    c, s = FakeCoordinator(reform_after=2), Counter()
    train(c, stepper(), s)
    assert s.applied == [] and s.seen == [0, 1, 2, 3, 4, 5]
    assert c.rounds == 4 and len(s.synced) == 4  # every 2 steps, and once more to find the end


def test_stop_iteration_ends_training_cleanly():
    c, s = FakeCoordinator(), Counter(steps=2)
    assert train(c, stepper(), s) is s and c.calls == ["rendezvous", "barrier", "done"]


def test_a_stop_from_the_rendezvous_returns_the_state_and_from_a_step_is_raised():
    class Closed(FakeCoordinator):
        def rendezvous_barrier(self):
            self.done = True
            raise StopException("the job was closed")

    c, s = Closed(), Counter()
    assert train(c, stepper(), s) is s and s.seen == [] and c.errors == []

    error = StopException("stop here")

    def stop(state):
        raise error

    c, s = FakeCoordinator(), Counter()
    with pytest.raises(StopException):
        train(c, stop, s)
    assert c.errors == [error]


def test_the_default_apply_snapshot_refuses_a_snapshot_it_cannot_apply():
    class HalfDone(Counter):
        apply_snapshot = State.apply_snapshot

    c, s = FakeCoordinator(), HalfDone()
    with pytest.raises(UserMethodError, match="apply_snapshot raised NotImplementedError"):
        train(c, stepper({2: RuntimeError("Connection reset by peer")}), s)


def test_a_non_retryable_failure_ends_the_loop_at_once():
    c, s = FakeCoordinator(), Counter()
    error = NonRetryableException("out of disk")
    with pytest.raises(NonRetryableException) as info:
        train(c, stepper({2: error}), s)
    assert info.value is error and c.errors == [error] and c.rounds == 1 and s.applied == []


def test_the_failure_budget_is_enforced():
    c, s = FakeCoordinator(), Counter()

    def always(state):
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match="Exceeded max number of recoverable failures: 3"):
        train(c, always, s, max_failures=3)
    assert c.rounds == 3 and len(s.applied) == 3


@pytest.mark.parametrize("method", ["sync", "apply_snapshot", "capture_snapshot"])
def test_a_state_method_that_raises_fails_at_once_naming_it(method):
    class Broken(Counter):
        pass

    def boom(*args):
        raise KeyError("model.weight")

    setattr(Broken, method, boom)
    c, s = FakeCoordinator(), Broken()
    with pytest.raises(UserMethodError) as info:
        train(c, stepper({2: RuntimeError("Connection reset by peer")}), s)
    assert f"{method} raised KeyError: 'model.weight'" in str(info.value)
    assert c.rounds <= 2, "no retry loop"


def test_sync_failing_because_a_peer_died_is_retried():
    failures = [RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234")]

    class PeerDiesInSync(Counter):
        def sync(self, world_size, rank):
            super().sync(world_size, rank)
            if failures:
                raise failures.pop()

    c, s = FakeCoordinator(), PeerDiesInSync()
    train(c, stepper(), s)
    assert c.rounds == 2 and s.seen == [0, 1, 2, 3, 4, 5]


def test_any_runtime_error_from_sync_is_retried_as_in_0_1():
    """torchelastic 0.1 retried every RuntimeError of the round's forming (its
    test_sync_retryable_exception): a state's own RuntimeError in sync too."""
    failures = [RuntimeError("sync throws RuntimeError (retryable exception)")]

    class FailsOnce(Counter):
        def sync(self, world_size, rank):
            super().sync(world_size, rank)
            if failures:
                raise failures.pop()

    c, s = FakeCoordinator(), FailsOnce()
    train(c, stepper(), s)
    assert c.rounds == 2 and s.seen == [0, 1, 2, 3, 4, 5]


def test_the_strict_mode_fails_a_runtime_error_from_sync_at_once(monkeypatch):
    from elastic_launch.train_loop.loop import STRICT_SYNC_ENV

    monkeypatch.setenv(STRICT_SYNC_ENV, "1")

    class Buggy(Counter):
        def sync(self, world_size, rank):
            raise RuntimeError("shape mismatch in my own code")

    with pytest.raises(UserMethodError, match="sync raised RuntimeError: shape mismatch"):
        train(FakeCoordinator(), stepper(), Buggy())


@pytest.mark.parametrize("where", ["elastic_launch.train_loop.loop", "elastic_launch.train_loop"])
def test_max_failures_set_on_the_module_or_the_package_takes_effect(monkeypatch, where):
    """torchelastic 0.1's test_process_max_retryable_failures patches MAX_FAILURES."""
    monkeypatch.setattr(f"{where}.MAX_FAILURES", 2)
    c, s = FakeCoordinator(), Counter(steps=50)

    def always(state):
        raise RuntimeError("Connection reset by peer")

    with pytest.raises(RuntimeError, match="Exceeded max number of recoverable failures: 2"):
        train(c, always, s)
    assert c.rounds == 2


def test_a_coordinator_written_for_0_1_needs_no_barrier_and_may_ask_for_checkpoints(tmp_path):
    """0.1's Coordinator had no barrier() and had should_save_checkpoint()."""
    from elastic_launch.train_loop import FileSystemCheckpointManager, set_checkpoint_manager

    class Classic(Coordinator):
        done = False

        def rendezvous_barrier(self):
            return None, 0, 1

        def should_rendezvous(self, state):
            return False

        def should_stop_training(self):
            return self.done

        def signal_training_done(self):
            self.done = True

        def should_save_checkpoint(self):
            return True  # a platform asked for one (a preemption)

    manager = FileSystemCheckpointManager(tmp_path)
    set_checkpoint_manager(manager)
    try:
        train(Classic(), stepper(), Counter(steps=3))
    finally:
        set_checkpoint_manager(None)
    assert len(manager.list_checkpoints()) == 3, "one after every step"


@pytest.mark.parametrize("bad", [42, "state", (1, 2), [None]])
def test_a_train_step_returning_what_the_loop_cannot_use_fails_naming_the_value(bad):
    c, s = FakeCoordinator(), Counter()
    with pytest.raises(UserMethodError, match="train_step returned") as info:
        train(c, stepper(returns=lambda state: bad), s)
    assert repr(bad) in str(info.value) and c.rounds == 1


def test_train_step_may_return_the_state_with_worker_stats_or_nothing():
    stats = SimpleWorkerStats(12.5)
    c, s = FakeCoordinator(), Counter(steps=2)
    train(c, stepper(returns=lambda state: (state, stats)), s)
    assert c.stats == [stats, stats] and stats.get_progress_rate() == 12.5
    c, s = FakeCoordinator(), Counter(steps=2)
    train(c, stepper(returns=lambda state: None), s)
    assert s.seen == [0, 1]


def test_train_needs_a_state():
    with pytest.raises(TypeError, match=r"needs an elastic_launch\.train_loop\.State, got dict"):
        train(FakeCoordinator(), stepper(), {})  # type: ignore[arg-type]


def test_the_default_save_and_load_go_through_the_snapshot():
    s = Counter()
    s.step, s.seen = 3, [0, 1, 2]
    buffer = io.BytesIO()
    s.save(buffer)
    buffer.seek(0)
    t = Counter()
    t.load(buffer)
    assert (t.step, t.seen) == (3, [0, 1, 2])
    assert State().capture_snapshot() is None and State().should_save_checkpoint(0) is False
    State().apply_snapshot(None)  # no rollback: nothing to do


def test_the_classic_names_are_exported_from_elastic_launch():
    import elastic_launch
    from elastic_launch import train_loop

    for name in (
        "State",
        "train",
        "Coordinator",
        "CoordinatorP2P",
        "SimpleWorkerStats",
        "StopException",
        "NonRetryableException",
        "UserMethodError",
    ):
        assert getattr(elastic_launch, name) is getattr(train_loop, name)
        assert name in elastic_launch.__all__


# ---- checkpoints and metrics ----------------------------------------------------------------


class Saved(Counter):
    """Checkpoints every `every` steps; `save` may be made to fail."""

    def __init__(self, steps: int = 6, every: int = 2) -> None:
        super().__init__(steps)
        self.every = every
        self.save_fails = False

    def should_save_checkpoint(self, rank: int) -> bool:
        return self.step % self.every == 0

    def save(self, stream) -> None:
        if self.save_fails:
            raise OSError("disk full")
        super().save(stream)


@pytest.fixture
def checkpoints(tmp_path):
    from elastic_launch.train_loop import FileSystemCheckpointManager, set_checkpoint_manager

    manager = FileSystemCheckpointManager(tmp_path / "ck")
    set_checkpoint_manager(manager)
    yield manager
    set_checkpoint_manager(None)


def saved(manager) -> list[int]:
    """The committed checkpoints' numbers, oldest first."""
    return sorted(c.sequence_id for c in manager.list_checkpoints())


def test_rank_zero_saves_when_the_state_asks_and_a_new_run_resumes_from_it(checkpoints):
    c, s = FakeCoordinator(), Saved(steps=5)
    train(c, stepper(), s)
    assert saved(checkpoints) == [0, 1], "after steps 2 and 4"
    assert c.calls.count("barrier") == 1 + 2, "the first sync, then one per checkpoint"
    resumed = Saved(steps=7)
    train(FakeCoordinator(), stepper(), resumed)
    assert resumed.seen == [0, 1, 2, 3, 4, 5, 6], "it went on from the checkpoint of step 4"
    assert resumed.applied[0] == {"step": 4, "seen": [0, 1, 2, 3]}


def test_only_rank_zero_writes_and_every_rank_meets_at_the_barrier(checkpoints):
    class Rank1(FakeCoordinator):
        def rendezvous_barrier(self):
            super().rendezvous_barrier()
            return None, 1, 2

    c = Rank1()
    train(c, stepper(), Saved(steps=4))
    assert saved(checkpoints) == [] and c.calls.count("barrier") == 1 + 2


def test_a_worker_waiting_for_a_round_neither_trains_nor_touches_checkpoints(checkpoints):
    """A hot spare waits in rendezvous_barrier: no step, sync, checkpoint read or write
    happens before a round takes it (and then as rank 0 it loads and saves)."""
    import threading

    admitted, waiting = threading.Event(), threading.Event()

    class Spare(FakeCoordinator):
        def rendezvous_barrier(self):
            waiting.set()
            assert admitted.wait(10), "never admitted"
            return super().rendezvous_barrier()

    train(FakeCoordinator(), stepper(), Saved(steps=2))  # an earlier run left checkpoint 0
    c, s = Spare(), Saved(steps=4)
    steps = stepper()
    opened: list[str] = []
    for name in ("get_latest_checkpoint", "create_checkpoint", "list_checkpoints"):
        real = getattr(checkpoints, name)
        setattr(checkpoints, name, lambda *a, _n=name, _r=real: opened.append(_n) or _r(*a))
    runner = threading.Thread(target=train, args=(c, steps, s), daemon=True)
    runner.start()
    assert waiting.wait(10)
    assert (s.seen, s.synced, s.applied, opened) == ([], [], [], []), "nothing before a round"
    assert saved(checkpoints) == [0]
    admitted.set()
    runner.join(10)
    assert not runner.is_alive() and s.applied[0] == {"step": 2, "seen": [0, 1]}, "loaded"
    assert s.seen == [0, 1, 2, 3], "then trained on from it"
    assert "get_latest_checkpoint" in opened and saved(checkpoints) == [0, 1]


def test_a_save_that_fails_fails_at_once_and_keeps_the_last_checkpoint(checkpoints):
    c, s = FakeCoordinator(), Saved(steps=6)

    def step(state):
        state.save_fails = state.step >= 3
        return stepper()(state)

    with pytest.raises(UserMethodError, match=r"state\.save raised OSError: disk full"):
        train(c, step, s)
    assert saved(checkpoints) == [0]
    assert checkpoints.get_latest_checkpoint().sequence_id == 0
    assert not any(p.name.endswith(".partial") for p in Path(checkpoints.checkpoint_dir).iterdir())


def test_the_loop_publishes_its_metrics_with_the_classic_names():
    from elastic_launch.train_loop import metrics

    kept = metrics.ListMetricHandler()
    metrics.configure(kept)
    try:
        c, s = FakeCoordinator(), Counter(steps=3)
        train(c, stepper({2: RuntimeError("Connection reset by peer")}), s)
    finally:
        metrics.configure(metrics.NullMetricHandler())
    names = [m.name for m in kept.values]
    assert {m.group_name for m in kept.values} == {"torchelastic"}
    assert names.count("train_step.duration.ms") == 3
    assert names.count("rollbacks") == 1 and "rollback.duration.ms" in names
    assert names.count("rendezvous.duration.ms") == 2 and names.count("state_sync.duration.ms") == 2
    assert "inner_train_loop.duration.ms" in names and "outer_train_loop.duration.ms" in names


def test_the_loop_adds_its_rounds_and_rollbacks_to_the_events_file(tmp_path, monkeypatch):
    import json

    path = tmp_path / "events.jsonl"
    monkeypatch.setenv("ELASTICRUN_EVENTS_FILE", str(path))
    train(FakeCoordinator(), stepper({2: RuntimeError("Connection reset by peer")}), Counter(3))
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in events] == [
        "train_loop_round",
        "train_loop_rollback",
        "train_loop_round",
    ]
    assert events[0]["world_size"] == 2 and events[1]["failures"] == 1
