"""The agent's loop, driven by a fake spawner, a fake watchdog and a fake rendezvous: every
way an attempt ends, and what the agent does next, in milliseconds."""

from __future__ import annotations

import re
import signal
import threading
import time
from typing import Any

import elastic_core
import pytest
from elastic_launch.agent.activity import Activity
from elastic_launch.agent.agent import ElasticAgent
from elastic_launch.agent.context import NodeContext
from elastic_launch.agent.events import AgentEvent, Events
from elastic_launch.agent.hang import HangMonitor
from elastic_launch.agent.watch import Heartbeats, Monitors
from elastic_launch.agent.workers import WorkerGroup
from elastic_launch.api import AgentState, Cancelled, FailureKind, LaunchConfig, WorkerState
from elastic_launch.cancel import CancelToken
from elastic_launch.processes.entrypoint import Entrypoint, Kind
from elastic_launch.processes.logs import LogLayout
from elastic_launch.rendezvous.api import (
    CloseReason,
    JobClosed,
    RendezvousClosedError,
    RendezvousTimeoutError,
    RestartReason,
)
from launch_fakes import FakeRendezvous, FakeSpawner, FakeWatchdog


class Recorder:
    def __init__(self) -> None:
        self.events: list[AgentEvent] = []

    def emit(self, event: AgentEvent) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass

    def names(self) -> list[str]:
        return [e.name for e in self.events]

    def states(self) -> list[str]:
        return [e.data["state"] for e in self.events if e.name == "state_changed"]


class Node:
    """One agent with its doubles; `play` runs it on a thread so the test can act."""

    def __init__(
        self, tmp_path, shm_path, rdzv: FakeRendezvous | None = None, hangs=None, **config
    ) -> None:

        config.setdefault("nproc_per_node", 2)
        config.setdefault("shutdown_timeout", 0.2)
        config.setdefault("monitor_interval", 0.01)
        self.config = LaunchConfig(**config)
        self.watchdog = FakeWatchdog()
        self.spawner = FakeSpawner(self.watchdog)
        slots = self.config.nproc_per_node + self.config.hot_spares
        self._heartbeats = Heartbeats.create(slots, lambda i: shm_path(f"agent{i}"))
        self.heartbeats = self._heartbeats.__enter__()
        self.layout = LogLayout(str(tmp_path / "logs"), "run")
        context = NodeContext(
            self.config, "run", Entrypoint(Kind.SCRIPT, "train.py"), self.layout, host="node0"
        )
        self.group = WorkerGroup(
            context, Monitors(self.heartbeats, None, self.watchdog), self.spawner
        )
        self.rdzv = rdzv or FakeRendezvous(max_restarts=self.config.max_restarts)
        self.recorder = Recorder()
        self.cancel = CancelToken()
        self.agent = ElasticAgent(
            self.group, self.rdzv, Events("run", [self.recorder]), cancel=self.cancel, hangs=hangs
        )
        self.result = None
        self.error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def play(self) -> Node:
        def body() -> None:
            try:
                self.result = self.agent.run()
            except BaseException as e:
                self.error = e

        self._thread = threading.Thread(target=body, daemon=True)
        self._thread.start()
        return self

    def finish(self, timeout: float = 10.0):
        assert self._thread is not None
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"the agent is stuck in {self.agent.state}"
        return self.result

    def wait_for(self, what, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            assert time.monotonic() < deadline, f"stuck in {self.agent.state}"
            time.sleep(0.005)

    def running(self, attempt: int = 0) -> list:
        """The processes of `attempt`, once it runs."""
        k = self.config.nproc_per_node
        self.wait_for(
            lambda: (
                self.agent.state == AgentState.RUNNING
                and self.agent.attempt == attempt
                and len(self.spawner.spawned) >= (attempt + 1) * k
            )
        )
        return self.spawner.spawned[attempt * k : (attempt + 1) * k]

    def close(self) -> None:
        self.group.close()
        self._heartbeats.__exit__(None, None, None)
        self.layout.close()


@pytest.fixture
def node(tmp_path, shm_path):
    made: list[Node] = []

    def make(**kw) -> Node:
        n = Node(tmp_path, shm_path, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.cancel.cancel()
        n.close()


def test_success_walks_through_the_states_and_closes_the_job(node):
    n = node().play()
    for p in n.running():
        n.watchdog.exit_process(p, code=0)
    result = n.finish()
    assert result.state == AgentState.SUCCEEDED and result.attempts == 1
    assert n.recorder.states() == ["rendezvous", "starting", "running", "succeeded"]
    assert n.recorder.names()[-1] == "job_succeeded"
    assert n.rdzv.done == 1 and n.rdzv.calls == [(RestartReason.START, "")]


def test_a_failure_restarts_the_group_and_spends_one_restart(node):
    n = node(max_restarts=2).play()
    first = n.running()
    n.watchdog.exit_process(first[1], code=3)
    second = n.running(1)
    assert first[0].group_signals[0] == signal.SIGTERM, "the survivor is stopped"
    assert n.rdzv.calls[1] == (RestartReason.FAILURE, "rank 1 exit code 3")
    for p in second:
        n.watchdog.exit_process(p, code=0)
    result = n.finish()
    assert result.state == AgentState.SUCCEEDED and result.restarts == 1
    assert "restarting" in n.recorder.states()
    restarted = [e for e in n.recorder.events if e.name == "group_restarted"]
    assert restarted and restarted[0].data["reason"] == "failure"


def test_the_failure_past_the_budget_fails_the_job_with_its_root_cause(node):
    n = node(max_restarts=0).play()
    first = n.running()
    n.watchdog.exit_process(first[0], signal=signal.SIGSEGV)
    result = n.finish()
    assert result.state == AgentState.FAILED
    assert (
        result.message
        == "the job failed: restarts exhausted (0); rank 0 killed by SIGSEGV (signal 11)"
    )
    assert result.root_cause.kind == FailureKind.SIGNAL
    kinds = {f.local_rank: f.kind for f in result.failures}
    assert kinds == {0: FailureKind.SIGNAL, 1: FailureKind.STOPPED}
    assert n.recorder.states()[-1] == "failed" and n.agent.health()["healthy"] is False


def test_a_hang_is_a_failure_with_the_workers_stack(node):
    n = node(max_restarts=0, stack_dump_timeout=0.2).play()
    first = n.running()
    n.watchdog.hang(first[1])
    result = n.finish()
    root = result.root_cause
    assert root.kind == FailureKind.HUNG and root.local_rank == 1
    assert root.stack == "(no Python stack: the worker did not answer)"
    assert 12 in first[1].signals, "SIGUSR2 asks the worker for its stack"
    assert "raise it with --hang-timeout" in root.detail, "the report says what to change"


def test_the_summary_labels_each_rank_truthfully(node):
    n = node(max_restarts=0).play()
    first = n.running()
    n.watchdog.exit_process(first[0], code=1)  # the root cause
    n.watchdog.exit_process(first[1], signal=6)  # failed on its own, before the stop
    result = n.finish()
    by_rank = {f.local_rank: f for f in result.failures}
    assert result.root_cause.local_rank == 0
    assert by_rank[1].kind == FailureKind.SIGNAL and by_rank[1].signal == 6
    failed = [e.data["local_rank"] for e in n.recorder.events if e.name == "worker_failed"]
    assert sorted(failed) == [0, 1], "recorded as any failure is: with its event"


def test_under_auto_a_quiet_node_is_hung_and_the_report_gives_the_evidence(node):
    quiet = Activity(cpu_seconds=1.0, io_bytes=10, processes=1, stopped=False, io_wait=False)
    hangs = HangMonitor(
        None, floor=0.3, factor=10.0, sampler=lambda pids: dict.fromkeys(pids, quiet)
    )
    n = node(max_restarts=0, stack_dump_timeout=0.2, hang_timeout=None, hangs=hangs).play()
    n.running()
    beats = [elastic_core.Heartbeat.attach(n.heartbeats.path(i), 0) for i in (0, 1)]
    for b in beats:
        b.beat()
    root = n.finish().root_cause
    assert root.kind == FailureKind.HUNG
    assert "no progress for" in root.detail and "0.00 s of CPU time" in root.detail
    assert "--hang-timeout-floor 0.3 s" in root.detail
    assert n.watchdog.timeouts == {}, "under auto the watchdog does not judge heartbeats"


def test_a_gpu_fault_is_a_failure(node):
    n = node(max_restarts=0).play()
    n.watchdog.gpu_fault(n.running()[0])
    assert n.finish().root_cause.kind == FailureKind.GPU


def test_a_membership_change_restarts_without_spending_the_budget(node):
    n = node(max_restarts=0).play()
    n.running()
    n.rdzv.changed = True
    second = n.running(1)
    assert n.rdzv.calls[1] == (RestartReason.MEMBERSHIP, "")
    for p in second:
        n.watchdog.exit_process(p, code=0)
    assert n.finish().state == AgentState.SUCCEEDED


def test_a_failure_caused_by_a_lost_node_is_a_membership_change(node):
    n = node(rdzv=FakeRendezvous(nodes=2, max_restarts=0)).play()
    first = n.running()
    n.rdzv.lost = ["node1-123"]
    n.watchdog.exit_process(first[0], code=1)  # its collective failed: the peer is gone
    second = n.running(1)
    assert n.rdzv.calls[1] == (RestartReason.MEMBERSHIP, ""), "no restart was spent"
    for p in second:
        n.watchdog.exit_process(p, code=0)
    assert n.finish().state == AgentState.SUCCEEDED


def test_a_signal_while_running_stops_the_workers_with_it(node):
    n = node().play()
    first = n.running()
    n.cancel.cancel(signal.SIGINT)
    result = n.finish()
    assert result.state == AgentState.STOPPED and result.signal == signal.SIGINT
    assert all(p.group_signals[0] == signal.SIGINT for p in first)
    assert n.recorder.states()[-2:] == ["stopping", "stopped"]


def test_a_signal_during_the_rendezvous_ends_it_at_once(node):
    n = node(rdzv=FakeRendezvous(block_until_cancelled=True)).play()
    n.wait_for(lambda: n.agent.state == AgentState.RENDEZVOUS)
    t0 = time.monotonic()
    n.cancel.cancel(signal.SIGTERM)
    result = n.finish()
    assert time.monotonic() - t0 < 1.0
    assert result.state == AgentState.STOPPED and result.signal == signal.SIGTERM
    assert n.spawner.spawned == [], "no worker was started"


def test_a_worker_that_cannot_start_is_a_failure(node):
    n = node(max_restarts=0)
    n.spawner.fail_ranks = {1}
    result = n.play().finish()
    assert result.state == AgentState.FAILED
    assert result.root_cause.kind == FailureKind.SPAWN and result.root_cause.local_rank == 1
    assert "No such file" in result.root_cause.detail
    assert n.spawner.spawned[0].group_signals, "the worker that did start was stopped"


def test_a_job_closed_by_another_node(node):
    closed = JobClosed(CloseReason.SUCCEEDED)
    n = node(rdzv=FakeRendezvous(raise_next=[RendezvousClosedError("over", closed)]))
    assert n.play().finish().state == AgentState.SUCCEEDED
    failed = JobClosed(CloseReason.FAILED, "restarts exhausted (3); rank 9 exit code 1")
    n = node(rdzv=FakeRendezvous(raise_next=[RendezvousClosedError("over", failed)]))
    result = n.play().finish()
    assert result.state == AgentState.FAILED and "rank 9 exit code 1" in result.message


def test_a_signal_that_abandoned_a_handler_stops_the_agent_with_its_number(node):
    # A handler of torch's takes no token: the signal raised Cancelled in it at once, and the
    # relay thread cancels the token a moment later.
    class Relay(FakeRendezvous):
        def next_rendezvous(self, *args, **kw):
            threading.Thread(target=n.cancel.cancel, args=(signal.SIGTERM,)).start()
            raise Cancelled(signal.SIGTERM)

    n = node(rdzv=Relay())
    result = n.play().finish()
    assert result.state == AgentState.STOPPED and result.signal == signal.SIGTERM
    assert not n.cancel.forced, "one signal, not two"


def test_a_rendezvous_error_fails_the_agent_and_goes_up(node):
    n = node(rdzv=FakeRendezvous(raise_next=[RendezvousTimeoutError("nobody came")]))
    n.play().finish()
    assert isinstance(n.error, RendezvousTimeoutError)
    assert n.agent.state == AgentState.FAILED


def test_health_names_the_state_and_the_workers(node):
    n = node(hang_timeout=7.0).play()
    n.running()
    n.wait_for(lambda: n.agent.health()["hang_timeout"] == 7.0)
    h = n.agent.health()
    assert (h["state"], h["healthy"], h["attempt"], h["run_id"]) == ("running", True, 0, "run")
    assert [w["state"] for w in h["workers"]] == [WorkerState.RUNNING.value] * 2
    assert n.watchdog.timeouts == {0: 7.0, 1: 7.0}
    n.cancel.cancel(signal.SIGTERM)
    n.finish()
    assert n.agent.health()["state"] == "stopped" and not n.agent.health()["healthy"]


# ---- workers that run the train loop: one dies, one is replaced ----------------------------


def _in_loop(p, what: str = "running") -> None:
    """What the worker's coordinator writes when it runs the train loop (team.LOOP_FILE_ENV)."""
    with open(p.request.env["ELASTICRUN_LOOP_FILE"], "w") as f:
        f.write(what)


def test_a_dead_train_loop_worker_is_replaced_alone(node):
    n = node(max_restarts=2).play()
    first = n.running()
    for p in first:
        _in_loop(p)
    n.watchdog.exit_process(first[1], signal=signal.SIGKILL)
    n.wait_for(lambda: len(n.spawner.spawned) == 3)
    replacement = n.spawner.spawned[2]
    assert replacement.request.local_rank == 1
    assert replacement.request.env["ELASTICRUN_REPLACEMENT"] == "1"
    assert "ELASTICRUN_HOT_SPARE" not in replacement.request.env, "no spare: it trains"
    assert first[0].group_signals == [] and first[0].signals == [], "the survivor is untouched"
    assert n.rdzv.calls == [(RestartReason.START, "")], "no new round of the nodes"
    replaced = [e for e in n.recorder.events if e.name == "worker_replaced"]
    assert replaced and replaced[0].data["local_rank"] == 1 and replaced[0].data["restarts"] == 1
    for p in (first[0], replacement):
        n.watchdog.exit_process(p, code=0)
    result = n.finish()
    assert result.state == AgentState.SUCCEEDED and result.restarts == 1 and result.attempts == 1
    assert [f.kind for f in result.failures] == [FailureKind.SIGNAL]


def test_a_hung_train_loop_worker_is_killed_and_replaced_alone(node):
    n = node(max_restarts=1).play()
    first = n.running()
    for p in first:
        _in_loop(p)
    n.watchdog.hang(first[0])
    n.wait_for(lambda: len(n.spawner.spawned) == 3)
    assert first[0].group_signals, "the hung worker is stopped"
    assert not first[1].group_signals, "its peer is not"
    for p in (first[1], n.spawner.spawned[2]):
        n.watchdog.exit_process(p, code=0)
    assert n.finish().state == AgentState.SUCCEEDED


def test_replacements_spend_the_restart_budget_then_the_job_fails(node):
    n = node(max_restarts=1).play()
    first = n.running()
    for p in first:
        _in_loop(p)
    n.watchdog.exit_process(first[0], code=1)
    n.wait_for(lambda: len(n.spawner.spawned) == 3)
    _in_loop(n.spawner.spawned[2])
    n.watchdog.exit_process(n.spawner.spawned[2], code=1)
    result = n.finish()
    assert result.state == AgentState.FAILED
    assert "restarts exhausted (1)" in result.message
    assert n.rdzv.closed().reason == CloseReason.FAILED
    assert first[1].group_signals[0] == signal.SIGTERM, "the rest is stopped at the end"


def test_group_restarts_and_replacements_spend_one_count_and_never_more(node, caplog):
    """A worker that fails before it runs the loop restarts the group (one restart), a loop
    worker's death replaces it alone (the second), and the next failure finds none left: the
    job has started 2 + 2 + 1 workers, and no log says "restart N of M" with N > M."""
    n = node(max_restarts=2).play()
    with caplog.at_level("WARNING"):
        first = n.running()
        n.watchdog.exit_process(first[0], code=1)  # not in the loop yet: the group restarts
        second = n.running(1)
        for p in second:
            _in_loop(p)
        n.watchdog.exit_process(second[1], signal=signal.SIGKILL)  # replaced alone
        n.wait_for(lambda: len(n.spawner.spawned) == 5)
        _in_loop(n.spawner.spawned[4])
        n.watchdog.exit_process(second[0], code=1)  # a third failure: none left
        result = n.finish()
    assert result.state == AgentState.FAILED and "restarts exhausted (2)" in result.message
    assert n.rdzv.restarts == 2 and result.restarts == 2
    assert len(n.spawner.spawned) == 5, "2 starts, 2 after the group restart, 1 replacement"
    for said in re.findall(r"restart (\d+) of (\d+)", caplog.text):
        assert int(said[0]) <= int(said[1]), caplog.text


def test_restarts_another_node_spent_are_the_ones_this_node_has_left(node):
    """The count is the job's: a replacement finds the budget spent by others."""
    n = node(max_restarts=1).play()
    first = n.running()
    for p in first:
        _in_loop(p)
    n.rdzv.restarts = 1  # another node replaced one of its workers
    n.watchdog.exit_process(first[1], code=1)
    result = n.finish()
    assert result.state == AgentState.FAILED and "restarts exhausted (1)" in result.message
    assert len(n.spawner.spawned) == 2, "nothing was replaced"


def test_a_worker_cannot_raise_the_restart_budget_beyond_the_launchers_cap(node):
    """The loop file is the worker's to write: "running 999999999" gives it what
    --loop-max-restarts allows (here 2), no more."""
    n = node(max_restarts=0, loop_max_restarts=2).play()
    first = n.running()
    for p in first:
        _in_loop(p, "running 999999999")
    victim = first[1]
    for generation in range(1, 4):
        n.watchdog.exit_process(victim, code=1)
        if generation == 3:
            break
        n.wait_for(lambda g=generation: len(n.spawner.spawned) == 2 + g)
        victim = n.spawner.spawned[-1]
        _in_loop(victim, "running 999999999")
    result = n.finish()
    assert result.state == AgentState.FAILED and "restarts exhausted (2)" in result.message
    assert len(n.spawner.spawned) == 4, "two replacements, the cap"
    assert n.rdzv.spends == [2, 2]


# ---- hot spares ---------------------------------------------------------------------------


def _training(n: Node, workers: list) -> None:
    """The workers run the loop and have made a step (their first round is theirs)."""
    for p in workers:
        _in_loop(p, "running 3")
        elastic_core.Heartbeat.attach(n.heartbeats.path(p.request.local_rank), 0).beat()


def _spare_waits(n: Node, said: str = "waiting 3") -> tuple[list, Any]:
    """The node's workers train and its one spare has started and waits (its loop file says
    `said`): (the workers, the spare)."""
    first = n.running()
    _training(n, first)
    k = n.config.nproc_per_node
    n.wait_for(lambda: len(n.spawner.spawned) == k + 1)
    spare = n.spawner.spawned[k]
    _in_loop(spare, said)
    return first, spare


def test_hot_spares_start_once_the_workers_train_with_no_rank_of_their_own(node):
    n = node(max_restarts=0, hot_spares=1).play()
    first = n.running()
    time.sleep(0.05)
    assert len(n.spawner.spawned) == 2, "not before the workers run the loop and step"
    _training(n, first)
    n.wait_for(lambda: len(n.spawner.spawned) == 3)
    spare = n.spawner.spawned[2]
    env = spare.request.env
    assert spare.request.local_rank == 2 and env["RANK"] == "-1"
    assert env["ELASTICRUN_HOT_SPARE"] == "1" and "ELASTICRUN_HOT_SPARE" not in first[0].request.env
    started = [e.data for e in n.recorder.events if e.name == "hot_spare_started"]
    assert started == [{"local_rank": 2, "pid": spare.pid}]
    _in_loop(spare, "waiting 3")
    time.sleep(0.05)
    assert len(n.spawner.spawned) == 3, "one spare, started once"
    for p in (*first, spare):  # the job ends: the spare leaves with the workers
        n.watchdog.exit_process(p, code=0)
    assert n.finish().state == AgentState.SUCCEEDED


def test_a_spare_that_dies_while_it_waits_is_replaced_without_touching_the_workers(node, caplog):
    n = node(max_restarts=2, hot_spares=1).play()
    first, spare = _spare_waits(n)
    with caplog.at_level("WARNING"):
        n.watchdog.exit_process(spare, signal=signal.SIGKILL)
        n.wait_for(lambda: len(n.spawner.spawned) == 4)
    behind = n.spawner.spawned[3]
    assert behind.request.local_rank == 2 and behind.request.env["RANK"] == "-1"
    assert behind.request.env["ELASTICRUN_HOT_SPARE"] == "1"
    assert all(p.group_signals == [] and p.signals == [] for p in first), "untouched"
    assert "replacing a hot spare (local rank 2, pid" in caplog.text
    assert "the training workers are not touched" in caplog.text
    assert n.rdzv.restarts == 1, "a death is one restart, a spare's too"
    for p in (*first, behind):
        n.watchdog.exit_process(p, code=0)
    assert n.finish().state == AgentState.SUCCEEDED


def test_a_dead_worker_is_replaced_behind_the_spare_that_takes_its_place(node, caplog):
    """The spare takes the place; the one behind it starts once the re-formed group has made a
    step (not while it re-forms). The budget counts the admitted spare as one replacement:
    one death, one restart, one new process."""
    n = node(max_restarts=1, loop_max_restarts=0, hot_spares=1).play()
    first, spare = _spare_waits(n, "waiting 0")
    # The rendezvous' wait beats at step 0 (elastic_core.quiet): no step, still a spare.
    elastic_core.Heartbeat.attach(n.heartbeats.path(2), 0).beat(0)
    with caplog.at_level("WARNING"):
        n.watchdog.exit_process(first[1], signal=signal.SIGKILL)
        n.wait_for(lambda: n.rdzv.restarts == 1 and n.group.get(1) is None)
    assert f"hot spare pid {spare.pid} takes its place at the next round" in caplog.text
    _in_loop(spare, "running 0")  # a round took it ...
    time.sleep(0.05)
    assert len(n.spawner.spawned) == 3, "nothing starts while the group re-forms"
    _training(n, [first[0], spare])  # ... and the group has made a step
    n.wait_for(lambda: len(n.spawner.spawned) == 4)
    behind = n.spawner.spawned[3]
    env = behind.request.env
    assert behind.request.local_rank == 1 and env["ELASTICRUN_REPLACEMENT"] == "1"
    assert env["ELASTICRUN_HOT_SPARE"] == "1" and env["RANK"] == "1", "a spare with a rank"
    replaced = [e.data for e in n.recorder.events if e.name == "worker_replaced"]
    assert [(e["local_rank"], e["pid"], e["restarts"]) for e in replaced] == [(1, behind.pid, 1)]
    _in_loop(behind, "waiting 0")
    n.watchdog.exit_process(spare, code=1)  # the budget (1) is spent
    result = n.finish()
    assert result.state == AgentState.FAILED and "restarts exhausted (1)" in result.message
    assert len(n.spawner.spawned) == 4


def test_a_worker_between_rounds_is_never_taken_for_a_spare(node):
    """A worker that waits in the rendezvous between rounds is a member the round needs: its
    peer's death is replaced at once, with no place left empty."""
    n = node(max_restarts=2, hot_spares=1).play()
    first, spare = _spare_waits(n)
    _in_loop(first[0], "waiting 3")  # re-forming: it has stepped, it is no spare
    n.watchdog.exit_process(spare, signal=signal.SIGKILL)  # the only spare
    n.wait_for(lambda: len(n.spawner.spawned) == 4)
    n.watchdog.exit_process(first[1], signal=signal.SIGKILL)
    n.wait_for(lambda: len(n.spawner.spawned) == 5)
    assert n.spawner.spawned[4].request.local_rank == 1, "replaced at once"
    assert "ELASTICRUN_HOT_SPARE" not in n.spawner.spawned[4].request.env


def test_a_spare_is_named_for_one_place_and_a_second_death_is_replaced_at_once(node, caplog):
    """Two workers die while one spare waits: the spare takes the first place; the second is
    replaced by a new process at once (the round needs it), not left empty behind a spare
    that is named for another place."""
    n = node(max_restarts=2, hot_spares=1, nproc_per_node=3).play()
    first, spare = _spare_waits(n, "waiting 0")
    with caplog.at_level("WARNING"):
        n.watchdog.exit_process(first[1], signal=signal.SIGKILL)
        n.wait_for(lambda: n.rdzv.restarts == 1 and n.group.get(1) is None)
        n.watchdog.exit_process(first[2], signal=signal.SIGKILL)
        n.wait_for(lambda: len(n.spawner.spawned) == 5)
    assert caplog.text.count(f"hot spare pid {spare.pid} takes its place") == 1
    assert "the other workers keep running the train loop" in caplog.text
    second = n.spawner.spawned[4]
    assert second.request.local_rank == 2 and "ELASTICRUN_HOT_SPARE" not in second.request.env
    assert n.group.get(1) is None, "the first place is the spare's until the group steps"


def test_a_place_a_spare_took_is_filled_anyway_when_the_group_does_not_step(node, monkeypatch):
    """The round may need one more member than the spares could give: the place is left
    empty for BEHIND_WAIT at most (here 0)."""
    from elastic_launch.agent import spares

    monkeypatch.setattr(spares, "BEHIND_WAIT", 0.0)
    n = node(max_restarts=2, hot_spares=1).play()
    first, _ = _spare_waits(n)
    n.watchdog.exit_process(first[1], signal=signal.SIGKILL)
    n.wait_for(lambda: len(n.spawner.spawned) == 4)  # no step was made
    assert n.spawner.spawned[3].request.local_rank == 1


def test_a_train_loop_worker_that_failed_for_good_fails_the_job_at_once(node):
    n = node(max_restarts=5).play()
    first = n.running()
    _in_loop(first[0])
    _in_loop(first[1], "fatal")  # a NonRetryableException
    n.watchdog.exit_process(first[1], code=1)
    result = n.finish()
    assert result.state == AgentState.FAILED and result.restarts == 0
    assert len(n.spawner.spawned) == 2, "nothing was replaced or restarted"
    assert "rank 1 exit code 1" in result.message


def test_a_membership_change_keeps_train_loop_workers_running(node):
    n = node(max_restarts=0).play()
    first = n.running()
    for p in first:
        _in_loop(p)
    n.rdzv.changed = True
    n.wait_for(lambda: len(n.rdzv.calls) == 2 and n.agent.state == AgentState.RUNNING)
    assert n.rdzv.calls[1] == (RestartReason.MEMBERSHIP, "")
    assert len(n.spawner.spawned) == 2 and not first[0].group_signals, "nobody restarted"
    assert n.agent.attempt == 0
    for p in first:
        n.watchdog.exit_process(p, code=0)
    assert n.finish().state == AgentState.SUCCEEDED


def test_a_hung_train_loop_worker_waiting_in_a_collective_is_judged_after_its_peer(node):
    """Both look hung; the one inside torch.distributed waits for the other, which is replaced
    first. The waiting one gets one more hang period, and is replaced if still stuck."""
    n = node(max_restarts=2, hang_timeout=0.5, stack_dump_timeout=0.3).play()
    first = n.running()
    for p in first:
        _in_loop(p)
    first[0].stack = (
        'Thread 0x1 (most recent call first):\n  File "/x/torch/distributed/'
        'distributed_c10d.py", line 3252 in all_reduce\n  File "train.py", line 9 in step\n'
    )
    n.watchdog.hang(first[0])  # the victim is found first
    n.wait_for(lambda: any(w.spared_until_ns for w in n.group.workers))
    n.watchdog.hang(first[1])  # the culprit: no stack (it is stopped)
    n.wait_for(lambda: len(n.spawner.spawned) == 3)
    assert n.spawner.spawned[2].request.local_rank == 1, "the culprit is replaced first"
    assert first[0].group_signals == [], "the victim is spared for now"
    n.wait_for(lambda: len(n.spawner.spawned) == 4, timeout=10)
    assert n.spawner.spawned[3].request.local_rank == 0, "still stuck a period later: replaced"
    for p in n.spawner.spawned[2:]:
        n.watchdog.exit_process(p, code=0)
    result = n.finish()
    assert result.state == AgentState.SUCCEEDED and result.restarts == 2
    assert [f.local_rank for f in result.failures] == [1, 0]


def test_workers_that_all_failed_for_good_end_the_job_even_alone(node):
    """Every rank hit the same bug: no worker says "running", and none is restarted."""
    n = node(max_restarts=5).play()
    first = n.running()
    for p in first:
        _in_loop(p, "fatal")
    n.watchdog.exit_process(first[0], code=1)
    result = n.finish()
    assert result.state == AgentState.FAILED and result.restarts == 0
    assert len(n.spawner.spawned) == 2 and n.rdzv.calls == [(RestartReason.START, "")]
