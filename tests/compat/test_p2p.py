"""torchelastic 0.1's elastic trainer tests (v0.1.0rc1 ``test/p2p/elastic_trainer_test_base.py``
through ``etcd_elastic_trainer_test.py``) on elasticrun: plain processes, each a trainer that
builds ``CoordinatorP2P`` with 0.1's ``etcd://`` URL and runs the classic loop, as 0.1's tests
did (no launcher). Each test names the upstream test it follows (written here: no code of
torchelastic's is copied).

The trainers add up the samples 11..30 of a shared dataset, one per step, with an all_reduce
(a stand-in for synchronous SGD): whatever fails, each survivor's total must be 410, the sum
of all samples. Upstream's URL waits 5 s for late trainers (``last_call_timeout``); here 3 s.
"""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest
from peers import Group, context, result

pytestmark = pytest.mark.slow  # real trainers, real etcd

SAMPLES = range(11, 31)
TOTAL = sum(SAMPLES)  # 410
HOOKS_FROM_STEP = 3  # the hooks run at this step of the process, and after


# ---- the trainers' state (upstream's TestState, in this project's words) ------------------------


class Shard:
    """The samples a rank reads: every world_size-th from where the job is, from its rank on;
    the furthest index read by any rank (an all_reduce per sample) is where a new group goes
    on from."""

    def __init__(self) -> None:
        self.world_size, self.rank, self.start = 1, 0, 0
        self.furthest = -1
        self._it = iter(())

    def reset(self, world_size: int, rank: int, start: int) -> None:
        self.world_size, self.rank, self.start = world_size, rank, start
        self.furthest = start - 1
        self._it = iter(range(start + rank, len(SAMPLES), world_size))

    def next(self) -> int:
        import torch
        import torch.distributed as dist

        index = next(self._it)
        seen = torch.tensor([index])
        dist.all_reduce(seen, op=dist.ReduceOp.MAX)
        self.furthest = int(seen[0])
        return SAMPLES[index]


def _state_class():
    from elastic_launch.train_loop import State

    class Summing(State):
        def __init__(self) -> None:
            self.total_sum = 0
            self.nums: list[int] = []
            self.shard = Shard()
            self.rank: int | None = None
            self.sync_calls = 0
            self.fail_sync_at: int | None = None  # sync raises RuntimeError on that call
            self.rollback = True

        def sync(self, world_size: int, rank: int) -> None:
            import torch
            import torch.distributed as dist

            self.sync_calls += 1
            if self.sync_calls == self.fail_sync_at:
                raise RuntimeError("sync throws RuntimeError (retryable exception)")
            t = torch.tensor([self.shard.furthest, self.total_sum])
            dist.broadcast(t, src=0)
            self.shard.reset(world_size, rank, int(t[0]) + 1)
            self.total_sum = int(t[1])
            self.rank = dist.get_rank()

        def capture_snapshot(self):
            if not self.rollback:
                return None
            # sync_calls + 1: the sync after a rollback must not count the failed one again.
            return {
                "sum": self.total_sum,
                "furthest": self.shard.furthest,
                "sync_calls": self.sync_calls + 1,
            }

        def apply_snapshot(self, snapshot) -> None:
            # No process group here: a rollback also follows a failed init_process_group
            # (a peer that left mid-handshake); sync re-reads the shard from rank 0 next.
            if snapshot is None:
                return
            self.total_sum = snapshot["sum"]
            self.sync_calls = snapshot["sync_calls"]
            self.shard.furthest = snapshot["furthest"]

        def should_save_checkpoint(self, rank: int) -> bool:
            return True

        def save(self, stream) -> None:
            stream.write(f"{self.total_sum} {self.shard.furthest}".encode())

        def load(self, stream) -> None:
            total, furthest = stream.read().decode().split()
            self.total_sum, self.shard.furthest = int(total), int(furthest)

    return Summing


STEPS = {"n": 0}  # this process's steps, as upstream's train_step counted them


def _step(state, hooks: list[str], rates: float | None):
    import torch
    import torch.distributed as dist
    from elastic_launch.train_loop import SimpleWorkerStats

    state.rank = dist.get_rank()
    sample = state.shard.next()
    t = torch.tensor([sample])
    dist.all_reduce(t)
    state.total_sum += int(t[0])
    state.nums.append(sample)
    STEPS["n"] += 1
    if STEPS["n"] >= HOOKS_FROM_STEP:
        for hook in hooks:
            HOOKS[hook]()
    dist.barrier()  # every rank ends the step together (a rollback then redoes this step)
    return state, SimpleWorkerStats(rates)


def _retryable_once() -> None:
    if STEPS["n"] == HOOKS_FROM_STEP:
        raise RuntimeError("train_step throws RuntimeError (retryable exception)")


def _retryable_always() -> None:
    raise RuntimeError("train_step throws RuntimeError (retryable exception)")


def _non_retryable() -> None:
    raise NameError("name 'bar' is not defined")


def _crash() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _stuck() -> None:
    while True:
        pass


HOOKS = {
    "retryable_once": _retryable_once,
    "retryable_always": _retryable_always,
    "non_retryable": _non_retryable,
    "crash": _crash,
    "stuck": _stuck,
}


def trainer(url: str, max_size: int, options: dict) -> dict:
    """One trainer to the end of the data; what it saw."""
    import elastic_launch.train_loop as torchelastic
    from elastic_launch.train_loop import CoordinatorP2P

    coordinator_class = CoordinatorP2P
    if options.get("rerendezvous"):

        class Rerendezvous(CoordinatorP2P):
            def should_rendezvous(self, state):
                return True

        coordinator_class = Rerendezvous
    if options.get("checkpoints"):
        torchelastic.set_checkpoint_manager(
            torchelastic.FileSystemCheckpointManager(options["checkpoints"])
        )

        class AskedToSave(CoordinatorP2P):
            def should_save_checkpoint(self):
                return True

        coordinator_class = AskedToSave
    if "max_failures" in options:
        torchelastic.MAX_FAILURES = options["max_failures"]  # as a 0.1 script sets it
    coordinator_class.MONITOR_PROGRESS_FREQ = options.get("monitor_every", 1000)
    timeout_ms = options.get("pg_timeout_ms", 10000)
    coordinator = coordinator_class("gloo", url, str(max_size), timeout_ms)
    state = _state_class()()
    state.fail_sync_at = options.get("fail_sync_at")
    state.rollback = options.get("rollback", True)
    hooks, rate = options.get("hooks", []), options.get("rate")
    if "gate" in options:
        hooks = [*hooks, "gate"]
        HOOKS["gate"] = _gate(*options["gate"])
    final = torchelastic.train(coordinator, lambda s: _step(s, hooks, rate), state)
    return {
        "rank": final.rank,
        "nums": final.nums,
        "sum": final.total_sum,
        "relative": getattr(coordinator, "last_relative_prog_rate", None),
        "straggler": coordinator.is_worker_straggler,
    }


def _gate(arrived, resume):
    """At the hooks' first step: say so, then wait until the newcomers are on their way."""

    def hook() -> None:
        if STEPS["n"] == HOOKS_FROM_STEP:
            arrived.release()
            resume.acquire(timeout=60)
            time.sleep(3)  # their joining reaches the group by its watch, soon after

    return hook


# ---- the tests -------------------------------------------------------------------------------------


@pytest.fixture
def job(etcd_shared):
    """A URL maker for a fresh run id (upstream's get_rdzv_url), and the trainers, ended after."""
    group = Group()

    def url(
        min_size: int = 2, max_size: int = 4, run_id: str | None = None, last_call: int = 3
    ) -> str:
        rid = run_id or uuid.uuid4().hex
        return (
            f"etcd://{etcd_shared.endpoint}/{rid}?min_workers={min_size}&max_workers={max_size}"
            f"&last_call_timeout={last_call}"
        )

    yield url, group
    group.end()


def start(group: Group, url: str, n: int, **options) -> list[int]:
    return [group.start(trainer, url, 4, options) for _ in range(n)]


def test_normal_flow(job):
    """upstream: test_normal_flow"""
    url, group = job
    start(group, url(), 4)
    seen = [result(o) for o in group.outcomes().values()]
    assert [len(s["nums"]) for s in seen] == [5] * 4
    by_rank = {s["rank"]: s["nums"] for s in seen}
    assert by_rank == {r: list(range(11 + r, 31, 4)) for r in range(4)}
    assert [s["sum"] for s in seen] == [TOTAL] * 4


def test_normal_flow_with_worker_stats(job):
    """upstream: test_normal_flow_with_worker_stats: relative progress rates, a straggler"""
    url, group = job
    u = url()
    rates = [100, 95, 42, None]
    for rate in rates:
        group.start(trainer, u, 4, {"rate": rate, "monitor_every": 1})
    seen = {i: result(o) for i, o in group.outcomes().items()}
    for i, rate in enumerate(rates):
        assert len(seen[i]["nums"]) == 5
        if rate is None:
            assert seen[i]["relative"] is None, "it reported no rate"
        else:
            assert seen[i]["relative"] == pytest.approx(rate / 100, abs=1e-5)
    assert seen[2]["straggler"] and not seen[0]["straggler"]


def test_start_with_min_nodes(job):
    """upstream: test_start_with_min_nodes: 2 of at most 4"""
    url, group = job
    start(group, url(), 2)
    seen = [result(o) for o in group.outcomes().values()]
    assert {s["rank"]: s["nums"] for s in seen} == {
        0: list(range(11, 31, 2)),
        1: list(range(12, 31, 2)),
    }
    assert [s["sum"] for s in seen] == [TOTAL] * 2


def test_process_rerendezvous(job):
    """upstream: test_process_rerendezvous: a new round after every step"""
    url, group = job
    start(group, url(min_size=4), 4, rerendezvous=True)
    seen = [result(o) for o in group.outcomes().values()]
    assert [len(s["nums"]) for s in seen] == [5] * 4 and [s["sum"] for s in seen] == [TOTAL] * 4


def test_process_retryable_exception(job):
    """upstream: test_process_retryable_exception: 2 of 4 raise RuntimeError once"""
    url, group = job
    u = url(min_size=4)
    start(group, u, 2)
    start(group, u, 2, hooks=["retryable_once"])
    seen = [result(o) for o in group.outcomes().values()]
    assert [len(s["nums"]) for s in seen] == [6] * 4, "the failed step is redone"
    assert [s["sum"] for s in seen] == [TOTAL] * 4


def test_process_non_retryable_exception(job):
    """upstream: test_process_non_retryable_exception: 2 of 4 raise NameError and end; the
    other 2 finish the data"""
    url, group = job
    u = url()
    start(group, u, 2)
    start(group, u, 2, hooks=["non_retryable"])
    outcomes = group.outcomes()
    assert [result(outcomes[i])["sum"] for i in (0, 1)] == [TOTAL] * 2
    for i in (2, 3):
        kind, (name, _, _) = outcomes[i]
        assert (kind, name) == ("raised", "NameError")


def test_process_max_retryable_failures(job):
    """upstream: test_process_max_retryable_failures: MAX_FAILURES=5 set by the script"""
    url, group = job
    u = url()
    start(group, u, 2)
    start(group, u, 2, hooks=["retryable_always"], max_failures=5)
    outcomes = group.outcomes()
    for i in (0, 1):
        seen = result(outcomes[i])
        assert seen["sum"] == TOTAL and len(seen["nums"]) == 8 + 5
    for i in (2, 3):
        kind, (name, message, _) = outcomes[i]
        assert kind == "raised" and name == "TooManyFailures"
        assert "Exceeded max number of recoverable failures: 5" in message


def test_sync_retryable_exception(job):
    """upstream: test_sync_retryable_exception: sync raises RuntimeError on its 3rd call"""
    url, group = job
    # A rank that had not yet connected to a peer when that peer left the group retries the
    # connection until the group's timeout (gloo's, 10 s here) before it fails and rejoins;
    # upstream's "all 4 train 5 samples" needs the others' next round to wait for it however
    # long that takes. A last call is a duration (30 s was once too short on a loaded machine:
    # 6, 6, 6 and 2 samples): every round here waits for all four instead.
    u = url(min_size=4)
    start(group, u, 2, rerendezvous=True)
    start(group, u, 2, rerendezvous=True, fail_sync_at=3)
    seen = [result(o) for o in group.outcomes().values()]
    assert [len(s["nums"]) for s in seen] == [5] * 4 and [s["sum"] for s in seen] == [TOTAL] * 4


def test_checkpoint(job, tmp_path):
    """upstream: test_checkpoint: a checkpoint after every step; every trainer SIGKILLs itself
    at its 3rd step; a new set of trainers goes on from the last checkpoint"""
    from elastic_launch.train_loop import FileSystemCheckpointManager

    url, group = job
    folder = tmp_path / "checkpoints"
    manager = FileSystemCheckpointManager(folder)
    assert manager.list_checkpoints() == []
    run_id = uuid.uuid4().hex
    start(group, url(run_id=run_id), 4, hooks=["crash"], checkpoints=str(folder))
    group.join(60)
    assert len(manager.list_checkpoints()) == 2, "after steps 1 and 2"
    again = Group()
    try:
        # upstream reuses the run id: a job whose trainers all died is taken over
        start(again, url(run_id=run_id), 4, checkpoints=str(folder))
        seen = [result(o) for o in again.outcomes().values()]
    finally:
        again.end()
    assert [len(s["nums"]) for s in seen] == [3] * 4 and [s["sum"] for s in seen] == [TOTAL] * 4


def test_process_crash(job):
    """upstream: test_process_crash: 2 of 4 SIGKILL themselves; the other 2 finish"""
    url, group = job
    u = url()
    start(group, u, 2)
    start(group, u, 2, hooks=["crash"])
    outcomes = group.outcomes(count=2)
    assert sorted(outcomes) == [0, 1]
    assert [result(outcomes[i])["sum"] for i in (0, 1)] == [TOTAL] * 2


def test_stuck_process(job):
    """upstream: test_stuck_process: 2 of 4 spin forever; the other 2 notice after the
    process group's timeout (upstream's 10 s; 4 s here, the same behaviour) and finish"""
    url, group = job
    u = url()
    start(group, u, 2, pg_timeout_ms=4000)
    start(group, u, 2, hooks=["stuck"], pg_timeout_ms=4000)
    outcomes = group.outcomes(count=2, timeout=150)
    assert [result(outcomes[i])["sum"] for i in (0, 1)] == [TOTAL] * 2


def test_rollback_not_supported(job):
    """upstream: test_rollback_not_supported: no snapshots; 2 of 4 raise once"""
    url, group = job
    u = url()
    start(group, u, 2, rollback=False)
    start(group, u, 2, rollback=False, hooks=["retryable_once"])
    seen = [result(o) for o in group.outcomes().values()]
    assert [len(s["nums"]) for s in seen] == [5] * 4 and [s["sum"] for s in seen] == [TOTAL] * 4


def test_new_processes_join(job):
    """upstream: test_new_processes_join: 2 train 3 steps, 2 more arrive and all go on"""
    url, group = job
    u = url()
    arrived, resume = context().Semaphore(0), context().Semaphore(0)
    start(group, u, 2, gate=(arrived, resume))
    assert arrived.acquire(timeout=60) and arrived.acquire(timeout=60)
    start(group, u, 2)
    resume.release()
    resume.release()
    sums = {result(o)["sum"] for o in group.outcomes().values()}
    # With 2 samples left for 4 trainers, the end of the data may come before the last two.
    assert sums <= {351, TOTAL}
