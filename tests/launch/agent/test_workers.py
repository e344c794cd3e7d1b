"""The worker group, with a fake spawner and a fake watchdog: starting all, stopping all,
replacing one worker while the others run, and what each worker is given."""

from __future__ import annotations

import signal

import pytest
from elastic_launch.agent.context import NodeContext
from elastic_launch.agent.decide import Happening
from elastic_launch.agent.watch import Heartbeats, Monitors
from elastic_launch.agent.workers import SpawnError, WorkerGroup
from elastic_launch.api import LaunchConfig, Std, WorkerState
from elastic_launch.cancel import CancelToken
from elastic_launch.processes.entrypoint import Entrypoint, Kind
from elastic_launch.processes.logs import LogLayout
from elastic_launch.rendezvous.api import RendezvousInfo
from launch_fakes import FakeSpawner, FakeWatchdog

INFO = RendezvousInfo(
    round=4,
    group_rank=1,
    group_world_size=2,
    world_size=6,
    rank_offset=3,
    master_addr="10.0.0.9",
    master_port=29511,
    restart_count=2,
)


@pytest.fixture
def parts(tmp_path, shm_path):

    watchdog = FakeWatchdog()
    spawner = FakeSpawner(watchdog)
    layout = LogLayout(str(tmp_path / "logs"), "run-1")
    with Heartbeats.create(3, lambda i: shm_path(f"hb{i}")) as heartbeats:
        yield watchdog, spawner, heartbeats, layout
    layout.close()


def group_of(parts, **config) -> WorkerGroup:
    watchdog, spawner, heartbeats, layout = parts
    config.setdefault("nproc_per_node", 3)
    config.setdefault("shutdown_timeout", 0.2)
    ep = Entrypoint(Kind.SCRIPT, "train.py", ["--rank", "${local_rank}"])
    context = NodeContext(LaunchConfig(**config), "run-1", ep, layout, host="node7")
    return WorkerGroup(context, Monitors(heartbeats, None, watchdog), spawner)


def test_start_all_gives_each_worker_torchruns_environment(parts):
    watchdog, spawner, heartbeats, _ = parts
    with group_of(parts, max_restarts=5, role="trainer") as group:
        group.start_all(INFO, attempt=7, restarts=2)
        assert [w.rank for w in group.workers] == [3, 4, 5]
        assert len(spawner.spawned) == 3 and all(p.is_watched for p in spawner.spawned)
        assert set(watchdog.watched) == {0, 1, 2}
        env = spawner.spawned[1].request.env
        assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE")} == {
            "RANK": "4",
            "LOCAL_RANK": "1",
            "GROUP_RANK": "1",
            "WORLD_SIZE": "6",
        }
        assert (env["MASTER_ADDR"], env["MASTER_PORT"]) == ("10.0.0.9", "29511")
        assert env["TORCHELASTIC_RESTART_COUNT"] == "2"
        assert env["TORCHELASTIC_MAX_RESTARTS"] == "5"
        assert env["TORCHELASTIC_RUN_ID"] == "run-1" and env["ROLE_NAME"] == "trainer"
        # one table each: what a worker does to its own file reaches no other's watch
        assert env["ELASTIC_HEARTBEAT_FILE"] == heartbeats.path(1)
        assert env["ELASTIC_HEARTBEAT_SLOT"] == "0"
        assert len({heartbeats.path(i) for i in range(3)}) == 3
        assert env["ELASTICRUN_ATTEMPT"] == "7" and env["ELASTICRUN_ROUND"] == "4"
        assert env["ELASTICRUN_SHUTDOWN_TIMEOUT"] == "0.2", "what a worker has after SIGTERM"
        assert env["TORCHELASTIC_ERROR_FILE"].endswith("attempt_7/1/error.json")
        assert spawner.spawned[1].request.argv == ["--", "train.py", "--rank", "1"]


def test_replace_one_worker_while_the_others_keep_running(parts):
    watchdog, spawner, _, _ = parts
    with group_of(parts) as group:
        group.start_all(INFO, attempt=0, restarts=0)
        first = {w.local_rank: w for w in group.workers}
        old = spawner.spawned[1]
        new = group.replace(1)
        assert old.group_signals[0] == signal.SIGTERM, "the old one is stopped first"
        assert group.get(1) is new and new.generation == 1 and new.rank == first[1].rank
        assert new.pid != first[1].pid
        assert spawner.spawned[-1].request.env["ELASTICRUN_REPLACEMENT"] == "1"
        assert new.rank_dir.endswith("attempt_0/1_r1")
        for lr in (0, 2):
            assert group.get(lr) is first[lr] and not spawner.spawned[lr].group_signals
        assert watchdog.watched[1] == new.pid
        # The old worker's late events are stale: they never reach the agent.
        watchdog.exit_process(old, code=1)
        assert group.next_event(0.01) is None


def test_a_replacement_of_a_dead_worker_starts_at_once(parts):
    watchdog, spawner, _, _ = parts
    with group_of(parts) as group:
        group.start_all(INFO, attempt=0, restarts=0)
        watchdog.exit_process(spawner.spawned[2], signal=signal.SIGKILL)
        event = group.next_event(1.0)
        assert event is not None and event.happening == Happening.FAILED
        assert event.worker.state == WorkerState.FAILED and event.worker.signal == signal.SIGKILL
        replacement = group.replace(2)
        assert replacement.state == WorkerState.RUNNING
        assert set(spawner.spawned[2].group_signals) == {signal.SIGKILL}, "only its leftovers"


def test_stop_all_signals_then_kills_after_the_grace_period(parts):
    _watchdog, spawner, _, _ = parts
    with group_of(parts) as group:
        group.start_all(INFO, attempt=0, restarts=0)
        stubborn = spawner.spawned[0]
        stubborn.exits_on = {signal.SIGKILL}  # ignores SIGTERM
        stopped = group.stop_all(signal.SIGTERM, grace=0.2)
        assert {w.local_rank for w in stopped.stopped} == {0, 1, 2}
        assert stopped.ended == []
        # SIGCONT after SIGTERM: a stopped worker acts on it too
        assert stubborn.group_signals[:3] == [signal.SIGTERM, signal.SIGCONT, signal.SIGKILL]
        assert spawner.spawned[1].group_signals[0] == signal.SIGTERM
        assert all(w.state == WorkerState.STOPPED and w.exited for w in group.workers)


def test_a_forced_cancellation_skips_the_grace_period(parts):
    _, spawner, _, _ = parts
    with group_of(parts) as group:
        group.start_all(INFO, attempt=0, restarts=0)
        for p in spawner.spawned:
            p.exits_on = {signal.SIGKILL}
        token = CancelToken()
        token.cancel(2)
        token.cancel(2)  # a second Ctrl-C
        import time

        t0 = time.monotonic()
        group.stop_all(signal.SIGINT, grace=30.0, cancel=token)
        assert time.monotonic() - t0 < 5.0
        assert all(p.group_signals[-1] == signal.SIGKILL for p in spawner.spawned)


def test_a_hung_worker_stays_failed_when_stopped(parts):
    watchdog, spawner, _, _ = parts
    with group_of(parts) as group:
        group.start_all(INFO, attempt=0, restarts=0)
        watchdog.hang(spawner.spawned[1])
        event = group.next_event(1.0)
        assert event is not None and event.happening == Happening.HUNG
        group.mark_failed(event.worker)
        stopped = group.stop_all(signal.SIGTERM, grace=0.2)
        assert {w.local_rank for w in stopped.stopped} == {0, 2}
        assert group.get(1).state == WorkerState.FAILED


def test_a_worker_that_ended_on_its_own_before_the_stop_keeps_its_own_status(parts):
    watchdog, spawner, _, _ = parts
    with group_of(parts) as group:
        group.start_all(INFO, attempt=0, restarts=0)
        watchdog.exit_process(spawner.spawned[2], code=7)  # queued: nobody polled it yet
        stopped = group.stop_all(signal.SIGTERM, grace=0.2)
        assert {w.local_rank for w in stopped.stopped} == {0, 1}
        assert [w.local_rank for w in stopped.ended] == [2], "it failed on its own"
        own = group.get(2)
        assert own.state == WorkerState.FAILED and own.exit_code == 7


def test_a_spawn_failure_names_the_local_rank(parts):
    _watchdog, spawner, _, _ = parts
    spawner.fail_ranks = {1}
    with group_of(parts) as group:
        with pytest.raises(SpawnError, match="No such file") as info:
            group.start_all(INFO, attempt=0, restarts=0)
        assert info.value.local_rank == 1
        assert [w.local_rank for w in group.alive()] == [0], "the caller stops those started"
    assert set(spawner.spawned[0].group_signals) == {signal.SIGKILL}, "close() ends the rest"


def test_hang_timeouts_reach_every_live_worker(parts):
    watchdog, _, _, _ = parts
    with group_of(parts) as group:
        group.start_all(INFO, attempt=0, restarts=0)
        group.set_hang_timeout(12.5)
        assert watchdog.timeouts == {0: 12.5, 1: 12.5, 2: 12.5}


def test_logs_follow_redirects_and_virtual_local_rank(parts, monkeypatch):
    _, spawner, _, _layout = parts
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    with group_of(parts, redirects={1: Std.ALL}, virtual_local_rank=True) as group:
        group.start_all(INFO, attempt=3, restarts=0)
        w = group.get(1)
        assert w.stdout_log and w.stdout_log.endswith("attempt_3/1/stdout.log")
        assert group.get(0).stdout_log is None
        request = spawner.spawned[1].request
        assert request.stdout >= 0 and request.stderr >= 0, "file descriptors of the logs"
        assert request.env["CUDA_VISIBLE_DEVICES"] == "5" and request.env["LOCAL_RANK"] == "0"


def test_function_return_values_by_global_rank(parts, tmp_path):
    watchdog, spawner, heartbeats, layout = parts
    ep = Entrypoint(Kind.FUNCTION, print, fn_args=(1,))
    context = NodeContext(LaunchConfig(nproc_per_node=2), "r", ep, layout)
    group = WorkerGroup(context, Monitors(heartbeats, None, watchdog), spawner)
    with group:
        group.start_all(INFO, attempt=0, restarts=0)
        request = spawner.spawned[0].request
        assert request.call is not None and request.call[0] is print
        assert request.argv[0] == "--function"
        import pickle

        with open(group.get(0).result_file, "wb") as f:
            pickle.dump("zero", f)
        assert group.return_values() == {3: "zero", 4: None}


def test_hot_spares_take_the_slots_beyond_the_workers_and_never_hold_up_readiness(parts):
    """Two workers and one hot spare in three heartbeat slots: the spare has no rank, starts
    once, and a spare that waits for a round is not a worker the group waits to beat."""
    import elastic_core

    watchdog, spawner, heartbeats, _ = parts
    with group_of(parts, nproc_per_node=2, hot_spares=1) as group:
        group.start_all(INFO, attempt=0, restarts=0)
        spares = group.fill(1)
        assert [w.local_rank for w in spares] == [2] and group.fill(1) == []
        assert [w.rank for w in group.workers] == [3, 4, -1]
        env = spawner.spawned[2].request.env
        assert (env["RANK"], env["ROLE_RANK"], env["ELASTICRUN_HOT_SPARE"]) == ("-1", "-1", "1")
        assert set(watchdog.watched) == {0, 1, 2}
        for w, said in zip(group.workers, ("running", "running", "waiting"), strict=True):
            with open(w.loop_file, "w") as f:
                f.write(said)
        for local_rank in (0, 1):
            elastic_core.Heartbeat.attach(heartbeats.path(local_rank), 0).beat()
        assert group.all_beating(), "the waiting spare is not waited for"
        assert group.hot_spares() == [group.get(2)]
        group.follow(INFO)
        assert group.get(2).rank == -1, "a new round of the nodes gives a spare no rank"


def test_a_heartbeat_file_a_worker_made_a_directory_moves_to_a_new_path(tmp_path, shm_path):
    """The table cannot be made again over a directory: the next worker gets a new path, and
    the launcher goes on (it died here with StateError)."""
    import os

    told: list[str] = []
    with Heartbeats.create(2, lambda i: shm_path(f"moved{i}-{len(told)}"), told.append) as hb:
        old = hb.path(1)
        os.unlink(old)
        os.mkdir(old)  # what the worker left
        try:
            hb.reset()
            assert hb.path(1) != old and hb.read(1) is not None and hb.path(0) == told[0]
            assert told[-1] == hb.path(1), "the new path is told, for the guardian to remove"
        finally:
            os.rmdir(old)
